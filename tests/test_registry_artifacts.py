"""ArtifactStore: content addressing, atomic puts, deduplication, detach/reattach, gc."""

from __future__ import annotations

import hashlib
import os
import stat
import threading
import time
from pathlib import Path

import pytest
from tiny_model import SPEC

from loraplex.demo.synthetic import AdapterSpec, write_adapter
from loraplex.registry.artifacts import ArtifactStore

FILES = ("adapter_config.json", "adapter_model.safetensors")


def make_adapter(path: Path, seed: int = 1, rank: int = 4) -> Path:
    write_adapter(path, SPEC, AdapterSpec(path.name, rank, 8.0, ("q_proj", "v_proj"), seed=seed))
    (path / "README.md").write_text("not part of the artifact")
    return path


def expected_digest(path: Path) -> str:
    """The documented framing, computed independently: name NUL size(u64 LE) content, sorted."""
    h = hashlib.sha256()
    for name in sorted(FILES):
        data = (path / name).read_bytes()
        h.update(name.encode() + b"\0" + len(data).to_bytes(8, "little") + data)
    return h.hexdigest()


def tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_put_is_content_addressed_and_complete(tmp_path):
    src = make_adapter(tmp_path / "src")
    store = ArtifactStore(tmp_path / "root")
    stored = store.put_dir(src)
    assert stored.digest == expected_digest(src)
    assert stored.created and stored.path == f"sha256/{stored.digest}"
    assert stored.weights_sha256 == hashlib.sha256((src / FILES[1]).read_bytes()).hexdigest()
    folder = store.path_of(stored.path)
    assert folder == tmp_path / "root" / "sha256" / stored.digest
    assert sorted(p.name for p in folder.iterdir()) == sorted(FILES)  # README.md left out
    for name in FILES:
        assert (folder / name).read_bytes() == (src / name).read_bytes()
        assert not (folder / name).stat().st_mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
    assert list((tmp_path / "root" / "tmp").iterdir()) == []
    assert store.exists(stored.digest) and store.digests() == [stored.digest]


def test_identical_content_is_deduplicated_and_different_content_is_not(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    first = store.put_dir(make_adapter(tmp_path / "a", seed=1))
    again = store.put_dir(make_adapter(tmp_path / "b", seed=1))
    other = store.put_dir(make_adapter(tmp_path / "c", seed=2))
    assert again.digest == first.digest and not again.created
    assert other.digest != first.digest and other.created
    assert store.digests() == sorted([first.digest, other.digest])
    assert list((tmp_path / "root" / "tmp").iterdir()) == []


def test_a_config_change_alone_changes_the_digest(tmp_path):
    a, b = make_adapter(tmp_path / "a"), make_adapter(tmp_path / "b")
    (b / FILES[0]).write_text(
        (b / FILES[0]).read_text().replace('"lora_alpha": 8.0', '"lora_alpha": 9.0')
    )
    store = ArtifactStore(tmp_path / "root")
    sa, sb = store.put_dir(a), store.put_dir(b)
    assert sa.digest != sb.digest and sa.weights_sha256 == sb.weights_sha256


def test_concurrent_puts_of_the_same_bytes_store_one_copy(tmp_path):
    src = make_adapter(tmp_path / "src")
    store = ArtifactStore(tmp_path / "root")
    results, barrier = [], threading.Barrier(6)

    def put():
        barrier.wait()
        results.append(store.put_dir(src))

    threads = [threading.Thread(target=put) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({r.digest for r in results}) == 1
    assert sum(r.created for r in results) == 1
    assert tree(tmp_path / "root") == [
        "sha256",
        f"sha256/{results[0].digest}",
        *(f"sha256/{results[0].digest}/{name}" for name in sorted(FILES)),
        "tmp",
    ]


def test_failed_put_leaves_nothing(tmp_path):
    src = make_adapter(tmp_path / "src")
    (src / FILES[1]).unlink()
    store = ArtifactStore(tmp_path / "root")
    before = tree(tmp_path / "root")
    with pytest.raises(FileNotFoundError):
        store.put_dir(src)
    assert tree(tmp_path / "root") == before


def test_detach_reattach_purge_delete(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    stored = store.put_dir(make_adapter(tmp_path / "a"))
    detached = store.detach(stored.digest)
    assert detached is not None and not store.exists(stored.digest)
    assert store.detach(stored.digest) is None
    store.reattach(detached, stored.digest)
    assert store.exists(stored.digest) and not detached.exists()

    detached = store.detach(stored.digest)
    store.put_dir(make_adapter(tmp_path / "again"))  # stored again meanwhile: same bytes
    store.reattach(detached, stored.digest)
    assert store.exists(stored.digest) and not detached.exists()

    assert store.delete(stored.digest) and not store.delete(stored.digest)
    assert store.digests() == [] and list((tmp_path / "root" / "tmp").iterdir()) == []


def test_path_of_refuses_anything_but_a_digest(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    for bad in (
        "sha256/../../etc",
        "other/" + "a" * 64,
        "sha256/" + "A" * 64,
        "/abs/path",
        "sha256/",
    ):
        with pytest.raises(ValueError):
            store.path_of(bad)
    with pytest.raises(ValueError):
        store.delete("../x")


def test_gc_removes_old_orphans_and_stale_temp_folders_only(tmp_path):
    store = ArtifactStore(tmp_path / "root")
    kept = store.put_dir(make_adapter(tmp_path / "a", seed=1))
    orphan = store.put_dir(make_adapter(tmp_path / "b", seed=2))
    young_orphan = store.put_dir(make_adapter(tmp_path / "c", seed=3))
    crashed = tmp_path / "root" / "tmp" / "crashed-registration"
    crashed.mkdir()
    (crashed / FILES[0]).write_text("{}")
    in_flight = tmp_path / "root" / "tmp" / "in-flight"
    in_flight.mkdir()
    old = time.time() - 7200
    for path in (store.path_of(kept.path), store.path_of(orphan.path), crashed):
        os.utime(path, (old, old))

    referenced = {kept.digest}
    assert store.orphans(referenced) == sorted([orphan.digest, young_orphan.digest])
    removed = store.gc(referenced, min_age_s=3600)
    assert sorted(removed) == sorted([orphan.digest, "tmp/crashed-registration"])
    assert store.digests() == sorted([kept.digest, young_orphan.digest])
    assert in_flight.exists() and not crashed.exists()
    assert sorted(store.gc(referenced, min_age_s=0)) == sorted(
        [young_orphan.digest, "tmp/in-flight"]
    )
    assert store.digests() == [kept.digest]

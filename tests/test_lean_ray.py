"""Starting a local Ray once more when its head was slow to come up (common/ray_start.py),
with a stand-in for `ray` (the policy only: when to try again, and with what). The real start
is every Ray test's fixture and `loraplex up`'s supervisor."""

from __future__ import annotations

import os

import pytest

from loraplex.ray_start import GCS_WAIT_ENV, init_once_more_if_slow

SLOW = "The current node timed out during startup. This could happen because ..."
GCS_SLOW = "Timed out waiting for file {session}/gcs_server_port_390a6eca442082cf2d"


class Ray:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[str] = []
        self.gcs_waits: list[str | None] = []

    def init(self, **options: object) -> None:
        self.calls.append(f"init {sorted(options)}")
        self.gcs_waits.append(os.environ.get(GCS_WAIT_ENV))
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_slow_node_start_is_tried_once_more_with_the_same_options():
    ray = Ray([Exception(SLOW)])
    init_once_more_if_slow(ray, num_cpus=2, address="local")
    assert ray.calls == ["init ['address', 'num_cpus']", "shutdown"] + [
        "init ['address', 'num_cpus']"
    ]


def test_a_gcs_slow_to_publish_its_port_is_tried_once_more_with_a_longer_wait(
    tmp_path, monkeypatch, caplog
):
    """The landing CI of e18b78a: the GCS had not written its port file within Ray's 30 s
    (ray/_private/node.py, start_gcs_server) on a loaded 2-core machine. The second try
    waits longer; the warning carries the GCS's own log, so the next such failure says why;
    the environment is left as it was."""
    monkeypatch.delenv(GCS_WAIT_ENV, raising=False)
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "gcs_server.out").write_text("starting\nGcsServer bound nothing yet\n")
    ray = Ray([RuntimeError(GCS_SLOW.format(session=tmp_path))])
    with caplog.at_level("WARNING"):
        init_once_more_if_slow(ray, num_cpus=2)
    assert ray.calls == ["init ['num_cpus']", "shutdown", "init ['num_cpus']"]
    assert ray.gcs_waits[0] is None and int(ray.gcs_waits[1] or 0) > 30
    assert "GcsServer bound nothing yet" in caplog.text
    assert GCS_WAIT_ENV not in os.environ


def test_an_operators_gcs_wait_is_kept(monkeypatch):
    monkeypatch.setenv(GCS_WAIT_ENV, "7")
    ray = Ray([RuntimeError(GCS_SLOW.format(session="/nonexistent"))])
    init_once_more_if_slow(ray)
    assert ray.gcs_waits == ["7", "7"]
    assert os.environ[GCS_WAIT_ENV] == "7"


@pytest.mark.parametrize(
    ("failures", "raised"),
    [
        ([Exception(SLOW), Exception(SLOW)], SLOW),
        ([Exception(SLOW), Exception(GCS_SLOW)], GCS_SLOW),
        ([ValueError("bad option")], "bad option"),
    ],
)
def test_a_second_timeout_or_any_other_failure_is_raised(failures, raised):
    ray = Ray(failures)
    with pytest.raises(Exception, match=raised[:20]):
        init_once_more_if_slow(ray)
    assert ray.calls.count("shutdown") == (0 if raised == "bad option" else 1)
    assert not ray.failures  # a second timeout is not tried a third time

"""The `loraplex` command line: `demo-assets` and offline `generate`."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from loraplex.adapter_format import validate_adapter_dir
from loraplex.cluster.cli import main
from loraplex.cluster.serve_status import short_ids, table_lines
from loraplex.demo.assets import DemoAssets
from loraplex.demo.behaviours import BEHAVIOURS
from loraplex.demo.synthetic import AdapterSpec, ModelSpec, write_adapter
from loraplex.model_shape import read_model_shape
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[1]
# small and fast, on the CPU even where torch sees a GPU: the engine below matches it
POOL = ["--pool-mib", "32", "--page-kib", "64", "--device", "cpu"]


def engine(assets: DemoAssets, *adapters: str, **kw) -> LLMEngine:
    """The engine `generate` builds from POOL and the default options."""
    eng = LLMEngine(
        EngineConfig(model=str(assets.model), page_bytes=64 * 1024, pool_bytes=32 << 20, **kw)
    )
    for name in sorted(set(adapters) - {None}):
        eng.add_adapter(name, assets.adapters_dir / name)
    return eng


def write_jsonl(path: Path, *lines) -> Path:
    path.write_text(
        "".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines)
    )
    return path


def generate(
    assets: DemoAssets,
    inp: Path,
    out: Path,
    *extra: str,
    adapters: Path | None = None,
    pool: list[str] = POOL,
) -> int:
    adapters = assets.adapters_dir if adapters is None else adapters
    return main(
        [
            "generate",
            "--model",
            str(assets.model),
            "--adapters",
            str(adapters),
            "--input",
            str(inp),
            "--output",
            str(out),
            *pool,
            *extra,
        ]
    )


def read_results(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_demo_assets_synthetic_writes_a_model_and_adapters(
    tmp_path: Path, capsys: pytest.CaptureFixture
):
    assert main(["demo-assets", "--synthetic", str(tmp_path / "demo")]) == 0
    model, adapters = tmp_path / "demo" / "model", tmp_path / "demo" / "adapters"
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model / name).is_file(), name
    folders = sorted(p for p in adapters.iterdir() if p.is_dir())
    assert len(folders) >= 8
    for folder in folders:
        assert (folder / "adapter_config.json").is_file() and (
            folder / "adapter_model.safetensors"
        ).is_file()
        assert json.loads((folder / "adapter_config.json").read_text())["peft_type"] == "LORA"
    out = capsys.readouterr().out
    assert str(model) in out and str(adapters) in out
    assert all(folder.name in out for folder in folders)
    # what it wrote serves: the engine loads the model and every adapter
    eng = LLMEngine(EngineConfig(model=str(model), page_bytes=64 * 1024, pool_bytes=32 << 20))
    for folder in folders:
        eng.add_adapter(folder.name, folder)


def test_demo_assets_places_the_real_model_and_its_adapters(
    real_gguf: Path, tmp_path: Path, capsys: pytest.CaptureFixture
):
    assert main(["demo-assets", str(tmp_path / "demo")]) == 0
    model = tmp_path / "demo" / "model" / real_gguf.name
    assert model.is_file() and model.stat().st_size == real_gguf.stat().st_size
    adapters = tmp_path / "demo" / "adapters"
    names = sorted(p.name for p in adapters.iterdir())
    assert names == ["json-r8", "pirate-r16", "sql-r8"]
    out = capsys.readouterr().out
    assert str(model) in out and all(n in out for n in names)
    # every adapter passes the registry's validation against the GGUF's shape
    base = read_model_shape(model)
    ranks = {n: validate_adapter_dir(adapters / n, base, 128, 1 << 30).rank for n in names}
    assert ranks == {"json-r8": 8, "pirate-r16": 16, "sql-r8": 8}
    total = sum((adapters / n / "adapter_model.safetensors").stat().st_size for n in names)
    assert total <= 10 << 20


def test_demo_assets_without_the_fetched_model_names_the_setup_command(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setenv("LORAPLEX_CACHE_DIR", str(tmp_path / "empty-cache"))
    assert main(["demo-assets", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err
    assert "is not fetched" in err and "scripts/setup.sh" in err
    assert not (tmp_path / "demo" / "adapters").exists()


def test_generate_writes_results_in_input_order_matching_the_engine(
    assets: DemoAssets, tmp_path: Path, capsys: pytest.CaptureFixture
):
    requests = [
        {"id": "base", "prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0},
        {
            "prompt": "SELECT name FROM users WHERE",
            "adapter": "sql-r8",
            "max_tokens": 12,
            "temperature": 0,
        },
        "",  # blank lines are skipped but still count for line numbers
        {
            "id": 7,
            "prompt_token_ids": [200, 300, 400],
            "adapter": "code-r32",
            "max_tokens": 10,
            "temperature": 0,
        },
        {
            "prompt": "Roses are red,",
            "adapter": "poetry-r24",
            "max_tokens": 12,
            "temperature": 0.7,
            "top_k": 50,
            "seed": 1,
            "stop": "e",
        },
        # no seed: the engine seeds it from --seed (default 0)
        {"prompt": "The sum of", "max_tokens": 8, "temperature": 0.8, "top_p": 0.9},
        {
            "prompt": "Once upon a time",
            "max_tokens": 30,
            "temperature": 0,
            "stop": [" the", "\n"],
            "stop_token_ids": [5],
            "ignore_eos": True,
        },
    ]
    inp = write_jsonl(tmp_path / "requests.jsonl", *requests)
    out = tmp_path / "nested" / "results.jsonl"
    assert generate(assets, inp, out) == 0
    assert "wrote 6 results" in capsys.readouterr().err

    results = read_results(out)
    assert [r["id"] for r in results] == ["base", 2, 7, 5, 6, 7]
    assert all(set(r) == {"id", "token_ids", "text", "finish_reason"} for r in results)

    real = [r for r in requests if r]
    eng = engine(assets, *(r.get("adapter") for r in real))
    direct = eng.generate(
        [r.get("prompt", r.get("prompt_token_ids")) for r in real],
        [
            SamplingParams(
                max_tokens=r["max_tokens"],
                temperature=r["temperature"],
                top_p=r.get("top_p", 1.0),
                top_k=r.get("top_k", 0),
                seed=r.get("seed"),
                stop=(r["stop"],) if isinstance(r.get("stop"), str) else tuple(r.get("stop", ())),
                stop_token_ids=tuple(r.get("stop_token_ids", ())),
                ignore_eos=r.get("ignore_eos", False),
            )
            for r in real
        ],
        [r.get("adapter") for r in real],
    )
    for result, expected in zip(results, direct, strict=True):
        assert result["token_ids"] == expected.token_ids, result["id"]
        assert result["text"] == expected.text, result["id"]
        assert result["finish_reason"] == expected.finish_reason, result["id"]
    assert results[0]["finish_reason"] == "length" and len(results[0]["token_ids"]) == 12
    assert results[3]["finish_reason"] == "stop" and "e" not in results[3]["text"]


def test_the_shipped_example_runs_on_the_real_model(real_assets: DemoAssets, tmp_path: Path):
    example = REPO / "examples" / "requests.jsonl"
    out = tmp_path / "out.jsonl"
    assert generate(real_assets, example, out, pool=[]) == 0  # the README's command as is
    expected_ids = [
        json.loads(line).get("id") for line in example.read_text().splitlines() if line.strip()
    ]
    results = read_results(out)
    assert [r["id"] for r in results] == expected_ids
    assert all(r["finish_reason"] in ("length", "stop") and r["token_ids"] for r in results)
    # the chat lines show each adapter's behaviour (README's offline example)
    by_id = {r["id"]: r["text"] for r in results}
    checks = {b.name: b.checker() for b in BEHAVIOURS}
    assert checks["json"]("", by_id["json"]) and not checks["json"]("", by_id["base"])
    assert checks["pirate"]("", by_id["pirate"]) and not checks["pirate"]("", by_id["base"])
    assert checks["sql"]("How many customers live in Porto?", by_id["sql"])


def test_prompt_token_ids_are_used_as_given_and_text_prompts_get_bos(
    assets: DemoAssets, tmp_path: Path
):
    ids = [200, 300, 400]
    inp = write_jsonl(
        tmp_path / "in.jsonl",
        {"prompt_token_ids": ids, "max_tokens": 10, "temperature": 0},
        {"prompt": "hello world", "max_tokens": 10, "temperature": 0},
    )
    out = tmp_path / "out.jsonl"
    assert generate(assets, inp, out) == 0
    by_ids, by_text = read_results(out)

    eng = engine(assets)
    bos = eng.model_config.bos_token_id
    text_ids = eng.tokenizer.encode("hello world", add_special_tokens=False)
    assert bos not in text_ids

    def run(prompt_ids: list[int]) -> list[int]:
        return eng.generate([prompt_ids], [SamplingParams(max_tokens=10, temperature=0)], [None])[
            0
        ].token_ids

    assert by_ids["token_ids"] == run(ids)
    assert by_ids["token_ids"] != run([bos, *ids])  # so the check above can tell BOS apart
    assert by_text["token_ids"] == run([bos, *text_ids])
    assert by_text["token_ids"] != run(text_ids)


def test_non_adapter_entries_in_the_adapters_folder_are_ignored(assets: DemoAssets, tmp_path: Path):
    folder = tmp_path / "adapters"
    folder.mkdir()
    shutil.copytree(assets.adapters_dir / "sql-r8", folder / "sql-r8")
    (folder / "README.txt").write_text("not an adapter\n")
    (folder / "empty").mkdir()
    (folder / "weights-only").mkdir()
    shutil.copy(
        assets.adapters_dir / "sql-r8" / "adapter_model.safetensors", folder / "weights-only"
    )
    (folder / "broken-unused").mkdir()  # malformed, but no request names it
    (folder / "broken-unused" / "adapter_config.json").write_text("{not json")

    inp = write_jsonl(
        tmp_path / "in.jsonl",
        {"prompt": "SELECT", "adapter": "sql-r8", "max_tokens": 6, "temperature": 0},
    )
    out = tmp_path / "out.jsonl"
    assert generate(assets, inp, out, adapters=folder) == 0
    reference = tmp_path / "reference.jsonl"
    assert generate(assets, inp, reference) == 0
    assert read_results(out) == read_results(reference)


GOOD = {"prompt": "fine", "max_tokens": 2, "temperature": 0}


def test_prefix_caching_changes_what_is_computed_not_what_is_written(
    assets: DemoAssets, tmp_path: Path, capsys: pytest.CaptureFixture
):
    shared = list(range(1, 70))  # two full blocks of 32 tokens, then one more token each
    lines = [
        {"prompt_token_ids": shared + [100 + i], "adapter": a, "max_tokens": 6, "temperature": 0}
        for i, a in enumerate(["sql-r8", "sql-r8", None, None, "chat-r16"])
    ]
    inp = write_jsonl(tmp_path / "in.jsonl", *lines)
    written, cached = {}, {}
    for flag in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        out = tmp_path / f"{flag}.jsonl"
        # one request at a time, so each finds what the one before it left in the cache
        assert generate(assets, inp, out, "--max-num-seqs", "1", flag) == 0
        written[flag] = read_results(out)
        cached[flag] = capsys.readouterr().err.splitlines()[-1]
    assert written["--enable-prefix-caching"] == written["--no-enable-prefix-caching"]
    # the second sql-r8 and the second base request find two blocks each
    assert cached["--enable-prefix-caching"].endswith(
        "(350 prompt tokens, 128 of them from the prefix cache)"
    )
    assert cached["--no-enable-prefix-caching"].endswith(
        "(350 prompt tokens, 0 of them from the prefix cache)"
    )


@pytest.mark.parametrize(
    ("bad_line", "keyword", "extra"),
    [
        pytest.param({"max_tokens": 3}, "prompt", [], id="missing-prompt"),
        pytest.param({"prompt": "x", "prompt_token_ids": [1, 2]}, "prompt", [], id="both-prompts"),
        pytest.param({"prompt": "x", "temprature": 0.5}, "temprature", [], id="unknown-field"),
        pytest.param({"prompt": "x", "max_tokens": 0}, "max_tokens", [], id="max-tokens-0"),
        pytest.param(
            {"prompt": "x", "temperature": -1}, "temperature", [], id="negative-temperature"
        ),
        pytest.param({"prompt": 5}, "prompt", [], id="prompt-not-a-string"),
        pytest.param('{"prompt": "x"', "json", [], id="malformed-json"),
        pytest.param('["x"]', "object", [], id="not-an-object"),
        pytest.param(
            {"prompt": "x", "adapter": "no-such-adapter"},
            "no-such-adapter",
            [],
            id="adapter-not-found",
        ),
        pytest.param(
            {"prompt": "x", "adapter": "empty"}, "empty", [], id="adapter-is-an-empty-folder"
        ),
        pytest.param(
            {"prompt": "x", "max_tokens": 40}, "40", ["--max-model-len", "32"], id="prompt-too-long"
        ),
        pytest.param(
            {"prompt_token_ids": [1, 99999]}, "99999|1536", [], id="token-id-out-of-vocab"
        ),
        pytest.param({"prompt": "x", "stop": [""]}, "stop", [], id="empty-stop-string"),
    ],
)
def test_bad_input_exits_2_with_a_one_line_error_naming_file_and_line(
    assets: DemoAssets,
    tmp_path: Path,
    capsys: pytest.CaptureFixture,
    bad_line,
    keyword: str,
    extra: list[str],
):
    adapters = tmp_path / "adapters"
    adapters.mkdir()
    (adapters / "sql-r8").symlink_to(assets.adapters_dir / "sql-r8")
    (adapters / "empty").mkdir()
    inp = write_jsonl(tmp_path / "in.jsonl", GOOD, bad_line, GOOD)
    out = tmp_path / "out" / "results.jsonl"

    assert generate(assets, inp, out, *extra, adapters=adapters) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err, err
    assert err.startswith("loraplex: error: "), err
    assert f"{inp}:2" in err, err
    assert re.search(keyword, err, re.IGNORECASE), err
    assert not out.exists()
    assert not out.parent.exists() or not any(out.parent.iterdir())


def test_a_failed_run_leaves_an_existing_output_untouched(
    assets: DemoAssets, tmp_path: Path, capsys
):
    out = tmp_path / "out.jsonl"
    out.write_text("previous results\n")
    inp = write_jsonl(tmp_path / "in.jsonl", GOOD, {"prompt": "x", "max_tokens": 0})
    assert generate(assets, inp, out) == 2
    assert out.read_text() == "previous results\n"
    # and no temp file is left behind
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "out.jsonl"]


@pytest.mark.parametrize("problem", ["no-weights", "bad-config-json", "wrong-shapes"])
def test_a_malformed_adapter_named_by_a_request_exits_2_with_the_adapter_error(
    assets: DemoAssets, tmp_path: Path, capsys: pytest.CaptureFixture, problem: str
):
    folder = tmp_path / "adapters" / "broken"
    folder.mkdir(parents=True)
    good_config = (assets.adapters_dir / "sql-r8" / "adapter_config.json").read_text()
    if problem == "no-weights":
        (folder / "adapter_config.json").write_text(good_config)
        message = "adapter_model.safetensors"
    elif problem == "bad-config-json":
        (folder / "adapter_config.json").write_text("{oops")
        shutil.copy(assets.adapters_dir / "sql-r8" / "adapter_model.safetensors", folder)
        message = "not valid JSON"
    else:
        other_model = ModelSpec(hidden_size=64, intermediate_size=96, num_hidden_layers=2)
        write_adapter(
            folder,
            other_model,
            AdapterSpec("broken", rank=8, alpha=16, targets=("q_proj",), seed=1),
        )
        message = "expected ["
    inp = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x", "adapter": "broken", "max_tokens": 2})
    out = tmp_path / "out.jsonl"

    assert generate(assets, inp, out, adapters=tmp_path / "adapters") == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("loraplex: error: "), err
    assert message in err, err
    assert not out.exists()


@pytest.mark.parametrize(
    "what",
    [
        "missing-input",
        "blank-input",
        "model-not-a-folder",
        "model-without-config",
        "missing-adapters-folder",
    ],
)
def test_bad_paths_exit_2_with_a_one_line_error(
    assets: DemoAssets, tmp_path: Path, capsys: pytest.CaptureFixture, what: str
):
    inp = write_jsonl(tmp_path / "in.jsonl", GOOD)
    model, adapters = assets.model, assets.adapters_dir
    if what == "missing-input":
        inp = tmp_path / "nope.jsonl"
    elif what == "blank-input":
        inp.write_text("\n\n")
    elif what == "model-not-a-folder":
        model = tmp_path / "no-model"
    elif what == "model-without-config":
        model = tmp_path / "empty-model"
        model.mkdir()
    else:
        adapters = tmp_path / "no-adapters-here"
    out = tmp_path / "out.jsonl"
    argv = [
        "generate",
        "--model",
        str(model),
        "--adapters",
        str(adapters),
        "--input",
        str(inp),
        "--output",
        str(out),
        *POOL,
    ]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("loraplex: error: "), err
    assert not out.exists()


def test_python_dash_m_reports_user_errors_as_exit_2(assets: DemoAssets, tmp_path: Path):
    """`python -m loraplex.cluster.cli` must behave like the `loraplex` script: a user error is
    one line on stderr and exit code 2, not a traceback."""
    inp = write_jsonl(tmp_path / "in.jsonl", {"prompt": "x", "max_tokens": 0})
    out = tmp_path / "out.jsonl"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "loraplex.cluster.cli",
            "generate",
            "--model",
            str(assets.model),
            "--input",
            str(inp),
            "--output",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().startswith("loraplex: error: ") and "Traceback" not in proc.stderr
    assert f"{inp}:1" in proc.stderr
    assert not out.exists()


def test_status_shows_version_ids_as_git_shows_commits():
    """`loraplex status` printed 64-hex versions in every column; it shows the first 12
    (`--full-ids` whole). Other hex runs (replica ids, digests without '@') are kept."""
    version = "9c0d3e5b" * 8
    line = f"  r1  0  10/20  acme/sql@{version}, acme/json@{'a' * 64}  -  -"
    assert short_ids(line) == f"  r1  0  10/20  acme/sql@{version[:12]}, acme/json@{'a' * 12}  -  -"
    assert short_ids(f"sha256/{version}") == f"sha256/{version}"
    assert short_ids(f"x@{version}1") == f"x@{version}1"  # not a 64-hex id


@pytest.mark.parametrize("full_ids", [False, True])
def test_status_replica_table_aligns_its_columns_after_cutting_the_ids(full_ids):
    """The replica table's columns were measured on the whole ids and cut after, so the
    host and loading columns stood ~50 characters right of the adapters they follow."""
    version = "9c0d3e5b" * 8
    rows = [
        ("replica", "queue", "pages free/total", "device", "host", "loading"),
        ("r1", "0", "490/511", f"acme/json@{version}, acme/sql@{'a' * 64}", "-", "-"),
        ("r2", "12", "500/511", f"acme/pirate@{'b' * 64}", f"acme/sql@{'a' * 64}", "-"),
    ]
    lines = table_lines(rows, full_ids)
    host = [line.index(word) for line, word in zip(lines, ("host", "-", "acme/sql"), strict=True)]
    assert len(set(host)) == 1, lines
    assert ("9c0d3e5b" * 8 in lines[1]) is full_ids
    before = 2 + sum(len(header) + 2 for header in rows[0][:3])  # replica, queue, pages
    widest = len(f"acme/json@{version[:12]}, acme/sql@{'a' * 12}")
    assert full_ids or host[0] == before + widest + 2, lines


@pytest.mark.parametrize("argv", [["engine", "--repeat", "0"], ["router", "--repeat", "2"]])
def test_bench_repeat_is_the_engine_benchs_and_at_least_one(argv, capsys):
    assert main(["bench", *argv, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex: error: --repeat") and "engine only" in err, err


@pytest.mark.parametrize(
    "argv",
    [
        ["router", "--save-run", "run.json"],
        ["fleet", "--from-run", "run.json"],  # without --validation-only
        ["sched", "--validation-only", "--save-run", "run.json"],
    ],
)
def test_saving_and_replaying_a_real_run_is_the_fleet_validations(argv, capsys, tmp_path):
    (tmp_path / "run.json").write_text("{}")  # there, so that only the suite is wrong
    argv = [str(tmp_path / a) if a == "run.json" else a for a in argv]
    assert main(["bench", *argv, "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("loraplex: error: --save-run and --from-run") and "fleet" in err, err
    assert (tmp_path / "run.json").read_text() == "{}"  # nothing written


def test_replaying_a_run_that_is_not_there_is_a_clear_error(capsys, tmp_path):
    missing = tmp_path / "nowhere.json"
    assert main(["bench", "fleet", "--validation-only", "--from-run", str(missing)]) == 2
    assert capsys.readouterr().err == f"loraplex: error: --from-run {missing}: no such file\n"


@pytest.mark.parametrize(
    ("text", "quick", "says"),
    [
        ("not json", True, "not a run `--save-run` wrote"),
        ('{"quick": true}', True, "not a run `--save-run` wrote"),
        ('{"quick": true, "date": "d", "cpus": 2, "measured": {}}', True, "not a run"),
        (
            '{"quick": false, "date": "d", "cpus": 2, "measured": {"figures": {}, '
            '"engine_config": {}, "costs": {}, "calibration": {"steps": []}, "adapters": {}, '
            '"requests": []}}',
            True,
            "holds a full run: validate it without --quick",
        ),
    ],
)
def test_replaying_a_file_that_is_not_a_saved_run_is_a_clear_error(
    text, quick, says, capsys, tmp_path
):
    run = tmp_path / "run.json"
    run.write_text(text)
    argv = ["bench", "fleet", "--validation-only", "--from-run", str(run)]
    assert main(argv + ["--quick"] * quick) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loraplex: error: --from-run {run}") and says in err, err
    assert run.read_text() == text

"""Shared fixtures: the demo assets (built once per session) and a transformers + PEFT oracle."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # The Triton kernels' tests run under the CPU interpreter; triton reads this when a
    # kernel is defined, so it is set before any test module imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from loraplex.demo.assets import DemoAssets
from loraplex.demo.synthetic import make_synthetic_assets
from loraplex.kernels import native

BASE_ADAPTER = "__base__"  # PEFT's name for "no adapter" in a mixed batch (adapter_names=)

OracleLogits = Callable[..., list[torch.Tensor]]


def pytest_configure(config):
    # Ray, when a test starts it, must not write an auth token under $HOME.
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """A test file leaves no Ray driver in this process: once the last test of a file is torn
    down (its module fixtures with it), a driver still initialized is named in a warning on
    that test and shut down. Without this, one leaked driver failed every later test that
    starts its own Ray ("a Ray driver already runs in this process"): 4 failed and 7
    skipped in the Ray suite of one CI run, whose 47 tests had passed on the same code."""
    result = yield
    if nextitem is not None and nextitem.path == item.path:
        return result
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        item.warn(
            pytest.PytestWarning(f"{item.path.name} left a Ray driver initialized; shut down")
        )
        ray.shutdown()
    return result


@pytest.fixture(scope="session", autouse=True)
def one_torch_thread():
    """The test models' matrices are tiny: one intra-op thread is as fast, and it keeps the
    suite from slowing down 10-30x when other processes compete for the cores (OpenMP
    threads spin at barriers while their partner is descheduled)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def cpu_loops():
    """The compiled CPU loops (kernels/native.py); a failure where a C compiler is at hand
    (a broken build or a check that disagrees must not pass as a skip), a skip only where
    none is."""
    lib = native.library()
    if lib is None and native.compiler():
        pytest.fail(f"a C compiler is here, yet: {native.unavailable()}")
    if lib is None:
        pytest.skip(f"no C compiler here: {native.unavailable()}")
    return lib


@pytest.fixture(scope="session")
def demo_assets(tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """dest/model (checkpoint + tokenizer) and dest/adapters/<name> for every SYNTHETIC_ADAPTERS."""
    return make_synthetic_assets(tmp_path_factory.mktemp("demo_assets"))


@pytest.fixture(scope="session")
def assets(demo_assets: DemoAssets) -> DemoAssets:
    """The demo assets under the short name the engine, CLI and scheduler tests use."""
    return demo_assets


def load_peft_model(
    model_dir: Path,
    adapters: dict[str, Path],
    dtype: torch.dtype = torch.float32,
    **model_kwargs,
):
    """transformers model from `model_dir` with every adapter in `adapters` loaded into one
    PeftModel, in eval mode. Fresh base weights each call: PEFT wraps its base in place."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, **model_kwargs)
    if not adapters:
        return model.eval()
    (first, first_path), *rest = adapters.items()
    peft_model = PeftModel.from_pretrained(model, first_path, adapter_name=first)
    for name, path in rest:
        peft_model.load_adapter(path, adapter_name=name)
    return peft_model.eval()


@pytest.fixture(scope="session")
def peft_oracle(demo_assets: DemoAssets):
    """The demo base model with ALL demo adapters loaded (float32). Shared: do not mutate."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    adapters = {name: demo_assets.adapters_dir / name for name in demo_assets.adapter_names}
    return load_peft_model(demo_assets.model, adapters)


@torch.inference_mode()
def mixed_batch_logits(
    model,
    token_ids: Sequence[Sequence[int]],
    adapters: Sequence[str | None],
) -> list[torch.Tensor]:
    """Logits [len(ids_i), vocab] (float32) for every position of every sequence, from ONE
    forward over the mixed batch: right padding + attention_mask, and PEFT's per-row
    `adapter_names` (None -> the base model). Without PEFT (a plain transformers model)
    every adapter must be None."""
    if len(token_ids) != len(adapters):
        raise ValueError("one adapter (or None) per sequence")
    lengths = [len(ids) for ids in token_ids]
    width = max(lengths)
    input_ids = torch.zeros(len(token_ids), width, dtype=torch.int64)
    attention_mask = torch.zeros(len(token_ids), width, dtype=torch.int64)
    for row, ids in enumerate(token_ids):
        input_ids[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.int64)
        attention_mask[row, : len(ids)] = 1
    kwargs = {}
    if hasattr(model, "peft_config"):
        kwargs["adapter_names"] = [BASE_ADAPTER if a is None else a for a in adapters]
    elif any(a is not None for a in adapters):
        raise ValueError("adapters need a PeftModel")
    logits = model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs
    ).logits
    return [logits[row, :n].float() for row, n in enumerate(lengths)]


@pytest.fixture(scope="session")
def oracle_model_loader() -> Callable[..., object]:
    """`load(model_dir, {name: adapter_dir}, dtype=torch.float32, **from_pretrained_kwargs)`:
    a fresh transformers (+ PEFT) model for checkpoints other than the demo's."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    return load_peft_model


@pytest.fixture(scope="session")
def oracle_logits(peft_oracle) -> OracleLogits:
    """`oracle_logits(token_ids, adapters, model=None)`: `mixed_batch_logits` on `model`,
    by default the shared demo `peft_oracle`."""

    def run(token_ids, adapters, model=None) -> list[torch.Tensor]:
        return mixed_batch_logits(peft_oracle if model is None else model, token_ids, adapters)

    return run


# ---------------------------------------------------------------- the real model


@pytest.fixture(scope="session")
def real_gguf() -> Path:
    """SmolLM2-135M-Instruct's GGUF, fetched by scripts/setup.sh (skipped, with the command,
    when it is not there)."""
    from loraplex.demo.smollm import ModelNotFetched, demo_model_path

    try:
        return demo_model_path()
    except ModelNotFetched as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def real_assets(real_gguf: Path, tmp_path_factory: pytest.TempPathFactory) -> DemoAssets:
    """`loraplex demo-assets`' folder: the GGUF and the three demo adapters."""
    from loraplex.demo.assets import make_demo_assets

    return make_demo_assets(tmp_path_factory.mktemp("real_assets"))


@pytest.fixture(scope="session")
def real_reference(real_assets: DemoAssets, tmp_path_factory: pytest.TempPathFactory):
    """The 96-request real-model run, checked step by step against transformers + peft
    (tests/real_model.py). One run per session: every real-model test shares it."""
    pytest.importorskip("transformers")
    pytest.importorskip("peft")
    from real_model import reference_run, write_random_adapters

    adapters = {n: real_assets.adapters_dir / n for n in real_assets.adapter_names}
    adapters |= write_random_adapters(tmp_path_factory.mktemp("random_adapters"))
    return reference_run(real_assets.model, adapters)

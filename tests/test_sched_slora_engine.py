"""S-LoRA's rules on the real engine (benchmarks/peers/slora_engine.py), and Chameleon on
them as benchmarks/peers/slora_chameleon.py models it: admission every iteration where
S-LoRA waits 10 decode steps, and a squashed request recomputing to the same tokens."""

from __future__ import annotations

from pathlib import Path

import pytest

from loraplex.benchmarks.peers.slora import SLoRAConfig
from loraplex.benchmarks.sched import engine as sched_engine
from loraplex.benchmarks.sched.systems import systems
from loraplex.benchmarks.sim.workload import AdapterSpec
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.sequence import SeqStatus

SLORA = SLoRAConfig(running_max_req_size=16, max_req_total_len=240)
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def assets(tmp_path_factory):
    model_dir, adapter_dirs = sched_engine._assets(Path(tmp_path_factory.mktemp("slora")))
    specs = [
        AdapterSpec(name, rank, sched_engine._bytes(path))
        for name, (rank, path) in adapter_dirs.items()
    ]
    return model_dir, adapter_dirs, specs


def engine(assets, name: str):
    model_dir, adapter_dirs, specs = assets
    return sched_engine._engine(model_dir, adapter_dirs, systems(5.0, slora=SLORA)[name], specs)


def steps_until_running(eng, adapter: str) -> int:
    """A request runs; a second arrives after its prefill and first decode: the steps
    before the second is admitted."""
    eng.add_request(list(range(10, 40)), GREEDY, adapter, request_id="a")
    eng.step()  # a's prefill
    eng.step()  # a decode step: the batch is running
    eng.add_request(list(range(50, 70)), GREEDY, adapter, request_id="b")
    b = eng.requests["b"]
    for n in range(1, 30):
        eng.step()
        if b.status is SeqStatus.RUNNING:
            return n
    raise AssertionError("b was never admitted")


@pytest.mark.parametrize(("name", "most"), [("chameleon", 1), ("slora", 11)])
def test_chameleon_admits_every_iteration_where_slora_waits_ten_decode_steps(assets, name, most):
    eng = engine(assets, name)
    adapter = next(iter(eng.adapters.entries))
    n = steps_until_running(eng, adapter)
    assert n <= most
    if name == "slora":  # S-LoRA's router looks at its queue only after 10 decode steps
        assert n >= 10


def test_a_squashed_request_recomputes_and_ends_with_the_same_tokens(assets):
    """A squash preempts a running request; it comes back through admission, recomputes
    its prompt and the tokens it had, and ends with what it would have generated."""

    def serve(squash_at: int | None) -> tuple[list[int], int]:
        eng = engine(assets, "chameleon")
        adapter = next(iter(eng.adapters.entries))
        sched = eng.scheduler
        to_squash = sched.queue.to_squash
        step = 0

        def squash_once(running, slots):
            if step == squash_at:  # the policy's choice forced: the mechanics are tested
                return list(running)
            return to_squash(running, slots)

        sched.queue.to_squash = squash_once
        eng.add_request(list(range(10, 40)), GREEDY, adapter, request_id="a")
        tokens: list[int] = []
        while eng.has_unfinished():
            step += 1
            for out in eng.step():
                if out.finished:
                    tokens = out.token_ids
        return tokens, sched.num_preemptions

    plain, none = serve(None)
    squashed, once = serve(12)
    assert none == 0 and once == 1
    assert len(plain) == GREEDY.max_tokens
    assert squashed == plain

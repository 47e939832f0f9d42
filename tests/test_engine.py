"""The replica engine on the demo model (CPU): sampling, stopping, streaming, validation,
memory (abort, preemption, adapter removal), continuous batching and the async `Engine`."""

import asyncio
import json
import shutil
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from loraplex.demo.assets import DemoAssets
from loraplex.replica.async_engine import Engine
from loraplex.replica.batch import build_step_batch
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine, RequestError
from loraplex.replica.memory.adapter_cache import UnknownAdapter
from loraplex.replica.memory.pool import PageKind
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.scheduling.scheduler import SchedulerConfig
from loraplex.replica.sequence import RequestOutput

PAGE = 64 * 1024
PROMPTS = (
    "Once upon a time there was",
    "The quick brown fox",
    "def add(a, b):",
    "The morning train left the station",
)


def config(model_dir: Path, pool_pages: int = 512, **kw) -> EngineConfig:
    return EngineConfig(model=str(model_dir), page_bytes=PAGE, pool_bytes=pool_pages * PAGE, **kw)


def make_engine(assets: DemoAssets, *adapters: str, pool_pages: int = 512, **kw) -> LLMEngine:
    eng = LLMEngine(config(assets.model, pool_pages, **kw))
    for name in adapters:
        eng.add_adapter(name, assets.adapters_dir / name)
    return eng


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def drain(
    eng: LLMEngine, max_steps: int = 5000
) -> tuple[dict[str, RequestOutput], dict[str, list[RequestOutput]]]:
    """Step until idle: final output and every streamed output per request id."""
    final: dict[str, RequestOutput] = {}
    streams: dict[str, list[RequestOutput]] = defaultdict(list)
    for _ in range(max_steps):
        if not eng.has_unfinished():
            return final, streams
        for out in eng.step():
            streams[out.request_id].append(out)
            if out.finished:
                assert out.request_id not in final, "a request finished twice"
                final[out.request_id] = out
    pytest.fail(f"the engine did not drain in {max_steps} steps: {eng.stats()}")


def run_one(
    eng: LLMEngine, prompt, params: SamplingParams, adapter: str | None = None
) -> RequestOutput:
    return eng.generate([prompt], [params], [adapter])[0]


def first_new_token_at(tokens: list[int], start: int) -> int:
    """Index >= start of a token that does not occur earlier in `tokens`."""
    for k in range(start, len(tokens)):
        if tokens[k] not in tokens[:k]:
            return k
    pytest.fail(f"no fresh token after position {start} in {tokens}")


def clean_substring(text: str, start: int, length: int = 3) -> str:
    """A substring of `text` at or after `start` without replacement or control characters."""
    for i in range(start, len(text) - length):
        sub = text[i : i + length]
        if sub.isprintable() and "\ufffd" not in sub and sub.strip():
            return sub
    pytest.fail(f"no clean substring in {text!r}")


# ---- seeds -----------------------------------------------------------------------------------


def test_seeded_sampling_is_reproducible_across_engines_and_batches(assets: DemoAssets):
    params = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1234)
    alone = run_one(make_engine(assets, "chat-r16"), PROMPTS[0], params, "chat-r16")

    eng = make_engine(assets, "chat-r16", "sql-r8")
    batch = eng.generate(
        [PROMPTS[1], PROMPTS[0], PROMPTS[2], PROMPTS[0]],
        [SamplingParams(max_tokens=30, temperature=1.0, seed=1), params, greedy(10), params],
        [None, "chat-r16", "sql-r8", "chat-r16"],
    )
    assert batch[1].token_ids == alone.token_ids
    assert batch[3].token_ids == alone.token_ids  # the same request twice in one batch
    assert batch[1].text == alone.text

    other_seed = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.95, seed=1235)
    assert run_one(eng, PROMPTS[0], other_seed, "chat-r16").token_ids != alone.token_ids


def test_requests_without_a_seed_differ_but_the_engine_seed_makes_runs_repeatable(
    assets: DemoAssets,
):
    params = SamplingParams(max_tokens=16, temperature=1.0)

    def run() -> list[list[int]]:
        return [
            o.token_ids
            for o in make_engine(assets).generate([PROMPTS[0]] * 2, [params] * 2, [None] * 2)
        ]

    first = run()
    assert first[0] != first[1]
    assert run() == first


# ---- stopping --------------------------------------------------------------------------------


def test_stop_token_ids_stop_after_the_token_and_leave_it_out_of_the_text(assets: DemoAssets):
    eng = make_engine(assets)
    full = run_one(eng, PROMPTS[0], greedy(24))
    k = first_new_token_at(full.token_ids, 5)
    stop_id = full.token_ids[k]

    out = run_one(eng, PROMPTS[0], greedy(24, stop_token_ids=(stop_id,)))
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: k + 1]
    assert out.text == eng.tokenizer.decode(full.token_ids[:k])
    assert full.text.startswith(out.text) and len(out.text) < len(full.text)


def test_stop_strings_cut_the_text_before_the_first_occurrence(assets: DemoAssets):
    eng = make_engine(assets)
    full = run_one(eng, PROMPTS[1], greedy(32))
    assert full.finish_reason == "length"
    stop = clean_substring(full.text, len(full.text) // 2)
    expected = full.text[: full.text.find(stop)]

    out = run_one(eng, PROMPTS[1], greedy(32, stop=(stop,)))
    assert out.finish_reason == "stop"
    assert out.text == expected
    assert stop not in out.text
    assert full.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(out.token_ids) < len(full.token_ids)

    # with several stop strings the earliest occurrence wins, whatever the list order
    early = clean_substring(full.text, 2)
    both = run_one(eng, PROMPTS[1], greedy(32, stop=(stop, early)))
    assert both.finish_reason == "stop"
    assert both.text == full.text[: full.text.find(early)]


def test_max_tokens_finishes_with_length_and_exactly_max_tokens(assets: DemoAssets):
    eng = make_engine(assets)
    for n in (1, 2, 7):
        out = run_one(eng, PROMPTS[2], SamplingParams(max_tokens=n, seed=n, ignore_eos=True))
        assert out.finish_reason == "length"
        assert len(out.token_ids) == n
        assert out.num_prompt_tokens == len(eng.encode(PROMPTS[2]))


def _model_with_eos(assets: DemoAssets, dest: Path, *, config_eos=None, tokenizer_eos=None) -> Path:
    """A copy of the demo model (weights linked) whose config or tokenizer names other EOS tokens."""
    dest.mkdir()
    for name in ("model.safetensors", "tokenizer.json", "special_tokens_map.json"):
        (dest / name).symlink_to(assets.model / name)
    cfg = json.loads((assets.model / "config.json").read_text())
    tok_cfg = json.loads((assets.model / "tokenizer_config.json").read_text())
    if config_eos is not None:
        cfg["eos_token_id"] = config_eos
    if tokenizer_eos is not None:
        tok_cfg["eos_token"] = tokenizer_eos
    (dest / "config.json").write_text(json.dumps(cfg))
    (dest / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    return dest


def test_eos_from_config_or_tokenizer_stops_and_ignore_eos_continues(
    assets: DemoAssets, tmp_path: Path
):
    base = make_engine(assets)
    demo_eos = json.loads((assets.model / "config.json").read_text())["eos_token_id"]
    assert base.eos_ids == {demo_eos}
    full = run_one(base, PROMPTS[3], greedy(20))
    k = first_new_token_at(full.token_ids, 4)
    token = full.token_ids[k]
    token_text = Tokenizer.from_file(str(assets.model / "tokenizer.json")).id_to_token(token)

    variants = {
        "config list": _model_with_eos(assets, tmp_path / "cfg", config_eos=[demo_eos, token]),
        "tokenizer": _model_with_eos(assets, tmp_path / "tok", tokenizer_eos=token_text),
    }
    for what, model_dir in variants.items():
        eng = LLMEngine(config(model_dir))
        assert token in eng.eos_ids and demo_eos in eng.eos_ids, what
        out = run_one(eng, PROMPTS[3], greedy(20))
        assert out.finish_reason == "stop", what
        assert out.token_ids == full.token_ids[: k + 1], what
        assert out.text == base.tokenizer.decode(full.token_ids[:k]), what

        past = run_one(eng, PROMPTS[3], greedy(20, ignore_eos=True))
        assert past.finish_reason == "length", what
        assert past.token_ids == full.token_ids, what


# ---- streaming -------------------------------------------------------------------------------


def _stream_all(eng: LLMEngine, requests: dict[str, tuple[str, SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        eng.add_request(prompt, params, request_id=rid)
    return drain(eng)


def test_streamed_deltas_add_up_to_the_final_text(assets: DemoAssets):
    eng = make_engine(assets)
    reference = run_one(eng, PROMPTS[0], SamplingParams(max_tokens=32, seed=5))
    mid = clean_substring(reference.text, len(reference.text) // 2)
    requests = {}
    for i, prompt in enumerate(PROMPTS):
        for stop in ((), (" ",), ("e", "th"), (mid,)):
            requests[f"{i}-{'|'.join(stop)}"] = (
                prompt,
                SamplingParams(max_tokens=32, seed=5, stop=stop),
            )
    final, streams = _stream_all(eng, requests)
    assert set(final) == set(requests)
    assert final[f"0-{mid}"].finish_reason == "stop"
    for rid, outs in streams.items():
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True], rid
        assert "".join(o.new_text for o in outs) == final[rid].text, rid
        assert all(len(o.new_token_ids) == 1 for o in outs), rid
        assert [o.new_token_ids[0] for o in outs] == final[rid].token_ids, rid
        for k, o in enumerate(outs):  # streamed text never runs ahead of what is final
            assert final[rid].text.startswith(o.text), rid
            # each output's ids so far: a snapshot (later tokens do not show in it), taken
            # without copying the list each step; the final one is a list
            assert o.token_ids == final[rid].token_ids[: k + 1], rid
            assert len(o.token_ids) == k + 1 and o.token_ids[-1] == o.new_token_ids[0], rid
        assert type(final[rid].token_ids) is list, rid
        if final[rid].finish_reason == "length" and not requests[rid][1].stop:
            assert final[rid].text == eng.tokenizer.decode(final[rid].token_ids), rid


def test_streamed_deltas_with_a_stop_string_longer_than_the_first_tokens(assets: DemoAssets):
    """A stop string that matches the very start of the output: nothing may be streamed,
    since every prefix could still become the stop string."""
    eng = make_engine(assets)
    full = run_one(eng, PROMPTS[0], greedy(24))
    stop = full.text[:12]
    final, streams = _stream_all(eng, {"r": (PROMPTS[0], greedy(24, stop=(stop,)))})
    assert final["r"].finish_reason == "stop"
    assert final["r"].text == ""
    assert [o.new_text for o in streams["r"]] == [""] * len(streams["r"])


# ---- validation ------------------------------------------------------------------------------


def test_invalid_requests_are_rejected_and_leave_no_state(assets: DemoAssets):
    eng = make_engine(assets, "sql-r8", max_model_len=64)
    vocab = eng.model_config.vocab_size
    prompt = list(range(10, 50))  # 40 tokens

    with pytest.raises(RequestError, match=r"40 tokens.*max_tokens 25.*64 tokens"):
        eng.add_request(prompt, greedy(25))
    with pytest.raises(RequestError, match="empty"):
        eng.add_request([], greedy(4))
    for bad in ([1, vocab], [-1, 5], [1, 2.0]):
        with pytest.raises(RequestError, match=str(vocab)):
            eng.add_request(bad, greedy(4))
    with pytest.raises(UnknownAdapter, match="nope"):
        eng.add_request(prompt, greedy(4), adapter="nope")
    eng.add_request(prompt, greedy(24, ignore_eos=True), request_id="dup")  # 40 + 24 = 64 fits
    with pytest.raises(RequestError, match="dup"):
        eng.add_request(PROMPTS[0], greedy(4), request_id="dup")

    assert list(eng.requests) == ["dup"]
    final, _ = drain(eng)
    assert final["dup"].finish_reason == "length" and len(final["dup"].token_ids) == 24
    assert not eng.has_unfinished() and eng.pool.stats().kv_pages == 0


def test_a_request_larger_than_the_pool_is_rejected(assets: DemoAssets):
    eng = make_engine(assets, pool_pages=4)  # 4 pages x 32 tokens
    with pytest.raises(RequestError, match="pages"):
        eng.add_request(list(range(1, 101)), greedy(29))  # 129 tokens -> 5 blocks
    eng.add_request(list(range(1, 101)), greedy(28, ignore_eos=True))  # 128 tokens: 4 blocks
    final, _ = drain(eng)
    assert len(next(iter(final.values())).token_ids) == 28


def test_a_request_that_cannot_fit_beside_its_adapter_is_rejected_not_stuck(assets: DemoAssets):
    """code-r32 takes 7 of 14 pages, so its requests get at most 7 KV blocks (224 tokens).
    A larger one can never run: it must be refused up front instead of spinning forever."""
    eng = make_engine(assets, "code-r32", pool_pages=14)
    assert eng.add_adapter("code-r32", assets.adapters_dir / "code-r32").pool_pages == 7
    prompt = list(range(1, 201))
    eng.add_request(prompt, greedy(24, ignore_eos=True), adapter="code-r32", request_id="fits")
    final, _ = drain(eng, max_steps=200)
    assert len(final["fits"].token_ids) == 24

    # 225 tokens need 8 blocks: 8 + 7 > 14. Today it is accepted and step() then returns
    # nothing forever while has_unfinished() stays True (generate() would spin).
    with pytest.raises(RequestError):
        eng.add_request(
            prompt, greedy(25, ignore_eos=True), adapter="code-r32", request_id="too-big"
        )


# ---- memory: abort, preemption, adapter removal --------------------------------------------


def test_abort_frees_pages_at_once_and_unpins_the_adapter(assets: DemoAssets):
    eng = make_engine(assets, "chat-r16")
    long = list(range(1, 80))  # 79 tokens: 3 blocks once decoding starts
    eng.add_request(long, greedy(200), adapter="chat-r16", request_id="a1")
    eng.add_request(long[:40], greedy(200), adapter="chat-r16", request_id="a2")
    eng.add_request(PROMPTS[0], greedy(30), request_id="base")
    for _ in range(3):
        eng.step()
    before = eng.pool.stats()
    adapter = eng.adapters.resident["chat-r16"]
    assert adapter.pins == 2 and before.pinned_pages == len(adapter.pages)
    a1_pages = list(eng.requests["a1"].block_table)
    assert len(a1_pages) == 3

    eng.abort("a1")
    after = eng.pool.stats()
    # its two full blocks stay in the prefix cache (idle, evictable), the third is freed
    assert after.free_pages == before.free_pages + 1
    assert after.cached_pages == before.cached_pages + 2
    assert after.kv_pages == before.kv_pages - 3
    assert [eng.pool.kind[p] for p in a1_pages] == [PageKind.CACHED] * 2 + [PageKind.FREE]
    assert adapter.pins == 1 and after.pinned_pages == len(adapter.pages)  # a2 still uses it

    eng.abort("a2")
    assert adapter.pins == 0 and eng.pool.stats().pinned_pages == 0
    assert "chat-r16" in eng.adapters.resident  # unpinned, kept warm (evictable)
    eng.pool.check_invariants()

    eng.abort("a2")  # aborting twice, or an unknown id, is a no-op
    eng.abort("never-seen")
    final, _ = drain(eng)
    assert set(final) == {"base"}
    assert final["base"].token_ids == run_one(make_engine(assets), PROMPTS[0], greedy(30)).token_ids
    assert eng.pool.stats().kv_pages == 0


def test_abort_of_a_waiting_request_removes_it_from_the_queue(assets: DemoAssets):
    eng = make_engine(assets, scheduler=SchedulerConfig(max_num_seqs=1))
    eng.add_request(PROMPTS[0], greedy(5), request_id="runs")
    eng.add_request(PROMPTS[1], greedy(5), request_id="waits")
    eng.step()
    assert [s.request_id for s in eng.scheduler.waiting] == ["waits"]
    eng.abort("waits")
    assert not eng.scheduler.waiting
    final, _ = drain(eng)
    assert set(final) == {"runs"}
    eng.add_request(PROMPTS[1], greedy(2), request_id="waits")  # the id is free again
    assert drain(eng)[0]["waits"].finish_reason == "length"


def test_preemption_under_a_tiny_pool_gives_the_same_tokens_as_running_alone(assets: DemoAssets):
    requests = [
        (PROMPTS[0], greedy(60, ignore_eos=True), None),
        (PROMPTS[1], greedy(60, ignore_eos=True), "sql-r8"),
        (PROMPTS[2], SamplingParams(max_tokens=60, seed=3, ignore_eos=True), None),
        (PROMPTS[3], greedy(60, ignore_eos=True), None),
    ]
    big = make_engine(assets, "sql-r8")
    alone = [run_one(big, p, sp, a).token_ids for p, sp, a in requests]

    # 1 adapter page + 5 KV blocks, while the four requests need 3 blocks each
    small = make_engine(assets, "sql-r8", pool_pages=6)
    outs = small.generate(*map(list, zip(*requests, strict=True)))
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" for o in outs)
    assert small.scheduler.num_preemptions > 0
    stats = small.pool.stats()
    assert stats.kv_pages == 0 and stats.pinned_pages == 0
    small.pool.check_invariants()


def test_the_stats_count_requests_held_back_for_pages_and_not_for_the_step(assets: DemoAssets):
    # The router prices a replica's batch as full at its rows only while requests wait for
    # pages (router/policy.py batch_slots); requests held by the step's token budget or
    # max_num_seqs start within a step or two and must not read as pages.
    long = list(range(1, 80))  # 79 tokens: 3 blocks each once decoding starts
    held = [
        # the token budget: 79 + 79 > 100, the second prompt waits for the next step
        make_engine(assets, scheduler=SchedulerConfig(max_num_batched_tokens=100)),
        # the batch's sequences
        make_engine(assets, scheduler=SchedulerConfig(max_num_seqs=1)),
    ]
    for eng in held:
        for i in range(3):
            eng.add_request(long, greedy(20, ignore_eos=True), request_id=f"r{i}")
        eng.step()
        stats = eng.stats()
        assert stats["waiting"] > 0 and stats["waiting_for_pages"] == 0
        assert eng.pool.stats().free_pages > 100  # the pool had room
        drain(eng)

    # A 6-page pool holds fewer blocks than three such requests need (distinct prompts: no
    # shared prefix blocks), and the budget and max_num_seqs have room for all three: every
    # request still waiting after a step was held back for pages.
    eng = make_engine(assets, pool_pages=6)
    for i in range(3):
        eng.add_request([t + i for t in long], greedy(60, ignore_eos=True), request_id=f"r{i}")
    waited = 0
    while eng.has_unfinished():
        eng.step()
        stats = eng.stats()
        assert stats["waiting_for_pages"] == stats["waiting"]
        waited += stats["waiting"] > 0
    assert waited > 0 and eng.scheduler.num_preemptions > 0


def test_the_stats_count_forward_passes_and_the_seconds_they_took(assets: DemoAssets):
    # an engine's busy time, which the fleet validation sets beside its simulated replicas'
    # (benchmarks/fleet/validation.py `step_seconds_ratio`): a step that runs nothing is
    # not counted
    eng = make_engine(assets)
    assert eng.stats()["steps"] == 0 and eng.stats()["step_seconds"] == 0.0
    eng.step()
    assert eng.stats()["steps"] == 0
    eng.add_request(list(range(1, 20)), greedy(5, ignore_eos=True), request_id="r")
    started = time.perf_counter()
    _, streams = drain(eng)
    took = time.perf_counter() - started
    stats = eng.stats()
    assert stats["steps"] == len(streams["r"]) == 5  # a prefill, then a decode per token
    assert 0 < stats["step_seconds"] <= took


def test_continuous_batching_mixes_a_new_prefill_with_running_decodes(assets: DemoAssets):
    eng = make_engine(assets)
    eng.add_request(PROMPTS[0], greedy(20, ignore_eos=True), request_id="old")
    for _ in range(3):
        eng.step()
    eng.add_request(PROMPTS[1], greedy(5, ignore_eos=True), request_id="new")
    outs = {o.request_id: o for o in eng.step()}
    assert set(outs) == {"old", "new"}
    assert len(outs["old"].token_ids) == 4  # one more decode token
    assert len(outs["new"].token_ids) == 1  # the whole prefill and its first token
    final, _ = drain(eng)
    alone = run_one(make_engine(assets), PROMPTS[0], greedy(20, ignore_eos=True))
    assert final["old"].token_ids == alone.token_ids


def test_chunked_prefill_runs_beside_decodes_and_matches_a_single_pass(assets: DemoAssets):
    long_prompt = list(range(100, 150))  # 50 tokens
    eng = make_engine(assets, scheduler=SchedulerConfig(max_num_batched_tokens=8))
    eng.add_request(PROMPTS[0][:5], greedy(30, ignore_eos=True), request_id="old")
    while not eng.requests["old"].output_ids:
        eng.step()
    eng.add_request(long_prompt, greedy(6, ignore_eos=True), request_id="new")
    steps_until_first = 0
    while True:
        outs = {o.request_id: o for o in eng.step()}
        steps_until_first += 1
        assert "old" in outs  # the decode never stalls behind the long prefill
        if "new" in outs:
            break
    assert steps_until_first == -(-50 // 7)  # 7 prompt tokens per step beside the decode
    final, _ = drain(eng)
    reference = make_engine(assets)
    assert (
        final["new"].token_ids
        == run_one(reference, long_prompt, greedy(6, ignore_eos=True)).token_ids
    )
    assert (
        final["old"].token_ids
        == run_one(reference, PROMPTS[0][:5], greedy(30, ignore_eos=True)).token_ids
    )


def test_removing_an_adapter_lets_its_running_request_finish(assets: DemoAssets):
    expected = run_one(make_engine(assets, "code-r32"), PROMPTS[2], greedy(16), "code-r32")
    eng = make_engine(assets, "code-r32")
    idle_adapter_pages = eng.pool.stats().adapter_pages
    eng.add_request(PROMPTS[2], greedy(16), adapter="code-r32", request_id="r")
    eng.step()
    eng.step()
    assert eng.pool.stats().adapter_pages == idle_adapter_pages + 7

    eng.remove_adapter("code-r32")
    with pytest.raises(UnknownAdapter):
        eng.add_request(PROMPTS[0], greedy(4), adapter="code-r32")
    assert eng.pool.stats().adapter_pages == idle_adapter_pages + 7  # still in use
    final, _ = drain(eng)
    assert final["r"].token_ids == expected.token_ids
    stats = eng.pool.stats()
    assert stats.adapter_pages == idle_adapter_pages and stats.pinned_pages == 0
    eng.pool.check_invariants()
    with pytest.raises(UnknownAdapter):
        eng.remove_adapter("code-r32")


def test_removing_an_adapter_with_queued_requests_does_not_break_the_engine(assets: DemoAssets):
    """A request accepted for an adapter that is removed before it is scheduled must not make
    step() raise; the engine keeps serving everyone else."""
    eng = make_engine(assets, "sql-r8")
    eng.add_request(PROMPTS[0], greedy(4), adapter="sql-r8", request_id="queued")
    eng.add_request(PROMPTS[1], greedy(4), request_id="other")
    eng.remove_adapter("sql-r8")
    final, _ = drain(eng)  # raises UnknownAdapter from the scheduler today
    assert final["other"].finish_reason == "length"
    assert "queued" in final or "queued" not in eng.requests
    assert eng.pool.stats().kv_pages == 0


# ---- async Engine ----------------------------------------------------------------------------


def run_async(coro, timeout: float = 60.0):
    async def bounded():
        return await asyncio.wait_for(coro, timeout)

    return asyncio.run(bounded())


async def collect(engine: Engine, prompt, params: SamplingParams, adapter: str | None = None):
    return [out async for out in engine.generate(prompt, params, adapter)]


@pytest.fixture
def async_engine(assets: DemoAssets):
    engine = Engine(config(assets.model))
    try:
        yield engine
    finally:
        engine.shutdown()


def test_async_generate_streams_and_serves_two_adapters_concurrently(
    assets: DemoAssets, async_engine: Engine
):
    reference = make_engine(assets, "sql-r8", "chat-r16")
    expected = {
        a: run_one(reference, PROMPTS[i], greedy(12, ignore_eos=True), a).token_ids
        for i, a in enumerate(("sql-r8", "chat-r16"))
    }

    async def main():
        for name in ("sql-r8", "chat-r16"):
            info = await async_engine.add_adapter(name, assets.adapters_dir / name)
            assert info.name == name and info.pool_pages > 0
        a, b = await asyncio.gather(
            collect(async_engine, PROMPTS[0], greedy(12, ignore_eos=True), "sql-r8"),
            collect(async_engine, PROMPTS[1], greedy(12, ignore_eos=True), "chat-r16"),
        )
        with pytest.raises(UnknownAdapter):
            await collect(async_engine, PROMPTS[0], greedy(3), "not-registered")
        return a, b, await async_engine.stats()

    a, b, stats = run_async(main())
    for outs, name in ((a, "sql-r8"), (b, "chat-r16")):
        assert sum(len(o.new_token_ids) for o in outs) == 12  # steps may come coalesced
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert outs[-1].finish_reason == "length"
        assert outs[-1].token_ids == expected[name]
        assert "".join(o.new_text for o in outs) == outs[-1].text
    assert stats["running"] == 0 and stats["pool"]["kv_pages"] == 0
    assert set(stats["adapters"]["resident"]) == {"sql-r8", "chat-r16"}


def test_a_consumer_behind_the_steps_gets_the_outputs_waiting_for_it_as_one(async_engine: Engine):
    """A relay that falls behind (a flood's streams on a busy host) is handed what the
    engine produced meanwhile in one output, not one per step: it catches up instead of
    carrying every step's event."""

    async def main():
        outs = []
        stream = async_engine.generate(PROMPTS[0], greedy(40, ignore_eos=True), request_id="behind")
        async for out in stream:
            outs.append(out)
            if len(outs) == 1:  # fall behind: let the engine make 10 more tokens meanwhile
                seq = async_engine.core.requests.get("behind")
                while seq is not None and len(seq.output_ids) < 11 and not seq.finished:
                    await asyncio.sleep(0.01)
        return outs

    outs = run_async(main())
    tokens = [t for o in outs for t in o.new_token_ids]
    assert tokens == outs[-1].token_ids and len(tokens) == 40
    assert "".join(o.new_text for o in outs) == outs[-1].text
    assert len(outs[1].new_token_ids) >= 10  # what waited came as one
    assert len(outs) <= 31
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]


@pytest.mark.parametrize(
    ("total", "each", "gap"), [(0.0, 0.0, None), (40.0, 0.0, 0.2), (0.0, 4.0, 0.25)]
)
def test_a_replica_streams_within_its_chunk_budget_and_never_holds_a_first_token(
    assets: DemoAssets, total: float, each: float, gap: float | None
):
    """Eight streams of 1,000 tokens against 40 chunks a second in all (each stream's chunks
    spaced by 8 / 40 = 0.2 s) or 4 a second per stream (0.25 s): the chunks carry the tokens
    made meanwhile, the first chunk comes at once, the text is the same, and with neither cap
    every step is a chunk. "At once" is timed from the step that made the first token, not
    from the request: a held first chunk would come a gap (0.2 s) after its step, and a
    machine busy elsewhere can delay the first step itself (0.8 s once in CI, with the other
    test worker busy), which says nothing of the budget."""
    engine = Engine(
        config(assets.model, stream_events_per_s=total, stream_events_per_s_per_stream=each)
    )
    made: dict[str, float] = {}  # request id -> when the step that made its first token ended
    step = engine.core.step

    def timed_step():
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            made.setdefault(out.request_id, now)
        return outputs

    engine.core.step = timed_step  # type: ignore[method-assign]

    async def one(i: int):
        outs, times = [], []
        start = time.perf_counter()
        params = greedy(1000, ignore_eos=True)
        async for out in engine.generate(PROMPTS[i % 2], params, request_id=f"s{i}"):
            outs.append(out)
            times.append(time.perf_counter() - start)
        return outs, times, made[f"s{i}"] - start

    async def main():
        return await asyncio.gather(*(one(i) for i in range(8)))

    try:
        results = run_async(main())
    finally:
        engine.shutdown()
    for outs, times, first_made in results:
        assert sum(len(o.new_token_ids) for o in outs) == 1000
        assert "".join(o.new_text for o in outs) == outs[-1].text
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
        assert times[0] - first_made < 0.1  # the first token is not held
        gaps = [b - a for a, b in zip(times[1:-1], times[2:-1], strict=False)]
        if gap is not None:
            assert len(gaps) >= 3 and all(g >= gap - 0.02 for g in gaps), gaps
            assert len(outs) <= 2 + times[-1] / gap  # the first, the last, one per gap
        else:
            assert len(outs) > 500  # a step each, bar what a busy consumer coalesced


def test_a_stream_s_first_text_is_not_held_by_its_chunk_budget(assets: DemoAssets):
    """A first step that shows no text (an incomplete character, or text that may begin a
    stop string, as here) sends the reader nothing: the ingress makes no event of it. So the
    chunk budget starts at the first text; a stream's first words never wait a gap (at 20
    chunks a second, 50 ms more for the ~5% of the fairness bench's requests whose first token
    was not yet a character)."""
    engine = Engine(config(assets.model, stream_events_per_s=0, stream_events_per_s_per_stream=2))

    async def first_text(params: SamplingParams) -> tuple[float, RequestOutput]:
        start = time.perf_counter()
        async for out in engine.generate(PROMPTS[0], params):
            if out.new_text:
                return time.perf_counter() - start, out
        raise AssertionError("no text")

    try:
        _, first = run_async(first_text(greedy(1, ignore_eos=True)))  # the first token alone
        # a stop string shows nothing of the last len(stop) - 1 characters until it cannot match
        held = greedy(200, ignore_eos=True, stop=["\x00" * (len(first.text) + 1)])
        waited, out = run_async(first_text(held))
    finally:
        engine.shutdown()
    assert len(out.token_ids) >= 2, out  # the first token showed nothing
    assert waited < 0.3, f"the first text waited {waited:.2f}s: a chunk gap (0.5 s)"


def test_a_stream_s_first_chunk_goes_out_before_the_other_chunks_of_its_step(assets: DemoAssets):
    """Four streams decoding when a fifth arrives: in the step that makes its first token,
    that chunk is handed on before the others' (every process on the way relays in arrival
    order, so a first token behind a flood's chunks waits for all of them, in each)."""
    engine = Engine(config(assets.model, stream_events_per_s=0, stream_events_per_s_per_stream=0))
    steps: list[list[tuple[str, int]]] = []  # each step's outputs: (request, tokens so far)
    step = engine.core.step

    def recorded():
        time.sleep(0.02)  # the consumers take the last step's chunks before this step's come
        outputs = step()
        steps.append([(o.request_id, len(o.token_ids)) for o in outputs])
        return outputs

    engine.core.step = recorded  # type: ignore[method-assign]
    received: list[tuple[str, int]] = []  # in the order the consumers got them

    async def one(rid: str, n: int, after: asyncio.Event | None = None):
        if after is not None:
            await after.wait()
        async for out in engine.generate(PROMPTS[0], greedy(n, ignore_eos=True), request_id=rid):
            received.append((rid, len(out.token_ids)))
            if rid == "flood-0" and len(out.token_ids) >= 5 and started is not None:
                started.set()

    async def main():
        nonlocal started
        started = asyncio.Event()
        floods = [one(f"flood-{i}", 60) for i in range(4)]
        await asyncio.gather(*floods, one("late", 3, started))

    started: asyncio.Event | None = None
    try:
        run_async(main())
    finally:
        engine.shutdown()
    k = next(i for i, outs in enumerate(steps) if ("late", 1) in outs)
    first = received.index(("late", 1))
    others = [(rid, n) for rid, n in steps[k] if rid != "late"]
    assert others, "the late stream's first token came in a step of its own"
    for rid, n in others:  # where that step's token reached its consumer (maybe folded later)
        got = next(i for i, (r, m) in enumerate(received) if r == rid and m >= n)
        assert got > first, (rid, n, received[first - 4 : first + 5], steps[k])


def test_cancelling_the_consumer_aborts_the_request_and_frees_its_pages(async_engine: Engine):
    async def main():
        seen = []

        async def consume():
            async for out in async_engine.generate(PROMPTS[0], greedy(1500, ignore_eos=True)):
                seen.append(out)

        task = asyncio.create_task(consume())
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        assert (await async_engine.stats())["pool"]["kv_pages"] > 0
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        stats = await async_engine.stats()
        assert stats["running"] == 0 and stats["waiting"] == 0
        assert stats["pool"]["kv_pages"] == 0
        assert not seen[-1].finished
        # the engine keeps serving
        after = await collect(async_engine, PROMPTS[1], greedy(4, ignore_eos=True))
        assert after[-1].finish_reason == "length"

    run_async(main())


def test_closing_the_stream_early_aborts_the_request(async_engine: Engine):
    async def main():
        stream = async_engine.generate(
            PROMPTS[2], greedy(1500, ignore_eos=True), request_id="closed"
        )
        count = 0
        async for _ in stream:
            count += 1
            if count == 3:
                break
        await stream.aclose()
        stats = await async_engine.stats()
        assert stats["running"] == 0 and stats["pool"]["kv_pages"] == 0
        assert "closed" not in async_engine.core.requests
        again = await collect(async_engine, PROMPTS[2], greedy(3, ignore_eos=True))
        # steps may come coalesced when this consumer lags the engine (a busy host)
        assert sum(len(o.new_token_ids) for o in again) == 3 and again[-1].finished

    run_async(main())


def test_async_engine_reports_request_errors_and_keeps_running(async_engine: Engine):
    async def main():
        with pytest.raises(RequestError):
            await collect(async_engine, [], greedy(3))
        with pytest.raises(RequestError):
            await collect(async_engine, PROMPTS[0], greedy(4000))
        outs = await collect(async_engine, PROMPTS[0], greedy(3))
        assert outs[-1].finished

    run_async(main())


def test_no_output_is_lost_when_the_event_loop_is_busy(async_engine: Engine):
    """While the engine is busy with another request and the event loop is briefly blocked
    by other work, a new request's first outputs must still reach its stream (the stream has
    to be registered before the engine thread can step the new request)."""

    async def hog(stop: asyncio.Event):
        while not stop.is_set():
            time.sleep(0.02)  # some other coroutine doing blocking work
            await asyncio.sleep(0)

    async def main():
        background = asyncio.create_task(
            collect(async_engine, PROMPTS[0], greedy(1500, ignore_eos=True))
        )
        await asyncio.sleep(0.05)
        stop = asyncio.Event()
        hogger = asyncio.create_task(hog(stop))
        try:
            for i in range(4):
                try:
                    outs = await asyncio.wait_for(collect(async_engine, f"short {i}", greedy(1)), 3)
                except TimeoutError:
                    pytest.fail(f"request {i} (max_tokens=1) never delivered its only output")
                assert len(outs) == 1 and outs[0].finished
        finally:
            stop.set()
            await hogger
            background.cancel()
            with pytest.raises(asyncio.CancelledError):
                await background

    run_async(main())


def test_async_add_adapter_from_any_folder_then_generate_and_remove(
    assets: DemoAssets, tmp_path: Path, async_engine: Engine
):
    """add_adapter reads the folder it is given (here a copy under another name)."""
    shutil.copytree(assets.adapters_dir / "legal-r8", tmp_path / "tenant-7")
    expected = run_one(make_engine(assets, "legal-r8"), PROMPTS[3], greedy(8), "legal-r8").token_ids

    async def main():
        info = await async_engine.add_adapter("tenant-7", tmp_path / "tenant-7")
        assert info.rank == 8
        outs = await collect(async_engine, PROMPTS[3], greedy(8), "tenant-7")
        await async_engine.remove_adapter("tenant-7")
        with pytest.raises(UnknownAdapter):
            await collect(async_engine, PROMPTS[3], greedy(8), "tenant-7")
        return outs

    assert run_async(main())[-1].token_ids == expected


def test_a_step_batch_moves_every_tensor_to_the_model_device(assets: DemoAssets):
    """The batch is built on the host; on a GPU the model moves it, all of it, to its device
    (a tensor left behind fails the first CUDA step: index on cpu, weights on cuda)."""
    engine = make_engine(assets, "chat-r16")
    engine.add_request([5, 17, 99, 3], SamplingParams(max_tokens=2), "chat-r16")
    engine.add_request([11], SamplingParams(max_tokens=2), None)
    engine.step()  # both prefilled; the next step mixes nothing new: decode rows only
    engine.add_request(list(range(30, 60)), SamplingParams(max_tokens=2), None)
    batch = build_step_batch(engine.scheduler.schedule(), engine.kv, None)
    assert {g.decode for g in batch.groups} == {True, False}
    meta = torch.device("meta")
    moved = batch.to(meta)
    tensors = [
        v for v in (getattr(moved, f) for f in moved.__slots__) if isinstance(v, torch.Tensor)
    ]
    for g in moved.groups:
        tensors += [v for v in (getattr(g, f) for f in g.__slots__) if isinstance(v, torch.Tensor)]
    assert len(tensors) == 4 + 6 * 2 and all(t.device == meta for t in tensors)
    assert batch.to(torch.device("cpu")) is batch

"""A request resumed on another engine after the output a client already holds (what the
ingress sends when a replica dies mid-stream) goes on exactly as one uninterrupted run: the
same tokens, the same streamed text, stop strings spanning the cut, seeded draws included.
The cluster test (tests/test_serve_replica.py) kills a real replica under 16 streams."""

import pytest

from loraplex.demo.assets import DemoAssets
from loraplex.replica.config import EngineConfig
from loraplex.replica.engine import LLMEngine, RequestError
from loraplex.replica.sampling import SamplingParams, draw_seed
from loraplex.replica.sequence import Continuation, RequestOutput

PAGE = 64 * 1024
PROMPT = "The morning train left the station"


def _engine(assets: DemoAssets) -> LLMEngine:
    eng = LLMEngine(EngineConfig(model=str(assets.model), page_bytes=PAGE, pool_bytes=256 * PAGE))
    eng.add_adapter("sql-r8", assets.adapters_dir / "sql-r8")
    return eng


def _stream(eng: LLMEngine, prompt, params, adapter, continuation=None) -> list[RequestOutput]:
    seq = eng.add_request(prompt, params, adapter, continuation=continuation)
    outs = []
    while eng.has_unfinished():
        outs += [out for out in eng.step() if out.request_id == seq.request_id]
    return outs


CASES = {
    "greedy": (SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), None),
    "seeded": (SamplingParams(max_tokens=40, temperature=0.9, top_p=0.95, seed=11), "sql-r8"),
    "seeded-top-k": (SamplingParams(max_tokens=40, temperature=1.3, top_k=20, seed=5), None),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_the_uninterrupted_run(assets: DemoAssets, case: str):
    params, adapter = CASES[case]
    whole = _stream(_engine(assets), PROMPT, params, adapter)
    tokens = [t for out in whole for t in out.new_token_ids]
    other = _engine(assets)  # another replica: nothing of the first run is in it
    for cut in (1, 7, 23, len(whole) - 1):
        sent_text = "".join(out.new_text for out in whole[:cut])
        done = Continuation(tuple(tokens[:cut]), sent_text)
        rest = _stream(other, PROMPT, params, adapter, continuation=done)
        assert [t for out in rest for t in out.new_token_ids] == tokens[cut:], cut
        assert sent_text + "".join(out.new_text for out in rest) == whole[-1].text
        assert rest[-1].token_ids == whole[-1].token_ids
        assert rest[-1].finish_reason == whole[-1].finish_reason
        assert rest[-1].num_prompt_tokens == whole[-1].num_prompt_tokens


def test_a_stop_string_spanning_the_cut_still_stops(assets: DemoAssets):
    probe = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    whole = _stream(_engine(assets), PROMPT, probe, None)
    text = whole[-1].text
    stop = text[10:14]  # its first characters come from tokens before the cut
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True, stop=(stop,))
    uncut = _stream(_engine(assets), PROMPT, params, None)
    assert uncut[-1].finish_reason == "stop"
    # cut where the text streamed so far ends inside the stop string's span
    streamed, cut = "", 0
    while len(streamed) < 11 and cut < len(uncut) - 1:
        streamed += uncut[cut].new_text
        cut += 1
    tokens = [t for out in uncut for t in out.new_token_ids]
    rest = _stream(
        _engine(assets), PROMPT, params, None, Continuation(tuple(tokens[:cut]), streamed)
    )
    assert streamed + "".join(out.new_text for out in rest) == uncut[-1].text
    assert rest[-1].finish_reason == "stop" and stop not in uncut[-1].text


def test_each_draw_depends_on_the_seed_and_position_only():
    seeds = {draw_seed(s, p) for s in (0, 1, 2**63, 2**64 - 1, 12345) for p in range(50)}
    assert len(seeds) == 250 and all(0 <= s < 2**64 for s in seeds)
    assert draw_seed(-(2**63), 9) == draw_seed(2**63, 9)  # seeds are taken mod 2**64, as torch does
    assert draw_seed(7, 3) == draw_seed(7, 3) != draw_seed(7, 4)


def test_bad_continuations_are_refused(assets: DemoAssets):
    eng = _engine(assets)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    vocab = eng.model_config.vocab_size
    with pytest.raises(RequestError, match="nothing to resume"):
        eng.add_request(PROMPT, params, continuation=Continuation((1, 2, 3, 4), ""))
    with pytest.raises(RequestError, match="output token ids"):
        eng.add_request(PROMPT, params, continuation=Continuation((vocab,), ""))
    assert not eng.requests

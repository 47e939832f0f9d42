"""The output text, decoded a few ids at a time, is the whole decode: the same text, cut at
the same stop string on the same token, for the demo model's real tokenizer and the
synthetic one, on text with multi-byte characters and on random ids (bytes that split
characters, invalid UTF-8, special tokens). Each token decodes a window of ids whose size
does not grow with the output."""

from __future__ import annotations

import random
from pathlib import Path

from loraplex.demo.assets import DemoAssets
from loraplex.replica.config import EngineConfig
from loraplex.replica.detokenizer import MAX_PENDING, IncrementalDetokenizer
from loraplex.replica.engine import LLMEngine
from loraplex.replica.sampling import SamplingParams
from loraplex.replica.tokenizer import Tokenizer

TEXTS = (
    "The morning train left the station at 7:45, héading north.",
    "数据库查询：SELECT name FROM users WHERE age > 30; 完成了！",
    "Emoji 🚀🔥👩‍💻 and accents: naïve café, Zürich, São Paulo, Ελληνικά, русский.",
    "def f(x):\n    return x ** 2  # ½ ≈ 0.5 → ∞\n\n\tend",
    "日本語のテキストと한국어 텍스트, mixed with ASCII and 🎉🎉🎉 repeated.",
)


def _tokenizers(real_gguf: Path, demo_assets: DemoAssets) -> dict[str, Tokenizer]:
    return {"real": Tokenizer(real_gguf), "synthetic": Tokenizer(demo_assets.model)}


def _sequences(tok: Tokenizer, seed: int, n_random: int) -> list[list[int]]:
    """Encoded texts (whole, and cut after every few characters), then random ids drawn
    from the whole vocabulary: single bytes that split or break UTF-8, special tokens."""
    rng = random.Random(seed)
    seqs = [tok.encode(t, add_special_tokens=False) for t in TEXTS]
    seqs += [tok.encode(t[:k], add_special_tokens=False) for t in TEXTS for k in (3, 17, 29)]
    for _ in range(n_random):
        seqs.append([rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 60))])
    joined = [i for s in seqs[: len(TEXTS)] for i in s]
    for _ in range(n_random):  # real text with random ids spliced in
        ids = list(joined)
        for _ in range(5):
            ids.insert(rng.randrange(len(ids)), rng.randrange(tok.vocab_size))
        seqs.append(ids)
    return seqs


def test_incremental_text_is_the_whole_decode(real_gguf: Path, demo_assets: DemoAssets):
    for name, tok in _tokenizers(real_gguf, demo_assets).items():
        for ids in _sequences(tok, seed=0, n_random=40):
            detok, before = IncrementalDetokenizer(), ""
            for end in range(1, len(ids)):
                detok.add(tok, ids, end)
                assert detok.text == tok.decode(ids[:end]).rstrip("\ufffd"), (name, ids, end)
                assert detok.text.startswith(before)
                before = detok.text
            detok.flush(tok, ids, len(ids))
            assert detok.text == tok.decode(ids), (name, ids)


def test_a_resumed_state_matches_the_uninterrupted_one(real_gguf: Path, demo_assets: DemoAssets):
    tok = Tokenizer(real_gguf)
    for ids in _sequences(tok, seed=1, n_random=10):
        cut = len(ids) // 2
        uninterrupted = IncrementalDetokenizer()
        for end in range(1, cut + 1):
            uninterrupted.add(tok, ids, end)
        resumed = IncrementalDetokenizer.of(tok, ids[:cut])
        assert resumed.text == uninterrupted.text
        resumed.flush(tok, ids, len(ids))
        uninterrupted.flush(tok, ids, len(ids))
        assert resumed.text == uninterrupted.text == tok.decode(ids)


def _whole_decode_oracle(tok: Tokenizer, ids: list[int], stops: tuple[str, ...]):
    """What decoding the whole output at every token gives: (tokens, text, reason). A
    trailing U+FFFD stands for a character whose last bytes are still to come: it is not
    searched until the last token."""
    for k in range(1, len(ids) + 1):
        text = tok.decode(ids[:k])
        text = text if k == len(ids) else text.rstrip("\ufffd")
        hits = [i for s in stops if (i := text.find(s)) != -1]
        if hits:
            return k, text[: min(hits)], "stop"
    return len(ids), tok.decode(ids), "length"


def test_the_engine_output_path_matches_the_whole_decode(real_gguf: Path):
    """Token ids fed through the engine's output path (the forward's choice of token aside):
    the final text, the token it stops on and the streamed pieces are those of decoding the
    whole output at every token and cutting at the first stop string."""
    engine = LLMEngine(EngineConfig(model=str(real_gguf), pool_bytes=64 << 20))
    tok = engine.tokenizer
    rng = random.Random(2)
    checked = 0
    for ids in _sequences(tok, seed=2, n_random=6):
        text = tok.decode(ids)
        stop_sets: list[tuple[str, ...]] = [()]
        for _ in range(3):
            if len(text) > 4:
                at = rng.randrange(len(text) - 3)
                stop_sets.append((text[at : at + rng.randint(1, 3)], "never-in-the-output-xyz"))
        for stops in stop_sets:
            params = SamplingParams(max_tokens=len(ids), ignore_eos=True, stop=stops)
            seq = engine.add_request([1, 2, 3], params)
            outs = []
            for token in ids:
                outs.append(engine._append(seq, token, None))
                if outs[-1].finished:
                    break
            n, expected, reason = _whole_decode_oracle(tok, ids, stops)
            assert (len(outs), outs[-1].text, outs[-1].finish_reason) == (n, expected, reason)
            assert "".join(o.new_text for o in outs) == expected
            checked += 1
    assert checked > 40


class _CountingTokenizer:
    def __init__(self, tok: Tokenizer):
        self.tok, self.ids_decoded = tok, 0

    def decode(self, ids: list[int]) -> str:
        self.ids_decoded += len(ids)
        return self.tok.decode(ids)

    def __getattr__(self, name: str):
        return getattr(self.tok, name)


def test_a_token_decodes_a_window_that_does_not_grow_with_the_output(real_gguf: Path):
    engine = LLMEngine(EngineConfig(model=str(real_gguf), pool_bytes=64 << 20))
    counting = _CountingTokenizer(engine.tokenizer)
    engine.tokenizer = counting
    ids = [i for t in TEXTS * 8 for i in counting.tok.encode(t, add_special_tokens=False)]
    params = SamplingParams(max_tokens=len(ids) + 1, ignore_eos=True, stop=("never-xyz",))
    seq = engine.add_request([1, 2, 3], params)
    per_token = []
    for token in ids:
        before = counting.ids_decoded
        engine._append(seq, token, None)
        per_token.append(counting.ids_decoded - before)
    assert len(ids) > 500
    # ids[prefix:read] and ids[prefix:end]: each at most two pieces of MAX_PENDING ids
    assert max(per_token) <= 4 * MAX_PENDING, max(per_token)

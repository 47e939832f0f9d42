"""A sequence's output text, decoded a few ids at a time.

Decoding the whole output again at every token costs a token O(output length). Instead
each sequence keeps two offsets into its ids (the pattern of vLLM's
`detokenize_incrementally` and text-generation-inference's `decode_token`):

    ids[prefix:read]   already in `text`; decoded again only as context, so that a
                       tokenizer whose pieces depend on their neighbours (a leading
                       space, a byte split across ids) decodes them as in the whole text
    ids[read:]         not yet in `text`

A step decodes ids[prefix:read] and ids[prefix:]; what the second adds is new text. While
it ends in U+FFFD (a multi-byte UTF-8 character whose last bytes are in ids still to come)
the offsets stay, the ids are decoded again with the next ones, and `text` shows the new
text up to that character. The window holds a few ids, so a token costs the same at any
output length.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT = "\ufffd"
# Ids held back at most: a UTF-8 character is at most 4 bytes and a byte-level id at least
# one, so longer than this the held bytes are invalid, not incomplete (or the ids are
# special tokens, which decode to nothing); they are then emitted as the full decode would.
MAX_PENDING = 8


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class IncrementalDetokenizer:
    __slots__ = ("text", "_done", "_prefix", "_read")

    def __init__(self) -> None:
        self.text = ""  # the text so far: decode(ids[:end]) less a trailing U+FFFD
        self._done = ""  # decode(ids[:read])
        self._prefix = 0
        self._read = 0

    @classmethod
    def of(cls, tokenizer: Decoder, ids: list[int]) -> IncrementalDetokenizer:
        """The state after ids were added one at a time (a request resumed after them)."""
        detok = cls()
        for end in range(1, len(ids) + 1):
            detok.add(tokenizer, ids, end)
        return detok

    def add(self, tokenizer: Decoder, ids: list[int], end: int) -> None:
        """Decode up to ids[end]; an incomplete last character is held back (its ids are
        decoded again with the next ones), the characters before it are in `text`."""
        piece = self._piece(tokenizer, ids, end)
        if (not piece or piece.endswith(REPLACEMENT)) and end - self._read < MAX_PENDING:
            self.text = self._done + piece.rstrip(REPLACEMENT)
        else:
            self._advance(piece, end)

    def flush(self, tokenizer: Decoder, ids: list[int], end: int) -> None:
        """Decode everything up to ids[end], an incomplete character as U+FFFD (the last
        decode of a finished sequence: `text` is then the whole decode of ids[:end])."""
        self._advance(self._piece(tokenizer, ids, end), end)

    def cut(self, at: int) -> None:
        """Keep text[:at] (a stop string starts at `at`); nothing is added after."""
        self.text = self.text[:at]

    def _piece(self, tokenizer: Decoder, ids: list[int], end: int) -> str:
        prefix_text = tokenizer.decode(ids[self._prefix : self._read])
        return tokenizer.decode(ids[self._prefix : end])[len(prefix_text) :]

    def _advance(self, piece: str, end: int) -> None:
        self._done += piece
        self.text = self._done
        self._prefix, self._read = self._read, end


def find_stop(text: str, stops: tuple[str, ...], new_from: int) -> int | None:
    """Index where the earliest stop string starts, among those ending at or after
    text[new_from] (text before it was searched already)."""
    start = max(0, new_from - max(len(s) for s in stops) + 1)
    hits = [i for s in stops if (i := text.find(s, start)) != -1]
    return min(hits) if hits else None


def streamable_end(text: str, stops: tuple[str, ...]) -> int:
    """How much of an unfinished sequence's text may be streamed: all but what could be the
    start of a stop string (its longest one, less a character)."""
    hold = max((len(s) for s in stops), default=1) - 1
    return max(0, len(text) - hold)

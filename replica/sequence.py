"""A request's state inside the engine."""

from __future__ import annotations

import collections.abc
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import TYPE_CHECKING

import torch

from loraplex.replica.detokenizer import IncrementalDetokenizer
from loraplex.replica.sampling import SamplingParams, draw_seed

if TYPE_CHECKING:
    from loraplex.replica.memory.adapters import ResidentAdapter


class SeqStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True, slots=True)
class Continuation:
    """Where a request resumes that began on another replica: the output tokens it already
    produced there and the text already streamed for them. The request then runs as if it
    had been preempted after them (its prompt and these tokens are recomputed), so stop
    strings, detokenizing and seeded draws go on exactly as in one uninterrupted run."""

    token_ids: tuple[int, ...]
    text: str


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    adapter: str | None
    arrival: float
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # tokens whose KV is in the cache
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None
    error: str | None = None  # why it failed, when finish_reason is "error"
    text: str = ""  # output text streamed so far (all of it once finished, cut at a stop)
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)
    num_preemptions: int = 0
    lora: ResidentAdapter | None = None  # pinned while running
    # prefix cache: the salt (tenant, then the request's cache_salt), the chain root it was
    # admitted under, the keys of its full blocks, and the tokens whose blocks are registered
    tenant: str | None = None  # also: admission is shared fairly among tenants
    cache_salt: str | None = None
    prefix_root: bytes | None = None
    block_keys: list[bytes] = field(default_factory=list)
    num_committed: int = 0
    num_cached_tokens: int = 0  # prompt tokens its first admission found cached
    seed: int = 0  # the request's seed; each draw's generator state is draw_seed(seed, position)

    def next_draw(self) -> torch.Generator:
        """The generator, seeded for the draw of the next output token."""
        return self.generator.manual_seed(draw_seed(self.seed, len(self.output_ids)))

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output, without joining the two (a decode step
        asks for one token: joining copied the whole sequence, each step)."""
        n = len(self.prompt_ids)
        if end <= n:
            return self.prompt_ids[start:end]
        if start >= n:
            return self.output_ids[start - n : end - n]
        return self.prompt_ids[start:] + self.output_ids[: end - n]

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids if self.output_ids else self.prompt_ids

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED


class TokensSoFar(collections.abc.Sequence):
    """The first `n` ids of a request's output, taken without copying them: a sequence's
    output only grows (a resumed one starts a new list), so its first `n` never change.
    A streamed output carried a copy of every id so far, which made a long answer's
    per-token cost grow with its length."""

    __slots__ = ("_ids", "_n")

    def __init__(self, ids: list[int], n: int):
        self._ids, self._n = ids, n

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[: self._n][index]
        if not -self._n <= index < self._n:
            raise IndexError("token index out of range")
        return self._ids[index % self._n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TokensSoFar | list | tuple):
            return len(other) == self._n and all(a == b for a, b in zip(self, other, strict=False))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # like a list

    def __repr__(self) -> str:
        return repr(self._ids[: self._n])


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request (streamed), or its final state."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    token_ids: collections.abc.Sequence[int]  # all so far (a list once finished)
    text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort", or "error" (see `error`)
    num_prompt_tokens: int
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache, not computed
    logits: torch.Tensor | None = None  # [vocab] float32, when params.return_logits
    error: str | None = None  # why this request failed, when finish_reason is "error"

    def followed_by(self, later: RequestOutput) -> RequestOutput:
        """This output and the `later` one of the same request as one: both steps' new
        tokens and text, in the later one's state."""
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
        )

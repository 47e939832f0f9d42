"""Which idle adapter leaves the device pool first (seed 004 §4.2).

Pure policies over `AdapterUsage` records: no pool, no clock of their own (the cache passes
`now`). `order` returns the candidates in eviction order, first to go first.

- `WeightedScore(F, R, S)`: Chameleon's score F·frequency + R·recency + S·size, each term
  normalised to [0, 1] over the candidates; the lowest score goes first. Defaults
  0.45 / 0.10 / 0.45 (the paper's profiling); "equal" is its FairShare variant (1/3 each).
- `LRU`: least recently used first.
- `GDSF`: Greedy-Dual-Size-Frequency (web caching): H = L + frequency · cost / size, with
  cost the reload time (a fixed setup plus bytes over the link), set when the adapter is
  used; the lowest H goes and L rises to it (aging).

Idle adapters are not the only evictable pages: the prefix cache keeps full KV blocks no
request holds. Which kind goes is one decision by cost (`RestoreCosts`): the expected
seconds lost per page freed, i.e. how often the page is used (a count halving every
`half_life_s`) times what bringing it back costs (recomputing a block's tokens, reloading
an adapter), over the pages it frees.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class AdapterUsage:
    """What eviction knows of one adapter. `frequency` counts uses, halving every
    `half_life_s` without use (the paper's "uses within a time frame", without a window's
    cliff)."""

    name: str
    nbytes: int
    frequency: float = 0.0
    last_used: float = float("-inf")

    def touch(self, now: float, half_life_s: float) -> None:
        self.frequency = self.frequency_at(now, half_life_s) + 1.0
        self.last_used = now

    def frequency_at(self, now: float, half_life_s: float) -> float:
        return decayed(self.frequency, self.last_used, now, half_life_s)


def decayed(frequency: float, last_used: float, now: float, half_life_s: float) -> float:
    """A use count halving every `half_life_s` since `last_used`."""
    if frequency == 0.0:
        return 0.0
    return frequency * 0.5 ** (max(0.0, now - last_used) / half_life_s)


@dataclass(frozen=True, slots=True)
class RestoreCosts:
    """What losing an idle page costs if it is needed again. The engine measures both:
    its steps' cost per token (step_costs.py) and its adapter loads' seconds per byte."""

    recompute_s_per_token: float
    load_s_per_byte: float

    def block_loss(self, frequency: float, block_size: int) -> float:
        """Expected seconds lost by evicting one cached block (one page)."""
        return frequency * self.recompute_s_per_token * block_size

    def adapter_loss_per_page(self, frequency: float, nbytes: int, pages: int) -> float:
        """Expected seconds lost per page freed by evicting an adapter."""
        return frequency * self.load_s_per_byte * nbytes / max(pages, 1)


class EvictionPolicy(Protocol):
    name: str

    def order(self, candidates: list[AdapterUsage], now: float) -> list[AdapterUsage]: ...

    def touched(self, usage: AdapterUsage, now: float) -> None: ...

    def evicted(self, usage: AdapterUsage) -> None: ...


class _Stateless:
    """For policies that keep no state of their own between calls."""

    __slots__ = ()

    def touched(self, usage: AdapterUsage, now: float) -> None:
        pass

    def evicted(self, usage: AdapterUsage) -> None:
        pass


@dataclass(slots=True)
class WeightedScore(_Stateless):
    f: float = 0.45
    r: float = 0.10
    s: float = 0.45
    half_life_s: float = 60.0
    name: str = "chameleon"

    def __post_init__(self):
        if min(self.f, self.r, self.s) < 0 or self.f + self.r + self.s <= 0:
            raise ValueError(f"weights must be >= 0 and not all 0, got {self.f, self.r, self.s}")

    def scores(self, candidates: list[AdapterUsage], now: float) -> list[float]:
        freq = [u.frequency_at(now, self.half_life_s) for u in candidates]
        top_f = max(freq, default=0.0) or 1.0
        last = [u.last_used for u in candidates if u.last_used > float("-inf")]
        oldest, newest = (min(last), max(last)) if last else (0.0, 0.0)
        span = newest - oldest
        top_b = max((u.nbytes for u in candidates), default=0) or 1

        def recency(u: AdapterUsage) -> float:
            if u.last_used == float("-inf"):
                return 0.0
            return 1.0 if span == 0 else (u.last_used - oldest) / span

        return [
            self.f * fr / top_f + self.r * recency(u) + self.s * u.nbytes / top_b
            for u, fr in zip(candidates, freq, strict=True)
        ]

    def order(self, candidates: list[AdapterUsage], now: float) -> list[AdapterUsage]:
        scores = self.scores(candidates, now)
        ranked = sorted(range(len(candidates)), key=lambda i: (scores[i], candidates[i].name))
        return [candidates[i] for i in ranked]


@dataclass(slots=True)
class LRU(_Stateless):
    name: str = "lru"

    def order(self, candidates: list[AdapterUsage], now: float) -> list[AdapterUsage]:
        return sorted(candidates, key=lambda u: (u.last_used, u.name))


@dataclass(slots=True)
class GDSF:
    link_bytes_per_s: float = 25e9  # host -> device (PCIe 4.0 x16, effective)
    setup_s: float = 1e-3  # per load, whatever its size
    half_life_s: float = 60.0
    name: str = "gdsf"
    inflation: float = 0.0  # L
    _h: dict[str, float] = field(default_factory=dict)  # H per adapter, set when used

    def cost_per_byte(self, nbytes: int) -> float:
        return (self.setup_s + nbytes / self.link_bytes_per_s) / max(nbytes, 1)

    def touched(self, usage: AdapterUsage, now: float) -> None:
        freq = usage.frequency_at(now, self.half_life_s)
        self._h[usage.name] = self.inflation + freq * self.cost_per_byte(usage.nbytes)

    def order(self, candidates: list[AdapterUsage], now: float) -> list[AdapterUsage]:
        return sorted(candidates, key=lambda u: (self._h.get(u.name, self.inflation), u.name))

    def evicted(self, usage: AdapterUsage) -> None:
        self.inflation = max(self.inflation, self._h.pop(usage.name, self.inflation))


class IdleBlocks(Protocol):
    """The prefix cache as eviction sees it: how many idle cached blocks it holds."""

    num_idle: int


def victims(
    cold: list[AdapterUsage],
    warm: list[AdapterUsage],
    blocks: IdleBlocks | None,
    block_first: Callable[[AdapterUsage], bool] | None,
    blocks_last: bool = False,
) -> Iterator[tuple[AdapterUsage | None, bool]]:
    """Idle pages in the order they go, lazily: (an adapter's usage, or None for the
    cheapest idle cached block at that moment; whether it may go beyond the need, for a
    watermark). `cold` and `warm` (adapters queued requests want) come in a policy's order,
    kept among adapters. Between the next cold adapter and the next block,
    `block_first(adapter)` says which is cheaper to lose; warm adapters go after both.
    `blocks_last` (a static share for blocks): blocks go only when no idle adapter is left.
    The caller evicts each victim before asking for the next."""
    queue = deque(cold)
    merged = blocks is not None and not blocks_last
    while queue or (merged and blocks.num_idle):
        if merged and blocks.num_idle and (not queue or block_first(queue[0])):
            yield None, True
        else:
            yield queue.popleft(), True
    for usage in warm:
        yield usage, False
    while blocks is not None and blocks_last and blocks.num_idle:
        yield None, False


EVICTION_POLICIES = ("chameleon", "lru", "gdsf", "equal")


def make_eviction(name: str, half_life_s: float) -> EvictionPolicy:
    if name == "chameleon":
        return WeightedScore(half_life_s=half_life_s)
    if name == "lru":
        return LRU()
    if name == "gdsf":
        return GDSF(half_life_s=half_life_s)
    if name == "equal":
        return WeightedScore(1 / 3, 1 / 3, 1 / 3, half_life_s, name="equal")
    raise ValueError(f"eviction policy must be one of {', '.join(EVICTION_POLICIES)}, got {name!r}")

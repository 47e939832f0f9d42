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
"""

from __future__ import annotations

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
        if self.frequency == 0.0:
            return 0.0
        return self.frequency * 0.5 ** (max(0.0, now - self.last_used) / half_life_s)


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

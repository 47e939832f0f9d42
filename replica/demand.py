"""The adapters' demand as one replica sees it, and the store reads its tiers would make if
they were smaller: what the `lora` autoscaling policy needs before it removes a replica.

The reads a replica makes now say nothing of the reads after a step down: with N replicas'
tiers holding the working set, re-reads are near 0, and scaled to N - 1 they stay near 0
while the N - 1 tiers no longer hold it (the simulated flat-popularity day: 3 -> 2 replicas,
then re-reads back to 3). Under affinity routing each replica's adapters are its own; after a
step down each of the N - 1 gets N ÷ (N - 1) as many adapters of the same popularity into the
same tier, which reads as often as its own adapters would into a tier (N - 1) ÷ N as large.
So a replica reports, for a few tier fractions, the reads per second its own demand would
make from a tier of that size, by Che's approximation of an LRU cache (H. Che, Y. Tung,
Z. Wang, IEEE JSAC 2002): adapter i asked λ_i times a second, of s_i bytes, stays in a tier
of C bytes while it is asked again within T, where sum_i s_i (1 - exp(-λ_i T)) = C; it is
read λ_i exp(-λ_i T) times a second.

The adapters are not partitioned, though: a replica remembers every adapter the router sent
it, and over a day the router sends one adapter to several (spill copies, a hot adapter's
homes, homes moved as replicas came and went). On the simulated flat-popularity day, the four
evening replicas remembered 3,020 adapters between them, 1,997 of them distinct: Che over
each replica's own demand projected 1.1-2.1 reads a second for three replicas, where Che over
the distinct adapters pooled projected 0 (three tiers hold the whole catalog) and four
replicas read 0-0.5 a second, first reads included. So each replica also reports how many
adapters it remembers and a sketch of which (the SKETCH_K smallest of their hashes, K.
Beyer et al., "On synopses for distinct-value estimation", SIGMOD 2007): the policy merges
the sketches into the distinct count, and the overlap (remembered summed ÷ distinct) says
how much of each replica's demand the others share. Each of N - 1 replicas then takes
N ÷ (N - 1) of its share of the distinct demand: its own demand into a tier (N - 1) ÷ N ×
overlap of its own, a fraction above 1 where the overlap outweighs the replica leaving.
"""

from __future__ import annotations

import hashlib
import heapq
import math

import numpy as np

# the tier fractions reported: (N - 1) ÷ N for N = 2..8, 10 and 20, the tier itself, and
# larger ones for an overlap that outweighs the replica leaving
READ_FRACTIONS = (0.5, 2 / 3, 0.75, 0.8, 5 / 6, 6 / 7, 0.875, 0.9, 0.95, 1.0, 1.25, 1.5, 2.0)
SKETCH_K = 128  # hashes a replica reports: the distinct count merged to ~9% (1 / sqrt(K - 2))
DEMAND_TAU_S = 600.0  # the demand's memory: an exponential window of this time constant
# An adapter not asked for in g seconds is asked at most GAP_RATES / g times a second: a
# Poisson demand goes that long without a request with probability exp(-GAP_RATES) (5%).
# A working set that has left is forgotten as fast as its gaps grow, not over tau_s.
GAP_RATES = 3.0
_FORGOTTEN = 1e-3  # a decayed count this small is dropped


def fraction_key(fraction: float) -> str:
    return f"{fraction:.3f}"


def fraction_for(replicas: int, overlap: float = 1.0) -> float | None:
    """The largest reported fraction at most (replicas - 1) ÷ replicas × overlap (a smaller
    tier reads more: the projection errs toward keeping a replica), None for one replica."""
    if replicas < 2:
        return None
    want = (replicas - 1) / replicas * max(overlap, 1.0)
    return max(f for f in READ_FRACTIONS if f <= want + 1e-9)


def adapter_hash(adapter: str) -> str:
    """An adapter's place in the sketches: 16 hex digits, uniform over 64 bits."""
    return hashlib.blake2b(adapter.encode(), digest_size=8).hexdigest()


def distinct_adapters(sketches: list[tuple[float, frozenset[str]]]) -> float:
    """The distinct adapters over replicas, from each one's (adapters remembered, sketch):
    exact while every replica reported all its hashes (no more than SKETCH_K), else the
    K-th smallest of the merged hashes h_K estimates (K - 1) ÷ h_K (h as a share of 2^64)."""
    merged = sorted(set().union(*(sketch for _, sketch in sketches)))
    if all(count <= SKETCH_K for count, _ in sketches) or len(merged) < SKETCH_K:
        return float(len(merged))
    return (SKETCH_K - 1) / (int(merged[SKETCH_K - 1], 16) / 2.0**64)


class AdapterDemand:
    """Requests per adapter, decayed with time constant `tau_s`: the rates Che's
    approximation needs. `asked` on every request a replica takes; times from one clock."""

    def __init__(self, now: float, tau_s: float = DEMAND_TAU_S):
        self.tau_s = tau_s
        self.started = now
        self._counts: dict[str, tuple[float, float]] = {}  # adapter -> (count, as of when)
        self._bytes: dict[str, int] = {}
        self._hashes: dict[str, str] = {}

    def asked(self, adapter: str, nbytes: int, now: float) -> None:
        count, when = self._counts.get(adapter, (0.0, now))
        self._counts[adapter] = (count * math.exp(-(now - when) / self.tau_s) + 1.0, now)
        self._bytes[adapter] = nbytes
        if adapter not in self._hashes:
            self._hashes[adapter] = adapter_hash(adapter)

    def rates(self, now: float) -> tuple[np.ndarray, np.ndarray]:
        """(requests per second, bytes) per adapter still remembered; forgets the rest."""
        # the window so far: a demand younger than tau_s has had less time to count
        window = self.tau_s * -math.expm1(-max(now - self.started, 1e-9) / self.tau_s)
        rates, sizes = [], []
        for adapter, (count, when) in list(self._counts.items()):
            gap = now - when
            count *= math.exp(-gap / self.tau_s)
            if count < _FORGOTTEN:
                del self._counts[adapter], self._bytes[adapter], self._hashes[adapter]
                continue
            rates.append(min(count / window, GAP_RATES / gap) if gap > 0 else count / window)
            sizes.append(self._bytes[adapter])
        return np.asarray(rates, dtype=np.float64), np.asarray(sizes, dtype=np.float64)

    def report(
        self, tier_bytes: float, now: float
    ) -> tuple[dict[float, float], tuple[int, list[str]]]:
        """What a replica reports of its demand, from one pass over it: for each of
        READ_FRACTIONS the store reads per second it would make from a tier of fraction ×
        tier_bytes; and (adapters remembered, the SKETCH_K smallest of their hashes)."""
        rates, sizes = self.rates(now)  # forgets those decayed away
        reads = {f: che_reads(rates, sizes, f * tier_bytes) for f in READ_FRACTIONS}
        return reads, (len(self._hashes), heapq.nsmallest(SKETCH_K, self._hashes.values()))


def che_reads(rates: np.ndarray, sizes: np.ndarray, capacity: float) -> float:
    """Che's approximation: reads per second of an LRU tier of `capacity` bytes under
    independent requests at `rates` (per second) for items of `sizes` (bytes)."""
    if rates.size == 0 or float(sizes.sum()) <= capacity:
        return 0.0
    if capacity <= 0:
        return float(rates.sum())
    t = _characteristic_time(rates, sizes, capacity)
    return float((rates * np.exp(-rates * t)).sum())


def _characteristic_time(rates: np.ndarray, sizes: np.ndarray, capacity: float) -> float:
    """T with sum(sizes × (1 - exp(-rates × T))) = capacity (< sum(sizes)), by bisection on
    log T: the held bytes grow with T from 0 to sum(sizes)."""

    def held(t: float) -> float:
        return float((sizes * -np.expm1(-rates * t)).sum())

    low, high = 0.0, 1.0
    while held(high) < capacity:
        low, high = high, high * 4.0
    for _ in range(50):
        mid = (low + high) / 2 if low == 0.0 else math.sqrt(low * high)
        if held(mid) < capacity:
            low = mid
        else:
            high = mid
        if high - low <= 1e-6 * high:
            break
    return high

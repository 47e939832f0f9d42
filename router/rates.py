"""Per-adapter request rates for the affinity policy, and the rate each replica's adapters
draw, kept incrementally so that a routing decision costs O(replicas), not O(adapters held).

Each adapter's rate is an exponentially decayed count of its requests (time constant tau):
count(a, now) = sum over its requests i of exp(-(now - t_i) / tau), and count / tau estimates
the rate. It is stored as a weight w(a) = sum_i exp((t_i - ref) / tau), so that a request
adds one term and nothing decays in place: count(a, now) = w(a) * exp((ref - now) / tau).
Every count shares that factor, so sums and comparisons of counts (a replica's heat against
the mean heat) can be made on the weights. `ref` moves forward, rescaling every weight,
before the terms could overflow; adapters whose count has decayed to nothing are dropped
then.
"""

from __future__ import annotations

import math
from collections.abc import Callable

_REBASE_AFTER = 200.0  # time constants: exp(200) is far from float overflow
_NEGLIGIBLE = 1e-6  # a count below this is an adapter not seen for ~14 time constants


class RateEstimator:
    def __init__(self, window_s: float, now: float):
        self.window_s = window_s
        self.ref = now
        self.weights: dict[str, float] = {}
        self._rebased: list[Callable[[float], None]] = []

    def on_rebase(self, scale: Callable[[float], None]) -> None:
        """`scale(f)` is called with the factor every weight was multiplied by."""
        self._rebased.append(scale)

    def add(self, adapter: str, now: float) -> float:
        """Count one request of `adapter` at `now`; the weight it added."""
        if (now - self.ref) / self.window_s > _REBASE_AFTER:
            self._rebase(now)
        term = math.exp((now - self.ref) / self.window_s)
        self.weights[adapter] = self.weights.get(adapter, 0.0) + term
        return term

    def weight(self, adapter: str) -> float:
        return self.weights.get(adapter, 0.0)

    def count(self, adapter: str, now: float) -> float:
        return self.to_count(self.weight(adapter), now)

    def to_count(self, weight: float, now: float) -> float:
        return weight * math.exp((self.ref - now) / self.window_s)

    def rate(self, adapter: str, now: float) -> float:
        """Requests/s: for a steady rate the count settles at rate * window_s."""
        return self.count(adapter, now) / self.window_s

    def _rebase(self, now: float) -> None:
        factor = math.exp((self.ref - now) / self.window_s)
        self.ref = now
        self.weights = {a: w * factor for a, w in self.weights.items() if w * factor > _NEGLIGIBLE}
        for scale in self._rebased:
            scale(factor)


class HeldHeat:
    """For each replica, the adapters its last routing stats showed on its device or
    loading there, and the sum of their weights (the traffic they draw), updated as
    requests are counted. Recomputed only when a replica's stats change."""

    def __init__(self, rates: RateEstimator):
        self.rates = rates
        self.held: dict[str, frozenset[str]] = {}
        self.heat: dict[str, float] = {}
        self._keys: dict[str, tuple[frozenset[str], frozenset[str]]] = {}
        self.holders: dict[str, set[str]] = {}  # adapter -> replicas whose stats hold it
        rates.on_rebase(self._scale)

    def update(self, replica_id: str, device: frozenset[str], loading: frozenset[str]) -> None:
        key = self._keys.get(replica_id)
        if key is not None and (key[0] is device or key[0] == device):
            if key[1] is loading or key[1] == loading:
                self._keys[replica_id] = (device, loading)  # the same sets: cheap next time
                return
        self._keys[replica_id] = (device, loading)
        for adapter in self.held.get(replica_id, ()):
            holders = self.holders[adapter]
            holders.discard(replica_id)
            if not holders:
                del self.holders[adapter]
        held = device | loading
        self.held[replica_id] = held
        for adapter in held:
            self.holders.setdefault(adapter, set()).add(replica_id)
        self.heat[replica_id] = sum(self.rates.weight(a) for a in held)

    def counted(self, adapter: str, term: float) -> None:
        for replica_id in self.holders.get(adapter, ()):
            self.heat[replica_id] += term

    def forget(self, keep: set[str]) -> None:
        """Drop replicas not in `keep` (gone from the deployment)."""
        for replica_id in [r for r in self.held if r not in keep]:
            self.update(replica_id, frozenset(), frozenset())
            del self.held[replica_id], self.heat[replica_id], self._keys[replica_id]

    def _scale(self, factor: float) -> None:
        for replica_id in self.heat:
            self.heat[replica_id] *= factor

"""router/request_router.py's `ranks_by_room`: the ranks Serve gets from the policy's order
(pure policy; stand-ins carry the two fields Serve's RunningReplica gives it)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from loraplex.router.request_router import ranks_by_room


@dataclass(frozen=True)
class Replica:
    replica_id: str
    max_ongoing_requests: int = 32


def names(ranks) -> list[list[str]]:
    return [[r.replica_id for r in rank] for rank in ranks]


def test_replicas_with_room_keep_the_policys_order_one_rank_each():
    ranked = [Replica("a"), Replica("b"), Replica("c")]
    held = {"a": 31, "b": None, "c": 0}
    assert names(ranks_by_room(ranked, held.get)) == [["a"], ["b"], ["c"]]


def test_full_replicas_go_last_together_so_serve_probes_them_at_once():
    """Serve probes a replica its cache says is full, and raises the next probe's deadline
    for each rank it finds full: a saturated fleet of three, a rank each, cost three probes
    one after another (0.1 + 0.2 + 0.4 s of deadlines) before any backoff."""
    ranked = [Replica("home"), Replica("b"), Replica("c"), Replica("d", max_ongoing_requests=64)]
    held = {"home": 32, "b": 40, "c": 3, "d": 40}
    assert names(ranks_by_room(ranked, held.get)) == [["c"], ["d"], ["home", "b"]]


def test_of_more_than_two_full_replicas_a_random_pair_is_probed():
    """Every routing task probing all the full replicas at once picked the same least loaded
    one, and all but the first were turned away: each draws two, as Serve's power of two
    does, and over many draws every full replica is in some pair."""
    ranked = [Replica("home"), Replica("b"), Replica("c"), Replica("d", max_ongoing_requests=64)]
    saturated = {"home": 32, "b": 32, "c": 33, "d": 64}
    rng = random.Random(0)
    pairs = [names(ranks_by_room(ranked, saturated.get, rng)) for _ in range(200)]
    assert all(len(p) == 1 and len(p[0]) == 2 == len(set(p[0])) for p in pairs)
    assert {r for p in pairs for r in p[0]} == {"home", "b", "c", "d"}
    assert len({tuple(sorted(p[0])) for p in pairs}) == 6  # each of the four's six pairs

"""router/request_router.py's `ranks_by_room`: the ranks Serve gets from the policy's order
(pure policy; stand-ins carry the two fields Serve's RunningReplica gives it)."""

from __future__ import annotations

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
    saturated = {"home": 32, "b": 32, "c": 33, "d": 64}
    assert names(ranks_by_room(ranked, saturated.get)) == [["home", "b", "c", "d"]]

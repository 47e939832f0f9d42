"""demo/lean_ray.py's start-up retry, with a stand-in for `ray` (the policy only: when to try
again). The real start is every Ray test's fixture."""

from __future__ import annotations

import pytest

from loraplex.demo.lean_ray import init_once_more_if_slow

SLOW = "The current node timed out during startup. This could happen because ..."


class Ray:
    def __init__(self, failures: list[Exception]) -> None:
        self.failures = failures
        self.calls: list[str] = []

    def init(self, **options: object) -> None:
        self.calls.append(f"init {sorted(options)}")
        if self.failures:
            raise self.failures.pop(0)

    def shutdown(self) -> None:
        self.calls.append("shutdown")


def test_a_slow_node_start_is_tried_once_more_with_the_same_options():
    ray = Ray([Exception(SLOW)])
    init_once_more_if_slow(ray, num_cpus=2, address="local")
    assert ray.calls == ["init ['address', 'num_cpus']", "shutdown"] + [
        "init ['address', 'num_cpus']"
    ]


@pytest.mark.parametrize(
    ("failures", "raised"),
    [([Exception(SLOW), Exception(SLOW)], SLOW), ([ValueError("bad option")], "bad option")],
)
def test_a_second_timeout_or_any_other_failure_is_raised(failures, raised):
    ray = Ray(failures)
    with pytest.raises(Exception, match=raised[:20]):
        init_once_more_if_slow(ray)
    assert ray.calls.count("shutdown") == (1 if raised == SLOW else 0)
    assert not ray.failures  # a second timeout is not tried a third time

"""The arithmetic of Chameleon's multi-level queues (seed 004 §4.3), as pure functions:
output-length prediction, weighted request size, K-means queue cut-offs of minimal WCSS,
and per-queue token quotas from the M/M/1 bound."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

# Output-length histogram buckets: 4 per octave from 1 to 2^17 tokens.
_EDGES = np.unique(np.round(2.0 ** np.arange(0, 17.25, 0.25)).astype(np.int64))


class OutputPredictor:
    """Online per-adapter histogram of output lengths. The prediction is a quantile of the
    adapter's histogram (of all adapters' while it has fewer than `min_samples`), capped
    by the request's max_tokens; with no history at all, max_tokens."""

    def __init__(self, quantile: float = 0.5, min_samples: int = 8):
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.min_samples = min_samples
        self._hist: dict[str | None, np.ndarray] = {}
        self._all = np.zeros(len(_EDGES), dtype=np.int64)

    def observe(self, adapter: str | None, output_len: int) -> None:
        bucket = min(int(np.searchsorted(_EDGES, max(output_len, 1))), len(_EDGES) - 1)
        self._hist.setdefault(adapter, np.zeros(len(_EDGES), dtype=np.int64))[bucket] += 1
        self._all[bucket] += 1

    def predict(self, adapter: str | None, max_tokens: int) -> int:
        hist = self._hist.get(adapter)
        if hist is None or hist.sum() < self.min_samples:
            hist = self._all
        total = int(hist.sum())
        if total == 0:
            return max_tokens
        bucket = int(np.searchsorted(np.cumsum(hist), math.ceil(self.quantile * total)))
        return max(1, min(int(_EDGES[bucket]), max_tokens))


def weighted_request_size(
    prompt: int,
    output: int,
    adapter_bytes: int,
    max_prompt: int,
    max_output: int,
    max_adapter_bytes: int,
    a: float,
    b: float,
) -> float:
    """WRS = (A·in/max_in + B·out/max_out) · size/max_size (degree 2: the adapter scales
    both the prefill and the decode cost)."""
    return (a * prompt / max(max_prompt, 1) + b * output / max(max_output, 1)) * (
        adapter_bytes / max(max_adapter_bytes, 1)
    )


def kmeans_1d(xs: np.ndarray, k: int, iters: int = 100) -> tuple[np.ndarray, float]:
    """Lloyd's K-means on a line, best of a few deterministic starts (quantiles,
    farthest-first, seeded k-means++): one start alone often parks several centroids in one
    dense cluster. Returns the sorted centroids and the within-cluster sum of squares."""
    xs = np.sort(np.asarray(xs, dtype=np.float64))
    k = min(k, len(np.unique(xs)))
    rng = np.random.default_rng(0)
    starts = [np.quantile(xs, (np.arange(k) + 0.5) / k), _farthest_first(xs, k)]
    starts += [_kmeans_pp(xs, k, rng) for _ in range(3)]
    best = None
    for start in starts:
        fit = _lloyd(xs, start, iters)
        if best is None or fit[1] < best[1]:
            best = fit
    return best


def _lloyd(xs: np.ndarray, centroids: np.ndarray, iters: int) -> tuple[np.ndarray, float]:
    centroids = np.asarray(centroids, dtype=np.float64)
    for _ in range(iters):
        labels = _nearest(xs, centroids)
        new = np.array(
            [
                xs[labels == j].mean() if (labels == j).any() else centroids[j]
                for j in range(len(centroids))
            ]
        )
        if np.allclose(new, centroids):
            break
        centroids = new
    labels = _nearest(xs, centroids)
    return np.sort(centroids), float(((xs - centroids[labels]) ** 2).sum())


def _farthest_first(xs: np.ndarray, k: int) -> np.ndarray:
    centroids = [xs[np.abs(xs - xs.mean()).argmin()]]
    while len(centroids) < k:
        centroids.append(xs[np.abs(xs[:, None] - np.array(centroids)).min(axis=1).argmax()])
    return np.array(centroids)


def _kmeans_pp(xs: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    centroids = [xs[rng.integers(len(xs))]]
    while len(centroids) < k:
        d2 = np.abs(xs[:, None] - np.array(centroids)).min(axis=1) ** 2
        total = d2.sum()
        if total == 0:
            break
        centroids.append(xs[rng.choice(len(xs), p=d2 / total)])
    while len(centroids) < k:
        centroids.append(centroids[-1])
    return np.array(centroids)


def _nearest(xs: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    return np.abs(xs[:, None] - centroids[None, :]).argmin(axis=1)


def choose_cutoffs(sizes: np.ndarray, k_max: int) -> tuple[list[float], list[float]]:
    """Queue cut-offs for request sizes (seed 004 §4.3.4): K-means for K = 1..k_max, and
    the K of minimal WCSS. WCSS does not grow with K, so this is k_max unless fewer
    distinct sizes make the larger K no better (ties go to the smaller K). Cut-offs are
    the midpoints between consecutive centroids. Returns (cut-offs, WCSS per K)."""
    sizes = np.asarray(sizes, dtype=np.float64)
    if len(sizes) == 0:
        return [], []
    fits = [kmeans_1d(sizes, k) for k in range(1, k_max + 1)]
    wcss = [w for _, w in fits]
    best = min(wcss)
    k = next(i + 1 for i, w in enumerate(wcss) if w <= best + 1e-12 * max(wcss[0], 1.0))
    centroids = fits[k - 1][0]
    return [float(c) for c in (centroids[:-1] + centroids[1:]) / 2], wcss


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """One queue as the M/M/1 model sees it."""

    max_size: float  # S: the largest request of the queue, in tokens
    duration_s: float  # D: the expected time to serve one of its requests, once admitted
    rate: float  # λ: its arrivals per second
    weight: float  # λ x mean tokens: share of the tokens left after every queue's minimum


def token_quotas(
    queues: list[QueueLoad],
    total_tokens: int,
    slo_s: float,
    percentile: float | None = None,
    floor_requests: int | None = None,
) -> list[int]:
    """Tok_min = S·D·(1/SLO + λ) per queue (μ = Tok/(S·D) served per second, and
    1/(μ − λ) <= SLO); the remainder split by weight (seed 004 §4.3.5). The paper requires
    Σ Tok_min <= Tok_total and says nothing of the other case; there, every minimum is
    scaled by the same factor Tok_total / Σ Tok_min (the quotas in proportion to the
    minimums): the one split that keeps the paper's ratios between the queues, each queue
    short of its SLO quota by the same share. A quota scaled below S still runs one
    request at a time: admission starts the head of a queue with nothing running over
    quota (Chameleon._put). A floor of S here would add nothing to that queue (S is about
    one of its requests) and take the difference from the others.

    `percentile` (not in the paper, None: the paper's) sizes each minimum for that
    percentile of the M/M/1 time in system, which is exponential with rate μ − λ:
    μ − λ >= ln(1/(1 − p))/SLO, 4.6/SLO at P99 where the paper's mean bound has 1/SLO.
    Over the pool, the minimums are then granted largest queue first (`_largest_first`).

    `floor_requests` (not in the paper; None: the paper's) raises every quota to that many
    of its queue's largest requests (`_with_floors`)."""
    if not queues:
        return []
    per_slo = 1.0 if percentile is None else math.log(1.0 / (1.0 - percentile))
    mins = [q.max_size * q.duration_s * (per_slo / slo_s + q.rate) for q in queues]
    if sum(mins) >= total_tokens:
        if percentile is None:
            quotas = _split(total_tokens, mins)
        else:
            quotas = _largest_first(total_tokens, mins)
    else:
        whole = [math.ceil(m - 1e-9) for m in mins]  # not 241 for 240.00000000000003
        rest = _split(max(0, total_tokens - sum(whole)), [q.weight for q in queues])
        quotas = [m + r for m, r in zip(whole, rest, strict=True)]
    if floor_requests is None:
        return quotas
    return _with_floors(quotas, [math.ceil(floor_requests * q.max_size) for q in queues])


def _with_floors(quotas: list[int], floors: list[int]) -> list[int]:
    """Each quota raised to its floor, the tokens taken from the queues above theirs in
    proportion to what each has above it (so none is pushed under its own floor); floors
    over the total split it in proportion to the floors. Why a floor of two requests: the
    M/M/1 bound prices a queue's quota as a server of rate μ = Tok/(S·D), Tok/S requests
    at a time. A quota under 2·S runs one request at a time (admission lets a queue with
    nothing running start its head over quota), μ is 1/D whatever the quota, and with the
    pool over-subscribed that queue — the largest requests, few arrivals — is the one the
    scaling leaves there: its M/M/1 P99 is ~4.6x its mean and sets the scheduler's."""
    total = sum(quotas)
    if sum(floors) >= total:
        return _split(total, [float(f) for f in floors])
    short = sum(max(0, f - q) for q, f in zip(quotas, floors, strict=True))
    above = [max(0, q - f) for q, f in zip(quotas, floors, strict=True)]
    taken = _split(short, [float(a) for a in above])
    return [max(q, f) - t for q, f, t in zip(quotas, floors, taken, strict=True)]


def _largest_first(total: int, mins: list[float]) -> list[int]:
    """Minimums over the pool, granted from the largest-request queue down, each at most
    half the tokens not yet granted; the smallest queue takes the rest. A large queue's
    arrivals are few, so its minimum is small against the small queue's (λ·S·D), but
    scaled with the others it falls below two of its requests and it runs one at a time:
    an M/M/1 queue whose P99 is ~4.6x its mean (bench sched: the largest-rank queue's P99
    set Chameleon's at the high load)."""
    quotas = [0] * len(mins)
    left = total
    for q in range(len(mins) - 1, 0, -1):
        quotas[q] = min(math.ceil(mins[q] - 1e-9), left // 2)
        left -= quotas[q]
    quotas[0] = left
    return quotas


def _split(total: int, weights: list[float]) -> list[int]:
    """`total` in integer shares proportional to `weights` (equal if all are 0), the units
    left by rounding down going to the largest remainders."""
    s = sum(weights)
    if s <= 0:
        weights, s = [1.0] * len(weights), float(len(weights))
    exact = [total * w / s for w in weights]
    shares = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: shares[i] - exact[i])
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares

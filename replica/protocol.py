"""What the ingress sends a replica and what the replica streams back: plain dicts, so they
cross Ray's object store without pickling engine classes, and the same contract serves an
in-process backend (no Ray) and the Serve deployment.

A request names its adapter by the id of one version, `tenant/name@version` (registry names
cannot contain `/` or `@`; the version is the registry's content digest), or None for the
base model. The ingress resolves a name to a version when the request arrives, so the
request runs to its end on that version wherever it is sent, even if the name moves to
another meanwhile. The ingress tokenizes (it needs the counts for `usage` and the context
check), so replicas receive token ids only.

Prefix-cache block keys (`prefix_root`, `extend_block_keys`, defined once in
replica/prefix_keys.py and re-exported here) are part of this contract: the ingress computes
a prompt's first keys to route it to the replica holding those blocks, and the replica's
prefix cache keys its blocks with the same functions.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any, NotRequired, Protocol, TypedDict

from loraplex.replica.demand import DEMAND_TAU_S as DEMAND_TAU_S  # re-exported
from loraplex.replica.demand import distinct_adapters as distinct_adapters  # re-exported
from loraplex.replica.demand import fraction_for as fraction_for  # re-exported
from loraplex.replica.demand import fraction_key as fraction_key  # re-exported
from loraplex.replica.prefix_keys import extend_block_keys as extend_block_keys  # re-exported
from loraplex.replica.prefix_keys import prefix_root as prefix_root  # re-exported
from loraplex.replica.sampling import (
    SamplingParams,
    check_seed,
    check_temperature,
    check_top_k,
    check_top_p,
)
from loraplex.replica.sequence import Continuation, RequestOutput


class ResumeAfter(TypedDict):
    """A request resumed on another replica: the output it already streamed."""

    token_ids: list[int]  # output tokens already sent to the client
    text: str  # the text already sent for them


class GenerateRequest(TypedDict):
    request_id: str
    prompt_token_ids: list[int]
    adapter: str | None  # "tenant/name@version", or None for the base model
    params: dict  # SamplingParams fields (stop as a list)
    # The registry revision the ingress resolved the adapter at: a replica whose registry
    # watch is behind waits for it before calling the version unknown.
    adapter_revision: NotRequired[int]
    # The ingress sets the tenant. The replica's scheduler shares admission fairly among
    # tenants (absent: None, one group of its own), and the prefix cache's blocks are shared
    # only by requests of one tenant with one cache_salt (absent: None).
    tenant: NotRequired[str | None]
    cache_salt: NotRequired[str | None]
    resume_after: NotRequired[ResumeAfter]  # set when a replica died mid-stream


class GenerateChunk(TypedDict):
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop", "length", "abort" or "error" when finished
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: NotRequired[int]  # prompt tokens the prefix cache served
    # why the request failed (finish_reason "error"); other requests go on
    error: NotRequired[str | None]


class AdapterNotFound(LookupError):
    """The request names an adapter this replica does not know (deleted, or never
    registered): the ingress answers 404."""


class ReplicaFailed(RuntimeError):
    """Every replica tried for a request died: before its first chunk on every try, or
    after it on every resume. The ingress answers 503, or ends the stream with an error
    event."""


class Backend(Protocol):
    """Where the ingress sends requests: a Serve deployment handle, or an engine in process."""

    resumed: int  # streams resumed on another replica after theirs died mid-stream

    def generate(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]: ...

    async def replica_stats(self) -> dict[str, dict[str, Any]]:
        """Each replica's stats by replica id: the engine's `stats()` plus `tiers`, the
        adapter ids per tier (`device`, `host`: in host memory only, `loading`). A replica
        that does not answer in time is left out."""
        ...


# The engine's checks of the sampling fields, for the ingress to run before a request leaves
# it (each raises ValueError naming the field and what is accepted).
SAMPLING_CHECKS = {
    "temperature": check_temperature,
    "top_p": check_top_p,
    "top_k": check_top_k,
    "seed": check_seed,
}


def adapter_id(tenant: str, name: str, version: str) -> str:
    """The id of one version of a tenant's adapter."""
    return f"{tenant}/{name}@{version}"


def parse_adapter_id(adapter: str) -> tuple[str, str, str]:
    """(tenant, name, version) of an `adapter_id`; ValueError for anything else."""
    owner, sep, version = adapter.partition("@")
    tenant, slash, name = owner.partition("/")
    if not (sep and slash and tenant and name and version) or "/" in name:
        raise ValueError(f"not an adapter id (tenant/name@version): {adapter!r}")
    return tenant, name, version


def adapter_name(adapter: str) -> str:
    """The `tenant/name` an adapter id is a version of (the id itself when it has no
    version): what stays the same when a name moves to a new version."""
    return adapter.partition("@")[0]


def adapter_version(adapter: str | None) -> str | None:
    """The version part of an adapter id; None for the base model (or an unversioned id)."""
    if adapter is None:
        return None
    return adapter.partition("@")[2] or None


def sampling_params(request: GenerateRequest) -> SamplingParams:
    fields = dict(request["params"])
    for key in ("stop", "stop_token_ids"):
        if key in fields:
            fields[key] = tuple(fields[key])
    return SamplingParams(**fields)


def cache_salts(request: GenerateRequest) -> dict[str, str | None]:
    """The engine's `tenant` and `cache_salt` arguments for a request."""
    return {"tenant": request.get("tenant"), "cache_salt": request.get("cache_salt")}


def continuation(request: GenerateRequest) -> Continuation | None:
    resume = request.get("resume_after")
    if resume is None:
        return None
    return Continuation(tuple(resume["token_ids"]), resume["text"])


def chunk(out: RequestOutput) -> GenerateChunk:
    return GenerateChunk(
        request_id=out.request_id,
        new_token_ids=list(out.new_token_ids),
        new_text=out.new_text,
        finished=out.finished,
        finish_reason=out.finish_reason,
        num_prompt_tokens=out.num_prompt_tokens,
        num_cached_tokens=out.num_cached_tokens,
        num_output_tokens=len(out.token_ids),
        error=out.error,
    )


# What a replica reports to Ray Serve's autoscaler (`record_autoscaling_stats`), by name: the
# `lora` autoscaling policy (router/autoscaling.py) reads them from Serve's aggregate.
AUTOSCALE_REQUESTS = "requests"  # generate calls held: running, waiting, reading
AUTOSCALE_SLOTS = "slots"  # max_num_seqs
AUTOSCALE_READS_PER_S = "store_rereads_per_s"  # quick re-reads per s (adapter_cache.py)
AUTOSCALE_READ_S = "store_read_s"  # the mean store read, seconds (0 before the first)
AUTOSCALE_PREFILL_TOKENS = (
    "queued_prefill_tokens"  # prompt tokens waiting and running, not computed
)
AUTOSCALE_TOKEN_S = "token_s"  # what a prompt token adds to a step (per_prompt_token_s; 0 before)
AUTOSCALE_UTILISATION = "token_utilisation"  # tokens made ÷ its token capacity (0 before measured)
AUTOSCALE_SET_BYTES = "adapter_set_bytes"  # the distinct adapters asked for since the last report
AUTOSCALE_TIER_BYTES = "adapter_tier_bytes"  # what its device + host tiers hold at most (0: all)
AUTOSCALE_ADAPTER = "adapter_requests:"  # + an adapter's name: its requests held here
# + a tier fraction (replica/demand.py fraction_key): the store reads per second its demand
# would make from a tier that fraction of its own
AUTOSCALE_READS_AT = "store_reads_at_tier:"
AUTOSCALE_DEMAND_ADAPTERS = "demand_adapters"  # the adapters its demand remembers
# + an adapter's hash (replica/demand.py adapter_hash): the SKETCH_K smallest of them
AUTOSCALE_SKETCH = "demand_sketch:"
HOT_ADAPTERS_REPORTED = 4  # the adapters with most requests held, each reported by name


def measured_token_s(stats: Mapping[str, Any]) -> float:
    """What one prompt token adds to a step of this engine (its `stats()`), 0 until
    measured."""
    costs = stats.get("step_costs")
    return 0.0 if costs is None else float(costs["per_prompt_token_s"])


def token_utilisation(
    stats: Mapping[str, Any],
    *,
    prompt_tokens: int,
    output_tokens: int,
    elapsed_s: float,
    slots: int,
    adapters: int,
) -> float:
    """The share of its token capacity a replica used over `elapsed_s`, in which it computed
    `prompt_tokens` prompt tokens and made `output_tokens` (from its engine's `stats()`, 0
    until its step costs were measured). Priced by its measured step (step_costs.py:
    step_s ≈ base_s + per_prompt_token_s × prompt tokens + per_decode_row_s × decode rows
    + per_adapter_s × adapters): a prompt token costs per_prompt_token_s, and an output
    token its decode row plus its share of a full batch's fixed cost ((base_s +
    per_adapter_s × adapters) ÷ slots, `adapters` the distinct adapters its requests hold,
    at most one a slot). Below capacity the steps are short and few rows share them; this
    counts what the same tokens take when the batch is full, so it grows with the tokens
    asked for, not with a queue (which stays empty below capacity), and is 1 where the
    replica is saturated."""
    costs = stats.get("step_costs")
    if costs is None or elapsed_s <= 0:
        return 0.0
    shared = (costs["base_s"] + costs["per_adapter_s"] * min(max(adapters, 1), slots)) / max(
        slots, 1
    )
    seconds = prompt_tokens * costs["per_prompt_token_s"] + output_tokens * (
        costs["per_decode_row_s"] + shared
    )
    return seconds / elapsed_s


def tier_bytes(host_bytes: int | None, held_bytes: int) -> int:
    """What a replica's tiers hold of adapters at most (0: every adapter, a host tier without
    a budget): its host budget, or what device and host hold together now (`held_bytes`,
    AdapterCache.held_bytes) where that is more. Not the pool and the host summed: the host
    tier keeps a copy of what the pool holds (a copy loads from it, a read from the store
    lands in it), and the pool shares its pages with the KV cache; the pool adds only the
    adapters it holds whose host copies the budget has dropped."""
    return 0 if host_bytes is None else max(host_bytes, held_bytes)


def autoscaling_stats(
    *,
    requests: int,
    slots: int,
    reads: int,
    reads_before: int,
    elapsed_s: float,
    read_s: float,
    prefill_tokens: int,
    token_s: float,
    utilisation: float,
    adapter_queue: Mapping[str, int],
    set_bytes: int = 0,
    tier_bytes: int = 0,
    reads_at: Mapping[float, float] | None = None,
    sketch: tuple[int, Sequence[str]] | None = None,
) -> dict[str, float]:
    """One report (the deployment's `record_autoscaling_stats` and the fleet simulator's):
    `reads` re-reads from the store so far (of adapters its tiers had dropped, within the
    demand window of their previous load here: adapter_cache.py `quick_rereads`; not first
    reads),
    `reads_before` at the last report `elapsed_s` ago, `read_s` the mean read measured (0
    before the first); `prefill_tokens` the prompt tokens its engine has yet to compute
    (queued requests' and running ones' chunks left), `token_s` what a prompt token adds
    to its step, as measured (0 before); `utilisation` its `token_utilisation` since the last
    report; `adapter_queue` the requests held per adapter, of which
    the HOT_ADAPTERS_REPORTED largest are reported by name; `set_bytes` the weights of the
    distinct adapters asked for since the last report (held now included), `tier_bytes`
    what its device pool and host tier can hold of them at most (0 where the host tier has
    no budget: it keeps every adapter, none is read again); `reads_at` the store reads per
    second its demand would make from a tier of each fraction of its own
    (`AdapterDemand.report`; none where tier_bytes is 0); `sketch` the adapters its
    demand remembers and the smallest of their hashes (the same report)."""
    hot = sorted(((n, a) for a, n in adapter_queue.items() if n > 0), reverse=True)
    return {
        AUTOSCALE_REQUESTS: float(requests),
        AUTOSCALE_SLOTS: float(slots),
        AUTOSCALE_READS_PER_S: (reads - reads_before) / max(elapsed_s, 1e-3),
        AUTOSCALE_READ_S: read_s,
        AUTOSCALE_PREFILL_TOKENS: float(prefill_tokens),
        AUTOSCALE_TOKEN_S: token_s,
        AUTOSCALE_UTILISATION: utilisation,
        AUTOSCALE_SET_BYTES: float(set_bytes),
        AUTOSCALE_TIER_BYTES: float(tier_bytes),
        **{AUTOSCALE_ADAPTER + a: float(n) for n, a in hot[:HOT_ADAPTERS_REPORTED]},
        **{AUTOSCALE_READS_AT + fraction_key(f): r for f, r in (reads_at or {}).items()},
        **(
            {}
            if sketch is None
            else {
                AUTOSCALE_DEMAND_ADAPTERS: float(sketch[0]),
                **{AUTOSCALE_SKETCH + h: 1.0 for h in sketch[1]},
            }
        ),
    }

"""The ingress's limits on what one request, and one tenant, may ask of it: checked in this
order, each before the work it protects.

    key          the caller's key, from the headers, before any of the body is read
    tenant       requests in flight and tokens per minute, held for the whole cluster
                 (router/tenant_limiter.py, router/tenant_ledger.py): 429
                 with Retry-After, before the body is read (the token bucket is checked
                 again, with the request's own tokens, once it is tokenized)
    body         `max_body_bytes`, while it arrives (Content-Length or chunked): 413
    prompt       `max_prompt_bytes` of text and `max_messages`, before tokenizing: 413 / 400
    tokenizing   on a worker thread, so a long prompt never holds up the event loop
    context      prompt + max_tokens within the model's window: 400
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from loraplex.registry.models import TenantLimits


class IngressLimits(BaseModel):
    """Limits of the OpenAI-compatible routes, and every tenant's default limits."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(
        4 << 20,
        ge=1 << 10,
        le=1 << 30,
        description="Largest request body of the inference routes, bytes; reading stops with "
        "413 as soon as it is passed (or at once, for a larger Content-Length).",
    )
    max_prompt_bytes: int = Field(
        1 << 20,
        ge=1,
        le=1 << 30,
        description="Largest prompt text (UTF-8), or text of all chat messages together, "
        "bytes; larger ones are refused with 413 before they are tokenized.",
    )
    max_messages: int = Field(
        1024,
        ge=1,
        le=4096,  # the request schema's own bound
        description="Most messages in one chat completion request (400 past it).",
    )
    tenant_max_requests_in_flight: int | None = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Default for tenants whose record sets no max_requests_in_flight: "
        "generation requests the cluster serves at once per tenant; null: no limit.",
    )
    tenant_tokens_per_minute: int | None = Field(
        None,
        ge=1,
        le=1 << 40,
        description="Default for tenants whose record sets no tokens_per_minute: prompt plus "
        "generated tokens per minute per tenant across the cluster; null: no limit.",
    )

    special_tokens_in_messages: Literal["control", "text"] = Field(
        "control",
        description="What a special token typed in a chat message's content becomes: "
        "'control', the control token (as Hugging Face's apply_chat_template and vLLM read "
        "it; a caller can write turns of its own conversation), or 'text', the plain text it "
        "is, so that end-user text in a message cannot forge a system or assistant turn "
        "(the template's own special tokens stay control tokens).",
    )
    tenant_ledger_sync_s: float = Field(
        1.0,
        ge=0.05,
        le=60,
        description="How often each ingress reports its tenants' shares of their limits to "
        "the cluster's ledger and gives back what it does not use; an ingress silent for ten "
        "of these loses its shares, and one asked for room waits at most one.",
    )

    def for_tenant(self, limits: TenantLimits | None) -> TenantLimits:
        """The limits that apply to a tenant: its record's, else these defaults (None, for
        requests without a tenant: no limit)."""
        if limits is None:
            return TenantLimits()
        return TenantLimits(
            max_requests_in_flight=limits.max_requests_in_flight
            or self.tenant_max_requests_in_flight,
            tokens_per_minute=limits.tokens_per_minute or self.tenant_tokens_per_minute,
        )

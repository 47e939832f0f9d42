"""What the inference routes check before FastAPI reads a body: the caller's key (from the
headers), the tenant's limits (requests in flight, tokens per minute), then the body itself,
read under `max_body_bytes`. FastAPI reads and parses a declared body before it solves a
route's dependencies, so `OpenAIRoute.handle` calls `admit` first and the dependencies find
the caller in `request.state`.

A generation holds a `Ticket` on its tenant's limits from here until its response has been
sent (a stream: until its last event, or the client leaving); `Releasing` returns it then,
with the tokens the request used (`request.state.generation`, set by the route)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from loraplex.registry.api import body_timeouts
from loraplex.registry.request_body import read_capped
from loraplex.router.context import authenticate
from loraplex.router.tenant_limiter import Ticket


async def admit(request: Request, reads_body: bool) -> Ticket | None:
    """Authenticate from the headers (the registry's Unauthenticated or Forbidden), then,
    for a route with a body, take a ticket on the tenant's limits (RateLimited) and read the
    body under the cap (TooLarge). The caller is left in `request.state.call`."""
    call = await authenticate(request)
    request.state.call = call
    if not reads_body:
        return None
    ingress = call.ingress
    ticket = None
    if call.tenant is not None:
        limits = ingress.limits.for_tenant(call.limits)
        ticket = await ingress.limiter.admit(call.tenant, limits)
    request.state.ticket = ticket
    try:
        timeouts = None if ingress.registry is None else body_timeouts(ingress.registry.settings)
        await read_capped(
            request,
            ingress.limits.max_body_bytes,
            "limits.max_body_bytes",
            timeouts,
            ingress.json_parser,
        )
    except BaseException:
        if ticket is not None:
            ticket.release()
        raise
    return ticket


def tokens_used(request: Request) -> int:
    """Prompt plus generated tokens of the request's generation (0 if it never started)."""
    generation = getattr(request.state, "generation", None)
    if generation is None:
        return 0
    return generation.prompt_tokens + generation.timer.completion_tokens


class Releasing(Response):
    """Sends `response`, then releases the request's ticket with the tokens it used."""

    def __init__(self, response: Response, ticket: Ticket, request: Request) -> None:
        self.response, self.ticket, self.request = response, ticket, request
        self.status_code = response.status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.response(scope, receive, send)
        finally:
            self.ticket.release(tokens_used(self.request))


def holding(response: Response, ticket: Ticket | None, request: Request) -> Response:
    """`response`, releasing `ticket` once it has been sent."""
    return response if ticket is None else Releasing(response, ticket, request)

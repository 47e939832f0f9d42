"""Schemathesis hooks for tests/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

A random `model` names nothing, so nearly every generated completion would stop at 404
before reaching the engine: three cases in four name a servable model instead, chosen by a
checksum of the body so that runs repeat. A `model` the spec refuses (not a string, empty,
over 256 characters) is left alone: it is the field a negative case broke on purpose.

One JSON body in five, of every operation, is sent as what no JSON schema lets a generator
write but Python's json module reads (issue 27): one of its numbers NaN, Infinity or
-Infinity, or one of its strings a lone surrogate escape ("\\ud800"), chosen by the same
checksum. The server must answer those with a 4xx, never a 5xx (`not_a_server_error`)."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


HOSTILE = (float("nan"), float("inf"), float("-inf"), "\ud800")


@schemathesis.hook
def map_body(context: schemathesis.HookContext, body: Any) -> Any:
    body = _servable_model(context, body)
    operation = context.operation
    if not isinstance(body, dict | list) or operation is None:
        return body
    if operation.get_request_payload_content_types() != ["application/json"]:
        return body  # a multipart or form body is sent as its own encoding
    checksum = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode())
    if checksum % 5:
        return body
    hostile = _with_one_replaced(body, HOSTILE[(checksum // 5) % len(HOSTILE)])
    if hostile is None:
        return body
    return json.dumps(hostile).encode()  # NaN and "\ud800" written as Python's json writes them


def _with_one_replaced(body: Any, value: Any) -> Any:
    """A copy of `body` with its first number (for a float `value`) or string (for a str)
    replaced by `value`; None when it has none of that kind."""
    wanted = str if isinstance(value, str) else (int, float)
    done = False

    def walk(item: Any) -> Any:
        nonlocal done
        if done:
            return item
        if isinstance(item, dict):
            return {key: walk(child) for key, child in item.items()}
        if isinstance(item, list):
            return [walk(child) for child in item]
        if isinstance(item, wanted) and not isinstance(item, bool):
            done = True
            return value
        return item

    replaced = walk(body)
    return replaced if done else None


def _servable_model(context: schemathesis.HookContext, body: Any) -> Any:
    operation = context.operation
    if operation is None or operation.path not in GENERATION_PATHS:
        return body
    if not isinstance(body, dict) or not isinstance(body.get("model"), str):
        return body
    if not 1 <= len(body["model"]) <= 256:
        return body
    models = os.environ["LORAPLEX_FUZZ_MODELS"].split(",")
    pick = zlib.crc32(json.dumps(body, sort_keys=True, default=str).encode()) % (len(models) + 1)
    if pick < len(models):
        body = {**body, "model": models[pick]}
    return body

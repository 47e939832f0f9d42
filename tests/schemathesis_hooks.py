"""Schemathesis hooks for tests/test_openapi_fuzz.py (loaded through SCHEMATHESIS_HOOKS).

A random `model` names nothing, so nearly every generated completion would stop at 404
before reaching the engine: three cases in four name a servable model instead, chosen by a
checksum of the body so that runs repeat. A `model` the spec refuses (not a string, empty,
over 256 characters) is left alone: it is the field a negative case broke on purpose."""

from __future__ import annotations

import json
import os
import zlib
from typing import Any

import schemathesis

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")


@schemathesis.hook
def map_body(context: schemathesis.HookContext, body: Any) -> Any:
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

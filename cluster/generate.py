"""`loraplex generate`: offline batch generation (like vLLM's batch runner).

Every input line is validated before the engine starts, and the output file is written
whole (temp file + rename) only when every request has finished, so a bad line or a
crash never leaves a half-written result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from loraplex.cluster.errors import CLIError
from loraplex.cluster.flags import add_flags, built, flag_values, from_flags
from loraplex.replica.config import EngineConfig
from loraplex.replica.protocol import SAMPLING_CHECKS
from loraplex.replica.settings import EngineSettings


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="offline batch generation from a JSONL file of requests")
    p.add_argument(
        "--model", type=Path, required=True, help="Hugging Face checkpoint folder or .gguf file"
    )
    p.add_argument("--adapters", type=Path, help="folder whose subfolders are PEFT adapters")
    p.add_argument("--input", type=Path, required=True, help="JSONL: one request per line")
    p.add_argument("--output", type=Path, required=True, help="JSONL results, in input order")
    engine = p.add_argument_group("engine (the YAML config's `engine:` settings)")
    add_flags(engine, EngineSettings)
    add_flags(engine, EngineConfig, ["tp"])


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The engine the flags describe; CLIError naming a refused flag."""
    settings = from_flags(args, EngineSettings)
    device = settings.resolve_device(has_gpu=settings.device == "auto" and _cuda_available())
    more = flag_values(args, EngineConfig, ["tp"])
    return built(lambda: settings.engine_config(str(args.model), device=device, **more))


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant"]
    content: str


class GenerateRequest(BaseModel):
    """One line of the input file."""

    model_config = ConfigDict(extra="forbid")

    id: str | int | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = Field(
        None, description="a conversation, rendered with the model's own chat template"
    )
    adapter: str | None = Field(
        None, description="a folder name under --adapters; null for the base model"
    )
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=100.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False

    @field_validator(*SAMPLING_CHECKS)
    @classmethod
    def _as_the_engine_uses_it(cls, value: Any, info: ValidationInfo) -> Any:
        return SAMPLING_CHECKS[info.field_name](value)

    @model_validator(mode="after")
    def _one_prompt(self):
        given = [self.prompt, self.prompt_token_ids, self.messages]
        if sum(p is not None for p in given) != 1:
            raise ValueError(
                "give exactly one of 'prompt' (text), 'prompt_token_ids' or 'messages' (chat)"
            )
        return self

    def sampling_params(self):
        from loraplex.replica.sampling import SamplingParams

        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
        )


def read_requests(path: Path) -> list[tuple[int, GenerateRequest]]:
    """(line number, request) for every non-blank line; the first bad line is an error."""
    if not path.is_file():
        raise CLIError(f"input file {path} does not exist")
    requests = []
    for lineno, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            req = GenerateRequest.model_validate_json(line)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "line"
            raise CLIError(f"{path}:{lineno}: {where}: {first['msg']}") from None
        requests.append(
            (lineno, req if req.id is not None else req.model_copy(update={"id": lineno}))
        )
    if not requests:
        raise CLIError(f"{path} holds no requests")
    return requests


def run_generate(args: argparse.Namespace) -> int:
    from loraplex.checkpoint_shape import CheckpointError, is_gguf
    from loraplex.replica.engine import LLMEngine, RequestError
    from loraplex.replica.memory.adapters import AdapterError, is_adapter_dir

    numbered = read_requests(args.input)
    requests = [r for _, r in numbered]
    if args.adapters is not None and not args.adapters.is_dir():
        raise CLIError(f"--adapters {args.adapters} is not a folder")
    wanted = sorted({r.adapter for r in requests if r.adapter is not None})
    available = (
        {p.name for p in args.adapters.iterdir() if is_adapter_dir(p)} if args.adapters else set()
    )
    for lineno, r in numbered:
        if r.adapter is not None and r.adapter not in available:
            where = f"under {args.adapters}" if args.adapters else "(no --adapters folder given)"
            raise CLIError(f"{args.input}:{lineno}: adapter {r.adapter!r} not found {where}")
    if not (args.model.is_dir() or (is_gguf(args.model) and args.model.is_file())):
        raise CLIError(f"--model {args.model} is neither a checkpoint folder nor a .gguf file")

    try:
        engine = LLMEngine(engine_config(args))
        for name in wanted:
            engine.add_adapter(name, args.adapters / name)
    except (CheckpointError, AdapterError, RequestError, ValueError) as e:
        raise CLIError(str(e)) from None
    seqs = []
    for lineno, r in numbered:
        try:
            if r.messages is not None:
                if engine.tokenizer is None:
                    raise RequestError("this model has no tokenizer for 'messages'")
                prompt = engine.tokenizer.apply_chat_template([m.model_dump() for m in r.messages])
            else:
                prompt = r.prompt if r.prompt is not None else r.prompt_token_ids
            seqs.append(engine.add_request(prompt, r.sampling_params(), r.adapter))
        except (RequestError, ValueError) as e:
            raise CLIError(f"{args.input}:{lineno}: {e}") from None

    try:
        results = _run(engine, [s.request_id for s in seqs])
    finally:
        engine.close()
    lines = [
        json.dumps(
            {
                "id": r.id,
                "token_ids": out.token_ids,
                "text": out.text,
                "finish_reason": out.finish_reason,
                **({"error": out.error} if out.error is not None else {}),
            }
        )
        for r, out in zip(requests, results, strict=True)
    ]
    _write_atomic(args.output, "\n".join(lines) + "\n")
    prompt = sum(out.num_prompt_tokens for out in results)
    cached = sum(out.num_cached_tokens for out in results)
    print(
        f"wrote {len(lines)} results to {args.output} ({prompt} prompt tokens, {cached} of "
        "them from the prefix cache)",
        file=sys.stderr,
    )
    return 0


def _run(engine, request_ids: list[str]):
    total, done, tokens = len(request_ids), 0, 0
    final = {}
    start = last = time.monotonic()
    while engine.has_unfinished():
        for out in engine.step():
            tokens += 1
            if out.finished:
                final[out.request_id] = out
                done += 1
        now = time.monotonic()
        if now - last >= 1.0 or done == total:
            last = now
            rate = tokens / max(now - start, 1e-9)
            print(
                f"\r{done}/{total} requests done, {tokens} tokens, {rate:.1f} tok/s",
                end="",
                file=sys.stderr,
            )
    print(file=sys.stderr)
    return [final[i] for i in request_ids]


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise

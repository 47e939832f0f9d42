"""The checkpoint's tokenizer (`tokenizer.json`) and chat template (`tokenizer_config.json`)."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, model_dir: Path):
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = model_dir / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        template = cfg.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it: ~2 s for 1 MiB of
        # text on a CPU here), so tokenizing on a worker thread leaves the event loop free.
        [encoding] = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True
    ) -> list[int]:
        """Token ids of the rendered conversation (the template adds BOS itself)."""
        if self._template is None:
            raise ChatTemplateError("this model's tokenizer_config.json has no chat_template")
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        return self.encode(text, add_special_tokens=False)


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content")
    return token

"""The checkpoint's tokenizer and chat template, from wherever the model keeps them.

- A Hugging Face folder: `tokenizer.json`; the template from `chat_template.jinja`
  (transformers 5 writes it there) or else `tokenizer_config.json`'s `chat_template`.
- A GGUF file: the byte-level BPE vocabulary, merges and control tokens of its
  `tokenizer.ggml.*` metadata, split the way llama.cpp's pre-tokenizer of that name
  splits (llama-vocab.cpp, `llm_tokenizer_bpe`), and `tokenizer.chat_template`.
"""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from loraplex.checkpoint_shape import CheckpointError, is_gguf

CHAT_TEMPLATE_FILE = "chat_template.jinja"

# llama.cpp's pre-tokenizer splits (llama-vocab.cpp) beside GPT-2's byte-level regex.
_DIGITS = r"\p{N}"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_PRE_SPLITS: dict[str, str | None] = {
    "default": None,  # GPT-2's regex alone
    "gpt2": None,
    "smollm": _DIGITS,  # every digit alone, then GPT-2's regex
    "starcoder": _DIGITS,
    "refact": _DIGITS,
    "llama-bpe": _LLAMA3,
    "llama3": _LLAMA3,
    "llama-v3": _LLAMA3,
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp's token types


class ChatTemplateError(ValueError):
    pass


def _raise(message: str):
    raise ChatTemplateError(message)


class Tokenizer:
    def __init__(self, path: str | Path):
        """The tokenizer of the checkpoint at `path` (a Hugging Face folder or a .gguf file).
        FileNotFoundError when it has none."""
        path = Path(path)
        if is_gguf(path):
            self._tok, self.bos_token, self.eos_token, template = _from_gguf(path)
        else:
            self._tok, self.bos_token, self.eos_token, template = _from_folder(path)
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        specials = [t.content for t in self._tok.get_added_tokens_decoder().values() if t.special]
        # longest first: a special token that begins another one never hides it
        self._specials = (
            re.compile("|".join(re.escape(t) for t in sorted(specials, key=len, reverse=True)))
            if specials
            else None
        )
        self._as_text: HFTokenizer | None = None  # reads special tokens as text; on first use
        self._template = None
        if template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)

    @staticmethod
    def exists(path: str | Path) -> bool:
        """Whether the checkpoint at `path` carries a tokenizer."""
        path = Path(path)
        if not is_gguf(path):
            return (path / "tokenizer.json").is_file()
        from loraplex.gguf_checkpoint import open_gguf

        return open_gguf(path).tokenizer_spec() is not None

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

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    @property
    def has_chat_template(self) -> bool:
        return self._template is not None

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        special_tokens_as_text: bool = False,
    ) -> list[int]:
        """Token ids of the rendered conversation (the template adds BOS itself). Special
        tokens in the rendered text are control tokens, as Hugging Face's
        `apply_chat_template(tokenize=True)` has it; with `special_tokens_as_text`, only those
        the template itself writes are: one typed in a message's content is encoded as the
        plain text it is (`_as_text_ids`)."""
        if special_tokens_as_text and self._specials is not None:
            return self._as_text_ids(messages, add_generation_prompt, self._specials)
        return self.encode(self._render(messages, add_generation_prompt), add_special_tokens=False)

    def _as_text_ids(
        self, messages: list[dict], add_generation_prompt: bool, specials: re.Pattern[str]
    ) -> list[int]:
        """Each special token in a content is swapped for a mark no text holds (private-use
        characters around a random nonce), the conversation rendered, and the result read
        as Hugging Face's tokenizer reads any text: split at its special tokens (now only the
        template's), each piece between them encoded alone; marks go back to their token's
        text in the pieces, which are encoded with special tokens read as text. Without a
        special token in any content the ids are those of the plain path."""
        nonce = secrets.token_hex(8)
        mark = re.compile(f"\ue000{nonce}:(\\d+)\ue001")
        names: dict[str, int] = {}

        def hide(found: re.Match[str]) -> str:
            index = names.setdefault(found.group(), len(names))
            return f"\ue000{nonce}:{index}\ue001"

        hidden = [
            {**m, "content": specials.sub(hide, m["content"])}
            if isinstance(m.get("content"), str)
            else m
            for m in messages
        ]
        text = self._render(hidden, add_generation_prompt)
        tokens = list(names)
        ids: list[int] = []
        start = 0
        for control in [*specials.finditer(text), None]:
            end = len(text) if control is None else control.start()
            piece = mark.sub(lambda m: tokens[int(m.group(1))], text[start:end])
            if piece:
                ids += self._text_tokenizer().encode_batch([piece], add_special_tokens=False)[0].ids
            if control is not None:
                token_id = self._tok.token_to_id(control.group())
                assert token_id is not None, control.group()
                ids.append(token_id)
                start = control.end()
        return ids

    def _text_tokenizer(self) -> HFTokenizer:
        if self._as_text is None:
            tok = HFTokenizer.from_str(self._tok.to_str())
            tok.encode_special_tokens = True
            self._as_text = tok
        return self._as_text

    def _render(self, messages: list[dict], add_generation_prompt: bool) -> str:
        if self._template is None:
            raise ChatTemplateError(
                "this model has no chat template (none in chat_template.jinja, "
                "tokenizer_config.json or the GGUF metadata)"
            )
        try:
            text = self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None
        return text


def _from_folder(model_dir: Path):
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} has no tokenizer.json")
    tok = HFTokenizer.from_file(str(path))
    cfg_path = model_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    jinja_path = model_dir / CHAT_TEMPLATE_FILE
    template = jinja_path.read_text() if jinja_path.is_file() else cfg.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    return tok, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")), template


def _from_gguf(path: Path):
    from loraplex.gguf_checkpoint import open_gguf

    checkpoint = open_gguf(path)
    spec = checkpoint.tokenizer_spec()
    template = checkpoint.chat_template
    if spec is None:
        raise FileNotFoundError(f"{path} carries no tokenizer (no tokenizer.ggml.* metadata)")
    if spec.model != "gpt2":
        raise CheckpointError(
            f"{path}: tokenizer model {spec.model!r} unsupported; supported: 'gpt2' "
            "(byte-level BPE). Use the model's Hugging Face folder instead"
        )
    if spec.pre not in _PRE_SPLITS:
        raise CheckpointError(
            f"{path}: pre-tokenizer {spec.pre!r} unsupported; supported: {sorted(_PRE_SPLITS)}"
        )
    vocab = {token: i for i, token in enumerate(spec.tokens)}
    merges = [tuple(m.split(" ", 1)) for m in spec.merges]
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    split = _PRE_SPLITS[spec.pre]
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split != _LLAMA3)
    tok.pre_tokenizer = (
        byte_level
        if split is None
        else pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(split), behavior="isolated"), byte_level]
        )
    )
    tok.decoder = decoders.ByteLevel()
    types = spec.token_types or [1] * len(spec.tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(spec.tokens, types, strict=True)
            if kind == _CONTROL
        ]
    )
    user_defined = [t for t, kind in zip(spec.tokens, types, strict=True) if kind == _USER_DEFINED]
    if user_defined:
        tok.add_tokens([AddedToken(t, normalized=False) for t in user_defined])
    if spec.add_bos_token and spec.bos_token_id is not None:
        from tokenizers import processors

        bos = spec.tokens[spec.bos_token_id]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", special_tokens=[(bos, spec.bos_token_id)]
        )

    def name(token_id: int | None) -> str | None:
        return None if token_id is None else spec.tokens[token_id]

    return tok, name(spec.bos_token_id), name(spec.eos_token_id), template


def _token_text(token) -> str | None:
    if isinstance(token, dict):  # {"content": "<s>", ...}
        return token.get("content")
    return token

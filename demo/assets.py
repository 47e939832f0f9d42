"""Offline, seeded demo assets: a small Llama checkpoint in Hugging Face layout, its byte-level
BPE tokenizer, and PEFT LoRA adapters whose B matrices are random (not PEFT's zeros), so every
adapter visibly changes greedy output. Same code and library versions -> same bytes."""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from loraplex.registry.validation import BaseModelShape

BOS_TOKEN = "<|begin_of_text|>"
END_OF_TEXT_TOKEN = "<|end_of_text|>"
START_HEADER_TOKEN = "<|start_header_id|>"
END_HEADER_TOKEN = "<|end_header_id|>"
EOT_TOKEN = "<|eot_id|>"
SPECIAL_TOKENS = (BOS_TOKEN, END_OF_TEXT_TOKEN, START_HEADER_TOKEN, END_HEADER_TOKEN, EOT_TOKEN)

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ATTENTION_TARGETS = LORA_TARGETS[:4]
MLP_TARGETS = LORA_TARGETS[4:]

# Each adapter's delta (scale * B @ A @ x) is drawn to be this fraction of the base projection's
# output, whatever its rank, alpha or rsLoRA setting: large enough to move a greedy argmax within
# a few tokens, small enough to keep logits in the same range as the base model's.
LORA_DELTA_RATIO = 0.5

_TOKENIZER_TRAIN_VOCAB = 1531  # + 5 special tokens = 1536
_SAFETENSORS_METADATA = {"format": "pt"}
_DEMO_SEED = 0

CHAT_TEMPLATE = (
    "{{- bos_token }}"
    "{%- for message in messages %}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{%- endif %}"
)


def _llama3_rope_scaling() -> dict:
    return {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256,
    }


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a Llama checkpoint, plus how its random weights are drawn.

    Linear weights ~ N(0, weight_gain^2 / fan_in); embeddings ~ N(0, embed_std^2); RMSNorm
    weights ~ 1 + N(0, norm_jitter^2), so a reader that ignores norm weights is caught (a tied
    model's final norm is scaled down, see _checkpoint_params). rope_scaling is left out of the
    hash so the spec stays hashable.
    """

    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    vocab_size: int | None = None
    max_position_embeddings: int = 2048
    rope_theta: float = 10000.0
    rope_scaling: dict | None = field(default_factory=_llama3_rope_scaling, hash=False)
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    head_dim: int | None = None
    embed_std: float = 1.0
    weight_gain: float = 1.0
    norm_jitter: float = 0.1

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must divide by num_attention_heads "
                f"({self.num_attention_heads}) unless head_dim is given"
            )

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def shape(self) -> BaseModelShape:
        """The dimensions adapters for this model are validated against."""
        return BaseModelShape(
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_hidden_layers,
            num_heads=self.num_attention_heads,
            num_kv_heads=self.num_key_value_heads,
            head_dim=self.resolved_head_dim,
        )

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each projection in one decoder layer."""
        return self.shape.projection_shapes()


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    name: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    seed: int
    use_rslora: bool = False

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"adapter {self.name!r}: rank must be >= 1, got {self.rank}")
        unknown = set(self.targets) - set(LORA_TARGETS)
        if unknown or not self.targets:
            raise ValueError(
                f"adapter {self.name!r}: targets must be a non-empty subset of {LORA_TARGETS}, "
                f"got {self.targets}"
            )

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


@dataclass(frozen=True, slots=True)
class DemoAssets:
    model_dir: Path
    adapters_dir: Path
    adapter_names: tuple[str, ...]


DEMO_MODEL = ModelSpec()

DEMO_ADAPTERS = (
    AdapterSpec("sql-r8", rank=8, alpha=16.0, targets=("q_proj", "v_proj"), seed=101),
    AdapterSpec("chat-r16", rank=16, alpha=32.0, targets=LORA_TARGETS, seed=102),
    AdapterSpec("code-r32", rank=32, alpha=16.0, targets=ATTENTION_TARGETS, seed=103),
    AdapterSpec("math-r64", rank=64, alpha=128.0, targets=MLP_TARGETS, seed=104),
    AdapterSpec("legal-r8", rank=8, alpha=8.0, targets=("o_proj", "down_proj"), seed=105),
    AdapterSpec(
        "med-r16-rslora", rank=16, alpha=4.0, targets=LORA_TARGETS, seed=106, use_rslora=True
    ),
    AdapterSpec(
        "poetry-r24", rank=24, alpha=48.0, targets=("q_proj", "v_proj", "up_proj"), seed=107
    ),
    AdapterSpec(
        "support-r12", rank=12, alpha=24.0, targets=("k_proj", "v_proj", "gate_proj"), seed=108
    ),
    AdapterSpec("summary-r48", rank=48, alpha=96.0, targets=MLP_TARGETS, seed=109),
    AdapterSpec("translate-r64", rank=64, alpha=32.0, targets=LORA_TARGETS, seed=110),
)


def write_tokenizer(out_dir: Path, *, model_max_length: int = 2048) -> int:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json; return the
    vocab size including special tokens."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer()
    tokenizer.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOT_TOKEN,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "model_input_names": ["input_ids", "attention_mask"],
        "chat_template": CHAT_TEMPLATE,
    }
    _write_json(out_dir / "tokenizer_config.json", config)
    _write_json(
        out_dir / "special_tokens_map.json", {"bos_token": BOS_TOKEN, "eos_token": EOT_TOKEN}
    )
    return tokenizer.get_vocab_size(with_added_tokens=True)


def _train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_TOKENIZER_TRAIN_VOCAB,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_training_texts(), trainer)
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    bos_id = tokenizer.token_to_id(BOS_TOKEN)
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS_TOKEN}:0 $A:0",
                pair=f"{BOS_TOKEN}:0 $A:0 {BOS_TOKEN}:1 $B:1",
                special_tokens=[(BOS_TOKEN, bos_id)],
            ),
        ]
    )
    return tokenizer


def _training_texts() -> list[str]:
    prose = [" ".join(paragraph.split()) for paragraph in _PROSE.split("\n\n")]
    return prose + _CODE.split("\n\n")


def _special_token_ids(vocab_size: int) -> dict[str, int]:
    """Special tokens are appended after the trained vocab, in SPECIAL_TOKENS order."""
    first = vocab_size - len(SPECIAL_TOKENS)
    return {token: first + i for i, token in enumerate(SPECIAL_TOKENS)}


@dataclass(frozen=True, slots=True)
class _Param:
    name: str
    shape: tuple[int, ...]
    mean: float
    std: float

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def write_checkpoint(
    out_dir: Path,
    spec: ModelSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    num_shards: int = 1,
    with_tokenizer: bool = True,
) -> None:
    """Write config.json and safetensors weights (sharded with an index when num_shards > 1),
    and the tokenizer unless with_tokenizer is False. Weights depend only on spec and seed:
    the dtype is a cast of the fp32 draw and sharding only splits the same tensors."""
    out_dir.mkdir(parents=True, exist_ok=True)
    vocab_size, special_ids = _resolve_vocab(out_dir, spec, with_tokenizer)
    _write_json(out_dir / "config.json", _model_config(spec, vocab_size, special_ids, dtype))
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)

    params = _checkpoint_params(spec, vocab_size)
    generator = torch.Generator().manual_seed(seed)
    shards = _split_shards(params, num_shards)
    weight_map = {}
    for index, shard in enumerate(shards, start=1):
        filename = (
            "model.safetensors"
            if num_shards == 1
            else f"model-{index:05d}-of-{num_shards:05d}.safetensors"
        )
        tensors = {p.name: _draw(p, generator).to(dtype) for p in shard}
        save_file(tensors, str(out_dir / filename), metadata=_SAFETENSORS_METADATA)
        weight_map.update(dict.fromkeys(tensors, filename))
    if num_shards > 1:
        total_size = sum(p.numel for p in params) * dtype.itemsize
        index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
        _write_json(out_dir / "model.safetensors.index.json", index)


def _resolve_vocab(
    out_dir: Path, spec: ModelSpec, with_tokenizer: bool
) -> tuple[int, dict[str, int]]:
    if not with_tokenizer:
        if spec.vocab_size is None:
            raise ValueError("with_tokenizer=False needs spec.vocab_size to be set")
        return spec.vocab_size, _special_token_ids(spec.vocab_size)
    tokenizer_vocab = write_tokenizer(out_dir, model_max_length=spec.max_position_embeddings)
    vocab_size = spec.vocab_size or tokenizer_vocab
    if vocab_size < tokenizer_vocab:
        raise ValueError(
            f"spec.vocab_size ({vocab_size}) is smaller than the tokenizer's vocab "
            f"({tokenizer_vocab}); use None or a value >= {tokenizer_vocab}"
        )
    return vocab_size, _special_token_ids(tokenizer_vocab)


def _model_config(
    spec: ModelSpec, vocab_size: int, special_ids: dict[str, int], dtype: torch.dtype
) -> dict:
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "head_dim": spec.resolved_head_dim,
        "vocab_size": vocab_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": spec.rope_theta,
        "rope_scaling": spec.rope_scaling,
        "rms_norm_eps": spec.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "bos_token_id": special_ids[BOS_TOKEN],
        "eos_token_id": special_ids[EOT_TOKEN],
        "pad_token_id": None,
        "use_cache": True,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
    }


def _checkpoint_params(spec: ModelSpec, vocab_size: int) -> list[_Param]:
    """Every tensor in draw order; lm_head comes last so tying does not shift the others.

    A tied lm_head is the embedding (std embed_std, not weight_gain/sqrt(hidden)), so the final
    norm is scaled down to keep the logits of tied and untied models on the same scale.
    """
    h, gain = spec.hidden_size, spec.weight_gain
    norm_scale = gain / (spec.embed_std * math.sqrt(h)) if spec.tie_word_embeddings else 1.0
    params = [_Param("model.embed_tokens.weight", (vocab_size, h), 0.0, spec.embed_std)]
    for layer in range(spec.num_hidden_layers):
        prefix = f"model.layers.{layer}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            params.append(_Param(f"{prefix}.{norm}.weight", (h,), 1.0, spec.norm_jitter))
        for module, (out_features, in_features) in spec.projection_shapes().items():
            name = f"{prefix}.{_module_path(module)}.weight"
            params.append(
                _Param(name, (out_features, in_features), 0.0, gain / math.sqrt(in_features))
            )
    params.append(_Param("model.norm.weight", (h,), norm_scale, spec.norm_jitter * norm_scale))
    if not spec.tie_word_embeddings:
        params.append(_Param("lm_head.weight", (vocab_size, h), 0.0, gain / math.sqrt(h)))
    return params


def _module_path(module: str) -> str:
    return f"self_attn.{module}" if module in ATTENTION_TARGETS else f"mlp.{module}"


def _draw(param: _Param, generator: torch.Generator) -> torch.Tensor:
    return param.mean + param.std * torch.randn(param.shape, generator=generator)


def _split_shards(params: list[_Param], num_shards: int) -> list[list[_Param]]:
    """Contiguous, non-empty groups of roughly equal byte size."""
    if not 1 <= num_shards <= len(params):
        raise ValueError(f"num_shards must be in 1..{len(params)}, got {num_shards}")
    ends = list(itertools.accumulate(p.numel for p in params))
    cuts = [0]
    for k in range(1, num_shards):
        balanced = bisect.bisect_left(ends, k * ends[-1] / num_shards) + 1
        cuts.append(min(max(balanced, cuts[-1] + 1), len(params) - (num_shards - k)))
    cuts.append(len(params))
    return [params[start:end] for start, end in itertools.pairwise(cuts)]


def write_adapter(
    out_dir: Path,
    spec: ModelSpec,
    adapter: AdapterSpec,
    *,
    dtype: torch.dtype = torch.float32,
    vocab_size: int | None = None,
) -> None:
    """Write a PEFT LoRA adapter (adapter_config.json + adapter_model.safetensors) for `spec`.

    A ~ N(0, 1/in); B ~ N(0, sigma^2) with sigma chosen so that scaling * B @ A @ x is about
    LORA_DELTA_RATIO times the base projection's output. vocab_size is accepted for callers
    that pass the resolved vocab along; LoRA on the seven projections never depends on it.
    """
    del vocab_size
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_json(out_dir / "adapter_config.json", _adapter_config(adapter))
    save_file(
        {name: t.to(dtype) for name, t in _adapter_tensors(spec, adapter)},
        str(out_dir / "adapter_model.safetensors"),
        metadata=_SAFETENSORS_METADATA,
    )


def _adapter_tensors(spec: ModelSpec, adapter: AdapterSpec) -> Iterable[tuple[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(adapter.seed)
    b_std = LORA_DELTA_RATIO * spec.weight_gain / (adapter.scaling * math.sqrt(adapter.rank))
    shapes = spec.projection_shapes()
    for layer in range(spec.num_hidden_layers):
        for module in (m for m in LORA_TARGETS if m in adapter.targets):
            out_features, in_features = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{_module_path(module)}"
            a = torch.randn((adapter.rank, in_features), generator=generator)
            b = torch.randn((out_features, adapter.rank), generator=generator)
            yield f"{prefix}.lora_A.weight", a / math.sqrt(in_features)
            yield f"{prefix}.lora_B.weight", b * b_std


def _adapter_config(adapter: AdapterSpec) -> dict:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": "loraplex-demo-llama",
        "revision": None,
        "inference_mode": True,
        "r": adapter.rank,
        "lora_alpha": adapter.alpha,
        "target_modules": [m for m in LORA_TARGETS if m in adapter.targets],
        "lora_dropout": 0.0,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": adapter.use_rslora,
        "use_dora": False,
        "lora_bias": False,
        "modules_to_save": None,
        "init_lora_weights": True,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }


def make_demo_assets(dest: Path, *, progress: Callable[[str], None] | None = None) -> DemoAssets:
    """dest/model/ (checkpoint + tokenizer) and dest/adapters/<name>/ for DEMO_ADAPTERS,
    overwriting what is there."""
    report = progress or (lambda _message: None)
    model_dir, adapters_dir = dest / "model", dest / "adapters"
    report(f"writing base model to {model_dir}")
    write_checkpoint(model_dir, DEMO_MODEL, seed=_DEMO_SEED)
    for adapter in DEMO_ADAPTERS:
        report(f"writing adapter {adapter.name} (rank {adapter.rank}) to {adapters_dir}")
        write_adapter(adapters_dir / adapter.name, DEMO_MODEL, adapter)
    return DemoAssets(model_dir, adapters_dir, tuple(a.name for a in DEMO_ADAPTERS))


def _write_json(path: Path, payload: dict) -> None:
    path.write_text(json.dumps(payload, indent=2) + "\n")


# Prose paragraphs are wrapped here for reading and unwrapped for training.
_PROSE = """\
The morning train left the station a few minutes late, and the passengers settled into their seats
with coffee and newspapers. Outside the window, the fields were still grey with frost, and a thin
line of smoke rose from a farmhouse near the river. A child pressed her face to the glass and
counted the cows as they passed. Her father read the weather report aloud: cold in the morning,
clear skies in the afternoon, and a chance of rain by the evening.

A good cook keeps a clean kitchen and a sharp knife. Before you start, read the whole recipe and
gather what you need: flour, butter, eggs, sugar, a pinch of salt, and a little milk. Mix the dry
ingredients in one bowl and the wet ingredients in another, then fold them together gently. Do not
stir too much, or the bread will be tough. Bake it in a hot oven until the top is golden brown, and
let it cool on a rack before you cut it.

The library on the hill was built more than a hundred years ago. Its shelves hold books about
history, science, music, and the sea. Students come in the afternoon to study, and old men come in
the morning to read the papers and argue about politics. The librarian knows every reader by name.
She says that a library is not a room full of books but a place where people learn to ask better
questions.

When a server receives a request, it reads the prompt, turns the text into tokens, and runs the
model one step at a time. Each step produces a new token, and the server sends it back to the user
as soon as it is ready. A good scheduler keeps the machine busy by putting many requests into the
same batch. If memory runs low, the scheduler pauses the newest request and resumes it later, so
that the oldest requests finish first.

A small adapter can teach a large model a new skill without changing the model itself. The adapter
holds two thin matrices for each layer it touches. At run time the engine multiplies the input by
the first matrix, then by the second, and adds the result to the output of the original layer.
Because the adapters are small, one machine can keep hundreds of them in memory and switch between
them for every request in a batch.

The river runs from the mountains to the sea. In the spring it is fast and cold, full of melted
snow, and in the summer it is slow and warm, and children swim in the deep pools under the bridge.
Fishermen wait on the rocks at dawn. Herons stand in the shallow water, perfectly still, until a
fish comes close, and then they strike faster than the eye can follow.

My grandmother kept a garden behind her house. She grew tomatoes, beans, potatoes, onions, and tall
yellow flowers that turned to follow the sun. Every evening she walked along the rows with a
watering can and talked to the plants as if they were old friends. She said that a garden teaches
patience, because nothing you plant today will be ready tomorrow, and nothing good ever grows in a
hurry.

Questions and answers. What is the capital of France? The capital of France is Paris. How many days
are in a week? There are seven days in a week. What color is the sky on a clear day? The sky is
blue on a clear day. Why do leaves fall in autumn? The trees stop feeding their leaves when the
days get short and cold, so the leaves dry out and fall to the ground.

Dear team, thank you for your hard work this quarter. We shipped the new release on time, the error
rate is down, and our users are happier than they have ever been. Next month we will focus on speed
and on the documentation. Please send me your ideas before Friday, and let us meet on Monday
morning to plan the work. Best regards, and enjoy the weekend.

The history of numbers is the history of people trying to count the world. Shepherds cut marks in
sticks to count their sheep. Merchants wrote numbers on clay to keep track of grain and oil. Much
later, scholars learned to write zero, and with zero came the idea that a number could stand for
nothing at all. Today a computer counts billions of times every second, yet it still uses the same
simple ideas: one, two, many, and none.

Once upon a time there was a fox who wanted to learn to sing. He asked the birds to teach him, but
they laughed and flew away. He asked the wind, but the wind only whistled. At last he asked an old
owl, who said: listen first, and sing later. So the fox listened to the forest every night for a
year, and when spring came, he sang a song that made the whole forest fall silent.

The city wakes up slowly on Sunday. The shops open late, the streets are quiet, and the smell of
fresh bread drifts out of the bakery on the corner. People walk their dogs in the park, and a man
plays the violin near the fountain for a few coins. By noon the cafes are full, and friends sit
outside in the sun, talking about the week that has passed and the week that is coming.

Travel tips: pack light, carry a map, and learn a few words of the local language, such as hello,
please, thank you, and goodbye. Drink plenty of water, wear comfortable shoes, and keep a copy of
your passport in a safe place. Try the local food, talk to the people you meet, and do not plan
every hour of the day. The best moments of a journey are often the ones you did not expect.

The doctor listened to the patient's heart and lungs, checked his blood pressure, and asked him how
he had been sleeping. She told him to rest, to drink more water, and to take a short walk every
day. If the pain comes back, she said, call the clinic and we will see you again next week. He
thanked her, put on his coat, and walked out into the bright afternoon feeling better than he had
in days.

Mountains are made slowly. Over millions of years the plates of the earth push against each other,
and the rock folds and rises like a rug pushed against a wall. Rain and ice wear the peaks down
again, carrying sand and stones to the valleys and the sea. What looks solid and eternal is in fact
always moving, only so slowly that a human life is too short to see it.

In the evening the family gathered around the table. There was soup, bread, cheese, and a bowl of
apples from the tree in the yard. The youngest son told a story about his day at school, and
everyone laughed. Later, when the dishes were washed and the lights were low, their mother read a
chapter from an old book, and one by one the children fell asleep.
"""

_CODE = """\
def add(a, b):
    return a + b

def greet(name: str) -> str:
    return f"Hello, {name}!"

for i in range(10):
    if i % 2 == 0:
        print(i, "is even")
    else:
        print(i, "is odd")

class Counter:
    def __init__(self):
        self.count = 0

    def increment(self, step=1):
        self.count += step
        return self.count

{"name": "demo", "version": "1.0.0", "tags": ["small", "offline"], "enabled": true, "limit": 42}
{"user": "alice", "role": "admin", "email": "alice@example.com", "last_login": "2024-05-01"}
{"request_id": 1234, "prompt": "Write a poem about the sea.", "max_tokens": 64, "top_p": 0.9}

SELECT name, email FROM users WHERE active = 1 ORDER BY name LIMIT 10;
SELECT count(*) AS total FROM orders WHERE created_at > '2024-01-01' GROUP BY customer_id;
"""

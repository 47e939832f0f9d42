"""The small Llama shape the registry and adapter tests build adapters for."""

from loraplex.demo.synthetic import ModelSpec

SPEC = ModelSpec(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=320,
)
BASE = SPEC.shape  # head_dim 16

"""`loraplex bench engine`: the engine against transformers + peft, LoRA overhead, tensor parallelism, the prefix cache, the output path."""

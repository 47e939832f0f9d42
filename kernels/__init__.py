"""Batched multi-LoRA and paged-attention ops: torch references (CPU, oracles) and Triton."""

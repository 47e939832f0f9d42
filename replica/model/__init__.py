"""Llama-family decoder and its weight loader."""

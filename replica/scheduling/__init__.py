"""Continuous batching and its admission policies (FIFO, SJF with aging, Chameleon)."""

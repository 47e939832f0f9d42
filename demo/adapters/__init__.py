"""The committed demo adapters, one folder each (data only; trained by
scripts/train_adapters.py, read through loraplex.demo.assets)."""

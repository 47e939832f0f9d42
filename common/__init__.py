"""loraplex: multi-tenant LoRA serving. Subpackages map to the repository's top-level folders."""

__version__ = "0.1.0"

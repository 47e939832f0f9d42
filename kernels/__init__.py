"""Batched multi-LoRA and paged-attention ops: torch references (CPU, oracles) and Triton."""

if __name__ == "kernels":
    # This folder is `loraplex.kernels`. Imported as top-level `kernels`, the repository root is
    # on sys.path (`python -m` or `-c` run in the checkout, or a Ray worker of a driver started
    # there), and that name belongs to Hugging Face's `kernels`, which transformers >= 5.25
    # imports. Where it is installed, load it in this module's place; where it is not, nothing
    # asked for it that this folder could not stand in for, as before.
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec(__name__, _path)
    if _spec is not None and _spec.loader is not None:
        _installed = importlib.util.module_from_spec(_spec)
        sys.modules[__name__] = _installed
        _spec.loader.exec_module(_installed)

"""The declared layers (DESIGN.md's arrows, README "Layout"), read from the source of the
product packages (ast; nothing is imported). Every import counts: at module level, inside
functions, and under TYPE_CHECKING.

    cluster     → router, replica, registry, benchmarks, demo   (nothing imports cluster)
    benchmarks  → replica, router, registry, kernels, demo
    router      → registry, and of replica only its public face: replica.protocol and
                  replica.tokenizer
    replica     → kernels, and of registry only the watch, the records (models), the
                  artifact store and the etcd settings: the adapter format is the floor's
    demo, registry, kernels → nothing of ours
    and every package may import the common floor, `loraplex` itself (common/: the model
    shape, the adapter format, the domain errors, settings helpers), which imports none of
    them.
"""

from __future__ import annotations

import ast
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PACKAGE_DIRS: dict[str, str] = PYPROJECT["tool"]["setuptools"]["package-dir"]
BASE = "loraplex"

ARROWS = {
    "cluster": {"router", "replica", "registry", "benchmarks", "demo"},
    "benchmarks": {"replica", "router", "registry", "kernels", "demo"},
    "router": {"registry", "replica"},
    "replica": {"kernels", "registry"},
    "demo": set(),
    "registry": set(),
    "kernels": set(),
}
# The modules of replica/ the router may import: what crosses the process boundary (plain
# dicts and their errors) and the tokenizer the ingress runs.
REPLICA_PUBLIC_FACE = {"loraplex.replica.protocol", "loraplex.replica.tokenizer"}
# The modules of registry/ the replica may import: what it needs to follow the registry
# (the watch and its etcd settings, the records) and to read an adapter's bytes.
REGISTRY_FACE_FOR_REPLICA = {
    "loraplex.registry.watch",
    "loraplex.registry.etcd_client",
    "loraplex.registry.models",
    "loraplex.registry.artifacts",
}


def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every file of the product packages."""
    found = {}
    for package, folder in PACKAGE_DIRS.items():
        if package.count(".") > 1:  # a subpackage mapped on its own is inside its parent
            continue
        for path in (ROOT / folder).rglob("*.py"):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = modules()


def imports_of(name: str, path: Path) -> set[str]:
    """The product modules `name` imports, anywhere in its file."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, `level - 1` folders up
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import module` imports the module; `from module import name` the module
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name inside a.b
                target = target.rpartition(".")[0]
            if target.startswith(BASE) and target != name:
                found.add(target)
    return found


GRAPH = {name: imports_of(name, path) for name, path in MODULES.items()}


def layer(module: str) -> str:
    """The top-level package of a module: `cluster`, `replica`, ... or `loraplex` (the base)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in ARROWS else BASE


def test_the_graph_is_read():
    assert len(MODULES) > 100
    assert "loraplex.replica.config" in GRAPH["loraplex.replica.engine"]
    assert "loraplex.replica.protocol" in GRAPH["loraplex.router.serve_backend"]
    assert "loraplex.settings" in GRAPH["loraplex.router.policy"]
    assert set(ARROWS) | {BASE} == {layer(m) for m in MODULES}


def test_every_import_follows_the_declared_arrows():
    wrong = []
    for module, targets in sorted(GRAPH.items()):
        source = layer(module)
        for target in sorted(targets):
            dest = layer(target)
            if dest == source or dest == BASE and source != BASE:
                continue
            if dest not in ARROWS.get(source, set()):
                wrong.append(f"{module} -> {target} ({source} may not import {dest})")
            elif (source, dest) == ("router", "replica") and target not in REPLICA_PUBLIC_FACE:
                wrong.append(f"{module} -> {target} (router may import only {REPLICA_PUBLIC_FACE})")
            elif (source, dest) == (
                "replica",
                "registry",
            ) and target not in REGISTRY_FACE_FOR_REPLICA:
                wrong.append(
                    f"{module} -> {target} (replica may import only {REGISTRY_FACE_FOR_REPLICA})"
                )
    assert not wrong, "imports against the declared layers:\n  " + "\n  ".join(wrong)


def test_the_packages_import_each_other_without_a_cycle():
    edges = {(layer(m), layer(t)) for m, targets in GRAPH.items() for t in targets}
    edges = {(a, b) for a, b in edges if a != b}
    cycles = [f"{a} <-> {b}" for a, b in sorted(edges) if (b, a) in edges and a < b]
    assert not cycles, cycles  # longer circles are caught by the arrows test (ARROWS is a DAG)
    order = _topological(ARROWS)
    assert order is not None, "ARROWS itself has a cycle"


def test_no_two_modules_import_each_other_even_through_others():
    cycles = [c for c in _strongly_connected(GRAPH) if len(c) > 1]
    assert not cycles, (
        "modules in an import circle (move what they share into a module both import):\n"
        + "\n".join("  " + " <-> ".join(sorted(c)) for c in cycles)
    )


def test_every_package_folder_is_in_pyprojects_packages():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    on_disk = {m for m, p in MODULES.items() if p.name == "__init__.py"}
    assert on_disk - listed == set(), "package folders missing from pyproject's packages"
    assert listed - on_disk == set(), "pyproject lists packages that are not on disk"
    folders = {
        p.parent
        for package, folder in PACKAGE_DIRS.items()
        for p in (ROOT / folder).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    without_init = sorted(
        str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file()
    )
    assert not without_init, f"folders of Python files without __init__.py: {without_init}"


@pytest.mark.parametrize("source", sorted(ARROWS))
def test_nothing_imports_cluster_but_cluster(source):
    if source == "cluster":
        return
    assert "cluster" not in ARROWS[source]


def _strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's algorithm, iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    components = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph.get(root, ()))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    components.append(component)
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return components


def _topological(arrows: dict[str, set[str]]) -> list[str] | None:
    indegree = defaultdict(int)
    for targets in arrows.values():
        for t in targets:
            indegree[t] += 1
    ready = [n for n in arrows if indegree[n] == 0]
    order = []
    while ready:
        node = ready.pop()
        order.append(node)
        for t in arrows[node]:
            indegree[t] -= 1
            if indegree[t] == 0:
                ready.append(t)
    return order if len(order) == len(arrows) else None


def test_a_folder_named_like_an_installed_package_yields_to_it():
    """The folders sit at the repository root, and `python -m ...`, `python -c`, a notebook or a
    Ray worker started from the checkout (Ray puts the driver's working directory on every
    worker's path) put that root first on sys.path. Hugging Face's `kernels` (a dependency of
    transformers >= 5.25) then resolved to kernels/, and `import peft` failed in CI on
    2026-12-03 (`cannot import name 'CUDAProperties' from 'kernels'`). From the root, a name an
    installed distribution owns imports that distribution, and transformers' models load."""
    import importlib.metadata
    import subprocess
    import sys

    owners = importlib.metadata.packages_distributions()
    taken = sorted(
        folder
        for folder in {path.split("/")[0] for path in PACKAGE_DIRS.values()}
        if folder in owners and "loraplex" not in owners[folder]
    )
    if not taken:
        pytest.skip("no installed distribution owns a name of the root's folders")
    code = (
        "import importlib, sys\n"
        f"for name in {taken!r}:\n"
        "    print(name, importlib.import_module(name).__file__)\n"
        "import transformers.modeling_utils\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for line in done.stdout.splitlines():
        name, origin = line.split(" ", 1)
        assert not Path(origin).is_relative_to(ROOT / name), line

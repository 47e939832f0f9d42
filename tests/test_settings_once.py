"""Each setting is declared once (STYLE.md, "One definition per setting"), read from the
source of the product packages (ast; nothing is imported).

A settings class is a class named `*Config`, `*Settings`, `*Section`, `*Limits`,
`*Credentials` or `*Params`. Each annotated field in one declares a setting, unless its
value is `setting(Owner, "name", ...)` (loraplex/settings.py), which copies Owner's.
Also declarations: a hand-written CLI flag under a setting's name
(`add_argument("--max-lora-rank", ...)`), and a parameter default equal to the default of
the setting of its name (`def make_eviction(name, half_life_s=60.0)`). Names are compared
without a unit suffix, so `pool_mib` and `pool_bytes` are one setting.

HOMONYMS are the names that mean different things in different places, each with why;
NOT_SETTINGS the classes named like settings that describe something else.
"""

from __future__ import annotations

import ast
import re
import tomllib
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SETTINGS_CLASS = re.compile(r"(Config|Settings|Section|Limits|Credentials|Params)$")
UNIT_SUFFIX = re.compile(r"_(bytes|kib|mib)$")

HOMONYMS = {
    "seed": "the engine's sampling seed, the router's tie-break seed and a request's own seed",
    "host": "where etcd listens, where Serve's HTTP proxy binds, where `loraplex registry` binds",
    "port": "Serve's HTTP proxy (http.port) and the standalone `loraplex registry` server",
    "model": "a checkpoint folder: optional in the YAML config (unset: the demo), required by "
    "the engine and by `generate`/`registry` --model",
    "device": "the operator's choice (auto included: decided by the replica's GPUs) and the "
    "engine's resolved torch device",
    "endpoints": "the YAML config's (unset: `loraplex up` starts an etcd) and a client's, "
    "always set; EtcdSettings checks the format of both",
    "etcd": "the YAML config's etcd section and `loraplex registry --etcd HOST:PORT`",
    "min_samples": "warm-up counts of different estimators (Chameleon's clustering, the "
    "step-cost fit)",
}
NOT_SETTINGS = {
    "ModelConfig": "a checkpoint's shape, read from its config.json",
    "WorkLimits": "what one registry worker call gets, made from RegistrySettings' "
    "work_timeout_s and work_memory_bytes by its work_limits()",
    "RaySettings": "Ray Serve's own deployment options and router constants, as the bench's "
    "model of Ray's routers (benchmarks/peers/ray_routers.py) takes them",
    "SLoRAConfig": "S-LoRA's server flags in the benchmark's model of S-LoRA "
    "(benchmarks/peers/slora.py), not loraplex's",
}


def product_files() -> list[Path]:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    folders = pyproject["tool"]["setuptools"]["package-dir"].values()
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@dataclass(frozen=True)
class Place:
    where: str  # file:line
    what: str  # Class.field, flag --x, or function(param=...)


def _call_name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Call):
        func = node.func
        return func.id if isinstance(func, ast.Name) else getattr(func, "attr", None)
    return None


def _setting_name(name: str) -> str:
    return UNIT_SUFFIX.sub("", name)


_NOT_CONSTANT = object()


def _constant(node: ast.AST | None) -> object:
    """The value of a constant expression (`1 << 30` included); None if it is not one."""
    if node is None or any(
        isinstance(n, ast.Name | ast.Call | ast.Attribute | ast.Subscript) for n in ast.walk(node)
    ):
        return None
    try:
        return eval(compile(ast.Expression(node), "<default>", "eval"), {"__builtins__": {}})
    except Exception:  # noqa: BLE001  (not a constant after all)
        return None


def _default_of(value: ast.AST | None) -> object:
    """A field's default: `Field(default, ...)`'s, or the assigned constant's."""
    if _call_name(value) == "Field":
        assert isinstance(value, ast.Call)
        given = value.args[:1] + [k.value for k in value.keywords if k.arg == "default"]
        return _constant(given[0]) if given else None
    return _constant(value)


class Scan:
    def __init__(self) -> None:
        self.fields: dict[str, list[Place]] = defaultdict(list)  # declared in settings classes
        self.field_defaults: dict[str, object] = {}  # setting name -> its default, if constant
        self.annotations: dict[tuple[str, str], str] = {}  # (class, field) -> annotation
        self.copies: list[tuple[Place, str, str, str]] = []  # place, annotation, owner, field
        self.flags: dict[str, list[Place]] = defaultdict(list)
        self.defaults: dict[str, list[tuple[Place, object]]] = defaultdict(list)
        for path in product_files():
            self.read(path)

    def read(self, path: Path) -> None:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.ClassDef)
                and SETTINGS_CLASS.search(node.name)
                and node.name not in NOT_SETTINGS
            ):
                self.settings_class(rel, node)
            elif _call_name(node) == "add_argument":
                assert isinstance(node, ast.Call)
                for arg in node.args:
                    if isinstance(arg, ast.Constant) and str(arg.value).startswith("--"):
                        name = str(arg.value)[2:].replace("-", "_")
                        place = Place(f"{rel}:{node.lineno}", f"flag {arg.value}")
                        self.flags[_setting_name(name)].append(place)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                self.parameter_defaults(rel, node)

    def settings_class(self, rel: Path, node: ast.ClassDef) -> None:
        for item in node.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            annotation = ast.unparse(item.annotation)
            if annotation.startswith("ClassVar"):
                continue
            name = item.target.id
            place = Place(f"{rel}:{item.lineno}", f"{node.name}.{name}")
            self.annotations[(node.name, name)] = annotation
            value = item.value
            if _call_name(value) == "setting":
                assert isinstance(value, ast.Call)
                owner, field = (ast.unparse(a).strip("'\"") for a in value.args[:2])
                self.copies.append((place, annotation, owner, field))
            else:
                self.fields[_setting_name(name)].append(place)
                self.field_defaults[_setting_name(name)] = _default_of(value)

    def parameter_defaults(self, rel: Path, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        args = node.args
        positional = args.posonlyargs + args.args
        pairs = list(
            zip(positional[len(positional) - len(args.defaults) :], args.defaults, strict=True)
        )
        keyword = zip(args.kwonlyargs, args.kw_defaults, strict=True)
        pairs += [(a, d) for a, d in keyword if d is not None]
        for arg, default in pairs:
            value = _constant(default)
            if value is not None:
                place = Place(f"{rel}:{node.lineno}", f"{node.name}({arg.arg}={value!r})")
                self.defaults[_setting_name(arg.arg)].append((place, value))


@pytest.fixture(scope="module")
def scan() -> Scan:
    return Scan()


def test_no_setting_is_declared_in_two_settings_classes(scan: Scan):
    twice = {
        name: places
        for name, places in scan.fields.items()
        if len(places) > 1 and name not in HOMONYMS
    }
    assert not twice, "declared more than once (copy one with `setting`):\n" + "\n".join(
        f"  {name}: " + ", ".join(f"{p.what} ({p.where})" for p in places)
        for name, places in sorted(twice.items())
    )


def test_flags_and_parameter_defaults_do_not_redeclare_a_setting(scan: Scan):
    found = []
    for name, places in sorted(scan.flags.items()):
        if name in scan.fields and name not in HOMONYMS:
            setting = scan.fields[name][0]
            found += [f"  {p.what} ({p.where}) repeats {setting.what}" for p in places]
    for name, defaults in sorted(scan.defaults.items()):
        if name in scan.fields and name not in HOMONYMS:
            setting = scan.fields[name][0]
            found += [
                f"  {p.what} ({p.where}) repeats the default of {setting.what}"
                for p, value in defaults
                if value == scan.field_defaults[name]
            ]
    assert not found, (
        "a setting repeated by hand (derive flags with cluster/flags.py, pass the value):\n"
        + "\n".join(found)
    )


def test_every_copy_names_a_declared_setting_and_keeps_its_type(scan: Scan):
    assert scan.copies, "no `setting(...)` copies found: is the scan reading the sources?"
    for place, annotation, owner, field in scan.copies:
        source = scan.annotations.get((owner, field))
        assert source is not None, (
            f"{place.what} ({place.where}) copies {owner}.{field}: no such field"
        )
        assert annotation == source, (
            f"{place.what} ({place.where}) is annotated {annotation}; its source {owner}.{field} "
            f"is {source}"
        )


def test_the_scan_sees_the_settings_it_guards(scan: Scan):
    """Not vacuous: the known single definitions are found where they live."""
    assert [p.what for p in scan.fields["max_lora_rank"]] == ["AdapterLimits.max_lora_rank"]
    assert [p.what for p in scan.fields["max_num_seqs"]] == ["SchedulerConfig.max_num_seqs"]
    assert [p.what for p in scan.fields["pool"]] == ["EngineConfig.pool_bytes"]
    assert [p.what for p in scan.fields["load_cost_s"]] == ["AffinityConfig.load_cost_s"]
    assert {p.what for p, *_ in scan.copies} >= {
        "EngineSettings.pool_mib",
        "EngineConfig.max_lora_rank",
        "ReplicaSection.tp",
    }

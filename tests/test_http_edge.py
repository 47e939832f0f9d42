"""HTTP stays at the edge: the registry's domain modules raise domain errors and never import
an HTTP framework; one table gives each kind of error the status code the README documents
for the tenant API (and the ingress answers it with OpenAI's body)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from loraplex import errors
from loraplex.registry.api_errors import error_headers, status_code
from loraplex.router.openai_errors import registry_error

ROOT = Path(__file__).resolve().parents[1]
HTTP_PACKAGES = ("fastapi", "starlette")
# The registry's HTTP edge: its routes, the error mapping, and the streamed upload parser.
REGISTRY_EDGE = {"api.py", "api_errors.py", "request_body.py", "uploads.py"}

# The README's status codes of the tenant API, by kind of refusal.
DOCUMENTED = {
    errors.Invalid: 400,
    errors.Unauthenticated: 401,
    errors.Forbidden: 403,
    errors.NotFound: 404,
    errors.TimedOut: 408,
    errors.Conflict: 409,
    errors.AlreadyExists: 409,
    errors.RevisionConflict: 409,
    errors.OwnerChanged: 409,
    errors.TooLarge: 413,
    errors.Unacceptable: 422,
    errors.TooManyUploads: 429,
    errors.StagingFull: 503,
    errors.RegistryUnavailable: 503,
}


def kinds(cls: type) -> set[type]:
    found = set()
    for sub in cls.__subclasses__():
        found |= {sub} | kinds(sub)
    return found


def test_every_kind_of_registry_error_has_its_documented_status():
    concrete = kinds(errors.RegistryError) - {errors.AdapterRejected, errors.Busy}  # groupings
    assert concrete == set(DOCUMENTED)
    for kind, status in DOCUMENTED.items():
        error = kind("what went wrong")
        assert status_code(error) == status, kind
        openai = registry_error(error)
        assert (openai.status, openai.headers) == (status, error_headers(error)), kind
    assert error_headers(errors.Unauthenticated("x")) == {"WWW-Authenticate": "Bearer"}
    assert error_headers(errors.RegistryUnavailable("x")) == {"Retry-After": "5"}
    assert error_headers(errors.TooManyUploads("x")) == {"Retry-After": "5"}
    assert error_headers(errors.StagingFull("x")) == {"Retry-After": "5"}
    assert registry_error(errors.Unauthenticated("x")).code == "invalid_api_key"
    assert registry_error(errors.Forbidden("x")).code == "permission_denied"


def http_imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] in HTTP_PACKAGES]


@pytest.mark.parametrize("package", ["registry", "replica", "kernels"])
def test_only_the_http_edge_imports_an_http_framework(package: str):
    offenders = {
        str(path.relative_to(ROOT)): found
        for path in sorted((ROOT / package).rglob("*.py"))
        if (found := http_imports(path))
        and not (package == "registry" and path.name in REGISTRY_EDGE)
    }
    assert not offenders, offenders

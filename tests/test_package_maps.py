"""Every package's __init__ names each of its modules (and sub-packages) in a line of its docstring,
so the map a reader opens first is the package as it is."""
from __future__ import annotations

import ast
import re

import pytest

from tests.cluster_utils import REPO

PACKAGES = sorted(p.parent for top in ("cs_runtime", "chief", "worker", "wse", "cs_torch", "scripts")
                  for p in (REPO / top).rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_the_init_names_every_module(package):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    named = set(re.findall(r"\b([A-Za-z_][A-Za-z0-9_]*\.py|[A-Za-z_][A-Za-z0-9_]*/)", doc))
    modules = {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    subpackages = {f"{p.parent.name}/" for p in package.glob("*/__init__.py")}
    missing = sorted((modules | subpackages) - named)
    assert not missing, f"{package.relative_to(REPO)}/__init__.py does not name {missing}"

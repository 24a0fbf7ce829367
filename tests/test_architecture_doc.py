"""docs/ARCHITECTURE.md stays the map of the code: every top-level package and every module of
router/ is named in it, and the layers it states are the ones lint-imports enforces (pyproject's
import-linter contract)."""

from __future__ import annotations

import re
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "ARCHITECTURE.md").read_text()


def test_every_top_level_package_has_a_row():
    packages = sorted(p.name for p in ROOT.iterdir() if (p / "__init__.py").exists() or p.name == "protos")
    assert packages, "no package found"
    missing = [name for name in packages if f"| `{name}/` |" not in DOC]
    assert not missing, f"packages without a row in docs/ARCHITECTURE.md: {missing}"


def test_every_router_module_is_named():
    modules = sorted(p.name for p in (ROOT / "router").glob("*.py") if p.name != "__init__.py")
    missing = [name for name in modules if f"`{name}`" not in DOC]
    assert not missing, f"router modules docs/ARCHITECTURE.md does not name: {missing}"


def test_the_layers_stated_are_the_layers_enforced():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    stated = re.search(r"Layers, top to bottom.*?:\s*(`[^\n]+`)\.", DOC, re.S)
    assert stated, "the layers line is missing from docs/ARCHITECTURE.md"
    layers = [layer.strip(" `") for layer in stated.group(1).split(">")]
    assert layers == contract["layers"]

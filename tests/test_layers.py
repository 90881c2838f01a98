"""The floor plan in pyproject.toml names every top-level module: a new one gets a floor, or lint-imports cannot see
it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="Python 3.11+ reads pyproject.toml itself")

ROOT = Path(__file__).resolve().parent.parent


def test_every_top_level_module_has_a_floor() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    layers = next(c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in re.split(r"[|:]", layer)}
    tree = {f"pdkv.{p.stem}" for p in (ROOT / "pdkv").glob("*.py") if p.stem != "__init__"}
    tree |= {f"pdkv.{p.parent.name}" for p in (ROOT / "pdkv").glob("*/__init__.py")}
    tree |= {"pdkv.channels", "pdkv.launch"}  # installed into pdkv from the top of the repository
    assert tree - placed == set(), (
        f"modules without a floor in pyproject.toml's layers contract: {sorted(tree - placed)}"
    )

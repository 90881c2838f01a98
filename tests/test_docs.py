"""The newcomer's path through the docs: the README's map reaches the transfer README, whose reading path names real
code."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STEP = re.compile(r"^\d+\. `(?P<file>[\w/.]+\.py):(?P<name>[\w.]+)`", re.M)


def defined_names(path: Path) -> set[str]:
    """Every function and class in ``path``, methods as ``Class.method``."""
    names: set[str] = set()

    def walk(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(prefix + child.name)
                if isinstance(child, ast.ClassDef):
                    walk(child, f"{prefix}{child.name}.")

    walk(ast.parse(path.read_text()), "")
    return names


def reading_path() -> list[tuple[str, str]]:
    text = (ROOT / "pdkv/transfer/README.md").read_text()
    section = text.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    return [(m["file"], m["name"]) for m in STEP.finditer(section)]


def test_the_reading_path_walks_every_stage() -> None:
    text = (ROOT / "pdkv/transfer/README.md").read_text()
    for stage in ("keyed", "sent", "landed", "verified", "freed"):
        assert f"**{stage}**" in text
    assert len(reading_path()) >= 25


@pytest.mark.parametrize(("file", "name"), reading_path(), ids=lambda v: v)
def test_each_step_of_the_reading_path_names_a_function_that_exists(file: str, name: str) -> None:
    path = ROOT / file
    assert path.is_file(), f"{file} (named in pdkv/transfer/README.md) does not exist"
    assert name in defined_names(path), f"{file} defines no {name} (named in pdkv/transfer/README.md)"


def test_the_readme_map_links_the_folder_readmes() -> None:
    readme = (ROOT / "README.md").read_text()
    for folder in ("pdkv/transfer/README.md", "channels/README.md"):
        assert f"({folder})" in readme, f"README.md's map does not link {folder}"
        assert (ROOT / folder).is_file()

"""No class under channels/ grows past 250 lines, so that no channel becomes one class doing every job again: nixl
and ucx are facades over rooms of one job each (channels/nixl/, channels/ucx/), tcp is rooms (channels/tcp/), and a
new job gets a room of its own.
"""

from __future__ import annotations

import ast
from pathlib import Path

CHANNELS = Path(__file__).resolve().parent.parent / "channels"
LIMIT = 250  # lines of a class, its decorators left out; a class must stay under it


def class_sizes(root: Path) -> dict[str, int]:
    """Every class under ``root`` (nested ones too) -> its length in lines, keyed ``path/from/root.py:Qual.Name``."""
    sizes: dict[str, int] = {}

    def walk(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                name = f"{prefix}{child.name}"
                sizes[f"{where}:{name}"] = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                walk(child, where, f"{name}.")
            else:
                walk(child, where, prefix)

    for path in sorted(root.rglob("*.py")):
        walk(ast.parse(path.read_text()), path.relative_to(root).as_posix(), "")
    return sizes


def oversized(sizes: dict[str, int]) -> list[str]:
    """The classes at or past ``LIMIT``, with their size."""
    return [f"{name} is {size} lines (limit: under {LIMIT})" for name, size in sorted(sizes.items()) if size >= LIMIT]


def test_every_class_under_channels_stays_under_its_limit() -> None:
    over = oversized(class_sizes(CHANNELS))
    assert not over, "classes too long: split them into rooms of one job each\n" + "\n".join(over)


def test_the_check_names_a_long_class_and_its_size(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(LIMIT))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big.py").write_text(f"class Outer:\n    class Inner:\n{body.replace('    ', '        ')}\n")
    sizes = class_sizes(tmp_path)
    assert sizes == {"sub/big.py:Outer": LIMIT + 2, "sub/big.py:Outer.Inner": LIMIT + 1}
    assert oversized(sizes) == [
        f"sub/big.py:Outer is {LIMIT + 2} lines (limit: under {LIMIT})",
        f"sub/big.py:Outer.Inner is {LIMIT + 1} lines (limit: under {LIMIT})",
    ]

"""No class in the rooms the transfer path runs through grows past 250 lines: the transfer wing (pdkv/transfer: the
mass must not just move behind its capped facades, tests/test_wing_shape.py), the channels (nixl and ucx facades over
rooms of one job each, tcp's connection halves in rooms), and the router (``Proxy`` runs each request through its
rooms). A new job gets a room of its own, not more lines in an old one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LIMIT = 250  # lines of a class, its decorators left out; a class must stay under it
# Each measured tree, with classes that must be found in it (so a wrong path cannot pass by measuring nothing).
TREES = {
    "pdkv/transfer": ("outgoing.py:OutgoingTransfer", "book.py:IncomingBook", "posting.py:ChunkPoster"),
    "channels": ("nixl/channel.py:NixlChannel", "tcp/target.py:Target", "tcp/link.py:Link", "tcp/conn.py:Conn"),
    "pdkv/router": ("proxy.py:Proxy", "failover.py:Failover", "prefill_hop.py:PrefillHop", "decode_hop.py:DecodeHop"),
}


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


@pytest.mark.parametrize("tree", sorted(TREES))
def test_every_class_stays_under_the_limit(tree: str) -> None:
    sizes = class_sizes(ROOT / tree)
    missing = [name for name in TREES[tree] if name not in sizes]
    assert not missing, f"{tree}: {missing} not measured (moved? then name where they went)"
    over = oversized(sizes)
    assert not over, f"{tree}: classes too long: split them into rooms of one job each\n" + "\n".join(over)


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

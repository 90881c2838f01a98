"""csrc/tcpwire.h is what channels/tcp/wire.py generates: the tcp frame format is written in wire.py alone, and the
native loops (csrc/kvframes.cpp, kvland.cpp, kvsend.cpp) read and write frames with the generated constants."""

from __future__ import annotations

import re
from pathlib import Path

from pdkv.channels.tcp.wire import C_HEADER_PATH, c_header

ROOT = Path(__file__).resolve().parents[1]


def test_the_checked_in_header_is_the_generated_one() -> None:
    checked_in = (ROOT / C_HEADER_PATH).read_bytes()
    assert checked_in == c_header().encode(), (
        f"{C_HEADER_PATH} is not what channels/tcp/wire.py generates: run "
        f"`python -m pdkv.channels.tcp.wire > {C_HEADER_PATH}` and rebuild the kernels "
        "(python setup.py build_ext --inplace, or pip install -e .)"
    )


def test_the_native_loops_take_the_format_from_the_header() -> None:
    """No C++ file but the generated header spells the format's numbers (a copy there would escape the check above)."""
    for name in ("kvframes.cpp", "kvland.cpp", "kvsend.cpp"):
        source = (ROOT / "csrc" / name).read_text()
        assert '#include "tcpwire.h"' in source, name
        for copy in ("kHeaderBytes =", "kRunBytes =", "kVersion =", "kMaxRuns =", "kMaxStreams =", "'P'"):
            assert copy not in source, f"csrc/{name} defines its own {copy!r}: take it from tcpwire.h"
        # a field's width is the header's too: read or written as its generated type, never a spelled-out one
        widths = re.findall(r"(?:field|put)<u?int\d+_t>\([^;]*wire::k(?:Header|Run)\w+|wire::kRun\w+, [1248]\)", source)
        assert not widths, f"csrc/{name} spells a field's width: {widths} (use wire::<Field>T, wire::read_run)"

"""Soak: many requests through the router while faults are injected; nothing may hang or leak.

    python benchmarks/soak.py --requests 200 --json

The scenario (the processes, the corrupting proxy, the faults, the counts and
what fails a run) lives in ``tests/soak/``, where ``tests/test_soak.py`` runs
a short one; its package docstring says what is injected and checked. This
command runs a long one and prints the JSON summary; it exits non-zero when
anything hung, leaked or mismatched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the scenario's package, as pytest sees it

from soak.report import problems, summary
from soak.run import soak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds (past it: hung)")
    ap.add_argument("--drop-every", type=int, default=8, help="every Nth request hangs up mid-stream (0: none)")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    counts = soak(args.requests, args.concurrency, args.timeout, args.drop_every)
    print(json.dumps(summary(counts), indent=None if args.json else 2))
    return 1 if problems(counts) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

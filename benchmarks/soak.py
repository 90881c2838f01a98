"""Soak: many requests through the router while faults are injected; nothing may hang or leak.

    python benchmarks/soak.py --requests 200 --json
    python benchmarks/soak.py --hosts 2 --requests 10000 --channel tcp --plot benchmarks/plots/soak_two_hosts.png

The scenario (the processes, the corrupting proxy, the faults, the counts and
what fails a run) lives in ``tests/soak/``, where ``tests/test_soak.py`` and
``tests/test_soak_two_hosts.py`` run short ones; the package docstring says
what is injected and checked. ``--hosts 2`` puts the router and the prefill
worker on one network namespace and the decode workers on another, joined by
a 10 Gbit veth (``soak.hosts``; needs root and iproute2), and adds the link's
faults (``soak.linkfaults``). This command runs a long one and prints the
JSON summary; it exits non-zero when anything hung, leaked or mismatched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the scenario's package, as pytest sees it

from pdkv.bench import plot as bench_plot
from pdkv.bench.netrig import terminate_cleanly, unavailable
from pdkv.errors import ConfigError

from soak.plot import plot
from soak.report import problems, summary
from soak.run import soak


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=60.0, help="per-request timeout in seconds (past it: hung)")
    ap.add_argument("--drop-every", type=int, default=8, help="every Nth request hangs up mid-stream (0: none)")
    ap.add_argument(
        "--hosts",
        type=int,
        choices=(1, 2),
        default=1,
        help="2: prefill and decode on two network namespaces, with link faults",
    )
    ap.add_argument("--channel", choices=("tcp", "nixl"), default="tcp", help="the KV channel (--hosts 2)")
    ap.add_argument(
        "--reverse", action="store_true", help="--hosts 2 with the roles' hosts swapped (decode on the hub)"
    )
    ap.add_argument("--block", type=int, default=100, help="requests per round of faults (each kind once per round)")
    ap.add_argument("--restart-every", type=int, default=1, help="--hosts 2: a decode restart in every Nth round only")
    ap.add_argument("--plot", metavar="FILE.png", help="draw throughput and failures over time, the faults marked")
    ap.add_argument("--out", metavar="FILE.json", help="also write the JSON summary here")
    ap.add_argument("--json", action="store_true", help="print only the JSON summary")
    args = ap.parse_args(argv)
    if args.hosts == 1 and (args.channel != "tcp" or args.reverse):
        raise ConfigError(
            "--channel and --reverse need --hosts 2 (the one-host soak runs tcp through its corrupting proxy)"
        )
    if args.hosts == 2 and (why := unavailable()) is not None:
        raise ConfigError(f"--hosts 2: {why}")
    if args.requests < 1 or args.block < 1 or args.restart_every < 1:
        raise ConfigError("--requests, --block and --restart-every must be at least 1")
    bench_plot.check(args.plot)
    with terminate_cleanly():  # SIGTERM unwinds like Ctrl-C: every process stopped, the namespaces deleted
        counts = soak(
            args.requests,
            args.concurrency,
            args.timeout,
            args.drop_every,
            hosts=args.hosts,
            channel=args.channel,
            reverse=args.reverse,
            block=args.block,
            restart_every=args.restart_every,
        )
    report = {"command": " ".join(sys.argv), **summary(counts)}
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        where = "one host" if args.hosts == 1 else f"two hosts{' (reversed)' if args.reverse else ''}, {args.channel}"
        plot(counts, args.plot, f"soak, {where}: {args.requests} requests, {sum(counts.injected.values())} faults")
    print(json.dumps(report, indent=None if args.json else 2))
    return 1 if problems(counts) else 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())

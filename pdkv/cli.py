"""The ``pdkv`` command: every role and every measurement behind one entry point.

Subcommands import their implementation lazily so ``pdkv --help`` is instant
and a missing optional extra only affects the subcommand that needs it.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from pdkv.errors import PdkvError


def _parts(text: str) -> tuple[int, ...]:
    """Parse ``2,3`` into the parts of ``pdkv bench ttft`` to run."""
    try:
        parts = tuple(sorted({int(p) for p in text.split(",")}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"parts {text!r}: expected a comma-separated list of 1, 2 and 3") from None
    if not parts or not set(parts) <= {1, 2, 3}:
        raise argparse.ArgumentTypeError(f"parts {text!r}: expected a comma-separated list of 1, 2 and 3")
    return parts


def _counts(text: str) -> tuple[int, ...]:
    """Parse ``1,2,4`` (``--streams``, ``--tokens``) into positive counts, in the order given."""
    try:
        counts = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers") from None
    if not counts or min(counts) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated positive integers")
    return counts


def _sizes(text: str) -> list[int]:
    """Parse ``4K,256K,4M,32M`` into bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = []
    for part in text.split(","):
        part = part.strip().upper().removesuffix("B")
        num, unit = (part[:-1], part[-1]) if part and part[-1] in units else (part, "")
        try:
            value = int(num) * units[unit]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"size {part!r}: expected a number with an optional K, M or G suffix"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"size {part!r} must be positive")
        out.append(value)
    return out


def _scenarios(text: str) -> list[tuple[int, int]]:
    """Parse ``40x1,2048x4`` (tokens x concurrent requests)."""
    out = []
    for part in text.split(","):
        tokens, _, requests = part.strip().lower().partition("x")
        try:
            pair = (int(tokens), int(requests or 1))
        except ValueError:
            raise argparse.ArgumentTypeError(f"scenario {part!r}: expected TOKENSxREQUESTS, e.g. 2048x4") from None
        if min(pair) <= 0:
            raise argparse.ArgumentTypeError(f"scenario {part!r}: tokens and requests must be positive")
        out.append(pair)
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdkv", description="Prefill/decode disaggregated KV transfer.")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser("demo", help="move a KV cache between two local processes and verify it")
    demo.add_argument("--channel", default="tcp", help="transfer channel (tcp, nixl, mock)")
    demo.add_argument("--model", default="default", help="model: 'default' or a path")
    demo.add_argument("--prompt", default=None, help="prompt text")
    demo.add_argument("--max-tokens", type=int, default=32)
    demo.set_defaults(target="pdkv.demo:run")

    launch = sub.add_parser("launch", help="run one role: prefill, decode or router")
    launch.add_argument("--role", required=True, choices=["prefill", "decode", "router"])
    launch.add_argument("--config", default=None, help="YAML config file")
    launch.add_argument(
        "--host",
        default=None,
        help="where every plane of the role listens (HTTP, KV control, KV data); default 127.0.0.1",
    )
    launch.add_argument(
        "--advertise-host",
        default=None,
        help="the address peers and the router dial, when --host is 0.0.0.0 or behind a NAT",
    )
    launch.add_argument("--port", type=int, default=None)
    launch.add_argument("--model", default=None)
    launch.add_argument("--channel", default=None)
    launch.add_argument("--engine", default=None, choices=["reference", "vllm"])
    launch.add_argument("--prefill", action="append", default=None, help="router: prefill worker URL (repeatable)")
    launch.add_argument("--decode", action="append", default=None, help="router: decode worker URL (repeatable)")
    launch.add_argument("--policy", default=None, choices=["round-robin", "least-loaded", "prefix"])
    launch.add_argument(
        "--mode", default=None, choices=["pdkv", "vllm"], help="router: how P and D are paired (vllm: vLLM servers)"
    )
    launch.add_argument(
        "--insecure",
        action="store_true",
        help="serve beyond loopback with no secret (workers) or admin token (router): a trusted network only",
    )
    launch.add_argument(
        "--print-config",
        action="store_true",
        help="print the validated config and the cache tier levels it builds (secrets redacted) as JSON, and exit",
    )
    launch.add_argument(
        "--ready-timeout",
        type=float,
        default=600.0,
        help="engine vllm: seconds to wait for vLLM to come up (default 600)",
    )
    launch.add_argument(
        "engine_args",
        nargs="*",
        metavar="-- VLLM_ARGS",
        help="engine vllm: flags after -- go to the vLLM server unchanged",
    )
    launch.set_defaults(target="pdkv.launch.main:run")

    bench = sub.add_parser("bench", help="measure against same-run baselines (JSON out)")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    ch = bsub.add_parser("channel", help="channel GB/s against raw sockets / raw NIXL / memcpy")
    ch.add_argument("--channel", default="tcp", help="mock, tcp, nixl or ucx")
    ch.add_argument("--sizes", type=_sizes, default=_sizes("4K,256K,4M,32M"))
    ch.add_argument("--repeats", type=int, default=0, help="repeats per size (0: chosen per size)")
    ch.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="run across two hosts (network namespaces, root) joined by a veth shaped to RATE: unshaped, 100mbit, "
        "1gbit, 10gbit, ...",
    )
    ch.add_argument(
        "--tls",
        action="store_true",
        help="tcp: also the channel with mutual TLS, in the same rounds (TLS/clear ratio per row)",
    )
    ch.add_argument(
        "--streams",
        type=_counts,
        default=(),
        help="tcp: also the channel with every transfer split over exactly N streams, per N given (e.g. 1,2,4), "
        "in the same rounds",
    )
    ch.add_argument("--json", action="store_true", help="print one JSON object")
    ch.set_defaults(target="pdkv.bench.channel:run")
    tr = bsub.add_parser(
        "transfer", help="a request's KV, sender -> receiver, against the raw channel moving the same bytes"
    )
    tr.add_argument("--channel", default="tcp", help="mock, tcp, nixl or ucx")
    tr.add_argument("--modes", default="direct,staging", help="direct and/or staging, comma-separated (default both)")
    tr.add_argument(
        "--scenarios",
        type=_scenarios,
        default=None,
        help="TOKENSxREQUESTS,... (default 40x1,256x1,2048x1,256x16,2048x4)",
    )
    tr.add_argument(
        "--repeats", type=int, default=3, help="repetitions of each scenario per round, 5 rounds (default 3)"
    )
    tr.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="run across two hosts (network namespaces, root) joined by a veth shaped to RATE: unshaped, 100mbit, "
        "1gbit, 10gbit, ...",
    )
    tr.add_argument(
        "--device",
        default="cpu",
        help="where the KV lives: cpu, emulated (device memory with no host view, on CPU) or cuda; several "
        "comma-separated are measured in one run",
    )
    tr.add_argument(
        "--tls",
        action="store_true",
        help="tcp: also the transfer over the channel with mutual TLS, in the same rounds (TLS/clear ratio per row)",
    )
    tr.add_argument(
        "--secret",
        action="store_true",
        help="also a pair sharing a secret (proven handshakes, tagged messages and notices), in the same rounds",
    )
    tr.add_argument("--json", action="store_true", help="print one JSON object")
    tr.set_defaults(target="pdkv.bench.transfer:run")
    fr = bsub.add_parser(
        "frames", help="the tcp target's CPU per DATA frame (native and Python loops) against a plain receiver"
    )
    fr.add_argument("--sizes", type=_sizes, default=_sizes("4K,64K,256K"), help="frame sizes (a run per 4 KiB, <= 64)")
    fr.add_argument("--frames", type=int, default=20000, help="frames per round (larger sizes: at most 256 MiB)")
    fr.add_argument("--rounds", type=int, default=3, help="rounds, each loop once per round (default 3)")
    fr.add_argument("--json", action="store_true")
    fr.set_defaults(target="pdkv.bench.frames:run")
    cs = bsub.add_parser(
        "checksum", help="the chunk checksum's cost against copy_ of the same bytes, on the bytes' device"
    )
    cs.add_argument("--device", default="cpu", help="cpu or cuda")
    cs.add_argument("--repeats", type=int, default=15, help="timed repeats of each row (default 15)")
    cs.add_argument("--threads", type=int, default=1, help="torch threads (default 1: steady on a shared machine)")
    cs.add_argument("--json", action="store_true")
    cs.set_defaults(target="pdkv.bench.checksum:run")
    ga = bsub.add_parser("gather", help="paged gather/scatter GB/s against memcpy")
    ga.add_argument("--tokens", type=int, default=256, help="tokens per chunk (Llama-3-8B shaped: 128 KiB each)")
    ga.add_argument("--repeats", type=int, default=0, help="timed repeats per row (0: 15 native, 5 torch)")
    ga.add_argument("--json", action="store_true")
    ga.set_defaults(target="pdkv.bench.gather:run")
    tt = bsub.add_parser("ttft", help="time to first token, cold and from each cache tier")
    tt.add_argument(
        "--parts",
        type=_parts,
        default=(1, 2, 3),
        help="which parts: 1 one prompt from each level, 2 trace hit rates against the optimum, 3 replay through "
        "workers (default 1,2,3)",
    )
    tt.add_argument("--model", default="default", help="'default' or a model directory")
    tt.add_argument("--prompt-tokens", type=int, default=2048, help="part 1: prompt length")
    tt.add_argument("--repeats", type=int, default=3, help="part 1: rounds (every case once per round)")
    tt.add_argument("--trace-requests", type=int, default=0, help="parts 2-3: the trace's first N requests (0: all)")
    tt.add_argument(
        "--replay-conversations",
        type=int,
        default=16,
        help="part 3: conversations replayed through real workers (default 16)",
    )
    tt.add_argument("--json", action="store_true")
    tt.set_defaults(target="pdkv.bench.ttft:run")
    ti = bsub.add_parser("tier", help="GB/s of each cache level's batched put and get, against memcpy")
    ti.add_argument("--levels", default="memory,disk,redis,s3", help="which levels (default memory,disk,redis,s3)")
    ti.add_argument("--chunks", type=int, default=16, help="chunks of 256 tokens of the default model (11.8 MB each)")
    ti.add_argument("--repeats", type=int, default=3, help="rounds, each level fresh (default 3)")
    ti.add_argument("--json", action="store_true")
    ti.set_defaults(target="pdkv.bench.tier:run")
    pd = bsub.add_parser(
        "pd", help="TTFT of a long prompt, prefill and decode on two hosts (--link), against one worker doing it all"
    )
    pd.add_argument(
        "--link",
        default=None,
        metavar="RATE",
        help="decode on a second host (network namespace, root) across a veth shaped to RATE: unshaped, 100mbit, "
        "1gbit, 10gbit, ...",
    )
    pd.add_argument("--model", default="default", help="model: 'default' or a path")
    pd.add_argument(
        "--tokens",
        type=_counts,
        default=(2048,),
        help="prompt tokens (default 2048); several (e.g. 16,64,256): the PD overhead per prompt length, with where "
        "the time goes",
    )
    pd.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="measured requests per side, after warm-up (default 3; 30 with several --tokens)",
    )
    pd.add_argument(
        "--disaggregate",
        default="always",
        help="router.disaggregate modes to measure, comma-separated: always, never, auto",
    )
    pd.add_argument(
        "--codec",
        default="none",
        help="the workers' transfer.codec (and the router's disaggregate_codec): none, fp8, zstd, ...",
    )
    pd.add_argument("--json", action="store_true")
    pd.set_defaults(target="pdkv.bench.pd:run")
    co = bsub.add_parser(
        "codec", help="KV codecs: bytes ratio, encode/decode GB/s against memcpy, fidelity on the default model"
    )
    co.add_argument("--model", default="default", help="default, a Hugging Face directory or a .gguf file")
    co.add_argument("--dtypes", default="float32,bfloat16", help="KV dtypes to measure (comma-separated)")
    co.add_argument(
        "--codecs", default="", help="codecs to measure (comma-separated; default all; none is always the reference)"
    )
    co.add_argument(
        "--decode-tokens", type=int, default=32, help="tokens decoded from each prompt's KV for the fidelity measure"
    )
    co.add_argument("--repeats", type=int, default=5, help="timed repeats of encode, decode and memcpy")
    co.add_argument("--prompts", type=int, default=0, help="use only the first N of the fixed prompts (0: all six)")
    co.add_argument("--json", action="store_true")
    co.set_defaults(target="pdkv.bench.codec:run")
    ro = bsub.add_parser(
        "router", help="the router's added latency and requests/s against doing its hops directly (trivial backend)"
    )
    ro.add_argument("--requests", type=int, default=500, help="requests per side and measurement")
    ro.add_argument("--concurrency", type=int, default=32, help="requests in flight for the requests/s measurement")
    ro.add_argument("--json", action="store_true")
    ro.set_defaults(target="pdkv.bench.router:run")
    kr = bsub.add_parser(
        "kv-routing",
        help="KV-aware routing on the Mooncake trace through real workers, and the prefix index's lookup cost",
    )
    kr.add_argument(
        "--trace",
        default=None,
        help="the Mooncake conversation trace (default: $PDKV_MOONCAKE_TRACE, else the copy shipped with pdkv)",
    )
    kr.add_argument("--prefill-workers", type=int, default=2, help="prefill workers (0: the lookup cost only)")
    kr.add_argument("--conversations", type=int, default=12, help="whole conversations replayed from the trace")
    kr.add_argument(
        "--block-tokens", type=int, default=32, help="tokens per 512-token trace block (and the workers' chunk size)"
    )
    kr.add_argument("--max-blocks", type=int, default=40, help="prompts capped at this many trace blocks")
    kr.add_argument("--memory-mib", type=int, default=256, help="each prefill worker's memory tier")
    kr.add_argument(
        "--routers", type=int, default=1, help="router replicas per policy; requests alternate between them"
    )
    kr.add_argument("--concurrency", type=int, default=1, help="requests in flight (in trace order)")
    kr.add_argument("--model", default="default")
    kr.add_argument("--blocks", type=int, default=100_000, help="blocks in the index for the lookup cost")
    kr.add_argument("--json", action="store_true")
    kr.set_defaults(target="pdkv.bench.kv_routing:run")
    for each in bsub.choices.values():
        each.add_argument(
            "--plot", metavar="FILE.png", default=None, help="also draw the result into this file (needs pdkv[plot])"
        )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    module_name, func_name = args.target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("pdkv"):
            print(f"pdkv: '{args.command}' is not available in this build ({exc.name} missing)", file=sys.stderr)
            return 2
        raise
    try:
        return int(getattr(module, func_name)(args) or 0)
    except PdkvError as exc:
        print(f"pdkv: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

"""Every `pdkv bench` subcommand, at tiny sizes, as a user runs it: its JSON has the shape the project promises.

The shape (README, "The command-line contract"): one JSON object naming its
``baseline``, with ``results`` rows that each carry their own ``ratio``
against that baseline measured in the same run, plus the absolute numbers.
Each bench also draws its result with ``--plot``. Speed is not asserted here:
the numbers come from tiny sizes on a shared machine. A new subcommand is one
line in ``BENCHES``.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pdkv.cli import build_parser

TINY_MODEL = "{model_dir}"  # replaced by a random tiny model's directory
BENCHES: dict[str, list[str]] = {
    "channel": ["--channel", "tcp", "--sizes", "4K,64K", "--repeats", "2", "--tls", "--streams", "1,2"],
    "gather": ["--tokens", "16", "--repeats", "2"],
    "ttft": [
        "--model",
        TINY_MODEL,
        "--prompt-tokens",
        "300",
        "--repeats",
        "1",
        "--trace-requests",
        "300",
        "--replay-conversations",
        "1",
    ],
    "router": ["--requests", "20", "--concurrency", "4"],
    "tier": ["--chunks", "2", "--repeats", "1"],
    "transfer": ["--channel", "tcp", "--scenarios", "40x2", "--repeats", "1", "--device", "cpu,emulated", "--tls"],
    "checksum": ["--repeats", "2"],
    "frames": ["--sizes", "4K,64K", "--frames", "200", "--rounds", "1"],
    "pd": ["--model", TINY_MODEL, "--tokens", "64", "--repeats", "1", "--disaggregate", "always,never,auto"],
    "codec": [
        "--model",
        TINY_MODEL,
        "--dtypes",
        "float32",
        "--codecs",
        "fp8,zstd",
        "--decode-tokens",
        "4",
        "--repeats",
        "1",
        "--prompts",
        "1",
    ],
    "kv-routing": [
        "--model",
        TINY_MODEL,
        "--blocks",
        "2000",
        "--prefill-workers",
        "2",
        "--conversations",
        "1",
        "--max-blocks",
        "4",
        "--block-tokens",
        "8",
    ],
}
PNG = b"\x89PNG\r\n\x1a\n"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(
        a for a in parser._actions if isinstance(a, argparse._SubParsersAction)
    ).choices  # argparse lists them nowhere public


def test_every_bench_subcommand_is_smoke_tested() -> None:
    assert set(_subcommands(_subcommands(build_parser())["bench"])) == set(BENCHES), (
        "add the new `pdkv bench` subcommand to BENCHES"
    )


def _finite(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.mark.timeout(900)  # a bench runs for minutes on a busy 2-core machine
@pytest.mark.parametrize("name", sorted(BENCHES))
def test_bench_prints_its_ratio_against_a_same_run_baseline_and_draws_it(
    name: str, model_dir: Path, tmp_path: Path
) -> None:
    picture = tmp_path / f"{name}.png"
    args = [a.replace(TINY_MODEL, str(model_dir)) for a in BENCHES[name]]
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", name, *args, "--json", "--plot", str(picture)],
        capture_output=True,
        text=True,
        timeout=840,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert isinstance(report.get("baseline"), str) and report["baseline"], report
    rows = report["results"]
    assert rows and all(isinstance(r, dict) for r in rows), report
    for row in rows:
        assert _finite(row.get("ratio")) and row["ratio"] > 0, row
        assert any(_finite(v) and v > 0 for k, v in row.items() if k != "ratio"), (
            f"no absolute number beside the ratio: {row}"
        )
        if (
            "--tls" in args and row.get("device", "cpu") == "cpu"
        ):  # the TLS numbers beside the clear host row, same rounds
            assert _finite(row.get("tls_ratio")) and row["tls_ratio"] > 0 and _finite(row.get("tls_gbps")), row
    if name in ("channel", "transfer"):
        for row in rows:
            _assert_cpu_beside_the_fastest_baseline(row)
        if name == "transfer":  # the host time per chunk and per request, both sides (pdkv.transfer.hosttime)
            for row in rows:
                _assert_host_times(row)
                _assert_moved_bytes(row)
        if "--streams" in args:
            assert all(set(r["streams"]) == {"1", "2"} and _finite(r["streams"]["2"]["gbps"]) for r in rows), rows
    assert picture.read_bytes()[:8] == PNG
    if name == "ttft":  # tenant B's run of A's stored prompt loads nothing; A's own again loads all it can
        by_case = {r["case"]: r for r in rows}
        assert by_case["other tenant"]["loaded_tokens"] == 0 == report["tenants"]["other_tenant_loaded_tokens"]
        assert by_case["same tenant"]["loaded_tokens"] == by_case["memory"]["loaded_tokens"] > 0
        assert by_case["s3"]["loaded_tokens"] == by_case["redis"]["loaded_tokens"] == by_case["memory"]["loaded_tokens"]
    if name == "tier":
        assert [r["level"] for r in rows] == ["memory", "disk", "redis", "s3"]


def _assert_host_times(row: dict[str, object]) -> None:
    """Each side recorded a span for every chunk and request it handled, and the CPU per chunk beside them."""
    for kind in ("chunk", "request"):
        host = row[f"host_us_per_{kind}"]
        assert isinstance(host, dict), row
        for side in ("prefill", "decode"):
            assert host[side]["n"] > 0 and _finite(host[side]["p50"]) and host[side]["mean"] > 0, (kind, side, row)
    cpu = row["cpu_us_per_chunk"]
    assert isinstance(cpu, dict) and all(_finite(cpu[s]) and cpu[s] > 0 for s in ("sender", "receiver")), row


def _assert_moved_bytes(row: dict[str, Any]) -> None:
    """A row's GB/s and its baseline's are of the bytes pdkv moved: a direct request's whole blocks (40 tokens end
    mid-block: 3 blocks of 16 go), a staged request's tokens."""
    from pdkv.bench.transfer import SENDER_LAYOUT as L

    blocks = row["requests"] * L.blocks_for(row["tokens"]) * L.num_tensors * L.block_bytes
    assert row["moved_bytes"] == (blocks if row["mode"] == "direct" else row["size_bytes"]), row
    assert row["mode"] != "direct" or row["moved_bytes"] > row["size_bytes"], row  # 40 tokens: not a whole block
    # a one-chunk request goes into a pool where the receiver has room for one, as a decode worker has: one of the
    # two at once a repetition, its blocks written in place (direct mode from host memory) or its slot (staged
    # chunks, KV on a device)
    assert 0 < row["pooled_share"] < 1, row


def _assert_cpu_beside_the_fastest_baseline(row: dict[str, object]) -> None:
    """Both sides' CPU per GB, ours and the baseline's; the ratio is against the faster baseline variant."""
    for key in ("cpu_s_per_gb", "baseline_cpu_s_per_gb"):
        cpu = row[key]
        assert isinstance(cpu, dict) and all(_finite(cpu[s]) and cpu[s] > 0 for s in ("sender", "receiver")), row
    variants = row["baselines"]
    assert isinstance(variants, dict) and row["baseline_used"] in variants, row
    assert row["baseline_gbps"] == max(v["gbps"] for v in variants.values()), row


def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    """The extra's error comes before any measuring, and says what to install."""
    code = "import sys; sys.modules['matplotlib'] = None; from pdkv.cli import main; sys.exit(main(sys.argv[1:]))"
    out = subprocess.run(
        [sys.executable, "-c", code, "bench", "router", "--requests", "1", "--plot", str(tmp_path / "g.png")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "pip install 'pdkv[plot]'" in out.stderr
    assert not (tmp_path / "g.png").exists()


@pytest.mark.timeout(300)
def test_bench_pd_with_short_prompts_breaks_the_overhead_down_and_moves_every_prompts_kv(model_dir: Path) -> None:
    """Several ``--tokens``: a row per prompt length whose parts add up to the P/D TTFT, every request's KV moved, the
    second token reported beside the first."""
    out = subprocess.run(
        [sys.executable, "-m", "pdkv.cli", "bench", "pd", "--model", str(model_dir), "--tokens", "16,64"]
        + ["--repeats", "2", "--json"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = json.loads(out.stdout)["results"]
    assert [r["tokens"] for r in rows] == [16, 64]
    for row in rows:
        assert row["fallbacks"] == 0 and row["requests"] == 2
        assert row["transferred_tokens"] == 2 * row["tokens"]
        parts = row["breakdown_ms"]  # P sent every first token (router.stream_first_token): D's parts are beside
        assert row["first_token_handoffs"] == 2
        assert set(parts) == {"prefill_ms", "router_to_prefill_ms", "router_rest_ms", "client_ms"}
        assert set(row["decode_ms"]) == {"transfer_wait_ms", "decode_first_step_ms"}
        assert parts["prefill_ms"] > 0 and row["decode_ms"]["transfer_wait_ms"] >= 0, parts
        assert sum(parts.values()) == pytest.approx(row["pd_mean_ms"]), row
        assert _finite(row["overhead_ms"]["median"]) and _finite(row["overhead_ms"]["p99"]), row
        assert _finite(row["second_token_overhead_ms"]["median"]), row
        # each request's split: the path's time beyond its worker's own compute, which is inside that time
        for split, ttft in (
            ("pd_outside_prefill_ms", "pd_ttft_ms"),
            ("baseline_outside_worker_ms", "baseline_ttft_ms"),
        ):
            assert 0 < row[split]["median"] < row[ttft] and row[split]["median"] <= row[split]["p99"], row
        assert (
            row["pd_second_token_ms"] > row["pd_ttft_ms"] and row["baseline_second_token_ms"] > row["baseline_ttft_ms"]
        )
        cpu = row["cpu_ms_per_request"]  # every process of both paths did work for each request
        assert all(cpu[name] > 0 for name in ("router", "prefill", "decode", "single")), cpu
        assert cpu["pd_total"] == pytest.approx(cpu["router"] + cpu["prefill"] + cpu["decode"]), cpu


def test_nixl_direct_is_held_to_the_raw_post_plus_one_verification_pass() -> None:
    """``blocks_plus_verify``: the faster raw blocks post (1 s here: the program without NIXL's progress thread; with
    it, 2 s) and the pass D cannot skip (0.5 s) against our 2 s; the contiguous WRITE (faster still) is not a way
    vLLM posts a request's blocks, so it does not count."""
    from pdkv.bench.transfer import Scenario, _plus_verify

    sc = Scenario(tokens=1, requests=1, mode="direct")
    raw_gbps = sc.moved / 1e9  # the raw post moves the scenario's bytes (its whole blocks) in 1 s
    baselines = {
        "raw": {"gbps": 4 * raw_gbps},
        "blocks": {"gbps": raw_gbps / 2},
        "blocks, no progress thread": {"gbps": raw_gbps},
    }
    got = _plus_verify(sc, {"baselines": baselines}, [0.4, 0.5, 0.6], gbps=raw_gbps / 2)
    assert got == pytest.approx({"blocks_plus_verify": 0.75, "verify_ms": 500.0})
    assert _plus_verify(sc, {"baselines": {}}, [], gbps=1.0) == {}  # no blocks baseline (tcp): nothing claimed


def test_a_direct_scenarios_baseline_moves_its_whole_blocks_and_a_staged_ones_its_tokens() -> None:
    """A baseline moves the bytes pdkv moves: direct mode sends a request's whole blocks (40 tokens: 3 blocks of 16,
    2.21 MB where the tokens are 1.84 MB), so the raw program is asked for those; staging sends the tokens."""
    from pdkv.bench.transfer import SENDER_LAYOUT, Scenario, variants_for

    class Asked:
        """A baseline that records the size it was asked to move."""

        def __init__(self) -> None:
            self.sizes: list[int] = []

        def variants(self, size: int) -> dict[str, dict[str, int]]:
            self.sizes.append(size)
            return {"raw": {}}

    asked = Asked()
    variants_for(asked, Scenario("direct", 40, 2))
    variants_for(asked, Scenario("staging", 40, 2))
    block = SENDER_LAYOUT.num_tensors * SENDER_LAYOUT.block_bytes
    assert asked.sizes == [2 * 3 * block, 2 * SENDER_LAYOUT.chunk_bytes(40)]


@pytest.mark.timeout(300)
def test_request_cost_pairs_each_round_of_requests_with_a_raw_run_of_the_same_blocks() -> None:
    """``benchmarks/request_cost.py``: its requests and the raw transfers take turns, and ``over_raw_ms`` is the
    median of the rounds' differences; the raw program moves the request's whole blocks, as direct mode does; with
    ``--threads`` each thread's CPU at rest over a span as long is beside its CPU over the request's."""
    from pdkv.bench.transfer import SENDER_LAYOUT as L

    script = Path(__file__).resolve().parents[1] / "benchmarks/request_cost.py"
    out = subprocess.run(
        [sys.executable, str(script), "--channel", "tcp", "--tokens", "40", "--repeats", "3", "--threads"],
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = json.loads(out.stdout.splitlines()[-1])["40"]
    # each thread's CPU over the request's span and over one as long at rest: D's serving threads work for the request
    receiver = row["threads"]["receiver"]
    assert all("at_rest_us" in r for side in row["threads"].values() for r in side), row["threads"]
    assert sum(r["at_rest_us"] for r in receiver) < sum(r["on_cpu_us"] for r in receiver), receiver
    assert row["rounds"] == 3 and len(row["over_raw_ms_by_round"]) == 3, row
    assert row["over_raw_ms"] == pytest.approx(sorted(row["over_raw_ms_by_round"])[1], abs=1e-3), row
    assert row["raw_bytes"] == 3 * L.num_tensors * L.block_bytes > row["bytes"] == L.chunk_bytes(40), row
    assert row["p50_ms"] > 0 and row["raw_ms"] > 0 and row["sender_cpu_ms"] > 0, row


def test_at_rest_reports_each_side_against_a_bare_channel_and_a_prefill_watcher_asleep() -> None:
    """``benchmarks/at_rest.py``: per channel, a prefill worker's, a decode worker's and a bare channel's CPU at rest;
    over nixl (when installed) the prefill worker's watcher makes no pass: its regions are sealed, nothing can come."""
    import importlib.util

    channels = "tcp,nixl" if importlib.util.find_spec("nixl") is not None else "tcp"
    script = Path(__file__).resolve().parents[1] / "benchmarks/at_rest.py"
    out = subprocess.run(
        [sys.executable, str(script), "--channels", channels, "--seconds", "0.3", "--settle", "0.3"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    for kind in channels.split(","):
        rows = got[kind]
        assert set(rows) == {"bare", "prefill", "decode"}, rows
        for side in ("prefill", "decode"):
            over = rows[side]["cpu_pct"] - rows["bare"]["cpu_pct"]
            assert rows[side]["over_bare_pct"] == pytest.approx(over, abs=0.02), rows
    if "nixl" in got:
        assert got["nixl"]["prefill"]["watch_polls_per_s"] == 0, got["nixl"]
    assert got["tcp"]["prefill"]["watch_polls_per_s"] is None  # the tcp channel has no watcher to poll


def test_the_rigs_receiver_claims_later_when_told_and_times_that_claim() -> None:
    """``expect`` with ``later`` (``benchmarks/request_cost.py --claim-later``): the receiver claims the KV only after
    the sender's go-ahead, as a decode request that comes after the router's hop, and times that claim; without it,
    it claims as the KV lands and times nothing. Either way the KV it holds is the KV sent."""
    from pdkv.bench.channel import _recv
    from pdkv.bench.transfer import TransferRig, _digest
    from pdkv.config import TransferConfig
    from pdkv.layout import KVLayout

    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
    with TransferRig("tcp", layout, 16, 32, TransferConfig(chunk_size=64), sender_layout=layout) as rig:
        for later in (True, False):
            rid, table = f"claimed-later-{later}", rig.allocator.allocate(2)
            rig.conn.send(("expect", [(rid, 30)], later))
            xfer = rig.sender.open(rid, rig.address, 30, table)
            xfer.send_all()
            xfer.wait(10)
            rig.conn.send(("check",))
            _, digests, _, claim_ns = _recv(rig.conn, "the receiver's digests")
            assert digests == [_digest(layout, rig.kv, table, 30)]
            assert (len(claim_ns) == 1 and claim_ns[0] > 0) if later else claim_ns == []
            rig.allocator.free(table)

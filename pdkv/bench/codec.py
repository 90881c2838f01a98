"""``pdkv bench codec``: what each KV codec saves, costs and changes, on the default model's real KV.

For each KV dtype (float32, bfloat16) the default model (SmolLM2-135M) prefills
a fixed set of prompts; their KV, cut into the wire's 256-token canonical
chunks, is what every codec encodes. Per codec, one row:

- ``bytes_ratio``: raw bytes over encoded bytes (frames, headers included).
- ``encode_gbps`` / ``decode_gbps``: raw KV bytes per second of one core
  through ``encode`` / ``decode`` of every chunk, against the baseline
  measured in the same run with repeats alternating: one memcpy of the same
  number of bytes, cold cache before each repeat. Both are timed in CPU time
  of the calling thread with torch on one thread (the codec kernels then use
  no helpers, zstd never does): on a shared machine wall-clock time measures
  the scheduler, not the code. A worker's codec runs on the sender's and the
  receiver's threads; the native kernels split a chunk over
  ``torch.get_num_threads()`` threads, zstd compresses one plane per thread.
  ``ratio`` is the slower of encode and decode over memcpy.
- fidelity: the decoded KV is scattered into fresh blocks and the model
  decodes ``--decode-tokens`` tokens from it, as a decode worker would after a
  transfer (the first token is the prefill side's, computed from exact KV).
  The reference is the same path with ``none`` (bit-exact, so its row must
  show agreement 1 and KL 0: a check of the harness). Decoding is
  teacher-forced on the reference's greedy tokens, so every step compares
  next-token distributions in the same context: ``token_agreement`` is the
  share of steps whose greedy token matches, ``first_divergence`` per prompt
  the first step that differs (a free-running greedy decode is identical up
  to there), ``mean_kl``/``max_kl`` are KL(reference || codec) in nats.

``links`` turns the rows into the choice a deployment makes: for a
100 Mbit, 1 Gbit and 10 Gbit link, the rate at which raw KV gets across
through each codec (encode, wire and decode overlap across chunks, so the
slowest of ``encode_gbps``, ``decode_gbps`` and ``link * bytes_ratio``), as
prompt tokens per second (``kv_tokens_per_s``: moving the KV beats a
recompute slower than that) and as the time for a 2048-token prompt, next to
recomputing it at the prefill rate measured here (the reference engine on
this CPU: a GPU prefills orders of magnitude faster, so compare its own rate
with ``kv_tokens_per_s``).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from pdkv.bench import plot
from pdkv.bench.gather import FLUSH_BYTES
from pdkv.codec import CODECS, Codec, codec_class, make_codec
from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams
from pdkv.errors import ConfigError
from pdkv.keys import DEFAULT_CHUNK_SIZE, chunk_spans
from pdkv.layout import gather, scatter
from pdkv.testing.model import single_thread

DTYPES = ("float32", "bfloat16")
LINKS_GBIT = (0.1, 1.0, 10.0)
GUIDE_TOKENS = 2048
DECODE_TOKENS = 32
REPEATS = 5

# Fixed prompts (chat-formatted for the instruct model): prose, code, a list,
# arithmetic, a story and one long passage that spans three wire chunks.
PROMPTS: tuple[str, ...] = (
    "Explain, step by step, why a key-value cache makes autoregressive decoding in a transformer faster, and what it "
    "costs in memory.",
    "What does this function do, and what is its time complexity?\n\n```python\ndef merge(a, b):\n    out, i, j = [], "
    "0, 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n            out.append(a[i]); i += 1\n        "
    "else:\n"
    "            out.append(b[j]); j += 1\n    out.extend(a[i:]); out.extend(b[j:])\n    return out\n```",
    "Here are some capitals: France - Paris, Germany - Berlin, Italy - Rome, Spain - Madrid, Portugal - Lisbon, "
    "Austria - Vienna, "
    "Poland - Warsaw, Greece - Athens, Sweden - Stockholm, Norway - Oslo. List five more European countries with their "
    "capitals, in the same format.",
    "A train leaves at 9:40 and travels 210 km at an average of 84 km/h. It then waits 25 minutes and travels another "
    "96 km at 64 km/h. "
    "At what time does it arrive? Show your working.",
    "Continue this story for one paragraph: The lighthouse keeper had not seen a ship in eleven days when the radio, "
    "silent since the storm, "
    "crackled and a voice asked for the one name she had hoped never to hear again.",
    "Summarize the following notes in three bullet points.\n\n"
    + " ".join(
        (
            "Serving a language model has two phases with opposite needs. Prefill reads the whole prompt at once and "
            "is limited by arithmetic: "
            "thousands of tokens go through every layer in one batch. Decode produces one token per step for each "
            "sequence and is limited by memory "
            "bandwidth: every step reads the weights and the whole key-value cache of each sequence to compute a "
            "single new token. "
            "Run on the same machine, the two interfere: a long prefill stalls the decode steps of every other "
            "request, which users see as "
            "stutter in the stream, and decode batches keep prefill from using the arithmetic units fully. "
            "Disaggregated serving runs them on different workers. A prefill worker computes the prompt's key-value "
            "cache, sends it over the "
            "network to a decode worker, and the decode worker continues the generation as if it had computed the "
            "prompt itself. "
            "The cost is the transfer: for a small model the cache of a long prompt is tens of megabytes, for a large "
            "one hundreds, and it has "
            "to arrive before the first decode step can run. With a fast interconnect this takes milliseconds. Over an "
            "ordinary data center "
            "network of ten or one gigabit per second it can take longer than computing the prompt again. "
        )
        for _ in range(3)
    ),
)


Report = dict[str, Any]


@dataclass
class Prompt:
    ids: list[int]
    first_token: int = -1
    seconds: float = 0.0  # CPU time of its prefill
    chunks: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (start token, canonical chunk)


def run(args: argparse.Namespace) -> int:
    plot.check(args.plot)
    prompts = PROMPTS[: args.prompts] if args.prompts > 0 else PROMPTS
    report = measure(
        model=args.model,
        dtypes=_split(args.dtypes),
        codecs=_split(args.codecs) or None,
        decode_tokens=args.decode_tokens,
        repeats=args.repeats,
        prompts=prompts,
    )
    if args.plot:
        draw(report, args.plot)
    print(json.dumps(report) if args.json else format_table(report))
    return 0


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.split(",") if t.strip()]


def measure(
    model: str = "default",
    dtypes: Sequence[str] = DTYPES,
    codecs: Sequence[str] | None = None,
    decode_tokens: int = DECODE_TOKENS,
    repeats: int = REPEATS,
    prompts: Sequence[str] = PROMPTS,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> Report:
    """Every (dtype, codec) row, and the link guide built from them."""
    names = list(codecs or CODECS)
    for name in names:
        codec_class(name)  # unknown or not installed: fail before loading anything
    if "none" in names:
        names.remove("none")
    names.insert(0, "none")  # the reference: measured first, must be exact
    for dtype in dtypes:
        if dtype not in DTYPES:
            raise ConfigError(f"--dtypes: {dtype!r} is not one of {', '.join(DTYPES)}")
    rows: list[dict[str, Any]] = []
    prefill: dict[str, dict[str, float]] = {}
    for dtype in dtypes:
        engine = ReferenceEngine.load(model, dtype=dtype, progress=False)
        batch, rate = _prefill(engine, prompts, chunk_size)
        prefill[dtype] = rate
        rows.extend(_measure_dtype(engine, batch, names, decode_tokens, repeats))
        del engine
    return {
        "bench": "codec",
        "baseline": "memcpy",
        "config": {
            "model": model,
            "dtypes": list(dtypes),
            "prompts": len(prompts),
            "decode_tokens": decode_tokens,
            "chunk_size": chunk_size,
            "repeats": repeats,
            "timing": "CPU time of one thread (torch threads = 1) for the codecs, memcpy and prefill",
            "load_avg": [round(x, 2) for x in os.getloadavg()],
        },
        "prefill": prefill,
        "results": rows,
        "links": link_guide(rows, prefill),
    }


def _prefill(engine: EngineAdapter, prompts: Sequence[str], chunk_size: int) -> tuple[list[Prompt], dict[str, float]]:
    """Each prompt prefilled chunk by chunk (timed on one core: the recompute rate), its first token and its
    canonical chunks."""
    batch, tokens, seconds = [], 0, 0.0
    with single_thread():
        for text in prompts:
            batch.append(_prefill_one(engine, text, chunk_size))
            tokens += len(batch[-1].ids)
            seconds += batch[-1].seconds
    return batch, {"tokens": tokens, "seconds": round(seconds, 3), "tokens_per_s": round(tokens / seconds, 1)}


def _prefill_one(engine: EngineAdapter, text: str, chunk_size: int) -> Prompt:
    """Prefill one prompt (timed), keep its first token and its KV as canonical chunks."""
    p = Prompt(engine.tokenizer.encode_chat([{"role": "user", "content": text}]))
    req = engine.new_request(p.ids, SamplingParams(max_tokens=1))
    try:
        start = time.thread_time()
        logits = None
        for s, n in chunk_spans(len(p.ids), chunk_size):
            logits = engine.prefill(req, s, s + n)
        p.seconds = time.thread_time() - start
        assert logits is not None
        p.first_token = int(torch.argmax(logits))
        p.chunks = [
            (s, gather(engine.layout, engine.kv_buffer, req.block_table, s, n))
            for s, n in chunk_spans(len(p.ids), chunk_size)
        ]
    finally:
        engine.free(req)
    return p


def _measure_dtype(
    engine: EngineAdapter, batch: list[Prompt], names: list[str], decode_tokens: int, repeats: int
) -> list[dict[str, Any]]:
    layout = engine.layout
    chunks = [c for p in batch for _, c in p.chunks]
    raw_bytes = sum(c.nbytes for c in chunks)
    src, dst = torch.empty(raw_bytes, dtype=torch.uint8).random_(), torch.empty(raw_bytes, dtype=torch.uint8)

    def memcpy() -> None:
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), raw_bytes)

    scratch = torch.zeros(FLUSH_BYTES, dtype=torch.uint8)
    reference: tuple[list[list[int]], torch.Tensor] | None = None
    rows = []
    for name in names:
        if codec_class(name).unsupported(layout):
            continue
        codec = make_codec(name, layout)
        frames = [torch.empty(codec.max_encoded_bytes(c.shape[2]), dtype=torch.uint8) for c in chunks]
        sizes = [codec.encode(c, f) for c, f in zip(chunks, frames, strict=True)]
        decoded = [torch.empty_like(c) for c in chunks]
        for f, n, d in zip(frames, sizes, decoded, strict=True):
            codec.decode(f[:n], d)

        def encode_all(codec: Codec = codec, frames: list[torch.Tensor] = frames) -> None:
            for c, f in zip(chunks, frames, strict=True):
                codec.encode(c, f)

        def decode_all(
            codec: Codec = codec,
            frames: list[torch.Tensor] = frames,
            sizes: list[int] = sizes,
            decoded: list[torch.Tensor] = decoded,
        ) -> None:
            for f, n, d in zip(frames, sizes, decoded, strict=True):
                codec.decode(f[:n], d)

        with single_thread():
            enc, dec, base = (
                raw_bytes / t / 1e9 for t in _cpu_times([encode_all, decode_all, memcpy], scratch, repeats)
            )
        it = iter(decoded)
        altered = [[(s, next(it)) for s, _ in p.chunks] for p in batch]
        forced = reference[0] if reference else None
        tokens, logp = _decode_from(engine, batch, altered, decode_tokens, forced)
        if reference is None:
            reference = (tokens, logp)
        fidelity = _fidelity(reference, logp)
        err = _kv_error(chunks, decoded)
        if codec.lossless and (err["max_abs_error"] != 0 or fidelity["mean_kl"] != 0):
            raise AssertionError(f"lossless codec {name} changed the KV or the output: {err} {fidelity}")
        rows.append(
            {
                "dtype": layout.dtype,
                "codec": name,
                "lossless": codec.lossless,
                "raw_bytes": raw_bytes,
                "encoded_bytes": sum(sizes),
                "bytes_ratio": round(raw_bytes / sum(sizes), 4),
                "encode_gbps": round(enc, 3),
                "decode_gbps": round(dec, 3),
                "baseline_gbps": round(base, 3),
                "encode_ratio": round(enc / base, 4),
                "decode_ratio": round(dec / base, 4),
                "ratio": round(min(enc, dec) / base, 4),
                **fidelity,
                **err,
            }
        )
    return rows


def _cpu_times(fns: list[Callable[[], object]], scratch: torch.Tensor, repeats: int) -> list[float]:
    """Median CPU seconds (this thread) of each function, repeats interleaved, cache flushed before each."""
    for fn in fns:
        fn()  # warm-up: lazy init, first touch
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times, strict=True):
            scratch.add_(1)
            start = time.thread_time()
            fn()
            spent.append(time.thread_time() - start)
    return [max(statistics.median(t), 1e-9) for t in times]


def _decode_from(
    engine: EngineAdapter,
    batch: list[Prompt],
    kv: list[list[tuple[int, torch.Tensor]]],
    steps: int,
    forced: list[list[int]] | None,
) -> tuple[list[list[int]], torch.Tensor]:
    """Decode ``steps`` tokens for every prompt from the given prompt KV, batched; (greedy tokens, log-probs [steps,
    prompts, vocab]).

    As on a decode worker: the KV lands in fresh blocks, the prompt counts as
    computed, the prefill side's first token is appended. With ``forced``
    each step is fed that token instead of its own greedy pick.
    """
    params = SamplingParams(max_tokens=steps + 1, ignore_eos=True)
    requests: list[Request] = []
    try:
        for p, chunks in zip(batch, kv, strict=True):
            req = engine.new_request(p.ids, params)
            requests.append(req)
            for start, chunk in chunks:
                scatter(engine.layout, engine.kv_buffer, req.block_table, start, chunk)
            engine.mark_computed(req, len(p.ids))
            engine.append_token(req, p.first_token)
        picked: list[list[int]] = [[] for _ in batch]
        logps = []
        for step in range(steps):
            logits = engine.decode_step(requests)
            logps.append(torch.log_softmax(logits.float(), dim=-1))
            for i, req in enumerate(requests):
                picked[i].append(int(torch.argmax(logits[i])))
                engine.append_token(req, forced[i][step] if forced else picked[i][-1])
        return picked, torch.stack(logps)
    finally:
        for req in requests:
            engine.free(req)


def _fidelity(reference: tuple[list[list[int]], torch.Tensor], logp: torch.Tensor) -> dict[str, Any]:
    ref_tokens, ref_logp = reference
    picks = logp.argmax(-1).T  # [prompts, steps]
    ref = torch.tensor(ref_tokens)
    agree = picks == ref
    first = [int((~row).nonzero()[0]) if not bool(row.all()) else None for row in agree]
    kl = (ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp_min(0)  # [steps, prompts]
    return {
        "token_agreement": round(float(agree.float().mean()), 4),
        "first_divergence": first,
        "prompts_diverged": sum(f is not None for f in first),
        "mean_kl": float(f"{float(kl.mean()):.3g}"),
        "max_kl": float(f"{float(kl.max()):.3g}"),
    }


def _kv_error(chunks: list[torch.Tensor], decoded: list[torch.Tensor]) -> dict[str, float]:
    """Largest absolute error over the KV, and RMS error relative to the KV's RMS."""
    worst, err_sq, ref_sq = 0.0, 0.0, 0.0
    for c, d in zip(chunks, decoded, strict=True):
        diff = d.float() - c.float()
        worst = max(worst, float(diff.abs().max()))
        err_sq += float(diff.square().sum())
        ref_sq += float(c.float().square().sum())
    return {"max_abs_error": float(f"{worst:.3g}"), "rel_rms_error": float(f"{(err_sq / ref_sq) ** 0.5:.3g}")}


def link_guide(
    rows: list[dict[str, Any]],
    prefill: dict[str, dict[str, float]],
    links_gbit: Sequence[float] = LINKS_GBIT,
    tokens: int = GUIDE_TOKENS,
) -> list[dict[str, Any]]:
    """Per dtype and link: each codec's effective rate of raw KV and the time to move a ``tokens``-token prompt, vs
    recomputing it."""
    out = []
    for row in rows:
        token_bytes = row["raw_bytes"] / prefill[row["dtype"]]["tokens"]
        recompute_s = tokens / prefill[row["dtype"]]["tokens_per_s"]
        for link in links_gbit:
            wire = link / 8 * row["bytes_ratio"]
            rate = min(row["encode_gbps"], row["decode_gbps"], wire)
            out.append(
                {
                    "dtype": row["dtype"],
                    "link_gbit": link,
                    "codec": row["codec"],
                    "lossless": row["lossless"],
                    "effective_gbps": round(rate, 4),
                    "limited_by": "link" if rate == wire else "codec",
                    # the prompt tokens' worth of KV delivered per second: transfer beats a recompute slower than this
                    "kv_tokens_per_s": round(rate * 1e9 / token_bytes),
                    "transfer_s": round(tokens * token_bytes / rate / 1e9, 4),
                    "recompute_s": round(recompute_s, 3),
                    "tokens": tokens,
                }
            )
    return out


def format_table(report: Report) -> str:
    cfg = report["config"]
    lines = [
        f"KV codecs on {cfg['model']} ({cfg['prompts']} prompts, {cfg['decode_tokens']} decode steps), one core (CPU "
        f"time), load {cfg['load_avg']}",
        f"{'dtype':<9} {'codec':<10} {'bytes x':>7} {'enc GB/s':>8} {'dec GB/s':>8} {'memcpy':>7} {'agree':>6} "
        f"{'diverged':>8} {'mean KL':>9} {'max KL':>9}",
    ]
    for r in report["results"]:
        lines.append(
            f"{r['dtype']:<9} {r['codec']:<10} {r['bytes_ratio']:>7.3f} {r['encode_gbps']:>8.2f} "
            f"{r['decode_gbps']:>8.2f} {r['baseline_gbps']:>7.2f} "
            f"{r['token_agreement']:>6.3f} {r['prompts_diverged']:>8} {r['mean_kl']:>9.3g} {r['max_kl']:>9.3g}"
        )
    for dtype, rate in report["prefill"].items():
        lines.append(f"recompute ({dtype}): {rate['tokens_per_s']} prompt tokens/s on one core")
    lines.append(f"{GUIDE_TOKENS}-token prompt over a link: seconds through each codec (recompute on the right)")
    guide: dict[tuple[str, float], list[str]] = {}
    recompute: dict[tuple[str, float], float] = {}
    for g in report["links"]:
        key = (g["dtype"], g["link_gbit"])
        guide.setdefault(key, []).append(f"{g['codec']} {g['transfer_s']:.3g}")
        recompute[key] = g["recompute_s"]
    for (dtype, link), cells in guide.items():
        lines.append(
            f"  {dtype:<9} {link:>5g} Gbit: " + ", ".join(cells) + f" | recompute {recompute[(dtype, link)]:.3g}"
        )
    return "\n".join(lines)


def draw(report: Report, path: str) -> None:
    """Bytes ratio against mean KL per codec and dtype, and encode/decode GB/s, as one picture."""
    plt = plot.pyplot()
    short = {"float32": "f32", "bfloat16": "bf16"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype, marker in zip(DTYPES, "os", strict=True):
        rows = [r for r in report["results"] if r["dtype"] == dtype]
        for r in rows:
            left.scatter(max(r["mean_kl"], 1e-7), r["bytes_ratio"], marker=marker)
            left.annotate(f"{r['codec']} ({short[dtype]})", (max(r["mean_kl"], 1e-7), r["bytes_ratio"]), fontsize=7)
    left.set_xscale("log")
    left.set_xlabel("mean KL vs exact KV (nats; exact codecs at 1e-7)")
    left.set_ylabel("bytes ratio")
    labels = [f"{r['codec']}\n{short[r['dtype']]}" for r in report["results"]]
    x = torch.arange(len(labels)).tolist()
    right.bar([i - 0.2 for i in x], [r["encode_gbps"] for r in report["results"]], width=0.4, label="encode")
    right.bar([i + 0.2 for i in x], [r["decode_gbps"] for r in report["results"]], width=0.4, label="decode")
    right.axhline(max(r["baseline_gbps"] for r in report["results"]), linestyle="--", color="gray", label="memcpy")
    right.set_xticks(x, labels, fontsize=6)
    right.set_ylabel("raw KV GB/s")
    right.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)

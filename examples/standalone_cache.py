"""Store a real prompt's KV in pdkv's cache and get it back, with the library API alone (``pdkv.KVCacheEngine``).

What an engine integrator does (LMCache's "standalone mode"), here with pdkv's
reference engine and the default model (SmolLM2-135M-Instruct):

1. The engine prefills a chat prompt into its paged KV buffer.
2. ``store`` keys the prompt into chunks and puts them into memory and a disk
   directory (the disk written behind; ``close`` finishes it).
3. The engine resumes from the cache: a new request retrieves the chunks
   before the one holding its last token, computes only the rest, and
   generates the same tokens as a run that computed everything.
4. A second ``KVCacheEngine`` on the same directory (fresh memory, as after a
   restart) retrieves the whole prompt into a fresh buffer of another layout
   (cross-layer, HND, 32-token blocks): bit-identical to the engine's KV.

    python examples/standalone_cache.py [--prompt TEXT] [--chunk-size 32] [--max-tokens 8]

Prints one JSON object; exits 1 unless both checks hold.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

import msgspec
import torch

import pdkv
from pdkv.engine import ReferenceEngine, Request, SamplingParams
from pdkv.layout import gather

PROMPT = (
    "Summarise the following in one sentence. The lighthouse on the northern cape was built in 1871 "
    "from granite quarried on the island itself. Its lamp, first fuelled by whale oil and later by "
    "kerosene, was electrified in 1934; the keepers left in 1986, when the light became automatic. "
    "Today the tower is a museum, and on clear nights its beam still reaches twenty nautical miles."
)


def prefill(engine: ReferenceEngine, request: Request, chunk_size: int) -> torch.Tensor:
    """Compute the prompt from ``request.num_computed`` on, chunk by chunk; the last token's logits."""
    logits = None
    for start in range(request.num_computed, request.num_prompt_tokens, chunk_size):
        logits = engine.prefill(request, start, min(start + chunk_size, request.num_prompt_tokens))
    assert logits is not None
    return logits


def generate_from(engine: ReferenceEngine, request: Request, logits: torch.Tensor) -> list[int]:
    engine.append_token(request, engine.sample(request, logits))
    while not request.finished:
        engine.append_token(request, engine.sample(request, engine.decode_step([request])[0]))
    return request.output_token_ids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", default=PROMPT)
    parser.add_argument("--chunk-size", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()

    engine = ReferenceEngine.load("default", progress=False)
    tokens = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    with tempfile.TemporaryDirectory(prefix="pdkv-standalone-") as disk:
        tier = {"memory_bytes": 256 << 20, "disk_path": disk}
        with pdkv.KVCacheEngine(engine.layout, tier, args.chunk_size, fingerprint=engine.fingerprint) as cache:
            # 1-2. compute the prompt's KV and store it
            request = engine.new_request(tokens, params)
            try:
                prefill(engine, request, args.chunk_size)
                computed = gather(engine.layout, engine.kv_buffer, request.block_table, 0, len(tokens))
                stored = cache.store(tokens, engine.kv_buffer, request.block_table)
            finally:
                engine.free(request)

            # 3. resume: load the cached chunks before the last token's, compute the rest, generate
            resumed = engine.new_request(tokens, params)
            try:
                loadable = cache.keys(tokens).prefix((len(tokens) - 1) // args.chunk_size * args.chunk_size)
                loaded = int(cache.retrieve(loadable, engine.kv_buffer, resumed.block_table).sum())
                engine.mark_computed(resumed, loaded)
                from_cache = generate_from(engine, resumed, prefill(engine, resumed, args.chunk_size))
            finally:
                engine.free(resumed)
        # closed: the disk has every chunk

        # 4. another KVCacheEngine on the same directory, into a fresh buffer of another layout
        layout = msgspec.structs.replace(engine.layout, block_size=32, kind="cross_layer", order="HND")
        fresh = layout.allocate(layout.blocks_for(len(tokens)))
        fresh_table = list(reversed(range(len(fresh[0]))))  # any blocks, in any order
        with pdkv.KVCacheEngine(layout, tier, args.chunk_size, fingerprint=engine.fingerprint) as restarted:
            looked_up = restarted.lookup(tokens)
            retrieved = restarted.retrieve(tokens, fresh, fresh_table)
            identical = bool(retrieved.all()) and torch.equal(
                gather(layout, fresh, fresh_table, 0, len(tokens)), computed
            )
            hits = {name: s.hits for name, s in restarted.stats().items()}
    cold = engine.generate(tokens, params, chunk_size=args.chunk_size).output_token_ids
    report = {
        "model": engine.model_name,
        "prompt_tokens": len(tokens),
        "chunk_size": args.chunk_size,
        "stored_tokens": stored,
        "looked_up_tokens": looked_up,
        "retrieved_tokens": int(retrieved.sum()),
        "bit_identical": identical,
        "resumed_loaded_tokens": loaded,
        "generated_equal": from_cache == cold,
        "generated": engine.tokenizer.decode(from_cache),
        "restarted_hits_by_level": hits,
    }
    print(json.dumps(report))
    return 0 if identical and report["generated_equal"] else 1


if __name__ == "__main__":
    sys.exit(main())

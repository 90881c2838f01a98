"""A vLLM worker extension for the integration tests: the KV a vLLM instance holds for each prompt, position by
position.

vLLM mixes this class into its worker (``--worker-extension-cls
vllm_kvprobe.KVProbe``, with this directory on ``PYTHONPATH``) and its
dev-mode HTTP server (``VLLM_SERVER_DEV_MODE=1``) exposes the methods as
``POST /collective_rpc``. Test-only: loopback servers the tests start.

After ``pdkv_probe_start``, each request's prompt KV is read out of vLLM's
paged cache right after the step that completes its prompt (the blocks may be
reused once the request ends): on a monolithic instance, its own prefill; on a
decode instance, the KV the connector loaded plus the last prompt position,
which vLLM recomputes to sample from. Each position is kept as an xxh3-64
digest of its K and V in every layer, so a test compares two instances' KV bit
for bit, position by position, without moving it.

Where a position's bytes sit inside a block depends on the CPU attention
kernel (the ``vec`` kernel stores K transposed, ``[heads, head_dim,
block_size]``, and V row-major; ``amx`` packs differently), so the probe does
not assume an order: at start it has vLLM's own ``cpu_attn_reshape_and_cache``
write token numbers into a scratch block and reads back which elements each
slot owns.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xxhash


def prompt_id(tokens: list[int]) -> str:
    """The key a prompt's digests are kept under: its token ids."""
    return xxhash.xxh3_64_hexdigest(json.dumps(list(tokens)).encode())


class KVProbe:
    """Mixed into vLLM's CPU worker; ``self`` is the worker (``self.model_runner`` holds the cache)."""

    def pdkv_probe_start(self) -> str:
        runner: Any = self.model_runner  # type: ignore[attr-defined]
        if getattr(runner, "_pdkv_probe", None) is None:
            runner._pdkv_probe = {}
            runner._pdkv_slots = _slot_elements(runner)
            step = runner.execute_model

            def execute_model(scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
                out = step(scheduler_output, *args, **kwargs)
                _record(runner, scheduler_output)
                return out

            runner.execute_model = execute_model
        return "started"

    def pdkv_probe_take(self, tokens_json: str) -> list[str] | None:
        """Per-position digests recorded for the prompt with these token ids (a JSON list), or None."""
        return self.model_runner._pdkv_probe.pop(prompt_id(json.loads(tokens_json)), None)  # type: ignore[attr-defined]

    def pdkv_connector(self) -> dict[str, Any]:
        """Where this worker's pdkv connector lands pushed KV, and its counters (loads, tokens loaded)."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        worker = get_kv_transfer_group().worker
        return {
            "landing": worker.landing,
            "counters": dict(worker.counters),
        }


def _slot_elements(runner: Any) -> torch.Tensor:
    """``[block_size, 2 * heads * head_dim]``: which elements of a block (flattened) hold each slot's K, then V."""
    from vllm import _custom_ops as ops

    layer = next(iter(runner.compilation_config.static_forward_context.values()))
    _, heads, block_size, two_d = runner.kv_caches[0].shape
    block = torch.zeros(1, heads, 2 * block_size, two_d // 2, dtype=runner.kv_caches[0].dtype)
    k_cache, v_cache = block.chunk(2, dim=2)  # how vLLM's CPU backend splits a block
    marks = (
        torch.arange(1, block_size + 1, dtype=torch.float32)
        .view(-1, 1, 1)
        .expand(block_size, heads, two_d // 2)
        .to(block.dtype)
    )
    ops.cpu_attn_reshape_and_cache(
        marks.contiguous(), (-marks).contiguous(), k_cache, v_cache, torch.arange(block_size), layer.isa
    )
    flat = block.flatten().float()
    slots = torch.stack(
        [
            torch.cat([(flat == t).nonzero().flatten(), (flat == -t).nonzero().flatten()])
            for t in range(1, block_size + 1)
        ]
    )
    assert slots.shape == (block_size, heads * two_d), f"could not map the {layer.isa!r} kernel's block layout"
    return slots


def _record(runner: Any, scheduler_output: Any) -> None:
    scheduled = scheduler_output.num_scheduled_tokens
    before = {new.req_id: new.num_computed_tokens for new in scheduler_output.scheduled_new_reqs}
    cached = scheduler_output.scheduled_cached_reqs
    before.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
    for req_id, computed in before.items():
        state = runner.requests.get(req_id)
        if state is None or not state.prompt_token_ids:
            continue
        n = len(state.prompt_token_ids)
        if computed < n <= computed + scheduled.get(req_id, 0):  # this step completed the prompt
            runner._pdkv_probe[prompt_id(state.prompt_token_ids)] = _digests(
                runner.kv_caches, runner._pdkv_slots, list(state.block_ids[0]), n
            )


def _digests(kv_caches: list[torch.Tensor], slots: torch.Tensor, block_ids: list[int], n: int) -> list[str]:
    block_size = slots.shape[0]
    pos = torch.arange(n)
    blocks = torch.tensor(block_ids, dtype=torch.long)[pos // block_size]
    rows = torch.stack(
        [layer.view(layer.shape[0], -1)[blocks[:, None], slots[pos % block_size]] for layer in kv_caches], dim=1
    )
    raw = rows.contiguous().view(torch.uint8).reshape(n, -1).numpy()
    return [xxhash.xxh3_64_hexdigest(raw[i].tobytes()) for i in range(n)]

"""A Llama-family decoder in plain torch whose attention reads K/V from a paged buffer.

Covers Llama (incl. 3.x rope scaling), Qwen2 (q/k/v bias) and SmolLM (llama
arch, tied embeddings): RMSNorm, RoPE, grouped-query attention, SwiGLU. The
arithmetic follows transformers' order (norms in float32, rope cos/sin cast to
the model dtype) so greedy output matches transformers on the same weights.
Weights are taken by Hugging Face name and checked strictly: a missing,
unexpected or mis-shaped tensor is a load error naming it, never a silent
half-loaded model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
import torch.nn.functional as F

from pdkv.engine import rope
from pdkv.engine.config import ModelConfig
from pdkv.engine.paged import Batch, PagedKV
from pdkv.errors import ModelLoadError

# Present in some checkpoints, derived from the config here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # q, k and v projections stacked: one matmul
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # gate and up stacked: one matmul
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name this config needs, with its shape (Hugging Face naming)."""
    c = config
    q_out, kv_out = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
        "model.norm.weight": (c.hidden_size,),
    }
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_hidden_layers):
        p = f"model.layers.{i}."
        linears = {
            "self_attn.q_proj": ((q_out, c.hidden_size), c.qkv_bias),
            "self_attn.k_proj": ((kv_out, c.hidden_size), c.qkv_bias),
            "self_attn.v_proj": ((kv_out, c.hidden_size), c.qkv_bias),
            "self_attn.o_proj": ((c.hidden_size, q_out), c.o_bias),
            "mlp.gate_proj": ((c.intermediate_size, c.hidden_size), c.mlp_bias),
            "mlp.up_proj": ((c.intermediate_size, c.hidden_size), c.mlp_bias),
            "mlp.down_proj": ((c.hidden_size, c.intermediate_size), c.mlp_bias),
        }
        for name, (shape, bias) in linears.items():
            shapes[f"{p}{name}.weight"] = shape
            if bias:
                shapes[f"{p}{name}.bias"] = (shape[0],)
        shapes[f"{p}input_layernorm.weight"] = (c.hidden_size,)
        shapes[f"{p}post_attention_layernorm.weight"] = (c.hidden_size,)
    return shapes


def check_tensors(config: ModelConfig, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Raise ``ModelLoadError`` naming missing, unexpected and mis-shaped tensors."""
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    tied_extra = {"lm_head.weight"} if config.tie_word_embeddings else set()
    unexpected = sorted(n for n in set(tensors) - set(shapes) - tied_extra if not n.endswith(_IGNORED_SUFFIXES))
    wrong = [
        f"{n} is {tuple(tensors[n].shape)}, expected {shapes[n]}"
        for n in sorted(set(shapes) & set(tensors))
        if tuple(tensors[n].shape) != shapes[n]
    ]
    problems = []
    if missing:
        problems.append(f"missing {len(missing)} tensors (e.g. {', '.join(missing[:4])})")
    if unexpected:
        problems.append(
            f"{len(unexpected)} tensors this {config.model_type} config does not use (e.g. {', '.join(unexpected[:4])})"
        )
    if wrong:
        problems.append("; ".join(wrong[:4]))
    if problems:
        raise ModelLoadError(
            f"{source} does not match its config: " + "; ".join(problems) + ". Is config.json from the same model?"
        )


class DecoderModel:
    """Weights in the compute dtype plus the forward pass over a paged KV buffer."""

    def __init__(
        self,
        config: ModelConfig,
        tensors: Mapping[str, torch.Tensor],
        dtype: torch.dtype,
        device: torch.device,
        source: str = "checkpoint",
    ) -> None:
        check_tensors(config, tensors, source)
        self.config = config
        self.dtype = dtype

        def get(name: str) -> torch.Tensor:
            return tensors[name].to(device=device, dtype=dtype).contiguous()

        def maybe(name: str) -> torch.Tensor | None:
            return get(name) if name in tensors else None

        def stacked(prefix: str, parts: tuple[str, ...], suffix: str = "weight") -> torch.Tensor:
            return torch.cat([get(f"{prefix}{part}.{suffix}") for part in parts])

        def stacked_bias(prefix: str, parts: tuple[str, ...]) -> torch.Tensor | None:
            return stacked(prefix, parts, "bias") if f"{prefix}{parts[0]}.bias" in tensors else None

        self.embed = get("model.embed_tokens.weight")
        self.lm_head = self.embed if config.tie_word_embeddings else get("lm_head.weight")
        self.norm = get("model.norm.weight")
        self.inv_freq = rope.inverse_frequencies(config).to(device)
        qkv, gate_up = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")
        self.layers: list[_Layer] = []
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                _Layer(
                    input_norm=get(p + "input_layernorm.weight"),
                    qkv=stacked(p, qkv),
                    qkv_bias=stacked_bias(p, qkv),
                    o=get(p + "self_attn.o_proj.weight"),
                    o_bias=maybe(p + "self_attn.o_proj.bias"),
                    post_norm=get(p + "post_attention_layernorm.weight"),
                    gate_up=stacked(p, gate_up),
                    gate_up_bias=stacked_bias(p, gate_up),
                    down=get(p + "mlp.down_proj.weight"),
                    down_bias=maybe(p + "mlp.down_proj.bias"),
                )
            )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return weight * h.to(x.dtype)

    def forward(self, batch: Batch, kv: PagedKV) -> torch.Tensor:
        """Run ``batch``, writing its K/V into ``kv``; float32 logits ``[segments, vocab]`` of each segment's
        last token."""
        c = self.config
        n_q, n_kv, dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        cos, sin = rope.cos_sin(self.inv_freq, batch.positions, self.dtype)
        h = self.embed[batch.token_ids]
        rows = h.shape[0]
        for index, layer in enumerate(self.layers):
            x = self._rms_norm(h, layer.input_norm)
            q, k, v = F.linear(x, layer.qkv, layer.qkv_bias).split([n_q * dim, n_kv * dim, n_kv * dim], dim=-1)
            q = rope.apply(q.view(rows, n_q, dim), cos, sin)
            k = rope.apply(k.view(rows, n_kv, dim), cos, sin)
            kv.write(index, batch.slot_blocks, batch.slot_offsets, k, v.view(rows, n_kv, dim))
            attn = torch.empty_like(q)
            for seg in batch.segments:
                keys, values = kv.read(index, seg.block_ids, seg.context)
                out = F.scaled_dot_product_attention(
                    q[seg.rows].transpose(0, 1)[None],
                    keys[None],
                    values[None],
                    attn_mask=seg.mask,
                    enable_gqa=n_q != n_kv,
                )
                attn[seg.rows] = out[0].transpose(0, 1)
            h = h + F.linear(attn.view(rows, n_q * dim), layer.o, layer.o_bias)
            x = self._rms_norm(h, layer.post_norm)
            gate, up = F.linear(x, layer.gate_up, layer.gate_up_bias).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, layer.down, layer.down_bias)
        last = self._rms_norm(h[batch.last_rows.to(h.device)], self.norm)
        return F.linear(last, self.lm_head).float()

"""Rotary position embeddings with the config's scaling, computed exactly as transformers does.

The reference engine must reproduce transformers' logits, and KV computed
on P must equal KV D would compute: both depend on these frequencies to the
last bit, so this follows transformers' formulas and float32 arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from pdkv.engine.config import ModelConfig


def inverse_frequencies(config: ModelConfig) -> torch.Tensor:
    """``[head_dim // 2]`` float32 inverse frequencies for ``default``, ``linear`` or ``llama3`` rope."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    if config.rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if config.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths slowed by ``factor``, a smooth band between."""
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, head_dim]`` cos and sin for ``positions``, computed in float32 then cast like transformers."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, heads, head_dim]`` (halves layout, as in Hugging Face checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]

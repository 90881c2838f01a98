"""Load a llama.cpp GGUF file (llama or qwen2 architecture) into a Checkpoint.

Quantized tensors (Q4_0, Q4_1, Q4_K, Q8_0, ... whatever ``gguf.quants``
knows) are dequantized to float32 and renamed to Hugging Face names, and the
row permutation llama.cpp's converter applies to Llama's Q and K projections
is undone, so the model code sees exactly what it would see from the
original safetensors.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import quants
from tqdm import tqdm

from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.config import ModelConfig
from pdkv.errors import ModelLoadError
from pdkv.modelfiles.gguf_tokenizer import open_gguf, tokenizer_from_gguf

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def load_gguf(path: Path, name: str | None = None, progress: bool = True) -> Checkpoint:
    """Read metadata, tokenizer and dequantized tensors from a GGUF file."""
    path = Path(path)
    reader, meta = open_gguf(path)
    tensor_names = {t.name for t in reader.tensors}
    config = config_from_gguf(meta, tensor_names, path)
    tensors: dict[str, torch.Tensor] = {}
    for t in tqdm(
        reader.tensors, desc=f"dequantizing {path.name}", unit="tensor", file=sys.stderr, disable=not progress
    ):
        hf_name = _hf_name(t.name, path)
        try:
            # a copy: F32 tensors come back as read-only views of the memory-mapped file
            array = np.array(quants.dequantize(t.data, t.tensor_type), dtype=np.float32)
        except NotImplementedError as exc:
            raise ModelLoadError(
                f"{path}: tensor {t.name} is {t.tensor_type.name}, which the installed gguf package cannot dequantize; "
                "upgrade it (pip install -U gguf)"
            ) from exc
        if config.model_type == "llama" and t.name.split(".")[-2] in ("attn_q", "attn_k"):
            heads = config.num_attention_heads if ".attn_q." in t.name else config.num_key_value_heads
            array = unpermute_rope_rows(array, heads)
        tensors[hf_name] = torch.from_numpy(np.ascontiguousarray(array))
    return Checkpoint(name=name or path.stem, config=config, tensors=tensors, tokenizer=tokenizer_from_gguf(meta))


def unpermute_rope_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: per head, interleaved rotary pairs back to Hugging Face's two halves."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def config_from_gguf(meta: Mapping[str, Any], tensor_names: set[str], path: Path) -> ModelConfig:
    """A ModelConfig from ``{arch}.*`` metadata; which tensors exist tells ties and biases."""
    arch = meta.get("general.architecture")
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(
            f"{path}: GGUF architecture {arch!r} is not supported by the reference engine; supported: llama, qwen2"
        )
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError(
            f"{path} bakes Llama 3 rope frequency factors into a tensor (rope_freqs.weight), which the reference "
            "engine does not read; load the Hugging Face directory of the model instead"
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path}: GGUF metadata lacks {arch}.{key}")
        return value

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise ModelLoadError(
            f"{path}: partial rotary embeddings (rope.dimension_count {get('rope.dimension_count')} != head_dim "
            f"{head_dim}) are not supported"
        )
    scaling_type = meta.get(f"{arch}.rope.scaling.type", "none")
    rope_scaling = (
        None if scaling_type == "none" else {"rope_type": scaling_type, "factor": _f32(get("rope.scaling.factor"))}
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        model_type=arch,
        vocab_size=int(meta.get(f"{arch}.vocab_size") or len(meta["tokenizer.ggml.tokens"])),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
        rope_theta=_f32(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length")),
        tie_word_embeddings="output.weight" not in tensor_names,
        qkv_bias="blk.0.attn_q.bias" in tensor_names,
        o_bias="blk.0.attn_output.bias" in tensor_names,
        mlp_bias="blk.0.ffn_up.bias" in tensor_names,
        rope_scaling=rope_scaling,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=() if eos is None else (int(eos),),
    )


def _f32(value: Any) -> float:
    """GGUF stores floats as float32: recover the short decimal the model was configured with (1e-05, not
    9.99999974e-06)."""
    return float(str(np.float32(value)))


def _hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if not match or match.group(2) not in _LAYER_NAMES:
        raise ModelLoadError(f"{path}: GGUF tensor {gguf_name!r} has no counterpart in a Llama/Qwen2 decoder")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"

"""A small Llama-shaped checkpoint, written from a seed, for running vLLM at tensor parallel on a CPU.

pdkv's default model (SmolLM2-135M) has 3 KV heads: no tensor-parallel size but 1 divides them. This one has
8 attention heads over 4 KV heads, so P and D run at 1, 2 or 4 ranks. vLLM's ``--load-format dummy`` is no
substitute: each rank fills its shard from the same seed, so a TP=2 dummy model is another model than the TP=1
one. Real weights on disk are the same model at every size.

The weights are scaled so the KV decides the output: attention and MLP projections at ``1/sqrt(fan_in)`` (each
sublayer's output as large as the residual stream), and tied embeddings at 0.5, so the greedy path has clear
margins (logits of a few units apart) rather than the near-ties of a model at the usual 0.02 init, where
swapped or stale KV heads would go unnoticed. The tokenizer is the default model's.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 256, 512, 4, 8, 4
HEAD_DIM = HIDDEN // HEADS
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_tiny_llama(dest: Path, tokenizer_from: Path, seed: int = 0) -> Path:
    """Write the checkpoint (config, safetensors weights, ``tokenizer_from``'s tokenizer) to ``dest``; return it."""
    base = json.loads((tokenizer_from / "config.json").read_text())
    vocab = int(base["vocab_size"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD_DIM,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "tie_word_embeddings": False,
        "bos_token_id": base.get("bos_token_id"),
        "eos_token_id": base.get("eos_token_id"),
        "torch_dtype": "bfloat16",
    }
    gen = torch.Generator().manual_seed(seed)

    def linear(out_features: int, in_features: int) -> torch.Tensor:
        w = torch.randn(out_features, in_features, generator=gen) / math.sqrt(in_features)
        return w.to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": (0.5 * torch.randn(vocab, HIDDEN, generator=gen)).to(torch.bfloat16)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": linear(HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.k_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.v_proj.weight": linear(KV_HEADS * HEAD_DIM, HIDDEN),
            p + "self_attn.o_proj.weight": linear(HIDDEN, HEADS * HEAD_DIM),
            p + "mlp.gate_proj.weight": linear(INTERMEDIATE, HIDDEN),
            p + "mlp.up_proj.weight": linear(INTERMEDIATE, HIDDEN),
            p + "mlp.down_proj.weight": linear(HIDDEN, INTERMEDIATE),
            p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
        }
    weights["model.norm.weight"] = torch.ones(HIDDEN, dtype=torch.bfloat16)
    weights["lm_head.weight"] = (4.0 * torch.randn(vocab, HIDDEN, generator=gen)).to(torch.bfloat16)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(weights, str(dest / "model.safetensors"), metadata={"format": "pt"})
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, dest / name)
    return dest

"""The reference engine against transformers on the same random weights: same logits, same greedy tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.testing.model import write_tiny_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

transformers = pytest.importorskip(
    "transformers", reason="transformers is the oracle for these tests (a dev dependency)"
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama-tied": ("llama", {}),
    "llama-llama3-rope-biases": (
        "llama",
        {"tie_word_embeddings": False, "rope_scaling": LLAMA3_ROPE, "qkv_bias": True, "o_bias": True, "mlp_bias": True},
    ),
    "llama-linear-rope-4-layers": (
        "llama",
        {"num_hidden_layers": 4, "rope_scaling": {"rope_type": "linear", "factor": 2.0}, "rope_theta": 500000.0},
    ),
    "qwen2-tied": ("qwen2", {}),
    "qwen2-untied-mha": ("qwen2", {"tie_word_embeddings": False, "num_key_value_heads": 4}),
}
NEW_TOKENS = 24


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(tmp_path: Path, case: str) -> None:
    model_type, overrides = CASES[case]
    path = write_tiny_model(tmp_path / case, model_type, seed=3, **overrides)
    engine = ReferenceEngine.load(path, max_kv_tokens=256, block_size=8)
    prompt = engine.tokenizer.encode_chat(
        [{"role": "user", "content": "Where is Paris? The quick brown fox jumps over the lazy dog."}]
    )
    ours = engine.generate(
        prompt, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), chunk_size=16
    ).output_token_ids

    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    hf.eval()
    # generate exactly NEW_TOKENS, like ignore_eos (min_new_tokens would mask EOS instead)
    hf.generation_config.eos_token_id = None
    ids = torch.tensor([prompt])
    with torch.no_grad():
        theirs = hf.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0
        )[0, len(prompt) :].tolist()
        hf_logits = hf(ids).logits[0, -1]
    assert ours == theirs
    assert len(set(ours)) > 8, "degenerate output would hide mistakes"

    request = engine.new_request(prompt, SamplingParams(max_tokens=1))
    our_logits = engine.prefill(request, 0, len(prompt))
    engine.free(request)
    torch.testing.assert_close(our_logits, hf_logits, rtol=1e-4, atol=1e-4)

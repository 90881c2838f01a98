"""Load (and write) a Hugging Face model directory: config.json, *.safetensors, tokenizer files.

Writing is here too because the default model's first run converts the GGUF
once and caches it as such a directory, which later runs load in seconds
(and which transformers can read, for cross-checking).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import safetensors
import safetensors.torch
import torch

from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.config import ModelConfig
from pdkv.errors import ModelLoadError
from pdkv.modelfiles.jsonfile import read_json
from pdkv.modelfiles.tokenizer import Tokenizer

WEIGHTS_FILE = "model.safetensors"


def load_hf_dir(path: Path, name: str | None = None) -> Checkpoint:
    """Read a model directory as saved by ``save_pretrained`` (safetensors, one file or sharded)."""
    path = Path(path)
    hf_config = read_json(path / "config.json", required=True)
    config = ModelConfig.from_hf(hf_config)
    generation = read_json(path / "generation_config.json")
    if generation.get("eos_token_id") is not None:
        extra = generation["eos_token_id"]
        ids = tuple(dict.fromkeys(config.eos_token_ids + tuple(extra if isinstance(extra, list) else [extra])))
        config = dataclasses.replace(config, eos_token_ids=ids)
    return Checkpoint(
        name=name or path.resolve().name,
        config=config,
        tensors=_read_safetensors(path),
        tokenizer=Tokenizer.from_hf_dir(path),
    )


def save_hf_dir(checkpoint: Checkpoint, path: Path) -> None:
    """Write ``checkpoint`` as a Hugging Face directory into the existing folder ``path``."""
    (path / "config.json").write_text(json.dumps(checkpoint.config.to_hf_dict(), indent=2))
    tensors = {k: v.contiguous() for k, v in checkpoint.tensors.items()}
    safetensors.torch.save_file(tensors, str(path / WEIGHTS_FILE), metadata={"format": "pt"})
    checkpoint.tokenizer.save(path)


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    index = read_json(path / f"{WEIGHTS_FILE}.index.json")
    files = sorted({path / f for f in index.get("weight_map", {}).values()}) or sorted(path.glob("*.safetensors"))
    if not files:
        hint = (
            " (found PyTorch .bin weights: re-save them with save_pretrained(..., safe_serialization=True))"
            if any(path.glob("*.bin"))
            else ""
        )
        raise ModelLoadError(f"{path} has no .safetensors weights{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            tensors.update(safetensors.torch.load_file(str(file)))
        except (OSError, safetensors.SafetensorError) as exc:
            raise ModelLoadError(f"cannot read weights {file}: {exc}") from exc
    return tensors

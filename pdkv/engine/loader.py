"""Turn a ``--model`` value into a loaded Checkpoint: 'default', a Hugging Face directory or a .gguf file."""

from __future__ import annotations

import os
from pathlib import Path

from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.default_model import ensure_default_model
from pdkv.engine.loader_gguf import load_gguf
from pdkv.engine.loader_hf import load_hf_dir
from pdkv.errors import ModelLoadError
from pdkv.modelfiles.lookup import DEFAULT_MODEL_NAME


def resolve_model(model: str | os.PathLike[str] = "default", progress: bool = True) -> Path:
    """The local path ``model`` names; 'default' is the cached SmolLM2 (converted on first use)."""
    if str(model) == "default":
        return ensure_default_model(progress)
    path = Path(model).expanduser()
    if path.is_dir() or (path.is_file() and path.suffix == ".gguf"):
        return path
    raise ModelLoadError(
        f"--model {str(model)!r} is not 'default', a Hugging Face model directory (config.json + *.safetensors + "
        "tokenizer.json) or a .gguf file"
    )


def load_checkpoint(model: str | os.PathLike[str] = "default", progress: bool = True) -> Checkpoint:
    """Load the weights, config and tokenizer ``model`` names (see ``resolve_model``)."""
    path = resolve_model(model, progress)
    name = DEFAULT_MODEL_NAME if str(model) == "default" else None
    return load_hf_dir(path, name) if path.is_dir() else load_gguf(path, name, progress)

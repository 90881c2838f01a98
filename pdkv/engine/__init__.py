"""Engines behind the prefill/decode workers.

``EngineAdapter`` (base.py) is what a worker drives; ``ReferenceEngine`` is
the built-in pure-torch implementation. Typical use::

    engine = ReferenceEngine.load("default")          # or a HF dir / .gguf path
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": "Hi"}])
    request = engine.generate(ids, SamplingParams(max_tokens=32))
    print(engine.tokenizer.decode(request.output_token_ids))
"""

from pdkv.engine.base import EngineAdapter, FinishReason, Request
from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.config import ModelConfig
from pdkv.engine.loader import load_checkpoint, resolve_model
from pdkv.engine.reference import ReferenceEngine
from pdkv.engine.sampling import SamplingParams

__all__ = [
    "Checkpoint",
    "EngineAdapter",
    "FinishReason",
    "ModelConfig",
    "ReferenceEngine",
    "Request",
    "SamplingParams",
    "load_checkpoint",
    "resolve_model",
]

"""What a loader hands the engine: config, weights under Hugging Face names, tokenizer.

Both loaders (safetensors directory, GGUF file) produce this one shape, so the
model code knows a single naming scheme and the default model's cache is just
a Checkpoint written back out as a Hugging Face directory.
"""

from __future__ import annotations

import dataclasses

import torch
import xxhash

from pdkv.engine.config import ModelConfig
from pdkv.modelfiles.tokenizer import Tokenizer


@dataclasses.dataclass
class Checkpoint:
    """A loaded model, not yet placed in an engine.

    ``name`` is what the workers report as the model id (``/v1/models``);
    ``tensors`` use Hugging Face parameter names
    (``model.layers.0.self_attn.q_proj.weight``) in their stored dtype.
    """

    name: str
    config: ModelConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer

    def weights_digest(self) -> str:
        """xxh3-128 over every tensor's name, dtype, shape and bytes, in name order.

        Goes into the model fingerprint: P and D that loaded the same weights
        from different paths (the GGUF, or its cached conversion) agree, and
        two fine-tunes with the same config never do. ~0.1 s per 500 MB.
        """
        h = xxhash.xxh3_128()
        for name in sorted(self.tensors):
            t = self.tensors[name].detach().contiguous().cpu()
            h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().data)
        return h.hexdigest()

"""The built-in engine: the pure-torch decoder behind the ``EngineAdapter`` interface.

It is the embedded default, so every role runs on a laptop CPU with no
other inference stack installed, and the oracle the disaggregated path is
tested against.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Literal

import torch

from pdkv.engine.base import EngineAdapter, Request
from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.loader import load_checkpoint
from pdkv.engine.model import DecoderModel
from pdkv.engine.paged import Batch, PagedKV
from pdkv.errors import ConfigError
from pdkv.keys import model_fingerprint
from pdkv.layout import KVLayout

ENGINE_DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_KV_TOKENS = 8192


class ReferenceEngine(EngineAdapter):
    """Paged-attention Llama-family decoder in plain torch.

    ``block_size``, ``order`` and ``kind`` choose the KV layout (P and D may
    differ); ``max_kv_tokens`` sizes the buffer: the most tokens of all live
    requests together. ``num_threads`` sets torch's intra-op threads for the
    whole process (None leaves them alone): a prefill and a decode worker on
    one machine should split the cores, because oversubscribed torch threads
    spin and make every step several times slower.
    """

    def __init__(
        self,
        checkpoint: Checkpoint,
        *,
        dtype: str = "float32",
        block_size: int = 16,
        order: Literal["NHD", "HND"] = "NHD",
        kind: Literal["per_layer", "cross_layer"] = "per_layer",
        max_kv_tokens: int = DEFAULT_MAX_KV_TOKENS,
        device: str | torch.device = "cpu",
        num_threads: int | None = None,
    ) -> None:
        if dtype not in ENGINE_DTYPES:
            raise ConfigError(f"engine dtype must be one of {', '.join(ENGINE_DTYPES)}, got {dtype!r}")
        if max_kv_tokens <= 0:
            raise ConfigError(f"max_kv_tokens must be a positive integer, got {max_kv_tokens!r}")
        if num_threads is not None:
            if num_threads <= 0:
                raise ConfigError(f"num_threads must be a positive integer or None, got {num_threads!r}")
            torch.set_num_threads(num_threads)
        config = checkpoint.config
        self.device = torch.device(device)
        self.model = DecoderModel(
            config, checkpoint.tensors, getattr(torch, dtype), self.device, source=checkpoint.name
        )
        layout = KVLayout(
            num_layers=config.num_hidden_layers,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            block_size=block_size,
            dtype=dtype,
            kind=kind,
            order=order,
        )
        kv_buffer = layout.allocate(layout.blocks_for(max_kv_tokens), device=self.device)
        self.kv = PagedKV(layout, kv_buffer)
        tokenizer = checkpoint.tokenizer
        eos = set(config.eos_token_ids)
        if tokenizer.eos_token_id is not None:
            eos.add(tokenizer.eos_token_id)
        super().__init__(
            layout=layout,
            kv_buffer=kv_buffer,
            tokenizer=tokenizer,
            fingerprint=model_fingerprint(f"weights:{checkpoint.weights_digest()}", config.fingerprint_dict(), dtype),
            model_name=checkpoint.name,
            # a request longer than the whole buffer could never be admitted: refuse it as invalid, not "busy"
            max_model_len=min(config.max_position_embeddings, self.kv.num_blocks * block_size),
            eos_token_ids=sorted(eos),
            vocab_size=config.vocab_size,
        )

    @classmethod
    def load(
        cls, model: str | os.PathLike[str] = "default", *, progress: bool = True, **options: object
    ) -> ReferenceEngine:
        """Load ``model`` ('default', a Hugging Face directory or a .gguf file) into a new engine.

        ``options`` are the constructor's keyword arguments (dtype, block_size, ...).
        """
        return cls(load_checkpoint(model, progress=progress), **options)  # type: ignore[arg-type]

    def _run(self, items: Sequence[tuple[Sequence[int], int, Sequence[int]]]) -> torch.Tensor:
        with torch.inference_mode():
            batch = Batch.build(self.layout.block_size, items, self.device)
            return self.model.forward(batch, self.kv)

    def _prefill(self, request: Request, start: int, end: int) -> torch.Tensor:
        return self._run([(request.block_table, start, request.prompt_token_ids[start:end])])

    def _decode(self, requests: Sequence[Request]) -> torch.Tensor:
        return self._run([(r.block_table, r.num_computed, r.token_ids[r.num_computed :]) for r in requests])

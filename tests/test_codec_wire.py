"""KV codecs on the wire (issue 18): a request's staged chunks encoded by the sender, decoded by the receiver.

Sender and receiver run in this process over the real tcp channel (sockets on
127.0.0.1). The codecs themselves are tested in test_codec.py; these prove the
transfer path around them: the codec is agreed at Hello and per request, the
channel carries fewer bytes, the checksum covers the encoded frame, a frame
that does not decode fails the request cleanly (its memory freed), and direct
mode never carries a codec.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import pytest
import torch

from pdkv.codec import make_codec
from pdkv.config import TransferConfig
from pdkv.errors import CodecError, HandshakeError, ReservationError, TransferError
from pdkv.layout import KVLayout, gather
from pdkv.transfer.protocol import ChunkNotice

from tests.conftest import Pair, wait_until

LAYOUT = KVLayout(num_layers=3, num_kv_heads=2, head_dim=16, block_size=16, dtype="float32")
TOKENS = 100  # 4 chunks of 32: three full, one of 4 tokens
TABLE = list(range(10, 17))

pytestmark = pytest.mark.device_emulation  # every pair test also runs with its KV in emulated device memory


def _config(codec: str) -> TransferConfig:
    return TransferConfig(chunk_size=32, lease_s=5, drain_timeout_s=2, codec=codec)


def _push(pair: Pair, request_id: str, codec: str | None = None) -> tuple[list[int], str]:
    xfer = pair.sender.open(request_id, pair.receiver.address, TOKENS, TABLE, codec=codec)
    xfer.send_all()
    xfer.wait(10)
    return pair.receiver.wait(request_id, 10).blocks, xfer.mode


def _sent(pair: Pair) -> torch.Tensor:
    return gather(pair.p_layout, pair.p_kv, TABLE, 0, TOKENS)


def _landed(pair: Pair, blocks: list[int]) -> torch.Tensor:
    return gather(pair.d_layout, pair.d_kv, blocks, 0, TOKENS)


def test_a_lossless_codec_lands_bit_exact_in_fewer_wire_bytes(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p_layout=LAYOUT, config=_config("zstd"), channel="tcp")
    # KV with structure (as real KV has: a compressor finds nothing in random floats)
    for t in pair.p_kv:
        t.copy_(torch.linspace(-2, 2, t.numel()).view(t.shape).to(t.dtype))
    blocks, mode = _push(pair, "z1")
    assert mode == "staging", "same layouts would be direct, but an encoded request must be staged"
    assert torch.equal(_sent(pair), _landed(pair, blocks))
    stats = pair.sender.stats()
    assert stats["bytes_raw"] == LAYOUT.chunk_bytes(TOKENS)
    assert 0 < stats["bytes_wire"] < stats["bytes_raw"], stats  # what the tcp channel carried
    pair.allocator.free(blocks)


@pytest.mark.parametrize("codec", ["fp8", "int8", "bf16"])
def test_a_lossy_codec_lands_within_its_error_and_moves_far_fewer_bytes(
    make_pair: Callable[..., Pair], codec: str
) -> None:
    pair = make_pair(p_layout=LAYOUT, config=_config(codec), channel="tcp")
    blocks, _ = _push(pair, f"{codec}-1")
    sent, got = _sent(pair), _landed(pair, blocks)
    # the same codec applied locally gives exactly what landed: the wire added nothing, lost nothing more
    local = make_codec(codec, LAYOUT)
    frame = torch.empty(local.max_encoded_bytes(32), dtype=torch.uint8)
    first = sent[:, :, :32].contiguous()
    n = local.encode(first, frame)
    assert torch.equal(local.decode(frame[:n], torch.empty_like(first)), got[:, :, :32])
    rel = ((got - sent).norm() / sent.norm()).item()
    assert 0 < rel < 0.1, f"{codec}: relative error {rel}"
    stats = pair.sender.stats()
    assert stats["bytes_wire"] < 0.6 * stats["bytes_raw"], stats
    pair.allocator.free(blocks)


def test_a_request_may_go_raw_when_the_sender_is_configured_with_a_codec(make_pair: Callable[..., Pair]) -> None:
    pair = make_pair(p_layout=LAYOUT, config=_config("fp8"), channel="tcp")
    blocks, mode = _push(pair, "raw-1", codec="none")
    assert (
        mode == pair.same_layout_mode
    )  # same layouts and no codec: block writes, byte for byte (staged from a device tcp cannot reach)
    assert torch.equal(_sent(pair), _landed(pair, blocks))
    pair.allocator.free(blocks)
    stats = pair.sender.stats()
    assert stats["bytes_wire"] >= stats["bytes_raw"], stats  # whole blocks, nothing encoded
    with pytest.raises(ReservationError, match="zstd"):
        pair.sender.open("other", pair.receiver.address, TOKENS, TABLE, codec="zstd")


def test_a_receiver_that_cannot_decode_the_codec_is_refused_at_the_handshake(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    import pdkv.transfer.receiver

    monkeypatch.setattr(
        pdkv.transfer.receiver, "available_codecs", lambda layout: ["none"]
    )  # as if its zstd extra were missing
    pair = make_pair(p_layout=LAYOUT, config=_config("zstd"), channel="tcp")
    with pytest.raises(HandshakeError, match="zstd"):
        pair.sender.open("h1", pair.receiver.address, TOKENS, TABLE)
    assert pair.receiver.stats()["reservations"] == 0


def test_a_frame_that_does_not_decode_fails_the_request_and_frees_its_memory(
    make_pair: Callable[..., Pair], monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = make_pair(p_layout=LAYOUT, config=_config("fp8"), channel="tcp")
    codec = pair.sender.codecs["fp8"]
    encode = codec.encode

    def corrupt(chunk: torch.Tensor, out: torch.Tensor) -> int:
        n = encode(chunk, out)
        out[0] ^= 0xFF  # before the checksum is taken: the checksum passes, the frame's header does not
        return n

    monkeypatch.setattr(codec, "encode", corrupt)
    xfer = pair.sender.open("bad-1", pair.receiver.address, TOKENS, TABLE)
    with pytest.raises(TransferError, match="codec frame"):  # the receiver cancels: the sender hears why
        xfer.send_all()
        xfer.wait(10)
    with pytest.raises(TransferError, match="codec frame"):
        pair.receiver.wait("bad-1", 10)
    wait_until(lambda: pair.receiver.stats()["reservations"] == 0, 10, "the failed reservation to be released")
    assert pair.held_blocks() == 0  # every block free, or in the sender's pool


def test_a_notice_claiming_more_bytes_than_a_slot_is_refused_before_the_slot_is_read(
    make_pair: Callable[..., Pair],
) -> None:
    pair = make_pair(p_layout=LAYOUT, config=_config("fp8"), channel="tcp")
    r = pair.receiver
    xfer = pair.sender.open("forged", r.address, TOKENS, TABLE)
    incoming = r.book.res["forged"]  # the reservation the forged notices name
    for nbytes in (0, r.memory.slot_bytes + 1, 1 << 40):
        with pytest.raises(TransferError, match="claims"):
            incoming.land(r.memory, ChunkNotice("forged", 0, 0, 0, nbytes))
    with pytest.raises(CodecError):  # within bounds but not a frame: the codec's own checks
        incoming.land(
            r.memory, ChunkNotice("forged", 0, _zero_digest(r.memory.slot_bytes // 2), 0, r.memory.slot_bytes // 2)
        )
    xfer.cancel("test over")


def _zero_digest(n: int) -> int:
    """The checksum of ``n`` zero bytes: what an untouched staging slot holds."""
    from pdkv.checksum import chunk_checksum

    return chunk_checksum([torch.zeros(n, dtype=torch.uint8)])


def test_the_codec_travels_in_the_reserve_and_its_proof() -> None:
    """With a secret, a Reserve's codec is covered by its proof: a peer in the middle cannot switch it."""
    from pdkv.transfer.protocol import Reserve, reserve_fields

    a = reserve_fields(Reserve("r", 10, b"k", codec="fp8"))
    b = reserve_fields(msgspec.structs.replace(Reserve("r", 10, b"k", codec="fp8"), codec="none"))
    assert a != b

"""KV that is not host memory: the device checksum, the emulation of device memory, and staging through host slots.

The data path runs on CPU as if its KV were device memory (``pdkv.memory.emulate_device``):
these tests prove that the emulation bites (code that takes a host view of such KV fails, as it
would with KV in VRAM), that the checksum is the integer formula it says it is (so CUDA, which
runs the same int64 ops, gives the same value: tests/gpu/check.py compares the two on a GPU),
and that a host-only channel carries such KV through staging, bit for bit.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pdkv.channels import create_channel
from pdkv.checksum import checksum, chunk_checksum, flat_bytes
from pdkv.errors import DeviceMemoryError, LayoutError
from pdkv.layout import KVLayout, gather
from pdkv.memory import EMULATE_ENV, adopt_kv, byte_view, emulate_device, in_reach, memory_kind
from pdkv.transfer.sender import KVSender

from tests.conftest import MakePair

MASK = (1 << 64) - 1


def _reference(data: bytes, unit: int) -> int:
    """chunk_checksum written out with Python integers, from its docstring (8-byte words, rows of up to 512)."""
    from pdkv.checksum import _GOLDEN, _ROW_SALT, _UNIT_SALT, _mix64

    def weight(i: int, salt: int) -> int:
        return ((i * _GOLDEN + salt) & MASK) | 1

    words_per_unit = unit // 8
    row = min(512, max(1, words_per_unit // 16))
    total = 0
    for u in range(len(data) // unit):
        words = [
            int.from_bytes(data[u * unit + 8 * j : u * unit + 8 * j + 8], "little", signed=True)
            for j in range(words_per_unit)
        ]
        rows = [words[r : r + row] for r in range(0, words_per_unit, row)]
        value = sum(weight(r, _ROW_SALT) * sum(ws) for r, ws in enumerate(rows))
        total += weight(u, _UNIT_SALT) * value
    return _mix64((total & MASK) ^ _mix64(len(data)))


def _bytes(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("unit", [64, 1024, 8192 + 24])
def test_the_checksum_is_its_integer_formula_whatever_the_reduction_order(unit: int) -> None:
    data = _bytes(6 * unit)
    assert chunk_checksum([data], unit=unit) == _reference(bytes(data.numpy()), unit)


def test_the_checksum_depends_on_the_byte_stream_not_on_how_it_is_cut() -> None:
    unit = 512
    data = _bytes(16 * unit)
    whole = chunk_checksum([data], unit=unit)
    assert chunk_checksum([data[: 5 * unit], data[5 * unit : 6 * unit], data[6 * unit :]], unit=unit) == whole
    assert chunk_checksum([data[i * unit : (i + 1) * unit] for i in range(16)], unit=unit) == whole


def test_a_chunks_blocks_hash_the_same_in_place_and_gathered_whatever_their_ids() -> None:
    """Direct mode: P's and D's block ids differ, the bytes (tensor by tensor, block by block) do not."""
    from pdkv.checksum import blocks_checksum

    unit = 256
    kv = [_bytes(32 * unit, seed=s) for s in range(3)]
    ids = [7, 8, 9, 2, 30]
    by_block = chunk_checksum([t[b * unit : (b + 1) * unit] for t in kv for b in ids], unit=unit)
    assert blocks_checksum(kv, ids, unit) == by_block
    moved = [
        torch.zeros(32 * unit, dtype=torch.uint8) for _ in kv
    ]  # the same bytes landed in blocks 0-4 of another buffer
    for src, dst in zip(kv, moved, strict=True):
        for i, b in enumerate(ids):
            dst[i * unit : (i + 1) * unit] = src[b * unit : (b + 1) * unit]
    assert blocks_checksum(moved, range(5), unit) == by_block
    assert blocks_checksum(moved, [0, 1, 2, 4, 3], unit) != by_block


def test_the_checksum_catches_a_flipped_bit_a_misplaced_block_and_a_truncated_chunk() -> None:
    unit = 1024
    data = _bytes(8 * unit, seed=1)
    whole = chunk_checksum([data], unit=unit)
    for pos in (0, 7, 4095, 8 * unit - 1):
        for bit in (0, 7):
            flipped = data.clone()
            flipped[pos] ^= 1 << bit
            assert chunk_checksum([flipped], unit=unit) != whole, (pos, bit)
    swapped = data.clone().view(8, unit)
    swapped[[2, 5]] = swapped[[5, 2]]
    assert chunk_checksum([swapped.reshape(-1)], unit=unit) != whole
    assert chunk_checksum([data[:-unit]], unit=unit) != whole  # a block short
    stale = data.clone()
    stale[-100:] = 0  # the tail never arrived: what was there before stays
    assert chunk_checksum([stale], unit=unit) != whole
    # as one frame (staging mode): an odd length, a truncated frame
    assert chunk_checksum([data[:777]]) != chunk_checksum([data[:776]])


def test_the_checksum_refuses_what_it_cannot_hash() -> None:
    with pytest.raises(LayoutError, match="meta"):
        chunk_checksum([torch.empty(64, dtype=torch.uint8, device="meta")])
    with pytest.raises(LayoutError, match="whole units"):
        chunk_checksum([_bytes(100)], unit=64)
    with pytest.raises(LayoutError, match="flat uint8"):
        chunk_checksum([torch.zeros(4, dtype=torch.float32)])


def test_device_memory_has_no_host_view_and_the_error_says_what_to_use() -> None:
    kv = emulate_device(torch.zeros(4, 16))
    assert memory_kind(kv) == "emulated" and memory_kind(kv[1:]) == "emulated"  # every view of its storage
    for buf in (kv, kv[2], torch.empty(16, device="meta")):
        with pytest.raises(DeviceMemoryError, match="nixl") as err:
            byte_view(buf)
        assert "pinned host memory" in str(err.value) and "chunk_checksum" in str(err.value)
    assert memory_kind(torch.zeros(4)) == "host" and len(byte_view(torch.zeros(4))) == 16
    # a value computed on the device gives the same as on a host copy of the same bytes
    kv.copy_(torch.randn(4, 16))
    assert chunk_checksum([flat_bytes(kv)]) == chunk_checksum([flat_bytes(kv.clone())])


def test_code_that_takes_a_host_view_of_device_kv_fails_in_the_emulation() -> None:
    """The regression the emulation exists to catch: the transfer path as it was (host views of the KV, xxh3 over
    them)."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    kv = [emulate_device(t) for t in layout.allocate(4)]
    with pytest.raises(DeviceMemoryError):
        checksum(byte_view(t) for t in kv)  # what sender.py did for every KV tensor at construction
    with create_channel("tcp", "emulated-tcp") as tcp:
        assert not in_reach(kv[0], tcp.memory) and in_reach(torch.zeros(4), tcp.memory)
        with pytest.raises(DeviceMemoryError):
            tcp.register(kv[0])


def test_the_environment_switch_makes_every_transfer_kv_buffer_device_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    kv = [torch.zeros(4, 8), torch.zeros(4, 8)]
    adopt_kv(kv)
    assert {memory_kind(t) for t in kv} == {"host"}
    monkeypatch.setenv(EMULATE_ENV, "1")
    adopt_kv(kv)
    assert {memory_kind(t) for t in kv} == {"emulated"}


def test_kv_on_the_meta_device_no_longer_fails_at_construction() -> None:
    """What a new user tried first: the sender takes it (staging only); only hashing its no-bytes fails, naming why."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    with create_channel("mock", "meta-p") as channel:
        sender = KVSender(channel, layout, layout.allocate(4, device="meta"), "m")
        try:
            assert sender.hello().kv_regions == [] and sender.kv_memory == "other" and sender.source.stager is not None
        finally:
            sender.close()


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="a GPU is here: tests/gpu/check.py runs for real, not as this test"
)
def test_the_gpu_check_says_no_gpu_in_one_json_line_and_is_not_collected() -> None:
    """tests/gpu/check.py is a script (pytest never collects it); on CPU it answers at once, in its summary's format."""
    script = Path(__file__).parent / "gpu" / "check.py"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2, done.stderr
    assert json.loads(done.stdout)["error"].startswith("no GPU")


def test_a_host_only_channel_stages_device_kv_through_host_slots_bit_exact(make_pair: MakePair) -> None:
    """Emulated device KV over tcp: no KV region in either Hello, staging granted, each chunk gathered and hashed on
    the device."""
    layout = KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    pair = make_pair(p_layout=layout, channel="tcp", kv_memory_override="emulated")
    assert pair.sender.hello().kv_regions == [] and pair.receiver.hello().kv_regions == []
    stager = pair.sender.source.stager
    assert stager is not None and pair.receiver.memory.stager is not None
    table = [9, 3, 4, 20, 21]
    xfer = pair.sender.open("emulated-1", pair.receiver.address, 70, table)
    xfer.send_all()
    xfer.wait(10)
    blocks = pair.receiver.wait("emulated-1", 10).blocks
    assert xfer.mode == "staging"
    assert torch.equal(gather(layout, pair.p_kv, table, 0, 70), gather(layout, pair.d_kv, blocks, 0, 70))
    assert stager.chunks_out == xfer.num_chunks and pair.receiver.memory.stager.chunks_in == xfer.num_chunks
    pair.allocator.free(blocks)

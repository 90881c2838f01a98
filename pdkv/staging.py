"""KV on a device the channel cannot reach: chunks through pinned host memory, ordered by events.

A tcp (or ucx) channel moves host memory only. With the KV in VRAM the
sender gathers each chunk on the KV's device, copies it asynchronously into a
pinned host slot on a stream of pdkv's own and posts the write once that
chunk's copy is done (its event, not a device-wide synchronize): while chunk
k is copied, chunk k-1 is on the wire, since the channel sends on its own
thread. The receiver copies a landed slot to the device on the same kind of
stream, scatters it into the blocks there, and waits for that chunk's event
before it frees the slot and counts the chunk as landed, so the engine's
stream sees every byte of a block it is handed.

On CPU (and for emulated device memory, ``pdkv.memory``) the same calls run:
the stream is a stand-in whose events are done at once, ``copy_`` with
``non_blocking`` is a plain copy, so the CPU suite goes through exactly the
code a GPU does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Protocol

import torch

from pdkv import native
from pdkv.checksum import flat_bytes, frame_checksum
from pdkv.layout import BlockTable, KVLayout, check_chunk
from pdkv.memory import emulate_device, memory_kind


class CopyEvent(Protocol):
    """What pdkv waits on for one chunk's copies: ``torch.cuda.Event`` on a GPU."""

    def synchronize(self) -> None: ...


class _Done:
    """The event of work that ran synchronously (CPU): already complete."""

    def synchronize(self) -> None:
        return None


_DONE = _Done()


def pinned_empty(nbytes: int) -> torch.Tensor:
    """A host staging buffer: page-locked when a CUDA device is present (so device copies are asynchronous DMA)."""
    return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())


class CopyStream:
    """pdkv's own stream on the KV's device; on CPU a stand-in with the same calls and nothing to wait for."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def after_callers_work(self) -> None:
        """Order our next copies after what the calling thread's stream has queued (the forward step that wrote
        the KV)."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Run torch ops inside on our stream."""
        if self._stream is None:
            yield
            return
        with torch.cuda.stream(self._stream):
            yield

    def record(self) -> CopyEvent:
        """An event that completes when everything queued on our stream so far has run."""
        if self._stream is None:
            return _DONE
        event = torch.cuda.Event()
        event.record(self._stream)
        return event


class DeviceStager:
    """Moves canonical chunks between a KV buffer the channel cannot reach and host staging slots.

    One per sender or receiver; its device scratch holds one chunk, so calls
    are serialised (a lock): the copies of one chunk are queued back to back on
    our stream and only the wait for that chunk's event blocks.
    """

    def __init__(self, layout: KVLayout, kv: list[torch.Tensor], chunk_tokens: int) -> None:
        self.layout = layout
        self.kv = kv
        self.paged = native.PagedBuffer(layout, kv)
        self.device = kv[0].device
        self.kind = memory_kind(kv[0])
        self.stream = CopyStream(self.device)
        scratch = torch.empty(layout.chunk_bytes(chunk_tokens), dtype=torch.uint8, device=self.device)
        self.scratch = emulate_device(scratch) if self.kind == "emulated" else scratch
        self._lock = threading.Lock()
        # chunks staged device -> host (sender) and host -> device (receiver): what benchmarks and tests read
        self.chunks_out = 0
        self.chunks_in = 0

    def _chunk(self, n: int) -> torch.Tensor:
        return self.scratch[: self.layout.chunk_bytes(n)].view(self.layout.torch_dtype).view(self.layout.chunk_shape(n))

    def stage_out(
        self, block_table: BlockTable, start: int, n: int, host_out: torch.Tensor, digest: bool = True
    ) -> int | None:
        """Gather tokens ``[start, start+n)`` on the KV's device into ``host_out`` (flat uint8); the chunk's
        checksum if ``digest``.

        The checksum is computed on the device, over the bytes gathered there,
        by the gather itself where its kernel can (CPU: in the same pass), else
        right after it (a codec that re-encodes the chunk on the host hashes its
        own frame: ``digest=False``); returns only once the copy into
        ``host_out`` is done (its event).
        """
        with self._lock:
            self.stream.after_callers_work()
            with self.stream.active():
                chunk, acc = self.paged.gather_summed(block_table, start, n, self._chunk(n), digest)
                dev_bytes = flat_bytes(chunk)
                host_out.copy_(dev_bytes, non_blocking=True)
                event = self.stream.record()
                value = frame_checksum(dev_bytes, acc) if digest else None
            event.synchronize()
            self.chunks_out += 1
        return value

    def stage_in(self, block_table: BlockTable, start: int, chunk: torch.Tensor, digest: bool = False) -> int | None:
        """Copy a canonical host chunk to the KV's device and scatter it into the blocks; returns once it is there,
        with the chunk's checksum if ``digest``.

        The checksum is the receiver's verify, computed on the device over the
        bytes that landed there, by the scatter itself where its kernel can (in
        the same pass), else right after it.
        """
        with self._lock:
            with self.stream.active():
                dev = self._chunk(check_chunk(self.layout, chunk, "staged chunk"))
                dev.copy_(chunk, non_blocking=True)
                acc = self.paged.scatter_summed(block_table, start, dev, digest)
                event = self.stream.record()
                value = frame_checksum(flat_bytes(dev), acc) if digest else None
            event.synchronize()
            self.chunks_in += 1
        return value

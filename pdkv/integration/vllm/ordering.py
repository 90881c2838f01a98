"""Where vLLM's device work stands, as events: the one abstraction the connector orders its transfers by.

On a GPU, vLLM queues a forward step's kernels and returns long before they
ran. The connector's own threads (push, loaders) must not read or write
vLLM's blocks until the device work that concerns them is done, and must not
stall vLLM's thread or the whole device to find out:

* P: ``wait_for_save`` (vLLM's thread, after the step's last layer was
  queued) marks an event on vLLM's stream; the push thread waits for that
  event before it posts a chunk computed in that step, so a chunk never
  leaves before the step that wrote it finished on the device.
* D: ``start_load_kv`` marks an event before the loader lets pdkv write
  into a request's newly allocated blocks (their previous owner's kernels
  may still be queued); the receiver hands the blocks over (and vLLM is
  told they are loaded, ``get_finished``) only after the bytes are there:
  the channel's completion, or a staged chunk's scatter event.

No ``torch.cuda.synchronize()``: each wait is one event, on a pdkv thread.
On CPU the work ran synchronously, so the events are done at once, and the
calls are the same: the CPU suite runs the code a GPU runs, with events that
are no-ops (or, in the tests, fakes that record the order of calls).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class StepEvent(Protocol):
    """``torch.cuda.Event``'s two calls the connector uses."""

    def record(self) -> None: ...

    def synchronize(self) -> None: ...


class _CpuEvent:
    """CPU work has run by the time the caller returns: nothing to record, nothing to wait for."""

    def record(self) -> None:
        return None

    def synchronize(self) -> None:
        return None


class _CudaEvent:
    """A CUDA event recorded on the current stream of one device (vLLM's stream, when vLLM's thread marks it)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._event = torch.cuda.Event()

    def record(self) -> None:
        self._event.record(torch.cuda.current_stream(self.device))

    def synchronize(self) -> None:
        self._event.synchronize()  # waits for this event only, on the calling (pdkv) thread


class DeviceOrder:
    """Marks how far the calling thread's device work has been queued; ``make_event`` is for tests."""

    def __init__(self, device: torch.device, make_event: Callable[[], StepEvent] | None = None) -> None:
        self.device = device
        if make_event is None:
            make_event = (lambda: _CudaEvent(device)) if device.type == "cuda" else _CpuEvent
        self._make_event = make_event

    def mark(self) -> StepEvent:
        """An event done once everything the calling thread queued on its device so far has run."""
        event = self._make_event()
        event.record()
        return event

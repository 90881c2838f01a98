"""Wake a thread sleeping in ``zmq.Poller.poll`` when another thread queued work for it.

The sender's and receiver's I/O threads own their ZeroMQ sockets (sockets are
not thread-safe) and sleep in ``poll``; other threads hand them messages
through a queue. Without a wake-up, a queued ``Reserve`` waited for the poll
timeout (10 ms) before it left. A pipe's read end is pollable next to the
sockets.
"""

from __future__ import annotations

import os


class Waker:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        try:
            os.write(self._w, b"\0")
        except BlockingIOError:  # the pipe is full: the reader is already due to wake
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass

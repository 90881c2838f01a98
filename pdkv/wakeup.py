"""Wake a thread sleeping in ``poll`` when another thread has work for it.

The control endpoints' I/O threads own their ZeroMQ sockets (sockets are not
thread-safe) and sleep in ``poll``; other threads hand them work through a
queue, and channels deliver notifications into an inbox. A pipe's read end is
pollable next to the sockets, so the sleeper wakes at once instead of at its
next timeout.
"""

from __future__ import annotations

import os
import threading


class Waker:
    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._closed = False
        self._lock = threading.Lock()  # a wake-up racing with close must never write to a reused fd number

    def fileno(self) -> int:
        return self._r

    def wake(self) -> None:
        with self._lock:
            if self._closed:  # nobody is left to wake
                return
            try:
                os.write(self._w, b"\0")
            except BlockingIOError:  # the pipe is full: the reader is already due to wake
                pass

    def clear(self) -> None:
        with self._lock:
            if self._closed:
                return
            try:
                while os.read(self._r, 4096):
                    pass
            except BlockingIOError:
                pass

    def __del__(self) -> None:
        # the owner never closed it: one whose construction failed after making it (a channel that found no
        # backend), which nobody can close; its pipe goes with it instead of staying open for the process's life
        if getattr(self, "_closed", True) is False:
            self.close()

    def close(self) -> None:
        """Idempotent: a second close must never close an fd number reused by someone else."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for fd in (self._r, self._w):
                try:
                    os.close(fd)
                except OSError:
                    pass

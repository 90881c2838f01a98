"""A relay between a prefill and a decode worker, as an attacker on the workers' network without the secret runs one.

It takes the prefill's control connection (a ROUTER where the prefill dials), passes every message on to the real
decode worker unchanged under the prefill's own routing id, and passes the answers back, but for one change: the
decode worker's Hello comes back with its tcp data address pointed at the relay, which forwards each data connection
to the real one byte for byte and counts what went through. The tests hold pdkv to what this must never get: a
handshake accepted, or one byte of anybody's KV through it.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator

import msgspec
import zmq

from pdkv.channels.tcp.wire import decode_meta
from pdkv.errors import ProtocolError
from pdkv.transfer import protocol

_POLL_MS = 50
_PIECE = 1 << 16


class Relay:
    """``address``: where a sender dials to reach ``receiver`` (a decode worker's control address) through us."""

    def __init__(self, receiver: str, timeout: float = 10.0) -> None:
        self.receiver, self.timeout = receiver, timeout
        self.ctx = zmq.Context()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.address = f"tcp://127.0.0.1:{self.front.bind_to_random_port('tcp://127.0.0.1')}"
        self.data = ByteRelay(timeout=timeout)  # its target: the real data address, from the receiver's Hello
        self.hellos_rewritten = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._control, name="relay-control", daemon=True)
        self._thread.start()

    def _control(self) -> None:
        backs: dict[bytes, zmq.Socket] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                for sock, _ in poller.poll(_POLL_MS):
                    if sock is self.front:
                        identity, *frames = self.front.recv_multipart()
                        back = backs.get(identity)
                        if back is None:
                            back = backs[identity] = self.ctx.socket(zmq.DEALER)
                            back.setsockopt(zmq.LINGER, 0)
                            back.setsockopt(zmq.ROUTING_ID, identity)  # the receiver sees the sender's own id
                            back.connect(self.receiver)
                            poller.register(back, zmq.POLLIN)
                        back.send_multipart(frames)
                    else:
                        identity = next(i for i, b in backs.items() if b is sock)
                        self.front.send_multipart([identity, *self._rewrite(sock.recv_multipart())])
        finally:
            for back in backs.values():
                back.close(0)
            self.front.close(0)

    def _rewrite(self, frames: list[bytes]) -> list[bytes]:
        """The receiver's Hello with its data address made ours; everything else as it came."""
        try:
            msg = protocol.decode(frames[0])
        except ProtocolError:
            return frames
        if not isinstance(msg, protocol.Hello):
            return frames
        real = decode_meta(msg.channel_metadata)
        self.data.target = (real.host, real.port)
        ours = msgspec.structs.replace(real, host="127.0.0.1", port=self.data.port)
        self.hellos_rewritten += 1
        forged = msgspec.structs.replace(msg, channel_metadata=msgspec.msgpack.encode(ours))
        return [protocol.encode(forged), *frames[1:]]

    def close(self) -> None:
        """Leave: the control connections and every data connection through us close."""
        self._stop.set()
        self._thread.join(self.timeout)
        self.data.close()
        self.ctx.term()


class ByteRelay:
    """A tcp forwarder to ``target`` (set once known): counts what the dialling side wrote, and may rewrite the first
    piece each dialling connection sends (``rewrite``), as one on the path rewrites a handshake. ``back`` sees each
    piece coming back first: it may send some of it to the dialling side itself (the socket it is given) and returns
    the rest to forward (a peer trickling its answers, say). ``port``: where it listens (0: any free port), so that a
    relay closed and started again is one peer that went away and came back at its address."""

    def __init__(
        self,
        target: tuple[str, int] | None = None,
        rewrite: Callable[[bytes], bytes] | None = None,
        timeout: float = 10.0,
        back: Callable[[bytes, socket.socket], bytes] | None = None,
        port: int = 0,
    ) -> None:
        self.target, self.rewrite, self.timeout, self.back = target, rewrite, timeout, back
        self.listener = socket.create_server(("127.0.0.1", port))
        self.listener.settimeout(_POLL_MS / 1000)
        self.port: int = self.listener.getsockname()[1]
        self.connections = 0
        self.bytes = 0  # what dialling sides wrote through us
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pipes: list[threading.Thread] = []
        self._thread = threading.Thread(target=self._accept, name="relay-data", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if self.target is None:
                conn.close()
                continue
            self.connections += 1
            pipe = threading.Thread(target=self._pipe_pair, args=(conn, self.target), name="relay-pipe", daemon=True)
            self._pipes.append(pipe)
            pipe.start()

    def _pipe_pair(self, conn: socket.socket, target: tuple[str, int]) -> None:
        with contextlib.closing(conn), socket.create_connection(target, timeout=self.timeout) as up:
            back = threading.Thread(target=self._pump, args=(up, conn, False), daemon=True)
            back.start()
            self._pump(conn, up, True)
            back.join(self.timeout)

    def _pump(self, src: socket.socket, dst: socket.socket, forward: bool) -> None:
        """Copy ``src`` to ``dst`` until either ends; ``forward`` (the dialling side's bytes): counted, and the first
        piece rewritten."""
        src.settimeout(_POLL_MS / 1000)
        first = forward and self.rewrite is not None
        while not self._stop.is_set():
            try:
                data = src.recv(_PIECE)
            except TimeoutError:
                continue
            except OSError:
                break
            if not data:
                break
            if forward:
                with self._lock:
                    self.bytes += len(data)
            if first and self.rewrite is not None:
                data, first = self.rewrite(data), False
            try:
                if not forward and self.back is not None:
                    data = self.back(data, dst)
                dst.sendall(data)
            except OSError:
                break
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        """Stop: every connection through us ends (its pumps see the stop within a poll) and is joined."""
        self._stop.set()
        self._thread.join(self.timeout)
        for pipe in self._pipes:
            pipe.join(self.timeout)
        self.listener.close()


@contextlib.contextmanager
def relay(receiver: str) -> Iterator[Relay]:
    r = Relay(receiver)
    try:
        yield r
    finally:
        r.close()

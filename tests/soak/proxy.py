"""A TCP forwarder in front of a decode worker's tcp channel that flips one byte of a chunk when told to."""

from __future__ import annotations

import socket
import threading

from pdkv.channels.tcp.wire import DATA, HDR_SIZE, HEADER, NOTIF_FOLLOWS, READ_REQ, RUN


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None on a clean close before the first of them."""
    buf = bytearray()
    while len(buf) < n:
        data = sock.recv(n - len(buf))
        if not data:
            if buf:
                raise ConnectionError(f"closed after {len(buf)} of {n} bytes")
            return None
        buf += data
    return bytes(buf)


class CorruptingProxy:
    """A TCP forwarder in front of a tcp channel listener that flips a byte of a chunk when armed.

    Bytes towards the listener are read frame by frame (the framing of
    channels/tcp/wire.py), so that an armed flip lands in the middle of the next
    DATA payload and never in a header, a handshake or a notification: the
    channel then sees nothing wrong but a chunk whose bytes changed, exactly
    what a bad NIC, cable or switch does, and only the receiver's checksum can
    tell. The other direction is forwarded untouched.
    """

    def __init__(self, upstream_port: int) -> None:
        self.upstream = ("127.0.0.1", upstream_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.server.getsockname()[1]
        self.cond = threading.Condition()
        self.armed = 0  # flips still to make
        self.flipped = 0  # flips made
        self.conns: set[socket.socket] = set()
        self._acceptor = threading.Thread(target=self._accept, name="soak-proxy", daemon=True)
        self._acceptor.start()

    def arm(self) -> int:
        """Flip a byte of the next DATA payload; returns the flip count to wait for (``wait_flipped``)."""
        with self.cond:
            self.armed += 1
            return self.flipped + self.armed

    def wait_flipped(self, count: int, timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: self.flipped >= count, timeout)

    def _take(self) -> bool:
        with self.cond:
            if not self.armed:
                return False
            self.armed -= 1
            return True

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(client,), name="soak-proxy-conn", daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.upstream, timeout=5)
        except OSError:  # the worker is down (being restarted): the channel sees a refused connection
            client.close()
            return
        upstream.settimeout(None)
        with self.cond:
            self.conns.update((client, upstream))
        back = threading.Thread(target=self._pipe_back, args=(upstream, client), daemon=True)
        back.start()
        try:
            self._forward_frames(client, upstream)
        except OSError:
            pass  # either side went away: hang up both, as a dead link would
        finally:
            for sock in (client, upstream):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            back.join(10)
            with self.cond:
                self.conns.difference_update((client, upstream))
            client.close()
            upstream.close()

    @staticmethod
    def _pipe_back(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(1 << 16):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            try:
                dst.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _forward_frames(self, src: socket.socket, dst: socket.socket) -> None:
        while (hdr := _recv_exact(src, HDR_SIZE)) is not None:
            _, _, ftype, flags, _, aux, notif, _, _, length = HEADER.unpack(hdr)
            dst.sendall(hdr)
            if ftype == DATA:  # its run table, then the runs' bytes
                self._copy(src, dst, aux * RUN.size, -1)
            # a READ_REQ's length is what it asks for, not what follows it
            payload = 0 if ftype == READ_REQ else length
            flip_at = payload // 2 if ftype == DATA and self._take() else -1
            self._copy(src, dst, payload, flip_at)
            if ftype == DATA and flags & NOTIF_FOLLOWS:
                self._copy(src, dst, notif, -1)

    def _copy(self, src: socket.socket, dst: socket.socket, n: int, flip_at: int) -> None:
        """Forward ``n`` bytes, inverting the one at ``flip_at`` (-1: none) on the way."""
        pos = 0
        while pos < n:
            data = src.recv(min(n - pos, 1 << 20))
            if not data:
                raise ConnectionError(f"closed inside a frame, {pos} of {n} bytes forwarded")
            if pos <= flip_at < pos + len(data):
                flipped = bytearray(data)
                flipped[flip_at - pos] ^= 0xFF
                dst.sendall(flipped)
                with self.cond:
                    self.flipped += 1
                    self.cond.notify_all()
            else:
                dst.sendall(data)
            pos += len(data)

    def close(self) -> None:
        try:  # a close alone wakes no blocked accept
            self.server.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.server.close()
        self._acceptor.join(10)
        with self.cond:
            conns = list(self.conns)
        for sock in conns:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

"""Stores that misbehave on purpose, on 127.0.0.1: what the conformance kit points a shared level at to hold it to
its bounds (``pdkv.testing.tier_conformance``: the rules on a hostile store; ``pdkv.tier.bounds``).

Each server speaks just enough of its protocol for a level's client, answers
everything else as an empty, healthy store would (nothing stored, every
write taken), and misbehaves in one way, its ``behaviour``:

* ``trickle``: the answer to a read (a value, or whether a key is stored)
  comes one byte every ``timeout_s / 4``, just inside any per-read timeout,
  for up to ``TRICKLE_S`` seconds;
* ``huge``: a value's answer declares a huge length (Redis: a 1 GiB bulk
  string, S3: an 8 GiB Content-Length) and then streams zeros as fast as the
  client takes them, up to ``HUGE_BYTES``, so what a client read shows in
  ``sent``;
* ``malformed``: answers that break the protocol's promises (Redis: a length
  or an integer that is not a number; S3: a CreateMultipartUpload answer
  without an UploadId, a GET whose body is not a chunk).

``resp_server`` speaks RESP (Redis, Valkey), ``s3_server`` S3's REST API over
HTTP/1.1. A backend speaking another protocol passes the kit its own server
with the same shape (``HostileServer``: a context manager with ``address``
and ``sent``).
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO, Protocol

BEHAVIOURS = ("trickle", "huge", "malformed")
TRICKLE_S = 4.0  # how long a trickle lasts at most: a bounded client gives up long before
HUGE_BYTES = 128 << 20  # the most a huge answer streams: what an unbounded client reads whole
VALUE_BYTES = 512  # the length a trickled value declares: within any chunk's, more than TRICKLE_S trickles
_PIECE = 1 << 20


class HostileServer(Protocol):
    """A running misbehaving store."""

    address: str  # "127.0.0.1:PORT"
    sent: int  # bytes of misbehaving answers the client took in (what its kernel accepted)


class _Server:
    """A TCP server on 127.0.0.1 that runs ``handle(conn, reader)`` per connection on a thread of its own."""

    def __init__(
        self, handle: Callable[[_Server, socket.socket, BinaryIO], None], behaviour: str, timeout_s: float
    ) -> None:
        if behaviour not in BEHAVIOURS:
            raise ValueError(f"behaviour {behaviour!r}: expected one of {', '.join(BEHAVIOURS)}")
        self.behaviour, self.interval_s = behaviour, timeout_s / 4
        self.sent = 0
        self._handle = handle
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, name="pdkv-hostile-accept", daemon=True)]
        self._lock = threading.Lock()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # closed: the server stops
            with self._lock:
                self._conns.append(conn)
                thread = threading.Thread(target=self._serve, args=(conn,), name="pdkv-hostile-conn", daemon=True)
                self._threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        with contextlib.suppress(OSError, ValueError), conn, conn.makefile("rb") as reader:
            self._handle(self, conn, reader)

    def trickle(self, conn: socket.socket, head: bytes, filler: bytes = b"\0") -> None:
        """Send ``head`` at once, then ``filler`` (one byte) every ``interval_s`` until ``TRICKLE_S`` passed; then
        close."""
        conn.sendall(head)
        for _ in range(int(TRICKLE_S / self.interval_s)):
            if self._stop.wait(self.interval_s):
                break
            conn.sendall(filler)
            self.sent += 1
        conn.shutdown(socket.SHUT_RDWR)

    def stream(self, conn: socket.socket, head: bytes) -> None:
        """Send ``head``, then zeros as fast as the client takes them, up to ``HUGE_BYTES``; then close."""
        conn.sendall(head)
        piece = bytes(_PIECE)
        while self.sent < HUGE_BYTES and not self._stop.is_set():
            conn.sendall(piece)
            self.sent += len(piece)
        conn.shutdown(socket.SHUT_RDWR)

    def __enter__(self) -> _Server:
        self._threads[0].start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept (a close alone would not)
        self._listener.close()
        with self._lock:
            for conn in self._conns:
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            threads = list(self._threads)
        for thread in threads:
            thread.join(10.0)


# -- RESP -------------------------------------------------------------------------------------
def _resp_command(reader: BinaryIO) -> list[bytes] | None:
    """One command as a client sends it (an array of bulk strings); None at the end of the connection."""
    line = reader.readline()
    if not line.startswith(b"*"):
        return None
    args = []
    for _ in range(int(line[1:])):
        size = int(reader.readline()[1:])
        args.append(reader.read(size + 2)[:-2])
    return args


_RESP_HEALTHY = {b"PING": b"+PONG\r\n", b"EXISTS": b":0\r\n", b"DEL": b":0\r\n", b"GET": b"$-1\r\n"}
_RESP_DATA = (b"GET", b"SET", b"EXISTS", b"DEL")
# COMMAND's answer for the commands a cluster client routes by key (name, arity, flags, first/last key, step)
_RESP_COMMANDS = b"*4\r\n" + b"".join(
    b"*6\r\n$%d\r\n%s\r\n:%d\r\n*0\r\n:1\r\n:%d\r\n:1\r\n" % (len(name), name, arity, last)
    for name, arity, last in ((b"get", 2, 1), (b"set", -3, 1), (b"exists", -2, -1), (b"del", -2, -1))
)


def _cluster_slots(server: _Server) -> bytes:
    """CLUSTER SLOTS: every slot on this server alone (a cluster client then sends it every key)."""
    host, port = server.address.split(":")
    return b"*1\r\n*3\r\n:0\r\n:16383\r\n*3\r\n$%d\r\n%s\r\n:%s\r\n$40\r\n%s\r\n" % (
        len(host),
        host.encode(),
        port.encode(),
        b"0" * 40,
    )


def _resp(server: _Server, conn: socket.socket, reader: BinaryIO) -> None:
    while (args := _resp_command(reader)) is not None:
        name = args[0].upper()
        if server.behaviour == "malformed" and name in _RESP_DATA:
            conn.sendall(b"$not-a-length\r\n" if name == b"GET" else b":not-a-number\r\n")
        elif name == b"GET" and server.behaviour == "trickle":
            server.trickle(conn, b"$%d\r\n" % VALUE_BYTES)
            return
        elif name == b"EXISTS" and server.behaviour == "trickle":
            server.trickle(conn, b":", b"0")  # an integer that never ends
            return
        elif name == b"GET" and server.behaviour == "huge":
            server.stream(conn, b"$%d\r\n" % (1 << 30))
            return
        elif name == b"CLUSTER" and args[1:2] == [b"SLOTS"]:
            conn.sendall(_cluster_slots(server))
        elif name == b"COMMAND":
            conn.sendall(_RESP_COMMANDS)
        elif name == b"HELLO":  # as Redis 6 and later answer it (a RESP3 map in RESP3); replies stay RESP2-shaped
            proto = args[1] if len(args) > 1 else b"2"
            conn.sendall((b"%1\r\n" if proto == b"3" else b"*2\r\n") + b"$5\r\nproto\r\n:" + proto + b"\r\n")
        else:
            conn.sendall(_RESP_HEALTHY.get(name, b"+OK\r\n"))


@contextlib.contextmanager
def resp_server(behaviour: str, timeout_s: float) -> Iterator[HostileServer]:
    """A Redis that misbehaves as ``behaviour`` says (the module docstring) for a client whose timeout is
    ``timeout_s``; its URL is ``redis://`` + ``address``."""
    with _Server(_resp, behaviour, timeout_s) as server:
        yield server


# -- S3 ---------------------------------------------------------------------------------------
def _http_answer(status: str, body: bytes = b"", **headers: str | int) -> bytes:
    lines = [f"HTTP/1.1 {status}", f"Content-Length: {headers.pop('length', len(body))}"]
    lines += [f"{name.replace('_', '-')}: {value}" for name, value in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def _s3_answer(server: _Server, method: str, path: str, query: str) -> bytes:
    """The answer of a healthy, empty store (the misbehaving ones are ``_s3``'s)."""
    is_object = "/" in path.strip("/")
    if method == "HEAD":
        return _http_answer("404 Not Found") if is_object else _http_answer("200 OK")
    if method == "GET" and is_object:  # a malformed store's GET: a body that is no chunk
        return _http_answer("200 OK", b"<not a chunk>")
    if method == "POST" and query.startswith("uploads"):
        upload = "" if server.behaviour == "malformed" else "<UploadId>hostile-upload</UploadId>"
        xml = f"<InitiateMultipartUploadResult><Bucket>b</Bucket><Key>k</Key>{upload}</InitiateMultipartUploadResult>"
        return _http_answer("200 OK", xml.encode(), Content_Type="application/xml")
    if method == "POST" and "uploadId=" in query:
        return _http_answer("200 OK", b"<CompleteMultipartUploadResult/>", Content_Type="application/xml")
    if method == "POST" and query.startswith("delete"):
        return _http_answer("200 OK", b"<DeleteResult/>", Content_Type="application/xml")
    if method == "DELETE":
        return _http_answer("204 No Content")
    return _http_answer("200 OK", ETag='"0123456789abcdef0123456789abcdef"')


def _s3(server: _Server, conn: socket.socket, reader: BinaryIO) -> None:
    while line := reader.readline(65536):
        method, target = line.decode("latin-1").split(" ")[:2]
        headers = {}
        while (header := reader.readline(65536)) not in (b"\r\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        if headers.get("expect", "").lower() == "100-continue":
            conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        reader.read(int(headers.get("content-length", 0)))
        path, _, query = target.partition("?")
        if method == "HEAD" and "/" in path.strip("/") and server.behaviour == "trickle":
            server.trickle(conn, b"HTTP/1.1 200 OK\r\nX-Trickle: ", b"a")  # headers that never end
            return
        if method == "GET" and "/" in path.strip("/") and server.behaviour != "malformed":
            head = _http_answer("200 OK", length=VALUE_BYTES if server.behaviour == "trickle" else 8 << 30)
            (server.trickle if server.behaviour == "trickle" else server.stream)(conn, head)
            return
        conn.sendall(_s3_answer(server, method, path, query))


@contextlib.contextmanager
def s3_server(behaviour: str, timeout_s: float) -> Iterator[HostileServer]:
    """An S3 store that misbehaves as ``behaviour`` says (the module docstring) for a client whose timeout is
    ``timeout_s``; its endpoint URL is ``http://`` + ``address`` (any bucket, any credentials)."""
    with _Server(_s3, behaviour, timeout_s) as server:
        yield server

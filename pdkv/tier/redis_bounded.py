"""The Redis tier's connections read within their request's bounds (``pdkv.tier.bounds``).

redis-py bounds each socket read by ``socket_timeout``, not a command, and
reads a bulk reply whole whatever length it declares. Every connection the
tier makes (one server or each cluster node) swaps its parser, as it
connects (``redis_connect_func``: a hook redis-py's single and cluster
clients both take), for ``BoundedParser``, which

* refuses a bulk length (``$N``) over the request's limit (outside one,
  ``bounds.ANSWER_BYTES``) and an array
  (``*N``) of more than ``MAX_ITEMS`` before reading them, and never
  buffers more unread bytes than the limit allows;
* watches its socket while it waits for an answer, so the request's
  deadline shuts it (``bounds.shut``): the read ends at once;
* answers a malformed reply (a length or an integer that is not a number)
  with an error instead of a ``ValueError`` escaping the client.

Each of these raises ``AnswerRefused``, a redis ``ConnectionError``: both
clients then drop the connection (never reused half-read) and fail the rest
of its pipeline, and the tier counts a failure (``pdkv.tier.redis_backend``).
This is redis-py's pure-Python RESP2 parser: hiredis, when installed, is not
used by the tier (it reads a declared length whole before Python sees it).
A value (a bulk string of ``DIRECT_BYTES`` or more) is received straight
into its own buffer, one copy from the kernel, where redis-py's own buffer
copies it four times: GETs of 11.8 MB chunks are as fast as hiredis's.
"""

from __future__ import annotations

from typing import Any

from redis._parsers import _RESP2Parser
from redis._parsers.socket import SENTINEL, SERVER_CLOSED_CONNECTION_ERROR, SocketBuffer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from pdkv.errors import StoreAnswerError
from pdkv.tier.bounds import ANSWER_BYTES, current, request, shut

MAX_ITEMS = 1 << 16  # the most items an array reply may declare (the tier's commands answer none; CLUSTER SLOTS few)
DIRECT_BYTES = 1 << 16  # a bulk string this long or longer is received straight into its own buffer
HANDSHAKE_S = 2.0  # a connection's handshake timeout where it has no socket_timeout (the tier always gives one)


class AnswerRefused(RedisConnectionError):
    """An answer out of its request's bounds (``StoreAnswerError``'s message); the connection is dropped."""


class _BoundedBuffer(SocketBuffer):
    """The parser's socket buffer, checking declared lengths against the request's limit before reading them."""

    def readline(self, *args: Any, **kwargs: Any) -> bytes:  # redis-py 6+ passes a timeout, 5 none
        line = super().readline(*args, **kwargs)
        kind = line[:1]
        if kind in (b"$", b"*", b":"):
            try:
                size = int(line[1:])
            except ValueError:
                raise StoreAnswerError(f"a malformed reply {bytes(line[:40])!r}: not a number") from None
            bounds = current()
            if kind == b"$" and bounds is not None:
                bounds.check_declared(size, "the server")
            elif kind == b"$" and size > ANSWER_BYTES:  # outside a request (a cluster client's own look-ups)
                raise StoreAnswerError(f"the server declared a {size}-byte answer, more than {ANSWER_BYTES}")
            if kind == b"*" and size > MAX_ITEMS:
                raise StoreAnswerError(f"the server declared an array of {size} items, more than {MAX_ITEMS}")
        return line

    def read(self, length: int, *args: Any, **kwargs: Any) -> bytes | bytearray:
        """A bulk string of ``length`` bytes (its length checked by ``readline``); a long one is received into a
        buffer of its own (the bytes already buffered, then ``recv_into`` the rest)."""
        if length < DIRECT_BYTES:
            return super().read(length, *args, **kwargs)
        value = bytearray(length + 2)  # and its CRLF
        view = memoryview(value)
        got = self._buffer.readinto(view)
        while got < len(value):
            received = self._sock.recv_into(view[got:])
            if not received:
                raise RedisConnectionError(SERVER_CLOSED_CONNECTION_ERROR)
            got += received
        view.release()
        if value[-2:] != b"\r\n":
            raise StoreAnswerError(f"a malformed reply: a {length}-byte bulk string not ended by CRLF")
        del value[-2:]
        return value

    def _read_from_socket(
        self, length: int | None = None, timeout: Any = SENTINEL, raise_on_timeout: bool = True
    ) -> bool:
        bounds = current()
        if bounds is not None and length is None and self.unread_bytes() > bounds.limit + self.socket_read_size:
            raise StoreAnswerError(f"the server sent more than {bounds.limit} bytes without ending a reply line")
        return super()._read_from_socket(length, timeout, raise_on_timeout)


class BoundedParser(_RESP2Parser):
    """redis-py's RESP2 parser within the request's bounds (the module docstring)."""

    def on_connect(self, connection: Any) -> None:
        super().on_connect(connection)
        self._buffer = _BoundedBuffer(self._sock, self.socket_read_size, connection.socket_timeout)

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        bounds = current()
        if bounds is None:
            return super().read_response(*args, **kwargs)
        sock = self._sock
        try:
            bounds.answering()
            with bounds.watching(lambda: shut(sock)):
                return super().read_response(*args, **kwargs)
        except StoreAnswerError as exc:
            raise AnswerRefused(str(exc)) from exc
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            if bounds.expired:
                raise AnswerRefused(str(bounds.late())) from exc
            raise


def bounded_connect(connection: Any) -> None:
    """``redis_connect_func``: read this connection's answers with ``BoundedParser``, then connect as usual; the
    handshake (AUTH, SELECT, CLIENT SETINFO) is a request of its own, so the clock of the command that made the
    connection starts when that command is sent."""
    connection.set_parser(BoundedParser)
    with request("a new connection's handshake", connection.socket_timeout or HANDSHAKE_S):
        connection.on_connect()

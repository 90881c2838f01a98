"""The S3 level's HTTP connections within their request's bounds (``pdkv.tier.bounds``).

botocore's ``read_timeout`` bounds each socket read, not a request, and an
answer's body is read whole whatever it declares. ``bound_http`` gives one
client connections (botocore's own, plus this mixin) that, inside a
``bounds.request``:

* from the moment a request is sent until the request ends, let its
  deadline (``timeout_s`` from when the answer is awaited) shut their
  socket (``bounds.shut``): a trickle in the headers or the body ends at
  once, and urllib3 never hands out a shut connection again (it checks a
  pooled connection for EOF before reusing it);
* refuse an answer whose Content-Length is over the request's limit as soon
  as its headers are in, before any of the body is read, and close the
  connection (a HEAD's Content-Length describes the object, not a body).

The level reads a GET's body itself, at most the limit (``pdkv.tier.s3``).
"""

from __future__ import annotations

import threading
from typing import Any

from botocore.awsrequest import AWSHTTPConnection, AWSHTTPConnectionPool, AWSHTTPSConnection, AWSHTTPSConnectionPool

from pdkv.errors import ConfigError, StoreAnswerError
from pdkv.tier.bounds import Request, current, shut


class _Bounded:
    """The bounds of ``pdkv.tier.bounds`` on an HTTP connection (a mixin in front of botocore's)."""

    sock: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._owner: Request | None = None  # the request this connection serves now
        self._owner_lock = threading.Lock()
        self._method = ""

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        self._method = method
        bounds = current()
        with self._owner_lock:
            self._owner = bounds
        if bounds is not None:
            bounds.attach(lambda: self._expire(bounds))
        return super().request(method, url, *args, **kwargs)  # type: ignore[misc]

    def _expire(self, bounds: Request) -> None:
        """The deadline of ``bounds`` passed: shut the socket, unless the connection serves another request now."""
        with self._owner_lock:
            if self._owner is bounds:
                shut(self.sock)

    def getresponse(self, *args: Any, **kwargs: Any) -> Any:
        bounds = current()
        if bounds is not None:
            bounds.answering()  # sent: the answer's clock starts
        response = super().getresponse(*args, **kwargs)  # type: ignore[misc]
        declared = response.headers.get("Content-Length")
        if bounds is None or declared is None or self._method == "HEAD":
            return response
        try:
            size = int(declared)
        except ValueError:
            size = -1
        if size < 0 or size > bounds.limit:
            shut(self.sock)
            self.close()  # type: ignore[attr-defined]
            if size < 0:
                raise StoreAnswerError(f"the store answered a malformed Content-Length {declared[:40]!r}")
            bounds.check_declared(size, "the store")
        return response


class _HTTPConnection(_Bounded, AWSHTTPConnection):
    pass


class _HTTPSConnection(_Bounded, AWSHTTPSConnection):
    pass


class _HTTPPool(AWSHTTPConnectionPool):
    ConnectionCls = _HTTPConnection


class _HTTPSPool(AWSHTTPSConnectionPool):
    ConnectionCls = _HTTPSConnection


def bound_http(client: Any) -> None:
    """Give ``client`` (a boto3 client) the bounded connections. botocore has no public way to choose its connection
    classes: its HTTP session's pool classes are replaced in place (the one dict its pool managers share), before
    the first request makes a pool."""
    try:
        pools = client._endpoint.http_session._pool_classes_by_scheme  # noqa: SLF001
    except AttributeError:
        raise ConfigError(
            "this botocore keeps its HTTP pools elsewhere: the S3 level cannot bound its requests; use botocore 1.x "
            "(1.34 to 1.44 are tested)"
        ) from None
    pools["http"], pools["https"] = _HTTPPool, _HTTPSPool

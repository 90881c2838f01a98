"""pdkv's own exception hierarchy.

Every error a user can see is one of these, so callers can catch ``PdkvError``
at a boundary (an HTTP handler, the CLI) and everything else is a bug.
"""

from __future__ import annotations


class PdkvError(Exception):
    """Base of every error pdkv raises on purpose."""


class ConfigError(PdkvError, ValueError):
    """A configuration value is wrong; the message names field, value and what was expected."""


class LayoutError(PdkvError, ValueError):
    """A KV layout or a block/slot index does not fit the buffer it describes."""


class DeviceMemoryError(LayoutError):
    """A buffer in device memory (CUDA, meta, emulated) was used where only host memory works; the message says what
    to use instead."""


class CacheRequestError(PdkvError, ValueError):
    """A ``KVCacheEngine`` call's tokens, keys or mask break its contract (pdkv/cache_engine.py); the message says
    which and how."""


class ProtocolError(PdkvError):
    """A control message or frame from a peer is malformed or unexpected."""


class HandshakeError(ProtocolError):
    """Hello was refused: the peers are incompatible or failed authentication."""


class AuthError(HandshakeError):
    """A peer did not prove the shared secret: it has another one, none, or sent no proof where one is required."""


class NoticeForged(ProtocolError):
    """A chunk notification without a valid session tag, where a shared secret requires one."""


class ChannelError(PdkvError):
    """A transfer channel failed: bad descriptor, unknown peer, dead connection."""


class PeerUnreachableError(ChannelError):
    """A peer's data path cannot be opened from here (the address it advertises is unreachable): no transfer to it
    can work."""


class ChannelNotInstalledError(ChannelError, ImportError):
    """The channel needs an optional extra that is not installed."""


class TransferError(PdkvError):
    """A KV transfer for one request failed; the request must fall back to recompute."""


class ChecksumError(TransferError):
    """A chunk landed with bytes that do not match the checksum the sender computed."""


class CodecError(TransferError):
    """An encoded chunk is malformed (bad header, a length that does not fit its shape) or cannot be encoded as
    asked."""


class TransferTimeout(TransferError, TimeoutError):
    """A wait for a peer, a reservation, a chunk or a completion ran past its timeout."""


class PromptMismatchError(TransferError):
    """The KV that landed was computed for another prompt than the one the decode side was asked to decode."""


class NotAnnouncedError(TransferTimeout):
    """No sender reserved the transfer within ``announce_timeout_s``: it will not come, compute instead."""


class TransferCancelled(TransferError):
    """The transfer was cancelled by either side or by the client going away."""


class ReservationError(TransferError):
    """The receiver could not reserve room for the whole request (all or nothing)."""


class OutOfBlocksError(ReservationError):
    """Not enough free KV blocks for the request."""


class EngineError(PdkvError):
    """The engine was driven wrongly (a request used after free, a prefill out of order) or failed a step."""


class ModelLoadError(EngineError):
    """A model could not be found, read or understood; the message says which file and what to do."""


class RequestError(PdkvError):
    """An HTTP request that cannot be served as sent: the client's fault, answered with ``status`` (4xx).

    ``param`` names the request field at fault, when one is (vLLM's error body carries it).
    """

    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


class InvalidRequestError(RequestError, EngineError, ValueError):
    """A generation request's parameters or tokens are invalid (an HTTP 400, not a server fault)."""


class RouterError(PdkvError):
    """The router could not serve a request; the message names the workers tried and what each did."""


class UpstreamError(RouterError):
    """One hop to one worker failed (unreachable, timed out, a 5xx, a broken answer): another worker is tried."""

    def __init__(self, message: str, reason: str, worker_down: bool = False) -> None:
        super().__init__(message)
        self.reason = reason  # a metric label: connect, timeout, disconnected, http_503, ...
        self.worker_down = worker_down  # the worker looks dead: stop picking it until a health check passes


class UpstreamRejected(RouterError):
    """A worker refused the request itself (a 4xx): the client's fault, passed back unchanged and never retried."""

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        super().__init__(f"a worker answered {status}: {body[:200]!r}")
        self.status = status
        self.body = body
        self.content_type = content_type


class DeadlinePassed(RouterError):
    """The client's own deadline (``X-Request-Timeout``) passed before the router could answer: a 504, not retried."""


class StoreAnswerError(PdkvError):
    """A shared tier's store answered out of bounds: a value declared larger than a chunk's can be, no whole answer
    within the level's per-request timeout, or an answer missing a field the protocol requires. The level counts it
    as a failure (``pdkv_tier_errors_total``), serves misses and skips the store for its ``retry_s``."""

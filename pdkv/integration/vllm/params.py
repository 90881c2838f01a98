"""The ``kv_transfer_params`` of the two hops, as vLLM carries them between router, P and D.

vLLM hands a request's ``kv_transfer_params`` to the connector untouched, so
they arrive as arbitrary JSON from whoever posted the request. Each hop's
params are a ``msgspec.Struct`` and are validated before use: a malformed one
is logged and ignored (the request is served without a transfer), never
trusted. Unknown keys pass (vLLM's own proxies add theirs).
"""

from __future__ import annotations

import hashlib
import logging
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pdkv.keys import MAX_SALT_CHARS, check_salt, chunk_keys

log = logging.getLogger(__name__)

TransferId = Annotated[str, Meta(min_length=1, max_length=256)]


class PushTo(msgspec.Struct):
    """Prefill hop: push this request's KV to the receiver at ``remote_host:remote_port``."""

    transfer_id: TransferId
    remote_host: Annotated[str, Meta(min_length=1, max_length=255)]
    remote_port: Annotated[int, Meta(ge=1, le=65535)]
    do_remote_decode: bool = True

    @property
    def address(self) -> str:
        host = f"[{self.remote_host}]" if ":" in self.remote_host else self.remote_host
        return f"tcp://{host}:{self.remote_port}"


class Pushed(msgspec.Struct):
    """Decode hop: the KV of the first ``num_tokens`` prompt tokens was pushed as ``transfer_id``.

    ``prompt_key`` is pdkv's chained chunk key of those tokens: D loads the KV
    only if its own tokens of the prompt hash the same, so a tokenizer or
    template difference between P and D costs a recompute, not a wrong answer.
    """

    transfer_id: TransferId
    num_tokens: Annotated[int, Meta(ge=1)]
    prompt_key: Annotated[str, Meta(min_length=1, max_length=128)]
    do_remote_prefill: bool = True
    do_remote_decode: bool = False


def _parse(params: Any, kind: type[msgspec.Struct], flag: str, request_id: str) -> Any:
    if not isinstance(params, dict) or not params.get(flag):
        return None
    try:
        return msgspec.convert(params, kind, strict=True)
    except msgspec.ValidationError as exc:
        log.warning("request %s: ignoring malformed kv_transfer_params (%s); serving it without a KV transfer", request_id, exc)
        return None


def push_target(params: Any, request_id: str) -> PushTo | None:
    """The prefill hop's target, or None when the request is not to be pushed.

    vLLM's own proxy sends ``remote_host: null`` (its NixlConnector pulls);
    that is "no push", not an error.
    """
    if isinstance(params, dict) and params.get("do_remote_decode") and params.get("remote_host") is None:
        return None
    return _parse(params, PushTo, "do_remote_decode", request_id)


def pushed(params: Any, request_id: str) -> Pushed | None:
    """The decode hop's transfer, or None when the request's KV was not pushed."""
    return _parse(params, Pushed, "do_remote_prefill", request_id)


def prompt_key(tokens: Any, fingerprint: str, chunk_size: int, salt: str = "") -> str:
    """The chained key of the last chunk of ``tokens`` under cache salt ``salt``: equal keys mean equal token
    prefixes, model and salt."""
    return chunk_keys(list(tokens), fingerprint, chunk_size, salt)[-1].hex()


def cache_salt(request: Any) -> str:
    """vLLM's ``Request.cache_salt`` ("" when unset): pdkv keys the request's chunks under it, as vLLM's own
    prefix cache hashes it into the request's first block, so the tier and the pushed KV stay in its partition.
    vLLM bounds no salt's length; one longer than pdkv's keys take is keyed by its SHA-256 (every instance
    alike), never dropped."""
    salt = getattr(request, "cache_salt", None)
    if not salt:
        return ""
    if isinstance(salt, str) and len(salt) > MAX_SALT_CHARS:
        return "sha256:" + hashlib.sha256(salt.encode("utf-8", "surrogatepass")).hexdigest()
    return check_salt(salt)

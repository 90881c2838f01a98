"""``kv_transfer_params``, typed once: what the router tells P (``PushTo``) and what P tells D (``DecodeHop``).

They arrive as arbitrary JSON from whoever posted the request (vLLM hands them to its connector
untouched), so each hop's params are a ``msgspec.Struct`` validated before use. Unknown keys pass: vLLM's
own proxies add theirs. Torch-free, so the router builds its hops with the same types the workers read.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import msgspec
from msgspec import Meta

from pdkv.auth import push_target_proof, verify_push_target
from pdkv.errors import InvalidRequestError, RequestError
from pdkv.keys import MAX_SALT_CHARS, check_salt, chunk_keys
from pdkv.netaddr import host_key, receiver_entry, zmq_address

log = logging.getLogger(__name__)

TransferId = Annotated[str, Meta(min_length=1, max_length=256)]
Host = Annotated[str, Meta(min_length=1, max_length=255)]
Port = Annotated[int, Meta(ge=1, le=65535)]
Logprob = Annotated[float, Meta(ge=-1e30, le=0)]


class PushTo(msgspec.Struct):
    """Prefill hop: push this request's KV to the receiver at ``remote_host:remote_port``.

    ``transfer_id`` names the transfer on the wire; a pdkv worker given none uses the HTTP request's id, the
    vLLM connector needs one. ``codec``: the router's per-request choice (``router.disaggregate``).
    ``push_proof``: the router's signature of the target (``PushGuard``), wanted by a prefill worker with a secret.
    """

    remote_host: Host | None = None
    remote_port: Port | None = None
    transfer_id: TransferId | None = None
    do_remote_decode: bool = True
    # vLLM decode instances: one receiver per tensor-parallel rank (rank r's is remote_ports[r]); absent: one
    remote_ports: Annotated[list[Port], Meta(min_length=1, max_length=1024)] | None = None
    codec: Annotated[str, Meta(min_length=1, max_length=32)] | None = None
    return_kv_digest: bool = False  # tests: P returns per-layer digests of the prompt's KV
    push_proof: Annotated[str, Meta(max_length=128)] | None = None
    # a streamed request: P's answer is the client's first event, left open (the router relays it at once and the
    # decode worker streams the rest, ``DecodeHop.first_event``); unsigned, as it moves no KV anywhere
    stream_first: bool = False

    @property
    def ports(self) -> list[int]:
        """Every port P may dial at ``remote_host``: ``remote_port`` (0 when absent), then ``remote_ports``."""
        return [self.remote_port or 0, *(self.remote_ports or [])]

    @property
    def signed(self) -> tuple[str, str, list[int], str]:
        """What the router's ``push_proof`` covers: transfer id, receiver host, ports, codec ("" when absent)."""
        return self.transfer_id or "", self.remote_host or "", self.ports, self.codec or ""

    @property
    def address(self) -> str | None:
        """The receiver's control address, or None when the params name no receiver."""
        return (
            None
            if self.remote_host is None or self.remote_port is None
            else zmq_address(self.remote_host, self.remote_port)
        )

    @property
    def addresses(self) -> list[str]:
        """Every decode rank's receiver, rank order (the one ``address`` when ``remote_ports`` is not given)."""
        if self.remote_host is None:
            return []
        ports = self.remote_ports or ([self.remote_port] if self.remote_port is not None else [])
        return [zmq_address(self.remote_host, port) for port in ports]


def sign_push(params: dict[str, Any], secret: str) -> dict[str, Any]:
    """The router's prefill hop ``params`` with their ``push_proof`` (unchanged without a secret or a receiver)."""
    target = parse(params, PushTo)
    if not secret or target.remote_host is None:
        return params
    return {**params, "push_proof": push_target_proof(secret, *target.signed)}


@dataclass(frozen=True)
class PushGuard:
    """Where a prefill worker pushes KV: only to a target the router signed (with a ``secret``), and only to a
    receiver an operator listed (``transfer.allowed_receivers``, when set).

    Without them whoever reaches P's HTTP port names the address P dials: P would scan ports for them, or push
    other users' KV to a relay of theirs. ``check`` refuses before anything is dialled.
    """

    secret: str = ""
    allowed: frozenset[tuple[str, int | None]] = frozenset()  # (host_key, port or None: any port)

    @classmethod
    def of(cls, secret: str, allowed_receivers: Sequence[str]) -> PushGuard:
        return cls(secret, frozenset(receiver_entry(entry) for entry in allowed_receivers))

    def check(self, target: PushTo) -> None:
        """``RequestError`` (403) naming why P must not push to ``target``; nothing when it may."""
        if self.secret and target.push_proof is None:
            raise _refused(
                "push target not signed by the router: kv_transfer_params carry no push_proof, and this prefill "
                "worker has a secret: it pushes KV only to a receiver named by a router that shares it"
            )
        if self.secret and not verify_push_target(self.secret, target.push_proof or "", *target.signed):
            raise _refused(
                "push target not signed by the router: push_proof does not match the transfer_id, remote_host, "
                "remote_port(s) and codec (changed after signing, or signed with another secret than this worker's)"
            )
        if self.allowed and target.remote_host is not None:
            host = host_key(target.remote_host)
            for port in {p for p in target.ports if p}:
                if (host, port) not in self.allowed and (host, None) not in self.allowed:
                    raise _refused(
                        f"push target {target.remote_host}:{port} is not one of this prefill worker's "
                        "transfer.allowed_receivers"
                    )


def _refused(why: str) -> RequestError:
    return RequestError(why, status=403, param="kv_transfer_params")


class FirstTokenLogprobs(msgspec.Struct, forbid_unknown_fields=True):
    """P's log-probabilities of the first token: its own, and the top ``[token id, logprob]`` pairs."""

    logprob: Logprob
    top: Annotated[list[tuple[Annotated[int, Meta(ge=0)], Logprob]], Meta(max_length=64)]


MAX_STREAM_ID = 256
"""The longest answer id a stream is handed on under (a client's own ``request_id`` may be longer: not handed)."""


class FirstEvent(msgspec.Struct, forbid_unknown_fields=True):
    """The stream P began (``PushTo.stream_first``): the client has its first event, P's token, so the decode
    worker continues it under the same id and creation time, without sending that token again."""

    id: Annotated[str, Meta(min_length=1, max_length=MAX_STREAM_ID)]
    created: Annotated[int, Meta(ge=0)]


class DecodeHop(msgspec.Struct):
    """Decode hop between pdkv workers: the transfer to wait for, and P's first token to decode on from."""

    do_remote_prefill: bool = False
    do_remote_decode: bool = False
    transfer_id: TransferId | None = None
    remote_engine_id: str | None = None
    num_prompt_tokens: Annotated[int, Meta(ge=0)] | None = None
    transfer_started: bool = True
    transfer_error: str | None = None
    first_token_id: Annotated[int, Meta(ge=0)] | None = None
    first_token_logprobs: FirstTokenLogprobs | None = None
    kv_digest: list[str] | None = None
    return_kv_digest: bool = False
    first_event: FirstEvent | None = None


class Pushed(msgspec.Struct):
    """Decode hop of the vLLM connector: the KV of the first ``num_tokens`` prompt tokens was pushed as ``transfer_id``.

    ``prompt_key`` is pdkv's chained chunk key of those tokens: D loads the KV only if its own tokens of the
    prompt hash the same, so a tokenizer or template difference between P and D costs a recompute, not a
    wrong answer.
    """

    transfer_id: TransferId
    num_tokens: Annotated[int, Meta(ge=1)]
    prompt_key: Annotated[str, Meta(min_length=1, max_length=128)]
    prefill_tp: Annotated[int, Meta(ge=1, le=1024)] = 1  # P's tensor-parallel size: which ranks push which heads
    do_remote_prefill: bool = True
    do_remote_decode: bool = False


S = TypeVar("S", bound=msgspec.Struct)


def parse(params: Any, kind: type[S]) -> S:
    """``params`` as ``kind``, or ``InvalidRequestError`` naming the field (a 400 on a worker's HTTP API)."""
    try:
        return msgspec.convert(params if params is not None else {}, kind, strict=True)
    except msgspec.ValidationError as exc:
        raise InvalidRequestError(f"kv_transfer_params: {exc}", param="kv_transfer_params") from None


def _lenient(params: Any, kind: type[S], flag: str, request_id: str) -> S | None:
    if not isinstance(params, dict) or not params.get(flag):
        return None
    try:
        return parse(params, kind)
    except InvalidRequestError as exc:
        log.warning(
            "request %s: ignoring malformed kv_transfer_params (%s); serving it without a KV transfer", request_id, exc
        )
        return None


def push_target(params: Any, request_id: str, guard: PushGuard) -> PushTo | None:
    """The vLLM connector's prefill hop, or None when the request is not to be pushed.

    vLLM's own proxy sends ``remote_host: null`` (its NixlConnector pulls); that is "no push", not an error.
    A target ``guard`` refuses is served without a push too (vLLM answers no error of a connector's), and logged.
    """
    if isinstance(params, dict) and params.get("do_remote_decode") and params.get("remote_host") is None:
        return None
    target = _lenient(params, PushTo, "do_remote_decode", request_id)
    if target is not None and (target.transfer_id is None or target.address is None):
        log.warning(
            "request %s: kv_transfer_params name no transfer_id or receiver; serving it without a KV transfer",
            request_id,
        )
        return None
    if target is not None:
        try:
            guard.check(target)
        except RequestError as exc:
            log.warning("request %s: %s; serving it without a KV transfer", request_id, exc)
            return None
    return target


def pushed(params: Any, request_id: str) -> Pushed | None:
    """The vLLM connector's decode hop, or None when the request's KV was not pushed."""
    return _lenient(params, Pushed, "do_remote_prefill", request_id)


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

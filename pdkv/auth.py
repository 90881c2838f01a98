"""Shared-secret proofs: the one HMAC construction both planes use.

The control plane (Hello/Auth in ``pdkv.transfer.protocol``) and the tcp channel's data
connections (``pdkv.channels.tcp``) prove the same shared secret the same way:
each side over the whole handshake transcript (both sides' fresh nonces and
everything else either side said), so a proof vouches for exactly what it came
with and is worth nothing to a relay that would change any of it. Only the role
string differs, so a proof made for one role or plane is never accepted for
another; it lives here, below both, so the channels need not import the
control-plane protocol.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Sequence

NONCE_BYTES = 16
PROOF_BYTES = hashlib.sha256().digest_size


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def transcript(*messages: bytes) -> bytes:
    """SHA-256 over a handshake's messages, each length-prefixed: what both sides' proofs are bound to.

    A proof over the nonces alone vouches for nothing else a Hello says, so a relay could pass the proof on
    and swap the rest (where the KV goes); a proof over the transcript checks out only for the exact
    messages both sides sent and saw.
    """
    h = hashlib.sha256(b"pdkv/transcript")
    for m in messages:
        h.update(len(m).to_bytes(8, "little") + m)
    return h.digest()


def control_token(secret: str) -> str:
    """The bearer token of the HTTP control endpoints of workers that share ``secret``.

    Derived, not the secret itself: HTTP carries it in clear, and whoever reads it off the wire
    may cancel a transfer, never prove the secret on the data plane. Computed by hand it is
    ``printf pdkv/http-control | openssl dgst -sha256 -hmac "$SECRET"``.
    """
    return hmac.new(secret.encode(), b"pdkv/http-control", hashlib.sha256).hexdigest()


def bound_proof(secret: bytes, role: str, session: bytes, *fields: bytes) -> bytes:
    """HMAC-SHA256 over a handshake's ``session`` (its transcript) and ``fields``, each length-prefixed.

    What a message asserts after the handshake (a Reserve's prompt key) is
    bound to the peer that proved the secret in that handshake: a proof made
    in one session, or for other fields, never checks out in another.
    """
    mac = hmac.new(secret, b"pdkv/" + role.encode() + b"/" + session, hashlib.sha256)
    for f in fields:
        mac.update(len(f).to_bytes(8, "little") + f)
    return mac.digest()


def verify_bound(secret: bytes, role: str, session: bytes, given: bytes, *fields: bytes) -> bool:
    return hmac.compare_digest(bound_proof(secret, role, session, *fields), given)


def session_key(secret: bytes, session: bytes) -> bytes:
    """The key that tags one session's control messages and chunk notices (``session``: the handshake's transcript).

    Derived per session, so a tag made in one session (or for the other direction, see ``message_tag``)
    never checks out in another, and the secret itself never keys a per-message MAC.
    """
    return bound_proof(secret, "control-session", session)


def message_tag(key: bytes, direction: str, data: bytes) -> bytes:
    """HMAC-SHA256 of one control message's bytes under its session key; ``direction`` (``sender`` or
    ``receiver``: who sent it) keeps a message from being reflected back to its author."""
    return hmac.new(key, b"pdkv/" + direction.encode() + b"/" + data, hashlib.sha256).digest()


def verify_tag(key: bytes, direction: str, data: bytes, given: bytes) -> bool:
    return hmac.compare_digest(message_tag(key, direction, data), given)


def push_target_proof(secret: str, transfer_id: str, host: str, ports: Sequence[int], codec: str) -> str:
    """The router's signature (hex) over the push target it hands a prefill worker: the transfer, the receiver's
    host, every port P may dial there and the codec.

    A prefill worker pushes only to a target signed with the secret it shares with the router, so whoever else
    reaches its HTTP port cannot make it dial an address of their choosing (a port scanner, or a relay of theirs).
    """
    fields = (transfer_id, host, ",".join(map(str, ports)), codec)
    return bound_proof(secret.encode(), "push-target", b"", *(f.encode("utf-8", "surrogatepass") for f in fields)).hex()


def verify_push_target(secret: str, given: str, transfer_id: str, host: str, ports: Sequence[int], codec: str) -> bool:
    expected = push_target_proof(secret, transfer_id, host, ports, codec).encode()
    return hmac.compare_digest(expected, given.encode("utf-8", "replace"))  # bytes: ``given`` may be any text

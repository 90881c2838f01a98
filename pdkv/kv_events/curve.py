"""ZeroMQ CURVE on the KV event stream: the publisher proves its key and lets in only the subscribers it names.

vLLM's event protocol has no authentication and no encryption, and its
batches carry prompt token ids: anyone who reaches the PUB port reads every
prompt a worker caches, and anyone who reaches the router's subscriber path
(or stands in front of it) can feed the KV-aware index blocks that were
never computed. CURVE (CurveZMQ: Curve25519 keys, every message encrypted
and authenticated) closes both, on the PUB and the replay ROUTER alike:

* the worker holds a server key pair (``kv_events.curve_secret_key``) and the
  public keys of the subscribers allowed to read (``kv_events.curve_clients``);
  a ZAP handler refuses every other key, so a subscriber without keys, with
  the wrong server key or with a key not on the list gets nothing at all;
* the router holds its own key pair (``router.kv_events_curve_secret_key``)
  and the workers' public key (``router.kv_events_curve_server_key``, or a
  source's ``curve_server_key``), so it reads only the worker it meant to.

Opt-in: without keys the stream is vLLM's, byte for byte, which is what
Dynamo, llm-d and vLLM's own consumers speak (none of them speaks CURVE).

A key is given as its 40-character Z85 text or as the path of a ZeroMQ
certificate file (``zmq.auth.create_certificates`` writes ``NAME.key``, the
public key, and ``NAME.key_secret``, both). A bad key is a ``ConfigError``
naming the field, never showing a secret.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import zmq
import zmq.auth
import zmq.utils.z85
from zmq.auth.thread import ThreadAuthenticator

from pdkv.errors import ConfigError

Z85_KEY_CHARS = 40
ZAP_DOMAIN = "pdkv-kv-events"


def load_key(value: str, field: str, secret: bool) -> bytes:
    """A CURVE key (Z85 bytes) from its text or a certificate file; ``secret`` picks the secret key of a file
    holding both."""
    which = "secret" if secret else "public"
    if len(value) == Z85_KEY_CHARS and not os.path.exists(value):
        try:
            if len(zmq.utils.z85.decode(value)) == 32:
                return value.encode()
        except (ValueError, KeyError, IndexError, TypeError):
            pass
        shown = "<secret>" if secret else repr(value)
        raise ConfigError(f"field '{field}' = {shown}: not a Z85 CURVE key (40 characters from zmq.curve_keypair)")
    try:
        public, secret_key = zmq.auth.load_certificate(value)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"field '{field}' = {value!r}: neither a 40-character Z85 {which} key nor a readable ZeroMQ certificate "
            f"file ({exc})"
        ) from None
    key = secret_key if secret else public
    if key is None or len(key) != Z85_KEY_CHARS:
        raise ConfigError(
            f"field '{field}' = {value!r}: the certificate file holds no {which} key (zmq.auth.create_certificates "
            "writes it to NAME.key_secret)"
        )
    return key


@dataclass(frozen=True)
class CurveServer:
    """The publisher's side: its key pair and the public keys of the subscribers it admits."""

    secret_key: bytes
    public_key: bytes
    clients: frozenset[bytes]

    @classmethod
    def load(cls, secret_key: str, clients: list[str], prefix: str = "kv_events") -> CurveServer:
        secret = load_key(secret_key, f"{prefix}.curve_secret_key", secret=True)
        if not clients:
            raise ConfigError(
                f"field '{prefix}.curve_clients' is empty: with curve_secret_key set, list the public key of every "
                "subscriber "
                "(each router's kv_events_curve_secret_key's public half) allowed to read the stream"
            )
        allowed = frozenset(load_key(c, f"{prefix}.curve_clients[{i}]", secret=False) for i, c in enumerate(clients))
        return cls(secret, zmq.curve_public(secret), allowed)

    def authenticator(self, ctx: zmq.Context) -> ThreadAuthenticator:  # type: ignore[type-arg]
        """A started ZAP handler on ``ctx`` that admits exactly ``clients``."""
        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        return auth

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP: whether a connecting subscriber's public key (Z85) is one of ours."""
        return client_key in self.clients

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Make ``sock`` a CURVE server under our ZAP domain (before it binds)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.zap_domain = ZAP_DOMAIN.encode()
        sock.curve_server = True


@dataclass(frozen=True)
class CurveClient:
    """A subscriber's side: its key pair and the public key of the publisher it trusts."""

    secret_key: bytes
    public_key: bytes
    server_key: bytes

    @classmethod
    def load(cls, secret_key: str, server_key: str, secret_field: str, server_field: str) -> CurveClient:
        secret = load_key(secret_key, secret_field, secret=True)
        return cls(secret, zmq.curve_public(secret), load_key(server_key, server_field, secret=False))

    def apply(self, sock: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Make ``sock`` a CURVE client of ``server_key`` (before it connects)."""
        sock.curve_secretkey = self.secret_key
        sock.curve_publickey = self.public_key
        sock.curve_serverkey = self.server_key

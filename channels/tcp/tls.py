"""Opt-in mutual TLS for the tcp channel: its options and the two ``ssl`` contexts built from them.

Without ``tls`` the data plane moves KV in clear, authenticated by the
shared-secret handshake alone (anyone on the path reads the prompt's KV).
With it, every connection is TLS 1.3 with a certificate on *both* sides,
each checked against ``ca``: a peer proves it belongs to the deployment
before the pdkv handshake (HELLO, and the secret's proofs, which stay on
top) even starts, and everything after it is encrypted.

``check_hostname`` is off by default: peers dial each other at the address
in the other's metadata (often an IP), and with a CA that signs only this
deployment's agents, holding one of its certificates is what makes a peer
trusted. Turn it on when the CA signs more than that; each certificate must
then name the host its agent advertises.

Kernel TLS is not used: ``ssl.OP_ENABLE_KTLS`` only exists from Python
3.12, so on 3.11 OpenSSL encrypts in user space (``pdkv bench channel
--tls`` measures what that costs).
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import msgspec

from pdkv.errors import ConfigError


class TlsOptions(msgspec.Struct, forbid_unknown_fields=True):
    """``channel.options.tls``: this agent's certificate and key, and the CA its peers' certificates are checked
    against (PEM files)."""

    cert: str
    key: str
    ca: str
    check_hostname: bool = False


@dataclass(frozen=True)
class TlsContexts:
    """The two sides' contexts: ``server`` for accepted connections, ``client`` for the ones this agent opens."""

    server: ssl.SSLContext
    client: ssl.SSLContext


def tls_contexts(opts: TlsOptions) -> TlsContexts:
    """Both contexts, mutual and TLS 1.3 only (both ends are pdkv); a missing or bad file is a ``ConfigError``
    naming its option."""
    for name in ("cert", "key", "ca"):
        path = getattr(opts, name)
        if not Path(path).is_file():
            raise ConfigError(f"tcp channel option tls.{name}={path!r}: no such file (a PEM file is expected)")
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    client = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    client.check_hostname = opts.check_hostname
    # No session tickets: links are long-lived (nothing to resume), and without them nothing arrives after the
    # handshake that makes OpenSSL write while reading (a stream's reader and its sender thread share a connection).
    server.num_tickets = 0
    for ctx in (server, client):
        ctx.minimum_version = ssl.TLSVersion.TLSv1_3
        ctx.verify_mode = ssl.CERT_REQUIRED
        try:
            ctx.load_verify_locations(cafile=opts.ca)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"tcp channel option tls.ca={opts.ca!r}: not a PEM CA certificate ({exc.reason or exc})"
            ) from None
        try:
            ctx.load_cert_chain(opts.cert, opts.key)
        except ssl.SSLError as exc:
            raise ConfigError(
                f"tcp channel options tls.cert={opts.cert!r} / tls.key={opts.key!r}: not a PEM certificate and its "
                f"private key ({exc.reason or exc})"
            ) from None
    return TlsContexts(server, client)

"""Tenants of a shared router: who sent a request, and the cache partition its KV lives in.

With ``router.tenants`` set, every ``/v1/`` request (and a tenant's ``POST
/pdkv/kv-index``) must say who it is, decided from its headers before a byte
of its body is read:

* ``Authorization: Bearer <api_key>``: the key's SHA-256 is compared, in
  constant time, with every tenant's (``api_key``, or ``api_key_sha256``
  when the config holds only hashes). No key, or one no tenant has: 401 in
  OpenAI's error shape, with ``WWW-Authenticate: Bearer``.
* a trusted gateway (``router.tenant_header``): a header naming the tenant,
  taken only from a peer address in ``router.tenant_header_from``. The same
  header from any other address is refused (403), whatever else the request
  carries, so a client cannot name a tenant by talking past the gateway.

The tenant's cache salt is derived here, never taken from the client:
``HMAC-SHA256(tenant_salt_secret, "pdkv/tenant-salt/" + name)``, hex. A
client's own ``cache_salt`` (vLLM's field, on completions and chat) makes a
partition *inside* its tenant: ``HMAC-SHA256(tenant salt, "pdkv/client-salt/"
+ client salt)``. Whatever ``cache_salt`` the client sent is replaced by the
derived one before the body goes to any worker, so no client can choose
another tenant's partition, and one that copies another tenant's client salt
gets a partition of its own tenant. Without ``router.tenants``, nothing is
checked and a client's ``cache_salt`` goes to the workers as it came (as with
vLLM).

Per-tenant limits: ``max_concurrent_requests`` in the router at once (429
beyond, before the body is read) and ``max_tokens`` per request (400 above;
a request that names none is given the bound).
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from pdkv.config import RouterConfig
from pdkv.errors import RequestError
from pdkv.http.web import Handler, error_response, header_bytes
from pdkv.keys import MAX_SALT_CHARS

log = logging.getLogger(__name__)

_MAX_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


@dataclasses.dataclass
class Tenant:
    name: str
    salt: str  # HMAC of the salt secret and the name, hex: the tenant's cache partition
    max_concurrent_requests: int = 0
    max_tokens: int = 0
    inflight: int = 0


# aiohttp >= 3.12 wants typed request keys (a plain string warns); older ones take the string.
TENANT_KEY: Any = web.RequestKey("pdkv_tenant", Tenant) if hasattr(web, "RequestKey") else "pdkv_tenant"
"""Where the middleware leaves a request's ``Tenant`` (``http[TENANT_KEY]``; absent without tenants)."""


def tenant_salt(secret: str, name: str) -> str:
    """A tenant's cache salt: only whoever holds ``secret`` can compute it (see the module docstring)."""
    return hmac.new(secret.encode(), b"pdkv/tenant-salt/" + name.encode(), hashlib.sha256).hexdigest()


def client_salt(tenant: str, given: str) -> str:
    """A client's ``cache_salt`` folded into its tenant's salt: a partition inside the tenant's, none outside."""
    return hmac.new(
        tenant.encode(), b"pdkv/client-salt/" + given.encode("utf-8", "surrogatepass"), hashlib.sha256
    ).hexdigest()


class Tenants:
    """The configured tenants, their keys and salts, and the middleware that admits requests; see the module
    docstring."""

    def __init__(self, config: RouterConfig, secret: str) -> None:
        salt_secret = config.tenant_salt_secret or secret
        self.tenants = {
            t.name: Tenant(t.name, tenant_salt(salt_secret, t.name), t.max_concurrent_requests, t.max_tokens)
            for t in config.tenants
        }
        self._digests = [
            (t.key_digest(), self.tenants[t.name]) for t in config.tenants if t.api_key or t.api_key_sha256
        ]
        self.header = config.tenant_header
        self._gateways = [ipaddress.ip_network(net, strict=False) for net in config.tenant_header_from]

    @classmethod
    def of(cls, config: RouterConfig, secret: str) -> Tenants | None:
        """The router's tenants, or None when ``router.tenants`` is empty (no authentication, salts as clients
        send them)."""
        return cls(config, secret) if config.tenants else None

    def authenticate(self, http: web.Request) -> Tenant:
        """The tenant ``http`` comes from, from its headers alone; ``RequestError`` (401, 403) otherwise."""
        if self.header and self.header in http.headers:
            peer = _peer(http)
            if peer is None or not any(peer in net for net in self._gateways):
                raise RequestError(
                    f"the {self.header} header is taken only from the trusted gateway (router.tenant_header_from), not "
                    f"from {peer}",
                    403,
                )
            tenant = self.tenants.get(http.headers[self.header])
            if tenant is None:
                raise RequestError(
                    f"the gateway named a tenant the router does not know ({self.header}: "
                    f"{http.headers[self.header]!r:.80})",
                    401,
                )
            return tenant
        scheme, _, key = http.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise RequestError("this router serves its tenants only: send 'Authorization: Bearer <your API key>'", 401)
        digest = hashlib.sha256(header_bytes(key.strip())).digest()  # bytes that are not UTF-8 match no key: a 401
        found = None
        for known, tenant in self._digests:  # every one compared, in constant time: no timing says how close a key came
            if hmac.compare_digest(digest, known):
                found = tenant
        if found is None:
            raise RequestError("the API key is not valid for this router", 401)
        return found

    def middleware(
        self, guarded: Callable[[web.Request], bool]
    ) -> Callable[[web.Request, Handler], Awaitable[web.StreamResponse]]:
        """Admit the requests ``guarded`` holds for (their tenant in ``http[TENANT_KEY]``), within their tenant's
        concurrency bound; answer the rest's failures before their body is read."""

        @web.middleware
        async def middleware(http: web.Request, handler: Handler) -> web.StreamResponse:
            if not guarded(http):
                return await handler(http)
            try:
                tenant = self.authenticate(http)
            except RequestError as exc:
                resp = error_response(exc.status, str(exc))
                if exc.status == 401:
                    resp.headers["WWW-Authenticate"] = 'Bearer realm="pdkv"'
                return resp
            if tenant.max_concurrent_requests and tenant.inflight >= tenant.max_concurrent_requests:
                return error_response(
                    429,
                    f"tenant {tenant.name!r} has {tenant.inflight} requests in flight, its bound (router.tenants "
                    "max_concurrent_requests)",
                )
            http[TENANT_KEY] = tenant
            tenant.inflight += 1
            try:
                return await handler(http)
            finally:
                tenant.inflight -= 1

        return middleware

    def scope(self, http: web.Request, body: dict[str, Any]) -> str:
        """Put ``body`` in its tenant's partition and bounds: ``cache_salt`` replaced by the derived salt (the
        client's folded in), ``max_tokens`` checked; returns the salt. ``RequestError`` for a bad field."""
        tenant: Tenant = http[TENANT_KEY]
        given = body.get("cache_salt")
        if given is not None and not (isinstance(given, str) and 0 < len(given) <= MAX_SALT_CHARS):
            raise RequestError(
                f"'cache_salt' must be a non-empty string of at most {MAX_SALT_CHARS} characters if provided, got "
                f"{given!r:.80}",
                param="cache_salt",
            )
        salt = body["cache_salt"] = client_salt(tenant.salt, given) if given else tenant.salt
        if tenant.max_tokens:
            asked = [body[f] for f in _MAX_TOKEN_FIELDS if body.get(f) is not None]
            for value in asked:
                if not isinstance(value, int) or isinstance(value, bool) or value > tenant.max_tokens:
                    raise RequestError(
                        f"tenant {tenant.name!r} may generate at most {tenant.max_tokens} tokens per request, got "
                        f"{value!r:.40}",
                        param="max_tokens",
                    )
            if not asked:
                body["max_tokens"] = tenant.max_tokens
        return salt


def request_salt(tenants: Tenants | None, http: web.Request, body: dict[str, Any]) -> str:
    """The cache salt of a generation or KV-index body: its tenant's (``Tenants.scope``, which rewrites the body);
    without tenants the client's ``cache_salt`` as the workers will take it ("" when it is none they take: they
    refuse it, and the router's index must not key by it)."""
    if tenants is not None:
        return tenants.scope(http, body)
    given = body.get("cache_salt")
    return given if isinstance(given, str) and 0 < len(given) <= MAX_SALT_CHARS else ""


def _peer(http: web.Request) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """The address of the connection's other end (never a forwarded-for header: that is the client's to write)."""
    transport = http.transport
    peer = transport.get_extra_info("peername") if transport is not None else None
    if not peer:
        return None
    try:
        address = ipaddress.ip_address(peer[0].split("%", 1)[0])
    except ValueError:
        return None
    mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
    return mapped or address  # a dual-stack socket's ::ffff:10.0.0.1 is 10.0.0.1 for an IPv4 network

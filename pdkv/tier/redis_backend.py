"""How the Redis tier reaches its server: one Redis/Valkey, or a Redis Cluster / Valkey cluster.

Both run a batch of per-key commands (one pipelined round trip per
server) and answer each key's result, or ``FAILED`` where the server could
not be asked; neither ever raises a server or network error.

* ``Single`` (``redis://``, ``rediss://``, ``unix://``): a failure makes the
  whole batch ``FAILED`` and the server is skipped for ``retry_s`` (calls
  return ``FAILED`` at once instead of each paying a connect timeout).
* ``Cluster`` (``redis+cluster://HOST:PORT[,HOST:PORT...]`` or
  ``rediss+cluster://``, with ``USER:PASSWORD@`` before the hosts if the
  cluster wants it): the seed nodes are where redis-py's cluster client
  learns the slot map from (any live one will do). Keys spread over the
  cluster by their slot (no hash tags: a prompt's chunks land on every
  primary). A batch is split by the primary that owns each key's slot,
  one pipeline per primary, so a primary that is down costs only the keys
  it owns: its part of the batch is ``FAILED`` and it is skipped for
  ``retry_s``. While any is skipped, the slot map is re-read (at most once
  a second), so the moment a replica takes over, its keys go to it. The
  client itself is made on first use: a cluster that is unreachable when
  a worker starts costs misses, not the start.

Every pipeline (and a cluster client's slot map read) is one request within
``pdkv.tier.bounds``: its answers whole within ``timeout_s`` of wall-clock
time once it is sent, none longer than the caller's limit (a GET: a chunk's
value), read by ``pdkv.tier.redis_bounded``'s parser. redis-py's own retries are off: a
failure is skipped for ``retry_s`` instead.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import unquote, urlsplit

from pdkv.errors import ConfigError, StoreAnswerError
from pdkv.tier import bounds
from pdkv.tier.backoff import Backoff
from pdkv.tier.redis_pool import Sweeper
from pdkv.tier.store import FAILED

log = logging.getLogger(__name__)

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
URL_FORMS = (
    "redis://HOST:PORT/DB, rediss://..., unix:///PATH, or redis+cluster://HOST:PORT[,HOST:PORT...] "
    "(rediss+cluster:// for TLS)"
)
_REFRESH_S = 1.0

Build = Callable[[Any, int], None]  # adds the command for key i to a pipeline


def _redis() -> Any:
    try:
        import redis
    except ImportError:
        raise ConfigError("tier.redis_url is set but redis-py is not installed: pip install 'pdkv[redis]'") from None
    return redis


def _bounded_options() -> dict[str, Any]:
    """Client options every connection of the tier gets: answers read within ``pdkv.tier.bounds`` (by a RESP2
    parser: the tier's commands need nothing of RESP3) and no retries (a failure is skipped for ``retry_s``; a retry
    would pay the timeout again)."""
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    from pdkv.tier.redis_bounded import bounded_connect

    return {"redis_connect_func": bounded_connect, "protocol": 2, "retry": Retry(NoBackoff(), 0)}


class Single:
    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float, retry_s: float) -> None:
        redis = _redis()
        try:
            self.client = redis.Redis.from_url(
                url, socket_timeout=timeout_s, socket_connect_timeout=connect_timeout_s, **_bounded_options()
            )
        except ValueError as exc:
            raise ConfigError(f"tier.redis_url {url!r} is not a Redis URL ({exc}); expected {URL_FORMS}") from None
        self.url, self.timeout_s = url, timeout_s
        self._errors = (redis.RedisError, StoreAnswerError, OSError)
        self._backoff = Backoff(f"redis tier {url}", retry_s)
        self._sweeper = Sweeper(url, lambda: (self.client.connection_pool,))

    def batch(
        self, what: str, names: Sequence[bytes], build: Build, limit: int = bounds.ANSWER_BYTES
    ) -> tuple[list[Any], bool]:
        """Each key's result (or ``FAILED``) and whether anything failed; ``limit``: the most bytes one answer may
        declare (``pdkv.tier.bounds``)."""
        if self._backoff.down("server"):
            return [FAILED] * len(names), False
        try:
            with bounds.request(f"{what} on {self.url}", self.timeout_s, limit):
                pipe = self.client.pipeline(transaction=False)
                for i in range(len(names)):
                    build(pipe, i)
                return list(pipe.execute()), False
        except self._errors as exc:
            self._backoff.failed("server", what, exc)
            return [FAILED] * len(names), True

    def ping(self) -> bool:
        result, _ = self.batch("ping", [b""], lambda pipe, _i: pipe.ping())
        return result[0] is not FAILED

    def close(self) -> None:
        self._sweeper.close()
        self.client.close()


def parse_cluster_url(url: str) -> dict[str, Any]:
    """``redis+cluster://[USER[:PASSWORD]@]HOST:PORT[,HOST:PORT...][/0]`` as RedisCluster keyword arguments."""
    parts = urlsplit(url)
    where = parts.netloc.rpartition("@")
    auth, hosts = where[0], where[2]
    seeds = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        host = host.strip("[]")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(f"tier.redis_url {url!r}: {item!r} is not HOST:PORT; expected {URL_FORMS}")
        seeds.append((host, int(port)))
    if parts.path not in ("", "/", "/0") or parts.query:
        raise ConfigError(
            f"tier.redis_url {url!r}: a cluster has only database 0 and takes no options; expected {URL_FORMS}"
        )
    user, _, password = auth.partition(":")
    return {
        "seeds": seeds,
        "username": unquote(user) or None,
        "password": unquote(password) or None,
        "ssl": parts.scheme == "rediss+cluster",
    }


class Cluster:
    def __init__(self, url: str, timeout_s: float, connect_timeout_s: float, retry_s: float) -> None:
        self._redis = _redis()
        self.url = url
        self._options = parse_cluster_url(url)
        self._timeouts = (timeout_s, connect_timeout_s)
        # RedisClusterException (no seed reachable, no slot map) is not a RedisError
        self._errors = (self._redis.RedisError, self._redis.exceptions.RedisClusterException, StoreAnswerError, OSError)
        self._backoff = Backoff(f"redis tier {url}", retry_s)
        self._client: Any = None
        self._lock = threading.Lock()
        self._refreshed = 0.0
        self._sweeper = Sweeper(url, self._pools)

    def _connect(self) -> Any:
        """The cluster client, made (the slot map read from a seed) on first use."""
        with self._lock:
            if self._client is None:
                from redis.cluster import ClusterNode, RedisCluster

                o = self._options
                with bounds.request(f"the slot map of {self.url}", self._timeouts[0]):
                    self._client = RedisCluster(
                        startup_nodes=[ClusterNode(h, p) for h, p in o["seeds"]],
                        username=o["username"],
                        password=o["password"],
                        ssl=o["ssl"],
                        socket_timeout=self._timeouts[0],
                        socket_connect_timeout=self._timeouts[1],
                        require_full_coverage=False,  # a primary down takes its own slots away, not the cluster's
                        **_bounded_options(),  # a node that fails is skipped for retry_s: no retries here
                    )
            return self._client

    def batch(
        self, what: str, names: Sequence[bytes], build: Build, limit: int = bounds.ANSWER_BYTES
    ) -> tuple[list[Any], bool]:
        """``Single.batch``, one request (and one deadline) per primary involved."""
        results: list[Any] = [FAILED] * len(names)
        if self._backoff.down("cluster"):
            return results, False
        try:
            client = self._connect()
        except self._errors as exc:
            self._backoff.failed("cluster", "connect", exc)
            return results, True
        self._refresh(client)
        groups: dict[str, list[int]] = {}
        failed = False
        for i, name in enumerate(names):
            try:
                node = client.get_node_from_key(name).name
            except self._errors as exc:  # no live node owns the slot now
                self._backoff.failed("an uncovered slot", what, exc)
                failed = True
                continue
            groups.setdefault(node, []).append(i)
        for node, indexes in groups.items():
            if self._backoff.down(node):
                continue
            try:
                with bounds.request(f"{what} on {node}", self._timeouts[0], limit):
                    pipe = client.pipeline(transaction=False)
                    for i in indexes:
                        build(pipe, i)
                    answers = pipe.execute()
                for i, value in zip(indexes, answers, strict=True):
                    results[i] = value
            except self._errors as exc:
                self._backoff.failed(node, what, exc)
                failed = True
        return results, failed

    def _refresh(self, client: Any) -> None:
        """While a node is skipped, re-read the slot map now and then: a replica that took over is used at once."""
        if not self._backoff.any_down() or time.monotonic() - self._refreshed < _REFRESH_S:
            return
        self._refreshed = time.monotonic()
        try:
            with bounds.request(f"the slot map of {self.url}", self._timeouts[0]):
                client.nodes_manager.initialize()
        except self._errors as exc:
            log.debug("redis tier: slot map refresh failed: %s", exc)

    def ping(self) -> bool:
        try:
            self._connect()
        except self._errors as exc:
            self._backoff.failed("cluster", "connect", exc)
            return False
        return True

    def _pools(self) -> list[Any]:
        """The connection pool of each node the client knows (none before its first use)."""
        with self._lock:
            client = self._client
        if client is None:
            return []
        return [n.redis_connection.connection_pool for n in client.get_nodes() if n.redis_connection is not None]

    def close(self) -> None:
        self._sweeper.close()
        with self._lock:
            if self._client is not None:
                self._client.close()


def connect(url: str, timeout_s: float, connect_timeout_s: float, retry_s: float) -> Single | Cluster:
    """The backend for ``url``: a cluster for ``redis+cluster://``/``rediss+cluster://``, one server otherwise."""
    scheme = url.partition("://")[0]
    if scheme in CLUSTER_SCHEMES:
        return Cluster(url, timeout_s, connect_timeout_s, retry_s)
    return Single(url, timeout_s, connect_timeout_s, retry_s)

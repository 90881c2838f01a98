"""One validated configuration for every role, from YAML and CLI flags.

msgspec does the type checking; ``load_config`` turns its errors into a
``ConfigError`` that names the field, the value given and what was expected,
so a bad config fails at start instead of deep inside a transfer.
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import os
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import msgspec
import yaml
from msgspec import Meta

from pdkv.channels import channel_class
from pdkv.codec import CODEC_NAME_PATTERN, codec_class
from pdkv.errors import ConfigError
from pdkv.keys import DEFAULT_CHUNK_SIZE
from pdkv.netaddr import is_wildcard, receiver_entry
from pdkv.plugins import class_path, convert_options, load_class, shown

Positive = Annotated[int, Meta(ge=1)]
Seconds = Annotated[float, Meta(gt=0)]


class TransferConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Sizes and timeouts of the KV data path; every wait has one."""

    chunk_size: Positive = DEFAULT_CHUNK_SIZE
    max_inflight_bytes: Positive = 64 << 20
    staging_slots: Positive = 8
    slots_per_request: Positive = 2
    max_reservations: Positive = 4096
    # Per sender (control-plane peer): open reservations, and the share of the decode buffer's blocks it may
    # hold at once, so no one peer (a runaway prefill, or anyone who reaches an unauthenticated port) can take all.
    max_reservations_per_peer: Positive = 512
    max_peer_blocks_share: Annotated[float, Meta(gt=0, le=1)] = 0.75
    # Tokens of the receiver's blocks granted ahead to each sender (pdkv/transfer/README.md, "Pools"): a request
    # of one chunk that fits is written at once, its Reserve riding on the chunk's notice, instead of waiting a
    # round trip for room. At most one chunk (the default: one chunk); 0: off, the receiver then holds no memory
    # for a sender between requests.
    pool_tokens: Annotated[int, Meta(ge=0)] = DEFAULT_CHUNK_SIZE
    # The share of the receiver's blocks all pools together may hold: a pool is at most this share, and a sender
    # that would take pools past it gets none (it reserves), so pools never starve Reserves of room.
    pool_blocks_share: Annotated[float, Meta(ge=0, le=0.5)] = 0.25
    # Where the channel carries answers on its data connections (tcp), a receiver verifies each chunk on the thread
    # that received it and answers there (``protocol.ChunkVerdict``), so a request sends no control message on its
    # way (pdkv/transfer/README.md, "Verdicts"); False: every chunk is acknowledged with a ``Landed`` on the control
    # plane, verified by the receiver's I/O thread (the path before; kept to measure one against the other).
    data_verdicts: bool = True
    handshake_timeout_s: Seconds = 10.0
    reserve_timeout_s: Seconds = 10.0
    chunk_timeout_s: Seconds = 30.0
    transfer_timeout_s: Seconds = 120.0
    # The decode side stops waiting for a transfer that no sender announced (no Reserve) after this long:
    # P reserves before it starts computing, so a transfer not reserved by the time D asks will not come.
    announce_timeout_s: Seconds = 3.0
    lease_s: Seconds = 15.0
    heartbeat_s: Seconds = 1.0
    claim_timeout_s: Seconds = 60.0
    drain_timeout_s: Seconds = 10.0
    # On a channel that cannot cut a sender's one-sided writes off (nixl: RDMA, cma, UCX's own connections), a failed
    # reservation's blocks go to another request only once its sender said it writes no more (Done/Cancel, sent after
    # every write of its finished), or after this long: a write posted before a link outage may land when the link
    # comes back, long after drain_timeout_s (pdkv/transfer/README.md, "The late-write fence").
    unfenced_quarantine_s: Seconds = 300.0
    # A posted write that neither completed nor failed within its stall bound is given up on: failed, and its blocks
    # quarantined at the receiver as a write that may still land (pdkv/transfer/stall.py). Unset (None): the bound is
    # stall_multiple times what the bytes in flight at its post need at the slowest rate the sender's writes were
    # seen to move, and at least stall_floor_s; a number here is the bound itself, for every write.
    stall_timeout_s: Seconds | None = None
    stall_floor_s: Seconds = 10.0
    stall_multiple: Annotated[float, Meta(ge=1)] = 8.0
    # How staged chunks are encoded on the wire (pdkv/codec): none, zstd (exact) or a lossy one. A request with a
    # codec always goes in staging mode (direct block writes stay raw); the receiver must offer it at Hello.
    codec: Annotated[str, Meta(pattern=CODEC_NAME_PATTERN)] = "none"
    # A prefill worker pushes only to these decode receivers, each "host" (any port) or "host:port" ("[v6]:port"):
    # whatever a request names, signed by the router or not. Hosts are compared as written (an IP literal in its
    # canonical form, a name never resolved). Empty: any receiver (with a `secret`: any the router signs).
    allowed_receivers: Annotated[list[str], Meta(max_length=4096)] = msgspec.field(default_factory=list)

    def late_write_hold(self, fences_writes: bool) -> float:
        """How long memory a sender may still write into waits, without its word, before it is reused: what
        drain_timeout_s bounds where the channel can cut the sender off, unfenced_quarantine_s where it cannot."""
        return self.drain_timeout_s if fences_writes else max(self.drain_timeout_s, self.unfenced_quarantine_s)

    def __post_init__(self) -> None:
        for entry in self.allowed_receivers:
            try:
                receiver_entry(entry)
            except ValueError as exc:
                raise ValueError(f"transfer.allowed_receivers: {exc}") from None
        if self.codec != "none":  # none needs nothing loaded (a router reads this section too, and never loads codecs)
            codec_class(self.codec)  # an optional codec whose extra is not installed fails here, naming the extra


class ChannelConfig(msgspec.Struct, forbid_unknown_fields=True):
    name: Literal["mock", "tcp", "nixl", "ucx"] = "tcp"
    options: dict[str, Any] = msgspec.field(default_factory=dict)


WORKER_URL_PATTERN = r"^https?://[^\s/?#]+/?$"
WorkerURL = Annotated[str, Meta(pattern=WORKER_URL_PATTERN)]
"""A worker's base URL, scheme, host and port only: ``http://127.0.0.1:8100``."""


class KVEventsConfig(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's ``--kv-events-config``, same fields and defaults (pdkv/kv_events/): what a worker publishes and where.

    ``endpoint`` is bound when its host is ``*`` (pdkv binds the worker's
    ``host`` then; port 0 takes a free one, shown in ``/pdkv/info``) and
    connected to otherwise; ``replay_endpoint`` is always bound.
    """

    enable_kv_cache_events: bool = False
    publisher: Literal["null", "zmq"] | None = None  # None: "zmq" when enabled, else "null" (as vLLM)
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: Positive = 10_000  # batches kept for the replay socket
    hwm: Positive = 100_000  # the PUB socket's high-water mark
    max_queue_size: Positive = 100_000  # batches queued for the publishing thread; beyond it a batch is dropped
    topic: str = ""
    # pdkv only (vLLM reads its environment): integer block hashes (the low 64 bits, what Dynamo decodes) or
    # the 16-byte chunk keys. None: VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES decides, as in vLLM (unset: integers).
    use_int_block_hashes: bool | None = None
    # pdkv only: the medium announced for the memory level: "CPU" (vLLM's word for host memory, what it is) or
    # "GPU", for a router that credits only GPU blocks (Dynamo's flat scores): see the README's kv-events section.
    memory_medium: Literal["CPU", "GPU"] = "CPU"
    # pdkv's own, off by default (vLLM's consumers speak no CURVE): encrypt the stream and admit only the
    # subscribers named (pdkv/kv_events/curve.py). Keys: 40-character Z85 text or ZeroMQ certificate files.
    curve_secret_key: str = ""  # this publisher's secret key
    curve_clients: list[str] = msgspec.field(default_factory=list)  # public keys of the subscribers allowed

    # not vLLM's: never in its --kv-events-config (the hash form reaches vLLM as its environment switch)
    PDKV_FIELDS: ClassVar[tuple[str, ...]] = (
        "use_int_block_hashes",
        "memory_medium",
        "curve_secret_key",
        "curve_clients",
    )

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    def int_block_hashes(self) -> bool:
        """Whether block hashes go out as integers: ``use_int_block_hashes``, else vLLM's environment switch."""
        if self.use_int_block_hashes is not None:
            return self.use_int_block_hashes
        raw = os.environ.get("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "1")
        try:
            return bool(int(raw))  # vLLM's own parse: any integer, nonzero is on
        except ValueError:
            raise ConfigError(
                f"kv_events.use_int_block_hashes is unset and VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES={raw!r} is not an "
                "integer (1: integer hashes, 0: bytes)"
            ) from None


ZmqEndpoint = Annotated[str, Meta(pattern=r"^(tcp://([^\s/:\[\]]+|\[[0-9a-fA-F:.]+\]):\d{1,5}|(ipc|inproc)://\S+)$")]


class KVEventSource(msgspec.Struct, forbid_unknown_fields=True):
    """Where the router reads one worker's KV events: a vLLM server started with ``--kv-events-config``,
    or any worker that does not name its stream in ``/pdkv/info``."""

    worker: WorkerURL
    endpoint: ZmqEndpoint  # what the router connects to: tcp://HOST:PORT (or ipc://PATH)
    replay_endpoint: ZmqEndpoint | None = None
    topic: str = ""
    curve_server_key: str = ""  # the worker's CURVE public key, when it is not router.kv_events_curve_server_key


class TenantConfig(msgspec.Struct, forbid_unknown_fields=True):
    """One tenant of a shared router (pdkv/router/tenants.py): who it is, how it proves it, what it may hold.

    ``api_key`` (the key itself) or ``api_key_sha256`` (its SHA-256, hex: the config then holds no key); a
    tenant with neither is reached only through the trusted gateway (``router.tenant_header``).
    ``max_concurrent_requests``: requests of this tenant in the router at once (beyond: 429); 0: no bound.
    ``max_tokens``: the most tokens one request may generate (beyond: 400; a request that names none is given
    this many); 0: no bound.
    """

    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")]
    api_key: Annotated[str, Meta(pattern=r"^$|^[\x21-\x7e]{16,256}$")] = ""
    api_key_sha256: Annotated[str, Meta(pattern=r"^$|^[0-9a-f]{64}$")] = ""
    max_concurrent_requests: Annotated[int, Meta(ge=0)] = 0
    max_tokens: Annotated[int, Meta(ge=0)] = 0

    def key_digest(self) -> bytes:
        """The SHA-256 of this tenant's API key (b"" when it has none): what a presented key is compared with."""
        if self.api_key_sha256:
            return bytes.fromhex(self.api_key_sha256)
        return hashlib.sha256(self.api_key.encode()).digest() if self.api_key else b""


class RouterConfig(msgspec.Struct, forbid_unknown_fields=True):
    """What ``pdkv launch --role router`` fronts and how (see pdkv/router/__init__.py).

    ``--prefill``/``--decode`` flags replace the lists given here and
    ``--policy`` the policy. Every hop to a worker has its own timeout, so a
    stuck worker costs a retry, never a hung request.
    """

    mode: Literal["pdkv", "vllm"] = "pdkv"
    policy: Literal["round-robin", "least-loaded", "prefix"] = "round-robin"
    prefill: list[WorkerURL] = msgspec.field(default_factory=list)
    decode: list[WorkerURL] = msgspec.field(default_factory=list)
    # Conditional disaggregation: a prompt of fewer (estimated) tokens goes to a decode worker alone.
    short_prompt_tokens: Annotated[int, Meta(ge=0)] = 0
    # Whether a prompt's KV moves from a prefill worker (pdkv/router/disaggregation.py): always (P/D for every
    # prompt past short_prompt_tokens), never (the decode worker computes every prompt), or auto (per request, the
    # way that gave the lowest seconds to the answer's second event per prompt token on that decode worker, re-measured
    # every disaggregate_explore_every requests). disaggregate_codec: a codec the prefill workers run
    # (their transfer.codec) that auto may also use per request; "" for none.
    disaggregate: Literal["always", "never", "auto"] = "always"
    disaggregate_codec: Annotated[str, Meta(pattern=f"^$|{CODEC_NAME_PATTERN}")] = ""
    disaggregate_explore_every: Annotated[int, Meta(ge=0, le=1_000_000)] = 20
    disaggregate_weight: Annotated[float, Meta(gt=0, le=1)] = 0.3  # of a new sample in each way's running cost
    # mode pdkv: a streamed request's first token goes to the client from the prefill worker the moment it has it,
    # and the decode worker streams the rest of the same answer (the decode hop off the time to first token;
    # pdkv/router/handoff.py). mode vllm never: vLLM's decode side sends its own first token.
    stream_first_token: bool = True
    # The router has no tokenizer: text is counted as len(text) / chars_per_token.
    chars_per_token: Annotated[float, Meta(gt=0)] = 4.0
    # How many other workers a failed hop is tried on (per hop: prefill, and decode pairs).
    max_retries: Annotated[int, Meta(ge=0, le=16)] = 2
    connect_timeout_s: Seconds = 5.0
    # Backstops for a hop whose worker keeps answering its health checks: a worker that stops
    # answering them is routed around, and its hops retried elsewhere, within seconds (below).
    prefill_timeout_s: Seconds = 120.0
    decode_timeout_s: Seconds = 900.0
    # Longest silence inside a streamed answer, the wait for its first event included.
    read_timeout_s: Seconds = 300.0
    # Health: GET /health on every worker each health_interval_s, and each busy_health_interval_s on a
    # worker the router has requests on. health_failures probes in a row that fail (timed out, not
    # 200) mark it down; a refused connection marks it down at once. A worker marked down is skipped
    # until a probe passes, and the hops waiting on it whose client has no byte yet are failed and
    # retried elsewhere (a decode hop only if another decode worker is healthy): a frozen worker
    # (SIGSTOP, a hung engine) costs its requests about busy_health_interval_s + health_failures *
    # health_timeout_s, not prefill_timeout_s.
    health_timeout_s: Seconds = 2.0
    health_interval_s: Seconds = 5.0
    busy_health_interval_s: Seconds = 1.0
    health_failures: Annotated[int, Meta(ge=1, le=100)] = 2
    # A 503 (no decode attempt could serve the request) carries Retry-After: the seconds until the router's health
    # loop may next find a decode worker up (pdkv/router/failures.py), never fewer than retry_after_min_s nor more
    # than retry_after_max_s (the OpenAI client does not retry past 120 s).
    retry_after_min_s: Annotated[int, Meta(ge=0, le=3600)] = 1
    retry_after_max_s: Annotated[int, Meta(ge=1, le=3600)] = 30
    prefix_chunk_tokens: Positive = 256
    prefix_cache_entries: Positive = 65536
    # prefix policy: the prefix's owner is skipped when it runs this many more requests than the least loaded.
    prefix_max_imbalance: Annotated[int, Meta(ge=0)] = 8
    # When set, the admin endpoints (/pdkv/workers) want "Authorization: Bearer <admin_token>"; unset,
    # with a top-level `secret`, they want the secret's control token (pdkv.auth.control_token).
    admin_token: str = ""
    # KV-aware prefix policy (pdkv/router/kv_aware.py): the model's tokenizer ("default", or a Hugging Face
    # directory) turns prompts into the token ids the workers' KV events carry; "": no tokenizer.
    tokenizer: str = ""
    # Streams of workers that do not name theirs in /pdkv/info (vLLM servers started with --kv-events-config).
    kv_events: list[KVEventSource] = msgspec.field(default_factory=list)
    kv_events_discover: bool = True  # subscribe to what each prefill worker's /pdkv/info names
    kv_events_check_s: Seconds = 5.0  # how often a stream asks its replay socket for batches it may have missed
    kv_events_timeout_s: Seconds = 5.0  # a replay or a resync request that takes longer has failed
    # CURVE on the event streams (pdkv/kv_events/curve.py): the router's own secret key, and the workers' public
    # key (a kv_events source may name its own). Both set, every stream is read with CURVE; neither, in clear.
    kv_events_curve_secret_key: str = ""
    kv_events_curve_server_key: str = ""
    kv_shared_blocks: Positive = 1 << 20  # blocks of the shared tier the index remembers (LRU)
    # Prefill cost = prompt tokens not cached on the worker + prefix_load_weight * tokens it has in flight.
    prefix_load_weight: Annotated[float, Meta(ge=0)] = 1.0
    # Tenants (pdkv/router/tenants.py): when set, every /v1/ request names its tenant with
    # "Authorization: Bearer <api_key>" (401 otherwise), and its KV lives in the tenant's cache partition, a salt
    # derived from tenant_salt_secret (else the top-level secret) and the tenant's name.
    tenants: list[TenantConfig] = msgspec.field(default_factory=list)
    tenant_salt_secret: str = ""
    # A trusted gateway that authenticates in front of the router names the tenant in this header; it is taken
    # only from these addresses or networks (CIDR), and a request carrying it from anywhere else is refused (403).
    tenant_header: Annotated[str, Meta(pattern=r"^$|^[A-Za-z0-9-]{1,64}$")] = ""
    tenant_header_from: list[str] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if self.retry_after_min_s > self.retry_after_max_s:
            raise ValueError(
                f"router.retry_after_min_s ({self.retry_after_min_s}) must not exceed router.retry_after_max_s "
                f"({self.retry_after_max_s})"
            )
        names = [t.name for t in self.tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"router.tenants names must be unique, got {names}")
        digests = [t.key_digest() for t in self.tenants if t.api_key or t.api_key_sha256]
        if len(set(digests)) != len(digests):
            raise ValueError("two router.tenants have the same API key: a key must name one tenant")
        for t in self.tenants:
            if t.api_key and t.api_key_sha256:
                raise ValueError(f"router.tenants {t.name!r}: set api_key or api_key_sha256, not both")
            if not (t.api_key or t.api_key_sha256 or self.tenant_header):
                raise ValueError(
                    f"router.tenants {t.name!r} has no api_key or api_key_sha256, and no tenant_header names tenants: "
                    "no request could reach it"
                )
        if self.tenant_header and not (self.tenants and self.tenant_header_from):
            raise ValueError(
                "router.tenant_header needs router.tenants and router.tenant_header_from (the gateway's addresses)"
            )
        for net in self.tenant_header_from:
            try:
                ipaddress.ip_network(net, strict=False)
            except ValueError:
                raise ValueError(f"router.tenant_header_from: {net!r} is not an IP address or network (CIDR)") from None


class TierConfig(msgspec.Struct, forbid_unknown_fields=True):
    """The shared prefix-keyed KV cache (pdkv/tier/): which levels, their bounds and timeouts.

    Memory (L1) is on by default: a worker that sees a prompt prefix again
    loads its KV instead of recomputing it. Disk (L2) and Redis/Valkey
    (shared by every worker pointing at it) are on when their path/URL is
    set. Reads go memory -> disk -> redis; writes go to memory and are
    written behind to the rest. Set ``enabled: false`` to compute every prompt.
    """

    enabled: bool = True
    memory_bytes: Annotated[int, Meta(ge=0)] = 1 << 30  # 0: no memory level
    # which chunks leave a full level (pdkv/tier/policy.py): lru, s3fifo, or prefix (leaves of the prompt tree
    # first, reuse-weighted)
    memory_policy: Literal["lru", "s3fifo", "prefix"] = "lru"
    disk_path: str = ""  # a directory of its own per worker; "": no disk level
    disk_bytes: Positive = 16 << 30
    disk_policy: Literal["lru", "s3fifo", "prefix"] = "lru"
    # redis://HOST:PORT/DB (or rediss://, unix://), or a cluster: redis+cluster://HOST:PORT[,HOST:PORT...]
    # (rediss+cluster:// for TLS; pdkv.tier.redis_backend); "": no remote level
    redis_url: str = ""
    redis_namespace: str = "pdkv:kv:"
    redis_ttl_s: Annotated[float, Meta(ge=0)] = 0.0  # 0: kept until the server evicts it (maxmemory policy)
    redis_timeout_s: Seconds = 2.0  # per request: a pipeline's answers whole within it, or its connection closes
    redis_connect_timeout_s: Seconds = 1.0
    redis_retry_s: Seconds = 10.0  # after a failure, the server is skipped (reads miss) this long
    # Seals every value written to Redis with an HMAC bound to its chunk key, and takes only values sealed with it:
    # anyone else who can write to the server cannot plant KV (pdkv.tier.remote). "": values carry a checksum only.
    redis_secret: str = ""
    write_behind_bytes: Positive = 256 << 20  # queued for the lower levels; beyond it writes are dropped
    flush_timeout_s: Seconds = 10.0  # at shutdown, how long queued writes may take
    load_batch_chunks: Positive = 4  # chunks read per batch when loading a prefix (staging memory)
    # More levels, read after memory, disk and redis, in this order: each {backend: NAME, name: LABEL, ...options},
    # NAME being "module:Class", a `pdkv.tier_backends` entry point or a built-in ("s3"); the options are checked
    # against the class's own `Options` at start (pdkv/tier/README.md, "Your own backend").
    levels: list[dict[str, Any]] = msgspec.field(default_factory=list)

    def describe_levels(self) -> list[dict[str, Any]]:
        """The levels ``pdkv.tier.build_tier`` builds from this section, in read order, secrets redacted: what
        ``pdkv launch --print-config`` and a worker's ``/pdkv/info`` show."""
        if not self.enabled:
            return []
        built_in = [
            ("memory", "pdkv.tier.memory:MemoryTier", self.memory_bytes, ("memory_bytes", "memory_policy")),
            ("disk", "pdkv.tier.disk:DiskTier", self.disk_path, ("disk_path", "disk_bytes", "disk_policy")),
            ("redis", "pdkv.tier.remote:RedisTier", self.redis_url, ("redis_namespace", "redis_ttl_s", "redis_secret")),
        ]
        levels = [
            {"name": name, "backend": backend, "options": {f: shown(f, getattr(self, f)) for f in fields}}
            for name, backend, on, fields in built_in
            if on
        ]
        return levels + [spec.describe() for spec in self.level_specs()]

    def level_specs(self) -> list[LevelSpec]:
        """Each entry of ``levels`` resolved: its class found and its options checked (``ConfigError`` naming the
        field otherwise)."""
        specs = []
        taken = {"memory", "disk", "redis"}
        for i, entry in enumerate(self.levels):
            field = f"tier.levels[{i}]"
            raw = dict(entry)
            backend, name = raw.pop("backend", None), raw.pop("name", None)
            if not isinstance(backend, str) or not backend:
                raise ConfigError(
                    f"field '{field}.backend' = {backend!r}: expected 'module:Class', an installed "
                    f"{TIER_BACKENDS_GROUP} entry point or one of {sorted(BUILTIN_TIER_BACKENDS)}"
                )
            cls = load_class(backend, TIER_BACKENDS_GROUP, BUILTIN_TIER_BACKENDS, f"{field}.backend")
            options = convert_options(cls, raw, field)
            name = name if name is not None else getattr(cls, "default_name", cls.__name__.lower())
            if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", name) or name in taken:
                raise ConfigError(
                    f"field '{field}.name' = {name!r}: expected a label of letters, digits, '_', '.', '-' that no "
                    f"other level has (taken: {sorted(taken)})"
                )
            taken.add(name)
            specs.append(LevelSpec(name, backend, cls, options, field))
        return specs


TIER_BACKENDS_GROUP = "pdkv.tier_backends"
BUILTIN_TIER_BACKENDS = {"s3": "pdkv.tier.s3:S3Tier"}  # shipped with pdkv; found without an entry point


@dataclasses.dataclass(frozen=True)
class LevelSpec:
    """One ``tier.levels`` entry, resolved: what ``pdkv.tier.build_tier`` opens as ``cls(layout, options, name)``."""

    name: str
    backend: str  # as the config gave it
    cls: type
    options: Any  # an instance of cls.Options
    field: str  # tier.levels[i]

    def describe(self) -> dict[str, Any]:
        """What ``pdkv launch --print-config`` and ``/pdkv/info`` show of it (secrets redacted)."""
        options = msgspec.to_builtins(self.options)
        return {
            "name": self.name,
            "backend": class_path(self.cls),
            "options": {k: shown(k, v) for k, v in options.items()},
        }


class HttpConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Limits of every HTTP server pdkv runs (workers and router): what a client can make it hold.

    A body larger than ``max_body_bytes`` is answered 413 without being read; one that does not
    arrive whole within ``body_timeout_s`` of its headers is answered 408 and its connection closed;
    a connection with no complete request for ``idle_timeout_s`` (idle keep-alive, or headers that
    never finish) is closed. Keep ``idle_timeout_s`` above the router's 4 s client keep-alive
    (``pdkv.router.app.UPSTREAM_KEEPALIVE_S``), so the router never reuses a connection a worker is closing.
    After an answer given before the body was read (408, 413, 401), what is left of the body is read
    and dropped for at most ``linger_s`` (so the client reads the answer, not a reset), then the
    connection is closed.
    """

    max_body_bytes: Positive = 16 << 20
    body_timeout_s: Seconds = 30.0
    idle_timeout_s: Seconds = 75.0
    linger_s: Annotated[float, Meta(ge=0)] = 1.0


class PdkvConfig(msgspec.Struct, forbid_unknown_fields=True):
    """Everything one pdkv process needs; unknown keys are errors, not silently ignored."""

    role: Literal["prefill", "decode", "router", "demo"] = "demo"
    # Where every plane of this process listens (HTTP, the KV receiver's control plane, the channel's data plane).
    host: str = "127.0.0.1"
    # The address peers and the router dial to reach it, when that is not ``host``: ``host`` is a wildcard
    # (0.0.0.0, ::) or a NAT/proxy sits in front. Advertised in /pdkv/info and in the channel's metadata.
    advertise_host: str = ""
    port: Annotated[int, Meta(ge=0, le=65535)] = 0
    control_port: Annotated[int, Meta(ge=0, le=65535)] = 0
    model: str = "default"
    engine: Literal["reference", "vllm"] = "reference"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # torch threads of the engine; 0 = half the cores (P and D often share a machine)
    num_threads: Annotated[int, Meta(ge=0)] = 0
    num_blocks: Positive = 1024
    block_size: Positive = 16
    kv_order: Literal["NHD", "HND"] = "NHD"
    kv_kind: Literal["per_layer", "cross_layer"] = "per_layer"
    secret: str = ""
    # Serve beyond loopback without a secret (workers) or an admin token/secret (router): only on a
    # network where everyone who can reach the ports is trusted. Refused at start otherwise.
    insecure: bool = False
    # A worker whose engine has work but finished no step for this long answers /health with 503.
    stall_timeout_s: Seconds = 60.0
    # After a streamed request's first token, the engine thread waits up to this long for it to be sent before it
    # steps on: its next step would hold the GIL and the cores while the event loop waits to send (0: never wait).
    first_token_yield_s: Annotated[float, Meta(ge=0)] = 0.005
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    channel: ChannelConfig = msgspec.field(default_factory=ChannelConfig)
    transfer: TransferConfig = msgspec.field(default_factory=TransferConfig)
    router: RouterConfig = msgspec.field(default_factory=RouterConfig)
    tier: TierConfig = msgspec.field(default_factory=TierConfig)
    kv_events: KVEventsConfig = msgspec.field(default_factory=KVEventsConfig)

    def channel_options(self) -> dict[str, Any]:
        """The channel's options with what the worker knows filled in.

        The shared secret (one ``secret`` authenticates both planes), and where
        the data plane lives: ``host`` and, for a channel that advertises an
        address (tcp), ``advertise_host`` follow the worker's unless
        ``channel.options`` sets them. So ``--host`` alone moves every plane:
        a channel left on 127.0.0.1 would make every transfer to another host fail.
        """
        options = {**self.channel.options, "secret": self.secret}
        options.setdefault("host", self.host)
        if self.advertise_host and "advertise_host" in channel_class(self.channel.name).Options.__struct_fields__:
            options.setdefault("advertise_host", self.advertise_host)
        return options

    def advertised_host(self) -> str:
        """The address peers dial to reach this process: ``advertise_host``, else ``host`` if that is one address."""
        if self.advertise_host:
            return self.advertise_host
        if is_wildcard(self.host):
            raise ConfigError(
                f"field 'host' = {self.host!r} listens on every address, which is no address peers can dial: "
                "set 'advertise_host' (--advertise-host) to the one the other workers and the router reach this host at"
            )
        return self.host


_PATH = re.compile(r"at `\$((?:\.\w+|\[\d+\])*)`")


# Fields whose values an error message never repeats: it goes to logs and terminals.
_SECRET_FIELDS = frozenset({"secret", "api_key", "admin_token", "tenant_salt_secret"})


def redacted(node: Any) -> Any:
    """A raw config mapping with every secret's value replaced: what error messages and ``--print-config`` show."""
    if isinstance(node, dict):
        return {k: "<redacted>" if k in _SECRET_FIELDS else shown(k, redacted(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [redacted(v) for v in node]
    return node


def _lookup(raw: Any, path: str) -> Any:
    """Follow a msgspec error path like ``.transfer.chunk_size`` into the raw mapping (secrets redacted)."""
    node = raw
    for part in re.findall(r"\.(\w+)|\[(\d+)\]", path):
        key = part[0] if part[0] else int(part[1])
        if key in _SECRET_FIELDS:
            return "<redacted>"
        try:
            node = node[key]
        except (KeyError, IndexError, TypeError):
            return "<missing>"
    return redacted(node)


def convert_config(raw: dict[str, Any], source: str = "config") -> PdkvConfig:
    """Validate a raw mapping; errors say field, value and expectation."""
    try:
        config = msgspec.convert(raw, PdkvConfig, strict=False)
    except msgspec.ValidationError as exc:
        text = str(exc)
        match = _PATH.search(text)
        path = match.group(1) if match else ""
        unknown = re.search(r"unknown field `(\w+)`", text)
        if unknown:
            path += "." + unknown.group(1)
            text = (
                "unknown field; expected one of the documented fields of "
                f"'{path.rsplit('.', 1)[0].lstrip('.') or 'the top level'}'"
            )
        field = path.lstrip(".") or "?"
        expected = _PATH.sub("", text).rstrip(" -")
        raise ConfigError(f"{source}: field '{field}' = {_lookup(raw, path)!r}: {expected}") from None
    why = (
        codec_class(config.transfer.codec).unsupported_dtype(config.dtype) if config.transfer.codec != "none" else None
    )
    if why and config.engine == "reference":  # vLLM's KV dtype is vLLM's: checked when the connector builds the codec
        raise ConfigError(
            f"{source}: field 'transfer.codec' = {config.transfer.codec!r} does not fit dtype {config.dtype!r}: {why}"
        )
    if config.router.tenants and not (config.router.tenant_salt_secret or config.secret):
        raise ConfigError(
            f"{source}: field 'router.tenants' needs a secret to derive each tenant's cache salt from: set "
            "router.tenant_salt_secret or the top-level secret"
        )
    try:
        if config.role != "router":  # a router builds no tier, and must not import a backend (torch) to read this
            config.tier.level_specs()  # each level's backend found and its options checked, naming the field
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if "secret" in config.channel.options:  # one secret for both planes; ``channel_options`` hands it to the channel
        raise ConfigError(
            f"{source}: field 'channel.options.secret' is not an option: set the top-level `secret`, which guards the "
            "channel too"
        )
    return config


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PdkvConfig:
    """YAML file (optional) with CLI overrides on top; ``None`` overrides are ignored."""
    raw: dict[str, Any] = {}
    source = "config"
    if path is not None:
        source = str(path)
        try:
            loaded = yaml.safe_load(Path(path).read_text())
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"{path} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level, got {type(loaded).__name__}")
        raw = loaded or {}
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        node = raw
        *parents, leaf = dotted.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return convert_config(raw, source)

"""A level in an S3-compatible object store (AWS S3, MinIO, SeaweedFS, Ceph RGW, R2, GCS's XML API) through boto3.

Where a fleet's shared KV goes when it outgrows one Redis: every worker that
names the same bucket and prefix shares one cache, on any machine, and the
store's capacity is the bucket's. Configured as a ``tier.levels`` entry
(``backend: s3``; ``pip install 'pdkv[s3]'``), read after memory, disk and
Redis.

Each chunk is one object, ``<prefix><key hex>``, holding the same bytes as a
Redis value (``pdkv.tier.base``: header with the chunk key, payload, xxh3,
and with ``secret`` the HMAC seal), checked the same way on every read
(``pdkv.tier.store``): a value that fails is a counted miss, logged once and
deleted. A batch is one request per object, ``max_concurrency`` at a time
(one bounded thread pool and as many pooled connections per level); an object
over ``multipart_bytes`` is uploaded in parts of that size. A put asks first
whether the object is there (a HEAD, far cheaper than a chunk's upload) and
then writes with ``If-None-Match: *``, so a chunk already stored, by this
worker or another, is left as it is.

Object stores do not evict. ``ttl_days`` installs a lifecycle rule on the
bucket (``pdkv-ttl:<prefix>``, beside any rules already there) that expires
each object that many days after it was written, reads or not; without it the
bucket keeps every chunk until someone deletes it, and bounding it (a quota, a
lifecycle rule of your own) is the operator's job. Put a memory or disk level
in front for an eviction that knows prefixes.

The cache must never fail a request: a store that is unreachable, slower
than ``timeout_s`` for a whole request (connect: ``connect_timeout_s``),
declaring a body longer than a chunk's value, or answering errors or
malformed answers makes its objects misses (reads) or no-ops (writes) with
one logged warning, and is skipped for ``retry_s`` afterwards
(``pdkv.tier.backoff``). ``timeout_s`` is a deadline per request (on its
whole answer, from when it is sent), not per socket read: each request runs
within ``pdkv.tier.bounds``, and its connection is closed when the deadline
passes (``pdkv.tier.s3_bounded``).
Writes reach the store only through the tier's write-behind queue, so a slow
store never stalls a forward step; reads wait at most the timeouts.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec
import torch
from msgspec import Meta

from pdkv.errors import ConfigError, StoreAnswerError
from pdkv.layout import KVLayout
from pdkv.tier import bounds
from pdkv.tier.backoff import Backoff
from pdkv.tier.store import FAILED, SharedStoreTier

MIN_PART_BYTES = 5 << 20  # S3's smallest part but the last
_MISSING_CODES = ("404", "NoSuchKey", "NotFound")
_DELETE_BATCH = 1000  # the most keys one DeleteObjects takes


class S3Options(msgspec.Struct, forbid_unknown_fields=True):
    """The ``tier.levels`` options of ``backend: s3``."""

    bucket: Annotated[str, Meta(pattern=r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")]
    prefix: str = "pdkv/kv/"  # object names are <prefix><chunk key hex>
    endpoint_url: str = ""  # "": AWS S3 in `region`; else any S3-compatible server
    region: str = "us-east-1"
    access_key_id: str = ""  # "" (both): boto3's own chain (environment, profile, instance role)
    secret_access_key: str = ""
    secret: str = ""  # seals values as tier.redis_secret does (pdkv.tier.base)
    timeout_s: Annotated[float, Meta(gt=0)] = 5.0  # per request: its answer whole within it, or its connection closes
    connect_timeout_s: Annotated[float, Meta(gt=0)] = 1.0
    retry_s: Annotated[float, Meta(gt=0)] = 10.0  # after a failure, the store is skipped (reads miss) this long
    max_concurrency: Annotated[int, Meta(ge=1, le=256)] = 16  # requests in flight per level
    multipart_bytes: Annotated[int, Meta(ge=MIN_PART_BYTES)] = 8 << 20  # larger objects go up in parts this big
    ttl_days: Annotated[int, Meta(ge=0)] = 0  # 0: no lifecycle rule (the bucket keeps chunks until deleted)
    create_bucket: bool = False  # create the bucket at start when it does not exist


def _boto3() -> Any:
    try:
        import boto3
    except ImportError:
        raise ConfigError("tier.levels names backend s3 but boto3 is not installed: pip install 'pdkv[s3]'") from None
    return boto3


class S3Tier(SharedStoreTier):
    Options = S3Options
    default_name = "s3"

    def __init__(self, layout: KVLayout, options: S3Options, name: str = "s3") -> None:
        boto3 = _boto3()
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        from pdkv.tier.s3_bounded import bound_http

        super().__init__(layout, name, options.secret)
        self.options = options
        self._client_error = ClientError
        self._errors = (BotoCoreError, ClientError, StoreAnswerError, OSError)
        self._client = boto3.session.Session().client(
            "s3",
            endpoint_url=options.endpoint_url or None,
            region_name=options.region,
            aws_access_key_id=options.access_key_id or None,
            aws_secret_access_key=options.secret_access_key or None,
            config=Config(
                connect_timeout=options.connect_timeout_s,
                read_timeout=options.timeout_s,
                retries={"total_max_attempts": 1, "mode": "standard"},  # no retry: a failure is skipped for retry_s
                max_pool_connections=options.max_concurrency,
            ),
        )
        bound_http(self._client)
        self._pool = concurrent.futures.ThreadPoolExecutor(options.max_concurrency, thread_name_prefix=f"pdkv-{name}")
        self.url = f"{options.endpoint_url or 's3:/'}/{options.bucket}/{options.prefix}"
        self._backoff = Backoff(f"{name} tier {self.url}", options.retry_s)

    # -- CacheTier ------------------------------------------------------------------
    def ping(self) -> bool:
        """Whether the bucket answers now (created with ``create_bucket``, its TTL rule installed with ``ttl_days``);
        a failure is logged and starts the retry window."""
        o = self.options
        try:
            try:
                self._call("head_bucket", Bucket=o.bucket)
            except self._client_error as exc:
                if not (o.create_bucket and self._missing(exc)):
                    raise
                self._call("create_bucket", Bucket=o.bucket)
            if o.ttl_days:
                self._install_ttl()
        except self._errors as exc:
            self._backoff.failed("store", "ping", exc)
            self._count(errors=1)
            return False
        return True

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        found = self._map(
            "head", keys, lambda key: self._call("head_object", Bucket=self.options.bucket, Key=self._name(key))
        )
        return [r is not FAILED and r is not None for r in found]

    def _get(self, keys: Sequence[bytes], outs: Sequence[torch.Tensor]) -> int:
        limit = bounds.value_limit(outs)
        return self.accept_run(keys, outs, self._map("get", keys, lambda key: self._read(key, limit)))

    def _put(self, keys: Sequence[bytes], chunks: Sequence[torch.Tensor], parents: Sequence[bytes | None]) -> None:
        """``parents`` are not used: an object store does not evict (see the module docstring)."""
        held = self.has(keys)
        todo = [i for i, h in enumerate(held) if not h]
        values = dict(zip(todo, self.encode([keys[i] for i in todo], [chunks[i] for i in todo]), strict=True))
        written = dict(zip(todo, self._map("put", todo, lambda i: self._write(keys[i], values[i])), strict=True))
        self._count(written_bytes=sum(len(values[i]) for i, w in written.items() if w is True))
        self._changed(stored=[k for i, k in enumerate(keys) if held[i] or written[i] is not FAILED])  # now, or before

    def remove(self, keys: Sequence[bytes]) -> int:
        present = [k for k, h in zip(keys, self.has(keys), strict=True) if h]
        batches = [present[i : i + _DELETE_BATCH] for i in range(0, len(present), _DELETE_BATCH)]
        done = self._map("delete", batches, self._delete)
        return sum(n for n in done if n is not FAILED and n is not None)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._client.close()

    def where(self, key: bytes) -> str:
        return f"s3://{self.options.bucket}/{self._name(key)}"

    # -- requests -------------------------------------------------------------------
    def _name(self, key: bytes) -> str:
        return self.options.prefix + key.hex()

    def _call(self, op: str, limit: int = bounds.ANSWER_BYTES, **kwargs: Any) -> Any:
        """One request to the store, within ``timeout_s`` and ``limit`` bytes of answer (``pdkv.tier.bounds``)."""
        with bounds.request(f"{op} on {self.url}", self.options.timeout_s, limit):
            return getattr(self._client, op)(**kwargs)

    def _read(self, key: bytes, limit: int) -> bytes:
        """The object's bytes, when they are at most ``limit`` (a chunk's value); the body is read within the
        request's deadline, and no further than one byte past the limit."""
        with bounds.request(f"GetObject on {self.url}", self.options.timeout_s, limit):
            answer = self._client.get_object(Bucket=self.options.bucket, Key=self._name(key))
            with contextlib.closing(answer["Body"]) as body:  # closes the connection unless the body was read whole
                value = body.read(limit + 1)
        if len(value) > limit:
            raise StoreAnswerError(f"{self.where(key)} is longer than a chunk's value ({limit} bytes): not read")
        return value

    def _write(self, key: bytes, value: bytes) -> bool:
        """Store ``value`` unless the object is there; True when written, False when it already was."""
        o, name = self.options, self._name(key)
        try:
            if len(value) <= o.multipart_bytes:
                self._call("put_object", Bucket=o.bucket, Key=name, Body=value, IfNoneMatch="*")
            else:
                self._write_parts(name, value)
        except self._client_error as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
                return False  # written meanwhile, by another worker: the first one stays
            raise
        return True

    def _write_parts(self, name: str, value: bytes) -> None:
        o, view = self.options, memoryview(value)
        answer = self._call("create_multipart_upload", Bucket=o.bucket, Key=name)
        upload = bounds.answer_field(answer, "UploadId", "CreateMultipartUpload")
        try:
            parts = []
            for number, start in enumerate(range(0, len(value), o.multipart_bytes), 1):
                body = view[start : start + o.multipart_bytes].tobytes()
                sent = self._call(
                    "upload_part", Bucket=o.bucket, Key=name, UploadId=upload, PartNumber=number, Body=body
                )
                parts.append({"ETag": bounds.answer_field(sent, "ETag", "UploadPart"), "PartNumber": number})
            self._call(
                "complete_multipart_upload",
                Bucket=o.bucket,
                Key=name,
                UploadId=upload,
                MultipartUpload={"Parts": parts},
                IfNoneMatch="*",
            )
        except BaseException:
            try:
                self._call("abort_multipart_upload", Bucket=o.bucket, Key=name, UploadId=upload)
            except self._errors:
                pass  # the store is failing anyway; a lifecycle rule (or the operator) clears stale uploads
            raise

    def _delete(self, batch: list[bytes]) -> int:
        answer = self._call(
            "delete_objects",
            Bucket=self.options.bucket,
            Delete={"Objects": [{"Key": self._name(k)} for k in batch], "Quiet": True},
        )
        return len(batch) - len(answer.get("Errors", []))

    def _map(self, what: str, items: Sequence[Any], call: Callable[[Any], Any]) -> list[Any]:
        """``call(item)`` for each item on the pool: its result, None where the object is not there, ``FAILED``
        where the store could not be asked (logged once per window; then skipped for ``retry_s``)."""
        if not items:
            return []
        if self._backoff.down("store"):
            return [FAILED] * len(items)
        futures = [self._pool.submit(call, item) for item in items]
        results: list[Any] = []
        failed = False
        for future in futures:
            try:
                results.append(future.result())
            except self._client_error as exc:
                if self._missing(exc):
                    results.append(None)
                    continue
                failed = True
                self._backoff.failed("store", what, exc)
                results.append(FAILED)
            except self._errors as exc:
                failed = True
                self._backoff.failed("store", what, exc)
                results.append(FAILED)
        if failed:
            self._count(errors=1)
        return results

    def _missing(self, exc: Any) -> bool:
        return str(exc.response.get("Error", {}).get("Code")) in _MISSING_CODES

    def _install_ttl(self) -> None:
        """Add (or replace) this prefix's expiration rule, keeping the bucket's other lifecycle rules."""
        o = self.options
        rule_id = f"pdkv-ttl:{o.prefix}"[:255]
        try:
            rules = self._call("get_bucket_lifecycle_configuration", Bucket=o.bucket).get("Rules", [])
        except self._client_error as exc:
            if "NoSuchLifecycleConfiguration" not in str(exc) and not self._missing(exc):
                raise
            rules = []
        rules = [r for r in rules if r.get("ID") != rule_id]
        rules.append(
            {"ID": rule_id, "Filter": {"Prefix": o.prefix}, "Status": "Enabled", "Expiration": {"Days": o.ttl_days}}
        )
        self._call("put_bucket_lifecycle_configuration", Bucket=o.bucket, LifecycleConfiguration={"Rules": rules})

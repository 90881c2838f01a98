"""Publish KV event batches the way vLLM's ``ZmqEventPublisher`` does: PUB with a topic, sequence numbers, a replay
socket.

Each batch goes out as ``(topic, seq, payload)`` on a PUB socket; the last
``buffer_steps`` batches are kept so that a subscriber that saw a gap in
the sequence numbers (or just connected) can ask the replay socket, a
ROUTER, for everything from a sequence number on: it sends the 8-byte
big-endian start, and gets every buffered batch from there as
``("", topic, seq, payload)`` followed by ``("", "", -1, "")``. That is
vLLM's protocol, so vLLM's subscribers work against a pdkv worker and
pdkv's router against a vLLM server.

Where pdkv differs, on purpose:

* ``publish`` never blocks its caller (the engine thread, the tier's
  writer): past ``max_queue_size`` queued batches a batch is dropped and
  counted. Its sequence number is taken when it is queued, so the drop is a
  gap every subscriber sees, and since the batch was never buffered a replay
  cannot fill it: subscribers know their view is incomplete and rebuild it.
* ``tcp://*:PORT`` binds the worker's own host (``--host``, 127.0.0.1 unless
  told otherwise), not every interface: events carry prompt token ids. A
  worker started with ``--host 0.0.0.0`` binds every interface. Port 0
  takes a free port; ``endpoint``/``replay_endpoint`` say which.
  An endpoint without ``*`` is connected to (a forwarder), as in vLLM.
* With ``curve_secret_key`` (and ``curve_clients``) both sockets are CURVE
  servers (``pdkv.kv_events.curve``): encrypted, and only the subscribers
  listed get a byte. The sockets then live in a ZMQ context of their own,
  whose ZAP handler thread admits those keys and is stopped at ``close``.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import NamedTuple

import zmq

from pdkv.config import KVEventsConfig
from pdkv.errors import ConfigError
from pdkv.kv_events.curve import CurveServer
from pdkv.kv_events.wire import END_SEQ, KVEvent, KVEventBatch, encode_batch, encode_seq
from pdkv.netaddr import zmq_address, zmq_ipv6

log = logging.getLogger(__name__)

_IDLE_S = 0.05  # the thread's longest sleep between looking at the replay socket and the queue


class _Numbered(NamedTuple):
    """A batch with the sequence number it was given when queued."""

    seq: int
    batch: KVEventBatch


def is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard hosts and ipc/inproc are bound, anything else is connected to."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    """A PUB socket, a replay ROUTER and the thread that owns both (ZMQ sockets are not thread-safe)."""

    def __init__(self, config: KVEventsConfig, bind_host: str = "127.0.0.1", data_parallel_rank: int = 0) -> None:
        if not config.publishing:
            raise ConfigError(
                f"kv_events: publisher {config.publisher!r} with enable_kv_cache_events "
                f"{config.enable_kv_cache_events}: "
                "nothing to publish; set enable_kv_cache_events: true and publisher: zmq"
            )
        self.config = config
        self.topic = config.topic.encode()
        self.data_parallel_rank = data_parallel_rank
        self.curve = (
            CurveServer.load(config.curve_secret_key, config.curve_clients) if config.curve_secret_key else None
        )
        if config.curve_clients and self.curve is None:
            raise ConfigError(
                "field 'kv_events.curve_clients' is set without 'kv_events.curve_secret_key': set the publisher's key "
                "pair too"
            )
        # CURVE: a context of our own, so its ZAP handler (one per context) answers for our sockets alone
        self._own_ctx = self.curve is not None
        self._ctx = zmq.Context() if self._own_ctx else zmq.Context.instance()
        self._auth = self.curve.authenticator(self._ctx) if self.curve is not None else None
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay: zmq.Socket | None = None
        try:
            if self.curve is not None:
                self.curve.apply(self._pub)
            self.endpoint = self._open(self._pub, config.endpoint, bind_host)
            if config.replay_endpoint:
                if not is_bind_endpoint(config.replay_endpoint):
                    raise ConfigError(
                        f"kv_events.replay_endpoint {config.replay_endpoint!r}: the replay socket is bound, give "
                        "tcp://*:PORT (or ipc://...)"
                    )
                self._replay = self._ctx.socket(zmq.ROUTER)
                if self.curve is not None:
                    self.curve.apply(self._replay)
                self.replay_endpoint: str | None = self._open(self._replay, config.replay_endpoint, bind_host)
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close_sockets()
            raise
        self._queue: queue.Queue[_Numbered | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._seq_lock = threading.Lock()
        self.stats = collections.Counter[str]()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="pdkv-kv-events", daemon=True)
        self._thread.start()

    @staticmethod
    def _open(sock: zmq.Socket, endpoint: str, bind_host: str) -> str:
        """Bind or connect ``sock``; returns the address a subscriber connects to."""
        if not is_bind_endpoint(endpoint):
            sock.connect(endpoint)
            return endpoint
        if endpoint.startswith("tcp://"):
            host = bind_host if bind_host not in ("", "0.0.0.0", "::") else "*"
            endpoint = endpoint.replace("*", zmq_address(host).removeprefix("tcp://"), 1)
            sock.setsockopt(zmq.IPV6, zmq_ipv6(endpoint))
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as exc:
            raise ConfigError(f"kv_events: cannot bind {endpoint}: {exc}; give a free port (0 picks one)") from None
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def publish(self, events: list[KVEvent]) -> None:
        """Queue one batch; never blocks (see the module docstring for what a full queue does)."""
        if not events or not self._running:
            return
        batch = KVEventBatch(ts=time.time(), events=events, data_parallel_rank=self.data_parallel_rank)
        with self._seq_lock:
            seq = self._seq
            self._seq += 1
            try:
                self._queue.put_nowait(_Numbered(seq, batch))
            except queue.Full:
                self.stats["dropped_batches"] += 1
                log.warning(
                    "kv events: %d batches queued, batch %d dropped; subscribers will see the gap and rebuild",
                    self.config.max_queue_size,
                    seq,
                )

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout``), then close both sockets."""
        if not self._running:
            return
        self._running = False
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._auth is not None:
            self._auth.stop()
        if self._own_ctx:
            self._ctx.term()

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=_IDLE_S)
            except queue.Empty:
                continue
            if item is None:
                return
            payload = encode_batch(item.batch)
            try:
                self._pub.send_multipart((self.topic, encode_seq(item.seq), payload))
            except zmq.ZMQError as exc:  # never stop publishing for one failed send: subscribers see the gap
                self.stats["send_errors"] += 1
                log.warning("kv events: batch %d not sent: %s", item.seq, exc)
            self._buffer.append((item.seq, payload))
            self.stats["batches"] += 1

    def _serve_replay(self) -> None:
        """One replay request: every buffered batch from the asked sequence number on, then the end marker."""
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            self.stats["bad_replay_requests"] += 1
            log.warning("kv events: malformed replay request (%d frames) ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        self.stats["replays"] += 1
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self.topic, encode_seq(seq), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

"""Follow one worker's KV event stream in sequence order, and heal when batches are lost or the worker restarts.

A ``EventStream`` holds a SUB socket on the worker's ``endpoint`` and, when
it has one, a DEALER on its ``replay_endpoint`` (vLLM's replay protocol:
send the first wanted sequence number, get every buffered batch from there
and an end marker). Batches are handed to ``apply`` strictly in sequence
order, each exactly once. How the view is kept right:

* Start: ask the replay socket for everything from 0 (a worker that
  started before the router has its last ``buffer_steps`` batches there),
  and ask the worker to ``resync`` (pdkv workers: publish everything they
  hold again) when it can.
* Gap (a batch numbered past the next one expected: the PUB socket dropped
  some, the connection broke): replay from the missing number. If the
  replay has them, nothing was lost. If it does not (no replay socket, the
  batches left its buffer, or the publisher dropped them before buffering),
  the worker's view cannot be trusted: it is ``clear``-ed, rebuilt from the
  next batches on, and a resync is asked for.
* Quiet stream: every ``check_s`` the replay socket is asked for anything
  past the last batch seen, so batches lost at the end of a burst are not
  missed until the next burst.
* Restart: a publisher starts again from sequence 0. A batch numbered
  before the next one expected but stamped later than the last applied
  one is a new incarnation: clear, replay from 0. (A batch numbered before
  and stamped no later is a duplicate a replay already applied: skipped.)
  The router also calls ``restarted`` when a health check sees the worker
  come back, or a pdkv worker's agent id changes.

With ``curve`` (``pdkv.kv_events.curve``) both sockets are CURVE clients of
the worker's public key: a publisher without that key's secret, or one that
does not admit ours, sends nothing, which looks like a quiet stream whose
replays time out (``replay_failures``).

Every frame is checked before use (three frames, the topic, an 8-byte
sequence number, a payload that decodes as a ``KVEventBatch``, at most
``MAX_MESSAGE_BYTES``): a malformed batch counts as a lost one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
from collections.abc import Awaitable, Callable

import zmq
import zmq.asyncio

from pdkv.errors import ProtocolError
from pdkv.kv_events.curve import CurveClient
from pdkv.kv_events.wire import KVEventBatch, decode_batch, decode_seq, encode_seq

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 256 << 20


class StreamLost(Exception):
    """The stream's batches from some point on cannot be had: the view must be rebuilt."""


class EventStream:
    """One worker's stream; ``run`` until cancelled."""

    def __init__(
        self,
        worker: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        apply: Callable[[str, KVEventBatch], None],
        clear: Callable[[str], object],
        resync: Callable[[], Awaitable[bool]] | None = None,
        check_s: float = 5.0,
        timeout_s: float = 5.0,
        curve: CurveClient | None = None,
    ) -> None:
        self.worker = worker
        self.curve = curve
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self._apply = apply
        self._clear = clear
        self._resync = resync
        self.check_s = check_s
        self.timeout_s = timeout_s
        self.next_seq = 0
        self.last_ts = 0.0
        self.stats = collections.Counter[str]()
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._dealer: zmq.asyncio.Socket | None = None
        self._restart = asyncio.Event()

    def describe(self) -> dict[str, object]:
        return {
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "curve": self.curve is not None,
            "next_seq": self.next_seq,
            **self.stats,
        }

    def restarted(self) -> None:
        """The worker may have restarted (seen down and up again, a new agent id): rebuild its view."""
        self._restart.set()

    async def run(self) -> None:
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self._sub.connect(self.endpoint)
        try:
            await self._rebuild("subscribed", from_scratch=False)
            while True:
                if self._restart.is_set():
                    self._restart.clear()
                    await self._rebuild("the worker restarted")
                    continue
                try:
                    async with asyncio.timeout(self.check_s):  # not wait_for: on 3.11 it can swallow a cancel
                        frames = await self._sub.recv_multipart()
                except TimeoutError:
                    if await self._catch_up():
                        await self._ask_resync()
                    continue
                await self._live(frames)
        finally:
            self._sub.close(linger=0)
            if self._dealer is not None:
                self._dealer.close(linger=0)

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        """A SUB or DEALER with the message bound and, with ``curve``, our keys (set before it connects)."""
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        if self.curve is not None:
            self.curve.apply(sock)
        return sock

    # -- live batches -----------------------------------------------------------------
    async def _live(self, frames: list[bytes]) -> None:
        try:
            seq, batch = self._parse(frames)
        except ProtocolError as exc:
            self.stats["malformed"] += 1
            log.warning("kv events from %s: %s; rebuilding its view", self.worker, exc)
            await self._rebuild("a malformed batch")
            return
        if batch is None:
            return
        if seq < self.next_seq:
            if batch.ts > self.last_ts:  # numbered from 0 again, and newer: a new incarnation
                self.stats["restarts"] += 1
                await self._rebuild(f"its sequence went back from {self.next_seq} to {seq}")
            return  # else a duplicate of a replayed batch
        if seq > self.next_seq:
            self.stats["gaps"] += 1
            lost = await self._catch_up()
            if seq < self.next_seq:  # the replay brought this one too
                if lost:
                    await self._ask_resync()
                return
            if seq > self.next_seq:
                self._lose(f"batches {self.next_seq}..{seq - 1} are gone")
                lost = True
            self._take(seq, batch)
            if lost:
                await self._ask_resync()
            return
        self._take(seq, batch)

    def _take(self, seq: int, batch: KVEventBatch) -> None:
        self._apply(self.worker, batch)
        self.next_seq = seq + 1
        self.last_ts = max(self.last_ts, batch.ts)
        self.stats["batches"] += 1

    def _parse(self, frames: list[bytes]) -> tuple[int, KVEventBatch | None]:
        """(seq, batch) of a stream message; batch None for another topic's message."""
        if len(frames) != 3:
            raise ProtocolError(f"a KV event message has 3 frames (topic, seq, payload), got {len(frames)}")
        topic, seq_frame, payload = frames
        if topic != self.topic:
            return -1, None
        seq = decode_seq(seq_frame)
        if seq < 0:
            raise ProtocolError(f"negative sequence number {seq}")
        return seq, decode_batch(payload)

    # -- healing ------------------------------------------------------------------------
    async def _catch_up(self) -> bool:
        """Apply what the replay socket has from ``next_seq`` on; True when some of it was gone (the view was
        cleared: ask for a resync). A failed replay is counted and changes nothing."""
        if self.replay_endpoint is None:
            return False
        try:
            batches = await self._replay(self.next_seq)
        except (StreamLost, ProtocolError) as exc:
            self.stats["replay_failures"] += 1
            log.info("kv events from %s: replay failed: %s", self.worker, exc)
            return False
        lost = bool(batches) and batches[0][0] > self.next_seq
        if lost:
            self._lose(f"the replay starts at {batches[0][0]}, after {self.next_seq}")
        for seq, batch in batches:
            if seq >= self.next_seq:
                self.stats["replayed"] += 1
                self._take(seq, batch)
        return lost

    def _lose(self, why: str) -> None:
        """Some batches are gone for good: the view cannot be trusted, clear it (later batches rebuild it)."""
        self.stats["lost"] += 1
        log.warning("kv events from %s: %s; its view is cleared and rebuilt", self.worker, why)
        self._clear(self.worker)

    async def _rebuild(self, why: str, from_scratch: bool = True) -> None:
        """Start the view again: clear it, replay from 0, ask for a resync."""
        if from_scratch:
            log.info("kv events from %s: rebuilding its view (%s)", self.worker, why)
            self._clear(self.worker)
        self.next_seq, self.last_ts = 0, 0.0
        await self._catch_up()
        await self._ask_resync()

    async def _ask_resync(self) -> None:
        if self._resync is not None:
            self.stats["resyncs"] += 1
            if not await self._resync():
                self.stats["resync_failures"] += 1

    async def _replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        """Every batch the replay socket holds from ``start`` on, in order."""
        assert self.replay_endpoint is not None
        if self._dealer is None:
            self._dealer = self._socket(zmq.DEALER)
            self._dealer.connect(self.replay_endpoint)
        out: list[tuple[int, KVEventBatch]] = []
        try:
            async with asyncio.timeout(self.timeout_s):  # a DEALER's send waits until it is connected
                await self._dealer.send_multipart((b"", encode_seq(start)))
            while True:
                async with asyncio.timeout(self.timeout_s):
                    frames = await self._dealer.recv_multipart()
                if len(frames) != 4 or frames[0] != b"":
                    raise ProtocolError(f"a replay message has 4 frames ('', topic, seq, payload), got {len(frames)}")
                seq = decode_seq(frames[2])
                if seq == -1:
                    return out
                seq_batch = self._parse(frames[1:])
                if seq_batch[1] is not None:
                    out.append((seq_batch[0], seq_batch[1]))
        except (TimeoutError, ProtocolError) as exc:
            # a late answer would be read as the next replay's: start that one on a fresh socket
            self._dealer.close(linger=0)
            self._dealer = None
            if isinstance(exc, ProtocolError):
                raise
            raise StreamLost(f"no complete answer from {self.replay_endpoint} within {self.timeout_s:.0f}s") from None


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel a stream's task and wait for it to close its sockets."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task

"""The control plane's I/O, shared by the sender and the receiver: one thread per side that owns the ZeroMQ sockets.

``ControlLoop`` sleeps in ``poll`` until a message, a channel notification, a handed-over call or its tick;
``RouterSocket`` is the receiver's bound ROUTER, ``DealerSockets`` the sender's DEALER per receiver, each with a
socket monitor so a peer that dies is noticed when its connection drops. Malformed input is counted and dropped.

Sessions. A ROUTER knows a peer only by its routing id, which any connection may claim. So the receiver's ROUTER
never hands a routing id over to a new connection (a second connection claiming one in use is refused by ZeroMQ),
senders pick routing ids nobody can guess, and with a shared secret every message after the handshake travels as
``[message, tag]``: an HMAC of its bytes under the key of the session the handshake proved
(``pdkv.auth.session_key``). A message that needs a session and lacks a valid tag is counted
(``unauthenticated_messages``) and dropped before anyone reads it; only what ``protocol.needs_session`` exempts travels
untagged. Without a secret there are no keys, and the routing ids alone keep peers apart.
"""

from __future__ import annotations

import errno
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import zmq
from zmq.utils.monitor import recv_monitor_message

from pdkv.auth import message_tag, verify_tag
from pdkv.errors import ProtocolError
from pdkv.netaddr import zmq_address, zmq_ipv6
from pdkv.ratelog import Throttled
from pdkv.transfer import protocol
from pdkv.wakeup import Waker

log = logging.getLogger(__name__)

_DRAIN_BATCH = 256  # messages read from one socket per wake-up, so one busy peer cannot starve the rest
_REBIND_WAIT_S = 2.0  # how long a given control port may still be held by a socket closing in this process
# How long a closed DEALER keeps trying to deliver what was queued on it (the Cancel of a reservation we
# gave up on, the last Done/Cancel at close) before it is discarded: leases cover the rest.
_CLOSE_LINGER_MS = 200


class ControlLoop:
    """One I/O thread: poll sockets and fds, run handed-over callables, tick every ``tick_s``."""

    def __init__(self, name: str, tick_s: float, on_tick: Callable[[], None]) -> None:
        self.name = name
        self.tick_s = tick_s
        self._on_tick = on_tick
        self._poller = zmq.Poller()
        self._handlers: dict[Any, Callable[[], None]] = {}
        self._calls: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._waker = Waker()
        self._waker_fd = self._waker.fileno()
        self._poller.register(self._waker, zmq.POLLIN)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def watch(self, source: zmq.Socket | int, on_ready: Callable[[], None]) -> None:
        """Call ``on_ready()`` on the loop whenever ``source`` (a socket or an fd) is readable. Loop thread only."""
        self._handlers[source] = on_ready
        self._poller.register(source, zmq.POLLIN)

    def unwatch(self, source: zmq.Socket | int) -> None:
        if self._handlers.pop(source, None) is not None:
            self._poller.unregister(source)

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` on the loop thread, in order with other calls, and wake the loop for it (any thread)."""
        self._calls.put(fn)
        self._waker.wake()

    def call_now_or_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at once when called on the loop thread with nothing queued before it (a message the loop
        itself sends: no wake-up, no hand-off); else as ``call_soon``, behind what is queued."""
        if threading.current_thread() is self._thread and self._calls.empty():
            fn()
        else:
            self.call_soon(fn)

    def stop(self, timeout: float = 5.0) -> None:
        """Run what is queued, then end the thread; idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._waker.wake()
        if self._thread is not threading.current_thread() and self._thread.ident is not None:
            self._thread.join(timeout)
        self._waker.close()

    def _run(self) -> None:
        next_tick = time.monotonic() + self.tick_s
        while not self._stop.is_set():
            try:
                timeout_ms = max(
                    0, math.ceil((next_tick - time.monotonic()) * 1000)
                )  # round() spun on 0 ms polls for the last half millisecond
                woken = False
                for source, _ in self._poller.poll(timeout_ms):
                    handler = self._handlers.get(source)
                    if handler is not None:
                        handler()
                    woken = woken or source == self._waker_fd  # zmq's poll names an fd-backed object by its fd
                if woken:  # before running the calls: one queued after this wakes the next poll
                    self._waker.clear()
                self._run_calls()
                if time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + self.tick_s
                    self._on_tick()
            except Exception:  # the loop must survive anything a peer sends or a handler does
                log.exception("%s: I/O loop error", self.name)
        self._run_calls()  # the last Cancel/Done messages

    def _run_calls(self) -> None:
        while True:
            try:
                fn = self._calls.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                log.exception("%s: queued call failed", self.name)


def _decode(data: bytes, source: str, counters: Any) -> protocol.Message | ProtocolError:
    """The message, or the error saying what is wrong with it (counted and logged)."""
    try:
        return protocol.decode(data)
    except ProtocolError as exc:
        counters["malformed_messages"] += 1
        log.warning("dropping control message from %s: %s", source, exc)
        return exc


class SessionKeys(Protocol):
    """Where the receiver's ROUTER finds the key of the session a routing id belongs to."""

    def session_key(self, identity: bytes) -> bytes:
        """The key of ``identity``'s proven session; ``b""`` with no secret, or before it proved the secret."""
        ...


class SessionPeer(Protocol):
    """A receiver as the sender's DEALERs know it (``peers.ReceiverPeer``): where it listens, the routing id we
    dial it with, and the key of its proven session (``b""``: none yet)."""

    address: str
    identity: bytes
    session_key: bytes


def _frames(key: bytes, direction: str, msg: protocol.Message) -> list[bytes]:
    """A message on the wire: tagged under ``key`` unless there is no session or the message needs none."""
    data = protocol.encode(msg)
    if not key or not protocol.needs_session(msg):
        return [data]
    return [data, message_tag(key, direction, data)]


def _authentic(key: bytes, direction: str, frames: list[bytes], msg: protocol.Message, counters: Any) -> bool:
    """Whether a message may be read: within a session, only with a valid tag (one that needs no session: also
    without).

    With no key (no secret, or a peer we hold no session with: it still handshakes, or we restarted) a tag
    cannot be checked and is ignored: what such a peer sends is checked by the handshake's own rules.
    """
    if not key or (len(frames) == 1 and not protocol.needs_session(msg)):
        return True
    if len(frames) == 2 and verify_tag(key, direction, frames[0], frames[1]):
        return True
    counters["unauthenticated_messages"] += 1
    return False


class RouterSocket:
    """The receiver's bound ROUTER: messages in with the sender's identity, replies out by identity.

    Anyone who reaches the port can open connections, and ZeroMQ caps
    neither how many nor (by default) how long one may take to greet: each
    connection is dropped unless its ZMTP greeting completes within
    ``handshake_s`` (``ZMQ_HANDSHAKE_IVL``), and an accept that fails (out of
    file descriptors) is counted (``control_accept_failures``) and said at a
    bounded rate, through the socket's monitor.
    """

    def __init__(
        self,
        loop: ControlLoop,
        host: str,
        port: int,
        on_message: Callable[[bytes, protocol.Message], None],
        counters: Any,
        keys: SessionKeys,
        handshake_s: float,
    ) -> None:
        self._loop = loop
        self._on_message = on_message
        self._counters = counters
        self._keys = keys
        self._said = Throttled(log)
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a connection that claims a routing id in use is refused, never given its pipe.
        self._sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.HANDSHAKE_IVL, max(1, math.ceil(handshake_s * 1000)))
        self._sock.setsockopt(zmq.IPV6, zmq_ipv6(zmq_address(host)))
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_ACCEPT_FAILED)
        if port:
            self._bind(zmq_address(host, port))
        else:
            port = self._sock.bind_to_random_port(zmq_address(host))
        self.address = zmq_address(host, port)
        loop.watch(self._sock, self._drain)
        loop.watch(self._monitor, self._on_monitor)

    def _bind(self, address: str) -> None:
        """Bind a given port, waiting out a socket on it that is still closing (ZeroMQ closes in the background:
        a receiver restarted on its old address in the same process found the port taken for a moment)."""
        deadline = time.monotonic() + _REBIND_WAIT_S
        while True:
            try:
                self._sock.bind(address)
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EADDRINUSE or time.monotonic() >= deadline:
                    self.close()
                    raise
            time.sleep(0.02)

    def send(self, identity: bytes, msg: protocol.Message) -> None:
        """Send on the loop thread (call through ``ControlLoop.call_soon`` from any other)."""
        try:
            self._sock.send_multipart(
                [identity, *_frames(self._keys.session_key(identity), "receiver", msg)], zmq.NOBLOCK
            )
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %r: %s", type(msg).__name__, identity, exc)

    def close(self) -> None:
        """After the loop stopped."""
        self._sock.disable_monitor()
        self._monitor.close(0)
        self._sock.close(0)

    def _on_monitor(self) -> None:
        """Failed accepts, counted and said at a bounded rate: ZeroMQ retries them as fast as it can."""
        for _ in range(_DRAIN_BATCH):
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            self._counters["control_accept_failures"] += 1
            self._said.log(
                logging.WARNING,
                "accept",
                "control port %s cannot accept a connection: %s (out of file descriptors? raise the open-files "
                "limit, `ulimit -n`; a flood of connections is dropped within transfer.handshake_timeout_s)",
                self.address,
                zmq.strerror(event["value"]),
            )

    def _drain(self) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) not in (2, 3):
                self._counters["malformed_messages"] += 1
                continue
            identity, *body = frames
            msg = _decode(body[0], repr(identity), self._counters)
            if isinstance(msg, ProtocolError):
                self.send(identity, protocol.Error(str(msg)))  # the sender learns what it got wrong
                continue
            if not _authentic(self._keys.session_key(identity), "sender", body, msg, self._counters):
                log.warning("dropping %s from %r: no valid session tag", type(msg).__name__, identity)
                continue
            self._on_message(identity, msg)


class DealerSockets:
    """The sender's DEALERs, one per receiver, keyed by the owner's record of that receiver (a ``SessionPeer``,
    hashable by identity).

    Sockets are made, used and closed on the loop thread only; ``send`` and
    ``close_peer`` hand themselves over. ``on_lost(key, why)`` runs when a
    peer's connection drops (its receiver died or restarted, or the network
    failed), or when its very first connect is refused (ZeroMQ would retry
    forever; nothing listens there, so the caller hears it at once).
    """

    def __init__(
        self,
        loop: ControlLoop,
        on_message: Callable[[Any, protocol.Message], None],
        on_lost: Callable[[Any, str], None],
        counters: Any,
    ) -> None:
        self._loop = loop
        self._on_message = on_message
        self._on_lost = on_lost
        self._counters = counters
        self._ctx = zmq.Context.instance()
        self._socks: dict[Any, tuple[zmq.Socket, zmq.Socket]] = {}  # key -> (DEALER, its monitor)
        self._connected: weakref.WeakSet[Any] = weakref.WeakSet()  # keys whose connection came up at least once
        self._closed: weakref.WeakSet[Any] = weakref.WeakSet()  # keys closed for good: a late send must not reopen them

    def send(self, key: SessionPeer, msg: protocol.Message) -> None:
        """Send from any thread, in order: the loop's own messages (Done, Cancel, Heartbeat) go out at once."""
        self._loop.call_now_or_soon(lambda: self._send(key, msg))

    def close_peer(self, key: Any) -> None:
        """Close ``key``'s socket for good (after what was already queued for it goes out)."""
        self._loop.call_soon(lambda: self._close(key))

    def count(self) -> int:
        return len(self._socks)

    def close_all(self) -> None:
        """On the loop thread, or after it stopped."""
        for key in list(self._socks):
            self._close(key)

    def _send(self, key: SessionPeer, msg: protocol.Message) -> None:
        address = key.address
        if key in self._closed:
            return  # forgotten: a socket opened for it now would never be closed
        pair = self._socks.get(key)
        if pair is None:
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.ROUTING_ID, key.identity)
            sock.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.IPV6, zmq_ipv6(address))
            monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_CONNECT_RETRIED)
            sock.connect(address)
            pair = self._socks[key] = (sock, monitor)
            self._loop.watch(sock, lambda: self._drain(key, sock, address))
            self._loop.watch(monitor, lambda: self._on_monitor(key, monitor, address))
        try:
            pair[0].send_multipart(_frames(key.session_key, "sender", msg), zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            log.warning("could not send %s to %s: %s", type(msg).__name__, address, exc)

    def _close(self, key: Any) -> None:
        self._closed.add(key)
        pair = self._socks.pop(key, None)
        if pair is None:
            return
        sock, monitor = pair
        self._loop.unwatch(monitor)
        self._loop.unwatch(sock)
        sock.disable_monitor()
        monitor.close(0)
        sock.close(_CLOSE_LINGER_MS)

    def _drain(self, key: SessionPeer, sock: zmq.Socket, address: str) -> None:
        for _ in range(_DRAIN_BATCH):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) > 2:
                self._counters["malformed_messages"] += 1
                continue
            msg = _decode(frames[0], address, self._counters)
            if isinstance(msg, ProtocolError):
                continue
            if not _authentic(key.session_key, "receiver", frames, msg, self._counters):
                log.warning("dropping %s from receiver %s: no valid session tag", type(msg).__name__, address)
                continue
            self._on_message(key, msg)

    def _on_monitor(self, key: Any, monitor: zmq.Socket, address: str) -> None:
        why = ""
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)["event"]
            except zmq.Again:
                break
            if event == zmq.EVENT_CONNECTED:
                self._connected.add(key)
            elif event == zmq.EVENT_DISCONNECTED:
                why = (
                    f"lost the control connection to receiver {address} (it died or restarted, or the network dropped)"
                )
            elif event == zmq.EVENT_CONNECT_RETRIED and key not in self._connected:
                why = (
                    f"cannot connect to receiver {address}: connection refused (is it running, and is this its "
                    "address and control port?)"
                )
        if why:
            self._on_lost(key, why)

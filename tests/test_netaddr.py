"""Ports handed to a child process: ``HeldPort`` keeps a port from every other process until the child binds it.

The race it closes, seen in CI: a port from ``free_port`` went to a monolithic vLLM, another server was handed
the same port before vLLM bound it, both bound it (``SO_REUSEADDR``), the other listened first, and vLLM's listen
failed silently: alive, never healthy.
"""

from __future__ import annotations

import socket

import pytest
import zmq

from pdkv.blocks import BlockAllocator
from pdkv.channels import create_channel
from pdkv.config import TransferConfig
from pdkv.layout import KVLayout
from pdkv.netaddr import HeldPort
from pdkv.transfer.receiver import KVReceiver
from pdkv.transfer.sender import KVSender


def _reuse_socket() -> socket.socket:
    """A server socket as vLLM makes its HTTP one (``create_server_socket``): SO_REUSEADDR, bound long before listen."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock


def test_no_bind_to_port_zero_gets_a_held_port() -> None:
    held = [HeldPort() for _ in range(200)]
    try:
        ports = {h.port for h in held}
        picks = []
        for _ in range(3000):  # about 40 of these would land on one of 200 released ports (32768-60999)
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                picks.append(s.getsockname()[1])
        with _reuse_socket() as s:  # a SO_REUSEADDR socket's bind(0) skips them too
            s.bind(("127.0.0.1", 0))
            picks.append(s.getsockname()[1])
        assert not ports & set(picks)
    finally:
        for h in held:
            h.release()


def test_the_child_binds_and_serves_on_its_held_port() -> None:
    with HeldPort() as held:
        with socket.socket() as plain, pytest.raises(OSError):  # a server that does not share a port cannot take it
            plain.bind(("127.0.0.1", held.port))
        with _reuse_socket() as server:  # vLLM's HTTP socket can, and serves
            server.bind(("127.0.0.1", held.port))
            server.listen()
            with socket.create_connection(("127.0.0.1", held.port), timeout=5) as client:
                conn, _ = server.accept()
                client.sendall(b"ping")
                assert conn.recv(4) == b"ping"
                conn.close()
        ctx = zmq.Context()
        router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
        try:  # so can a ZeroMQ listener (D's control port, vLLM's KV events)
            router.bind(f"tcp://127.0.0.1:{held.port}")
            dealer.connect(f"tcp://127.0.0.1:{held.port}")
            dealer.send(b"hello")
            assert router.poll(5000) and router.recv_multipart()[1] == b"hello"
        finally:
            router.close(0)
            dealer.close(0)
            ctx.term()


def test_a_run_of_consecutive_ports_is_held_and_no_one_else_can_hold_them() -> None:
    run = HeldPort.run("127.0.0.1", 4)
    try:
        ports = [h.port for h in run]
        assert ports == list(range(ports[0], ports[0] + 4))
        for port in ports:  # another launcher picking the same run: each port refused to its exclusive bind
            with pytest.raises(OSError):
                HeldPort("127.0.0.1", port)
        with socket.socket() as child:  # the rank given the port binds it as ZeroMQ does (SO_REUSEADDR)
            child.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            child.bind(("127.0.0.1", ports[2]))
            child.listen()
    finally:
        for h in run:
            h.release()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")
def test_a_receiver_on_an_ipv6_address_is_reached_by_its_bracketed_endpoint() -> None:
    """The control plane's endpoints go through ``zmq_address`` (brackets) with ``zmq.IPV6`` set on both sockets: a
    receiver bound on ``::1`` says ``tcp://[::1]:PORT`` and a sender handshakes, reserves and lands a request there."""
    layout = KVLayout(num_layers=2, num_kv_heads=2, head_dim=8, block_size=16, dtype="float32")
    p, d = create_channel("mock", "p-v6"), create_channel("mock", "d-v6")
    receiver = KVReceiver(d, layout, layout.allocate(16), BlockAllocator(16), "m", TransferConfig(chunk_size=32), "::1")
    sender = KVSender(p, layout, layout.allocate(16), "m", TransferConfig(chunk_size=32))
    try:
        assert receiver.address.startswith("tcp://[::1]:")
        xfer = sender.open("over-v6", receiver.address, 20, [0, 1])
        xfer.send_all()
        xfer.wait(10)
        assert receiver.wait("over-v6", 10).num_tokens == 20 and receiver.stats()["tokens_landed"] == 20
    finally:
        sender.close()
        receiver.close()
        p.close()
        d.close()

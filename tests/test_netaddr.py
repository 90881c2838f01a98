"""Ports handed to a child process: ``HeldPort`` keeps a port from every other process until the child binds it.

The race it closes, seen in CI: a port from ``free_port`` went to a monolithic vLLM, another server was handed
the same port before vLLM bound it, both bound it (``SO_REUSEADDR``), the other listened first, and vLLM's listen
failed silently: alive, never healthy.
"""

from __future__ import annotations

import socket

import pytest
import zmq

from pdkv.netaddr import HeldPort


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

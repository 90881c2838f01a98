"""``pdkv launch --engine vllm`` starts the vLLM it says it started: its ports are held until vLLM serves, and a
port another server answers on is refused, not reported ready."""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pdkv.config import convert_config
from pdkv.errors import ConfigError, PdkvError
from pdkv.launch.vllm import _serving, vllm_command
from pdkv.netaddr import HeldPort


def assert_held(ports: list[int]) -> None:
    """No plain bind gets any of ``ports``: something holds each."""
    for port in ports:
        with socket.socket() as plain, pytest.raises(OSError):
            plain.bind(("127.0.0.1", port))


def test_the_vllm_launcher_holds_every_port_it_picks_until_vllm_serves() -> None:
    cfg = convert_config({"role": "decode", "kv_events": {"enable_kv_cache_events": True, "endpoint": "tcp://*:0"}})
    held: list[HeldPort] = []
    try:
        cmd, info = vllm_command(cfg, "/models/m", [], python="py", held=held)
        events = info["kv_events"]["endpoint"]
        picked = [int(cmd[cmd.index("--port") + 1]), info["remote_port"], int(events.rsplit(":", 1)[1])]
        assert sorted(h.port for h in held) == sorted(picked) and len(set(picked)) == 3
        assert_held(picked)
    finally:
        for h in held:
            h.release()


@contextmanager
def _server(info: dict | None) -> Iterator[str]:
    """An HTTP server on a free port whose /health is 200 and whose /pdkv/info is ``info`` (404 when None)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = json.dumps(info).encode() if self.path == "/pdkv/info" and info is not None else b""
            ok = self.path == "/health" or bool(body)
            self.send_response(200 if ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def test_the_launcher_calls_ready_only_the_vllm_it_started() -> None:
    cfg = convert_config({"role": "prefill"})
    _, info = vllm_command(cfg, "/models/m", [], python="py")
    with _server(None) as url:  # a plain vLLM (or anything else) on our port: no /pdkv/info of ours
        with pytest.raises(PdkvError, match="another server answers"):
            _serving({**info, "url": url})
    with _server({**info, "instance": "another-launch"}) as url:  # another pdkv launch's vLLM, same port
        with pytest.raises(PdkvError, match="another-launch"):
            _serving({**info, "url": url, "instance": info["instance"]})
    with _server(None) as url:
        pass
    assert _serving({**info, "url": url}) is False  # nobody listens (yet): keep waiting
    mine = {**info, "url": ""}
    with _server(mine) as url:
        mine["url"] = url
        assert _serving(mine) is True


@pytest.mark.parametrize(
    ("args", "tp"),
    [
        ([], 1),
        (["--tensor-parallel-size", "2"], 2),
        (["-tp", "4", "--enforce-eager"], 4),
        (["--tensor-parallel-size=2", "--tensor-parallel-size", "3"], 3),  # argparse: the last one wins
    ],
)
def test_each_decode_rank_gets_its_own_receiver_on_consecutive_held_ports(args: list[str], tp: int) -> None:
    cfg = convert_config({"role": "decode"})
    held: list[HeldPort] = []
    try:
        _, info = vllm_command(cfg, "/models/m", args, python="py", held=held)
        ports = info["remote_ports"]
        assert ports == list(range(info["remote_port"], info["remote_port"] + tp))
        assert set(ports) <= {h.port for h in held}  # every rank's port held until vLLM serves
        assert_held(ports)
    finally:
        for h in held:
            h.release()
    # a control_port of the user's: rank r on control_port + r, as vLLM numbers its connectors' side channels
    _, info = vllm_command(convert_config({"role": "decode", "control_port": 6100}), "/m", args, python="py")
    assert info["remote_ports"] == [6100 + r for r in range(tp)]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-pp", "2"], "runs pipeline parallel size 1 only"),
        (["--tensor-parallel-size", "two"], "'two' is not an integer"),
        (["--tensor-parallel-size=0"], "0 is not a size from 1 to 1024"),
    ],
)
def test_parallel_settings_the_connector_cannot_serve_are_refused_before_vllm_starts(
    args: list[str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        vllm_command(convert_config({"role": "prefill"}), "/m", args, python="py")
    with pytest.raises(ConfigError, match="unset tier.redis_url"):
        vllm_command(convert_config({"role": "decode", "tier": {"redis_url": "redis://r"}}), "/m", ["-tp", "2"])
    with pytest.raises(ConfigError, match="runs past port 65535"):
        vllm_command(convert_config({"role": "decode", "control_port": 65535}), "/m", ["-tp", "2"], python="py")

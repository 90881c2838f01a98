"""``pdkv launch --role prefill|decode|router``: start the role, serve HTTP.

When it is up it prints one JSON line ``{"event": "ready", "url": ...}``
on stdout (with the real port when ``--port 0`` asked for any free one), so
scripts, the demo and tests start every role the same way users do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
from typing import Any

from aiohttp import web

from pdkv.config import PdkvConfig, load_config
from pdkv.errors import ConfigError

log = logging.getLogger("pdkv.launch")

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def config_from_args(args: argparse.Namespace) -> PdkvConfig:
    """The config file with flags on top; ``--prefill``/``--decode`` replace the file's lists."""
    overrides = {
        "role": args.role, "host": args.host, "advertise_host": args.advertise_host, "port": args.port, "model": args.model, "channel.name": args.channel, "engine": args.engine,
        "router.prefill": args.prefill, "router.decode": args.decode, "router.policy": args.policy, "router.mode": args.mode,
    }
    return load_config(args.config, overrides)


def build_worker(config: PdkvConfig):  # noqa: ANN201 - the Worker import is deferred (torch is slow to import)
    from pdkv.engine.reference import ReferenceEngine
    from pdkv.worker.server import Worker

    if config.engine != "reference":
        raise ConfigError(f"engine {config.engine!r} is not available in this build; use engine: reference")
    engine = ReferenceEngine.load(
        config.model,
        dtype=config.dtype,
        block_size=config.block_size,
        order=config.kv_order,
        kind=config.kv_kind,
        max_kv_tokens=config.num_blocks * config.block_size,
        num_threads=config.num_threads or max(1, (os.cpu_count() or 2) // 2),
    )
    return Worker(config, engine)


def warn_if_exposed(config: PdkvConfig) -> None:
    """A worker (its HTTP, receiver and channel) bound beyond loopback without a secret is open to anyone who reaches it."""
    if config.host not in LOOPBACK and not config.secret:
        log.warning("binding %s without a shared secret: anyone who can reach this address can talk to the worker and its KV receiver (set `secret`)", config.host)


async def serve(config: PdkvConfig) -> None:
    worker = await asyncio.to_thread(build_worker, config)
    warn_if_exposed(config)
    info = {"agent": worker.agent}
    if worker.receiver is not None:
        info["receiver"] = worker.receiver.address
    await serve_app(worker.app(), config, info)


async def serve_router(config: PdkvConfig) -> None:
    from pdkv.router.app import Router

    if config.host not in LOOPBACK and not config.router.admin_token:
        log.warning("binding %s without router.admin_token: anyone who can reach this address can register workers", config.host)
    router = await Router.start(config.router)
    try:
        await serve_app(router.app(), config, {"mode": router.mode.name, "policy": router.policy.name})
    finally:
        await router.close()


async def serve_app(app: web.Application, config: PdkvConfig, info: dict[str, Any]) -> None:
    """Serve ``app`` on the configured address, print the ready line, run until SIGINT/SIGTERM."""
    # handler_cancellation: a client that drops its connection cancels its handler. For a worker
    # that stops the engine job and frees its blocks and reservation instead of generating for
    # nobody; for the router it closes the upstream hops, which does the same on the workers.
    runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    print(json.dumps({"event": "ready", "role": config.role, "url": f"http://{config.advertise_host or config.host}:{port}", **info}), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.engine == "vllm" and config.role != "router":
        from pdkv.launch.vllm import run_vllm

        warn_if_exposed(config)
        return run_vllm(config, args.engine_args, args.ready_timeout)
    if args.engine_args:
        raise ConfigError(f"arguments after -- go to the engine, and only engine vllm takes any: {args.engine_args}")
    asyncio.run(serve_router(config) if config.role == "router" else serve(config))
    return 0

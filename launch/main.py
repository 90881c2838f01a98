"""``pdkv launch --role prefill|decode``: load the engine, start the worker, serve HTTP.

When the worker is up it prints one JSON line ``{"event": "ready", ...}``
on stdout (with the real port when ``--port 0`` asked for any free one), so
scripts, the demo and tests start workers the same way users do.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys

from aiohttp import web

from pdkv.config import PdkvConfig, load_config
from pdkv.errors import ConfigError

log = logging.getLogger("pdkv.launch")


def config_from_args(args: argparse.Namespace) -> PdkvConfig:
    overrides = {"role": args.role, "host": args.host, "port": args.port, "model": args.model, "channel.name": args.channel, "engine": args.engine}
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


async def serve(config: PdkvConfig) -> None:
    worker = await asyncio.to_thread(build_worker, config)
    if config.host not in ("127.0.0.1", "localhost", "::1") and not config.secret:
        log.warning("binding %s without a shared secret: anyone who can reach this address can talk to the worker", config.host)
    # handler_cancellation: a client (the router) that drops its connection cancels the handler, so the
    # engine job stops and a decode worker gives back its reservation instead of generating for nobody.
    runner = web.AppRunner(worker.app(), handle_signals=False, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, config.host, config.port)
    await site.start()
    port = runner.addresses[0][1]
    info = {"event": "ready", "role": config.role, "url": f"http://{config.host}:{port}", "agent": worker.agent}
    if worker.receiver is not None:
        info["receiver"] = worker.receiver.address
    print(json.dumps(info), flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if config.role == "router":
        print("pdkv: the router role is not part of this build yet; run prefill and decode workers", file=sys.stderr)
        return 2
    asyncio.run(serve(config))
    return 0

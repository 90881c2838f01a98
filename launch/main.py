"""``pdkv launch --role prefill|decode|router``: start the role, serve HTTP.

When it is up it prints one JSON line ``{"event": "ready", "url": ...}``
on stdout (with the real port when ``--port 0`` asked for any free one), so
scripts, the demo and tests start every role the same way users do.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import ipaddress
import json
import logging
import os
import resource
import signal
from typing import Any

import msgspec
from aiohttp import web

from pdkv.config import PdkvConfig, load_config, redacted
from pdkv.errors import ConfigError
from pdkv.http.web import runner

log = logging.getLogger("pdkv.launch")


def config_from_args(args: argparse.Namespace) -> PdkvConfig:
    """The config file with flags on top; ``--prefill``/``--decode`` replace the file's lists."""
    overrides = {
        "role": args.role,
        "host": args.host,
        "advertise_host": args.advertise_host,
        "port": args.port,
        "model": args.model,
        "channel.name": args.channel,
        "engine": args.engine,
        "router.prefill": args.prefill,
        "router.decode": args.decode,
        "router.policy": args.policy,
        "router.mode": args.mode,
        "insecure": True if args.insecure else None,
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


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


def check_exposure(config: PdkvConfig) -> None:
    """Refuse to serve beyond loopback with nothing guarding what is served, unless told ``insecure``.

    A worker's HTTP API, KV receiver and channel are open to anyone who reaches them without a
    ``secret``; a router's worker admin (anyone could register a worker and receive prompts)
    without ``router.admin_token`` or a ``secret``.
    """
    if is_loopback(config.host):
        return
    if config.role == "router":
        exposed, what = (
            not (config.router.admin_token or config.secret),
            "router.admin_token or secret (the admin endpoints then want its bearer token)",
        )
        whom = "register workers and be sent every prompt"
    else:
        exposed, what = not config.secret, "secret (the same on every worker and on the router)"
        whom = "talk to the worker, its KV receiver and its channel"
    if not exposed:
        return
    if not config.insecure:
        raise ConfigError(
            f"field 'host' = {config.host!r} is beyond loopback and nothing guards this {config.role}: anyone who can "
            f"reach it could {whom}. "
            f"Set {what}, or, on a network where everyone who can reach it is trusted, pass --insecure (insecure: true)"
        )
    log.warning("serving %s on %s with insecure: true: anyone who can reach it can %s", config.role, config.host, whom)


async def serve(config: PdkvConfig) -> None:
    worker = await asyncio.to_thread(build_worker, config)
    info = {"agent": worker.agent}
    if worker.receiver is not None:
        info["receiver"] = worker.receiver.address
    await serve_app(worker.app(), config, info)


async def serve_router(config: PdkvConfig) -> None:
    from pdkv.router.app import Router

    router = await Router.start(config.router, config.http, config.secret)
    try:
        await serve_app(router.app(), config, {"mode": router.mode.name, "policy": router.policy.name})
    finally:
        await router.close()


def freeze_startup_heap() -> None:
    """Move every object alive after start-up out of the collector's reach, as vLLM and SGLang do.

    Start-up leaves hundreds of thousands of long-lived objects (the model, torch, tokenizers, aiohttp)
    that a request never frees. Left in generation 2, each full collection walks them all: 100-140 ms
    of a worker's event loop and engine thread (20 ms of the router's), landing on whichever request
    is in flight (1-2 per process in the first 40 requests after start-up;
    benchmarks/history/2026-11-26-cost-of-a-byte-and-a-request-issue-28.md, "The PD overhead on short prompts").
    Frozen, a full collection walks only what requests allocated since: 0.1-0.2 ms.
    The garbage of start-up is collected first, so none of it is frozen for the process's life.
    """
    gc.collect()
    gc.freeze()


async def serve_app(app: web.Application, config: PdkvConfig, info: dict[str, Any]) -> None:
    """Serve ``app`` on the configured address, print the ready line, run until SIGINT/SIGTERM."""
    freeze_startup_heap()
    app_runner = runner(app, config.http)
    await app_runner.setup()
    site = web.TCPSite(app_runner, config.host, config.port)
    await site.start()
    port = app_runner.addresses[0][1]
    print(
        json.dumps(
            {
                "event": "ready",
                "role": config.role,
                "url": f"http://{config.advertise_host or config.host}:{port}",
                **info,
            }
        ),
        flush=True,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await app_runner.cleanup()


def printed_config(config: PdkvConfig) -> dict[str, Any]:
    """``--print-config``: the config as validated, secrets redacted, and the tier levels a worker builds from it."""
    return {"config": redacted(msgspec.to_builtins(config)), "tier_levels": config.tier.describe_levels()}


def raise_fd_limit() -> None:
    """Raise this process's soft open-files limit to its hard one, once, at start (logged).

    Every connection a role accepts (HTTP, the control port, the data port)
    holds a file descriptor, and anyone who reaches a port can open them: at
    the common soft limit of 1024, 1,500 idle connections on a decode
    worker's control port left it unable to accept anything, ``/health``
    included. The hard limit is the operator's bound; what lies below it is
    only a default. Children (an engine it runs) inherit the raised limit.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard or soft == resource.RLIM_INFINITY:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError) as exc:
        log.warning("cannot raise the open-files limit from %d to its hard limit %d: %s", soft, hard, exc)
        return
    log.info("raised the open-files limit from %d to its hard limit %d (every connection holds one)", soft, hard)


def run(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    if args.print_config:
        print(json.dumps(printed_config(config), indent=2))
        return 0
    check_exposure(config)
    raise_fd_limit()
    if config.engine == "vllm" and config.role != "router":
        from pdkv.launch.vllm import run_vllm

        return run_vllm(config, args.engine_args, args.ready_timeout)
    if args.engine_args:
        raise ConfigError(f"arguments after -- go to the engine, and only engine vllm takes any: {args.engine_args}")
    asyncio.run(serve_router(config) if config.role == "router" else serve(config))
    return 0

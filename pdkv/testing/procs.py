"""Start ``pdkv launch`` workers as real processes and wait for their ready line.

The demo, the tests and the benchmarks start workers exactly as a user does,
through the CLI, so what they exercise is what ships. (``pdkv launch`` itself
never starts a pdkv worker this way: this module serves the callers outside it.)
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pdkv.errors import PdkvError


@dataclass
class WorkerProcess:
    role: str
    proc: subprocess.Popen[str]
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM (the launcher passes it on to an engine it runs), then SIGKILL after ``timeout``; returns the
        exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipe()
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL the worker and everything it started (a vLLM server and its engine processes): a real crash."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)
        self._close_pipe()

    def _close_pipe(self) -> None:
        """Our end of its stdout: a caller that starts and stops many workers must not keep one fd for each."""
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def start_worker(
    role: str,
    *args: str,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    wrap: Sequence[str] = (),
) -> WorkerProcess:
    """Run ``pdkv launch --role ROLE ARGS...`` and return once it printed its ready line.

    stderr passes through (the worker's logs); a worker that exits or stays
    silent past ``timeout`` raises with what it said. ``python`` picks the
    environment (vLLM workers run in one of their own); ``wrap`` is a command
    that runs it, which must exec it in place (``ip netns exec NS``: another
    host of pdkv.bench.netrig). Each worker leads its own process group, so
    ``kill`` takes down whatever it started with it.
    """
    cmd = [*wrap, python, "-m", "pdkv.cli", "launch", "--role", role, *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, **(env or {})}, start_new_session=True
    )
    assert proc.stdout is not None
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    lines: list[str] = []
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=min(1.0, max(0.0, deadline - time.monotonic()))):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line)
            try:
                info = json.loads(line)
            except ValueError:
                continue
            if isinstance(info, dict) and info.get("event") == "ready":
                return WorkerProcess(role, proc, info)
    finally:
        sel.close()
    WorkerProcess(role, proc).kill()
    raise PdkvError(
        f"{role} worker did not become ready within {timeout:.0f}s (exit code {proc.returncode}); it printed: "
        f"{''.join(lines)[-2000:]}"
    )


def start_configured(role: str, config: dict[str, Any], path: Path, *args: str, **kwargs: Any) -> WorkerProcess:
    """``start_worker`` with ``config`` written as YAML to ``path`` and passed as ``--config``, on a free port.

    A test or benchmark describes a worker by the same YAML a user writes; the
    file stays beside the test's other files for a post-mortem.
    """
    path.write_text(yaml.safe_dump(config))
    return start_worker(role, "--config", str(path), "--port", "0", *args, **kwargs)

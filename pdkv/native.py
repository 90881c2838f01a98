"""Native paged gather/scatter (csrc/kvcopy.cpp), falling back to the torch path.

The same extension carries the KV codec kernels (csrc/kvcodec.cpp), which
pdkv.codec.kernels calls through ``extension()`` with the same fallback rule.

``gather``/``scatter`` here have exactly the signatures of
:func:`pdkv.layout.gather` / :func:`pdkv.layout.scatter` and produce the same
bytes; they are faster because each byte is copied once, with memcpy over the
longest contiguous runs, on up to ``torch.get_num_threads()`` threads, with
the GIL released.

The extension is compiled on first use with ``torch.utils.cpp_extension`` and
cached under ``$XDG_CACHE_HOME/pdkv/torch_extensions`` (``~/.cache`` when
unset), so ``pip install pdkv`` never needs a compiler. The cache directory is
keyed by Python, torch, CUDA and a hash of the sources, so a changed source,
a torch upgrade or a second checkout with other sources never loads a stale
library. A cold build takes tens of seconds; a cached load is a no-op ninja
run plus a dlopen. Anything that stops the build (no compiler, no ninja, a
compile error) logs one warning and every call takes the torch path;
``PDKV_NATIVE=0`` skips the build altogether.

The CUDA kernel (csrc/kvcopy_cuda.cu) is added to the build only when torch
sees a CUDA device and a toolkit; it has not yet been run on a GPU.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType

import torch

from pdkv.errors import LayoutError
from pdkv.filelock import exclusive
from pdkv.layout import BlockTable, KVLayout, check_chunk, used_blocks
from pdkv.layout import gather as torch_gather
from pdkv.layout import scatter as torch_scatter

log = logging.getLogger(__name__)

ENV_VAR = "PDKV_NATIVE"
"""Set to 0 (or false/off/no) to never build or use the extension."""

_MODULE_NAME = "pdkv_kvcopy"
_HEADERS = ("kvcopy.h", "kvcodec.h", "workshare.h")
_CPU_SOURCES = ("kvcopy.cpp", "kvcodec.cpp")
_CUDA_SOURCES = ("kvcopy_cuda.cu",)

_lock = threading.Lock()
# (module, reason it is None) once a load was attempted in this process.
_loaded: tuple[ModuleType | None, str | None] | None = None


def available() -> bool:
    """Whether calls use the native extension (builds it on first call)."""
    return _state()[0] is not None


def extension() -> ModuleType | None:
    """The loaded extension module, or None when calls take the torch path (builds it on first call)."""
    return _state()[0]


def reason() -> str | None:
    """Why the native extension is not used, or None when it is (builds it on first call)."""
    return _state()[1]


def gather(layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: BlockTable, start: int, num_tokens: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Native :func:`pdkv.layout.gather`: tokens ``[start, start+num_tokens)`` of the paged buffer as a canonical chunk."""
    ext = _extension_for(layout, tensors)
    if ext is None:
        return torch_gather(layout, tensors, block_table, start, num_tokens, out)
    num_blocks = layout.validate_buffer(tensors)
    table = used_blocks(layout, num_blocks, block_table, start, num_tokens)
    device = tensors[0].device
    if out is None:
        out = torch.empty(layout.chunk_shape(num_tokens), dtype=layout.torch_dtype, device=device)
    else:
        check_chunk(layout, out, "gather output", num_tokens)
    # The kernel writes a contiguous chunk on the buffer's device; any other
    # `out` (a strided view, another device) is filled through one copy.
    direct = out.is_contiguous() and out.device == device
    dst = out if direct else torch.empty(out.shape, dtype=out.dtype, device=device)
    _call(ext.gather, layout, tensors, table, start, dst)
    if not direct:
        out.copy_(dst)
    return out


def scatter(layout: KVLayout, tensors: Sequence[torch.Tensor], block_table: BlockTable, start: int, chunk: torch.Tensor) -> None:
    """Native :func:`pdkv.layout.scatter`: write a canonical chunk into tokens ``[start, start+T)``."""
    ext = _extension_for(layout, tensors)
    if ext is None:
        torch_scatter(layout, tensors, block_table, start, chunk)
        return
    num_blocks = layout.validate_buffer(tensors)
    num_tokens = check_chunk(layout, chunk, "chunk")
    table = used_blocks(layout, num_blocks, block_table, start, num_tokens)
    _call(ext.scatter, layout, tensors, table, start, chunk.to(tensors[0].device).contiguous())


def _call(op: Callable[..., None], layout: KVLayout, tensors: Sequence[torch.Tensor], table: torch.Tensor, start: int, chunk: torch.Tensor) -> None:
    """Run one extension copy; its own argument checks surface as LayoutError like the torch path's."""
    try:
        op(list(tensors), table.cpu(), start, chunk, layout.kind == "cross_layer", layout.order == "HND", layout.mla, layout.block_size)
    except (IndexError, ValueError) as exc:
        raise LayoutError(str(exc)) from exc


def _extension_for(layout: KVLayout, tensors: Sequence[torch.Tensor]) -> ModuleType | None:
    """The extension if it can copy this layout on this device, else None (torch path).

    HKND (vLLM's CPU cache) has no kernel: it moves whole blocks between
    vLLM workers, so gather/scatter only run when P and D layouts differ.
    """
    if not tensors or (layout.order == "HKND" and not layout.mla):
        return None
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        return None
    ext = _state()[0]
    if ext is None or (device.type == "cuda" and not ext.has_cuda()):
        return None
    return ext


def _state() -> tuple[ModuleType | None, str | None]:
    """(extension, None) or (None, why not); builds once per process unless disabled.

    The environment is read on every call so ``PDKV_NATIVE=0`` takes effect
    even after the extension was loaded.
    """
    global _loaded
    setting = os.environ.get(ENV_VAR, "1")
    if setting.strip().lower() in ("0", "false", "off", "no"):
        return None, f"disabled by {ENV_VAR}={setting}"
    if _loaded is None:
        with _lock:
            if _loaded is None:
                _loaded = _load()
    return _loaded


def _load() -> tuple[ModuleType | None, str | None]:
    sources = _sources_dir()
    if sources is None:
        why = "csrc/kvcopy.cpp not found (neither installed as pdkv.csrc package data nor in a source checkout)"
    else:
        try:
            return _build(sources), None
        except Exception as exc:  # noqa: BLE001 - any build failure means "use the torch path", never a crash
            # The tail of the compiler/ninja output says what broke; the whole of it is at DEBUG.
            tail = [line.strip()[:200] for line in str(exc).strip().splitlines()[-3:]]
            log.debug("pdkv native build output:\n%s", exc)
            why = "build failed: " + " | ".join([type(exc).__name__, *tail])
    log.warning("pdkv native gather/scatter unavailable, using the torch path (same bytes, slower): %s. "
                "Needs a C++ compiler and ninja (pip install ninja); set %s=0 to skip the build.", why, ENV_VAR)
    return None, why


def _sources_dir() -> Path | None:
    """csrc/ as installed package data (``pdkv.csrc``) or, from a source checkout, the repo's csrc/."""
    spec = importlib.util.find_spec("pdkv.csrc")
    candidates = [Path(p) for p in spec.submodule_search_locations or []] if spec else []
    candidates.append(Path(__file__).resolve().parent.parent / "csrc")
    return next((c for c in candidates if all((c / f).is_file() for f in _HEADERS + _CPU_SOURCES)), None)


def _cache_root() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "pdkv" / "torch_extensions"


def _build(sources: Path) -> ModuleType:
    """Compile (or reuse) the extension for this Python/torch/CUDA and these exact sources."""
    from torch.utils import cpp_extension  # slow import: only when building

    cuda_version = torch.version.cuda  # None on CPU-only torch builds
    with_cuda = cuda_version is not None and torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    names = _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())
    # No fused multiply-add: the codec kernels must round exactly like their torch twins; no FP traps
    # assumed, so their selects vectorize (csrc/kvcodec.cpp). Neither changes any IEEE result.
    cflags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"] + (["-DPDKV_WITH_CUDA"] if with_cuda else [])
    cuda_cflags = ["-O3", "-DPDKV_WITH_CUDA"] if with_cuda else []

    digest = hashlib.sha256()
    for name in _HEADERS + names:
        digest.update(name.encode() + b"\0" + (sources / name).read_bytes() + b"\0")
    digest.update(repr((cflags, cuda_cflags)).encode())
    accel = f"cu{cuda_version.replace('.', '')}" if with_cuda and cuda_version else "cpu"
    tag = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch.__version__}-{accel}"
    build_dir = _cache_root() / tag / f"kvcopy-{digest.hexdigest()[:16]}"
    build_dir.mkdir(parents=True, exist_ok=True)

    with exclusive(build_dir / "pdkv-build.flock"):
        # cpp_extension's own lock is a file created with O_EXCL and removed
        # when the build ends; a build killed hard leaves it behind and every
        # later load would wait forever. We hold the flock (dropped by the
        # kernel when a process dies), so no live pdkv build owns it.
        (build_dir / "lock").unlink(missing_ok=True)
        return cpp_extension.load(
            name=_MODULE_NAME,
            sources=[str(sources / n) for n in names],
            extra_cflags=cflags,
            extra_cuda_cflags=cuda_cflags,
            build_directory=str(build_dir),
            with_cuda=with_cuda,
            verbose=False,
        )

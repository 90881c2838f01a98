"""Builds pdkv's native kernels when the package is installed (``pip install .`` or ``pip install -e .``).

Everything else about the package is in pyproject.toml. The kernels (csrc/)
are plain shared libraries with a C ABI, no torch headers and no Python API:
pdkv/native.py loads them with ctypes and passes data pointers, sizes and
strides taken from the tensors. So the build needs only the system C++
compiler, never torch (build isolation installs setuptools alone), and a
worker never compiles anything when it starts.

- ``pdkv/libpdkv_kernels.so``: paged gather/scatter (kvcopy.cpp) and the
  codec kernels (kvcodec.cpp), for the CPU. Always built; where it cannot be
  (no C++ compiler) the install warns and goes on, and pdkv runs on the torch
  path, saying so once (the test suite fails then: it asserts the library).
- ``pdkv/libpdkv_kernels_cuda.so``: the CUDA gather/scatter
  (kvcopy_cuda.cu), CUDA runtime linked in statically. Built when nvcc is
  found (``$CUDA_HOME/bin/nvcc`` or on ``PATH``) and ``PDKV_BUILD_CUDA`` is
  not 0; with ``PDKV_BUILD_CUDA=1`` a failed or impossible build fails the
  install, unset it only warns (a CPU install must never fail on a CUDA
  toolkit it does not need). ``PDKV_CUDA_ARCHS`` (default ``80;90``) lists
  the GPU architectures compiled to machine code; the last one is also
  embedded as PTX, which newer GPUs compile at load time.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

CSRC = Path("csrc")
HEADERS = [str(CSRC / name) for name in ("kvcopy.h", "kvnet.h", "kvsum.h", "tcpwire.h", "workshare.h")]
# No fused multiply-add: the codec kernels must round exactly like their torch twins; no FP traps
# assumed, so their selects vectorize (csrc/kvcodec.cpp). Neither changes any IEEE result.
CXXFLAGS = ["-O3", "-std=c++17", "-ffp-contract=off", "-fno-trapping-math", "-fvisibility=hidden", "-pthread"]


class CudaLibrary(Extension):
    """A shared library built by nvcc instead of the C++ compiler."""


def _nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    candidate = Path(home, "bin", "nvcc") if home else None
    return str(candidate) if candidate and candidate.is_file() else shutil.which("nvcc")


class BuildKernels(build_ext):
    """build_ext for libraries loaded with ctypes: plain ``lib*.so`` names, CUDA through nvcc."""

    def finalize_options(self) -> None:
        super().finalize_options()
        setting = os.environ.get("PDKV_BUILD_CUDA", "").strip().lower()
        want = setting not in ("0", "false", "off", "no")
        nvcc = _nvcc()
        if setting in ("1", "true", "on", "yes") and nvcc is None:
            raise RuntimeError("PDKV_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        if not (want and nvcc):
            self.extensions = [e for e in self.extensions if not isinstance(e, CudaLibrary)]
        self.nvcc = nvcc

    def build_extensions(self) -> None:
        # Python's own CFLAGS (sysconfig) bring -fwrapv, which defines signed overflow and so keeps GCC from
        # vectorizing loops over int64 indices, and -g; the kernels want neither.
        for attr in ("compiler_so", "compiler_so_cxx", "linker_so", "linker_so_cxx"):  # the _cxx ones: setuptools >= 72
            if hasattr(self.compiler, attr):
                setattr(
                    self.compiler,
                    attr,
                    [flag for flag in getattr(self.compiler, attr) if flag not in ("-fwrapv", "-g")],
                )
        super().build_extensions()

    def copy_file(self, infile: str, outfile: str, *args: object, **kwargs: object) -> tuple[str, bool]:  # type: ignore[override]
        """Put a library in place by rename (what ``pip install -e`` does with each): a process that has the old
        one loaded (a test session reinstalling into a second environment) keeps its mapping intact, where
        rewriting the file in place would corrupt it under that process."""
        tmp = f"{outfile}.{os.getpid()}.tmp"
        shutil.copyfile(infile, tmp)
        shutil.copymode(infile, tmp)
        os.replace(tmp, outfile)
        return outfile, True

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")) + ".so"

    def build_extension(self, ext: Extension) -> None:
        if not isinstance(ext, CudaLibrary):
            super().build_extension(ext)
            return
        target = Path(self.get_ext_fullpath(ext.name))
        target.parent.mkdir(parents=True, exist_ok=True)
        archs = [
            a.strip() for a in os.environ.get("PDKV_CUDA_ARCHS", "80;90").replace(",", ";").split(";") if a.strip()
        ]
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in archs] + [
            f"-gencode=arch=compute_{archs[-1]},code=compute_{archs[-1]}"
        ]
        cmd = [
            self.nvcc,
            "-O3",
            "-std=c++17",
            "-shared",
            "-Xcompiler",
            "-fPIC,-fvisibility=hidden",
            "-cudart",
            "static",
            *gencode,
            "-o",
            str(target),
            *ext.sources,
        ]
        print(" ".join(cmd))
        try:
            subprocess.run(cmd, check=True)
        except (OSError, subprocess.CalledProcessError) as exc:
            if os.environ.get("PDKV_BUILD_CUDA", "").strip().lower() in ("1", "true", "on", "yes"):
                raise
            print(
                f"WARNING: pdkv's CUDA kernels were not built ({exc}); CUDA tensors take the torch path. Set "
                "PDKV_BUILD_CUDA=0 to skip the attempt."
            )


setup(
    ext_modules=[
        Extension(
            "pdkv.libpdkv_kernels",
            sources=[
                str(CSRC / name)
                for name in ("kvcopy.cpp", "kvsum.cpp", "kvcodec.cpp", "kvland.cpp", "kvframes.cpp", "kvsend.cpp")
            ],
            depends=HEADERS,
            language="c++",
            extra_compile_args=CXXFLAGS,
            extra_link_args=["-pthread"],
            optional=True,
        ),
        CudaLibrary("pdkv.libpdkv_kernels_cuda", sources=[str(CSRC / "kvcopy_cuda.cu")], depends=HEADERS),
    ],
    cmdclass={"build_ext": BuildKernels},
)

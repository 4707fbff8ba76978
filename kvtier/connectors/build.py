"""The compiled copy kernels (`kvtier/csrc/`), built on first use against the installed torch.

A wheel of kvtier carries the C++/CUDA sources, not a binary: a binary would be tied to one torch
version and C++ ABI, and an isolated pip build would compile it against a torch it then throws
away. So the first process that needs the kernels compiles them with
`torch.utils.cpp_extension` into a cache directory keyed by torch version, C++ ABI, Python
version and CUDA version (`$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else
`~/.cache/kvtier`); later processes load the cached module in milliseconds.

Several processes may start at once (one per TP rank, several servers): an exclusive `flock`
serializes the build, and since the kernel drops a dead holder's lock, a build killed halfway
never blocks the next one (torch's own lock file, which would, is cleared under it). An
ahead-of-time build (`KVTIER_BUILD_EXT=1 pip install --no-build-isolation .`, which puts
`kvtier._C` in the package) is used when present.
"""

from __future__ import annotations

import fcntl
import importlib
import logging
import os
import re
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["load", "cache_dir", "build_dir", "SOURCE_DIR"]

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent.parent / "csrc"
# at::parallel_for is header-only: without OpenMP it silently runs on one thread.
CXX_FLAGS = ["-O3", "-g0", "-fopenmp"]


def cache_dir() -> Path:
    root = os.environ.get("KVTIER_CACHE_DIR")
    if root:
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "kvtier"


def _with_cuda() -> bool:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME

    # A CPU-only torch cannot load CUDA kernels even when a toolkit is installed.
    return torch.version.cuda is not None and CUDA_HOME is not None


def build_dir() -> Path:
    """Where this interpreter's torch gets its build (one directory per binary interface)."""
    import torch

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    gpu = f"cuda{torch.version.cuda}" if _with_cuda() else "cpu"
    tag = f"torch{torch.__version__}-abi{abi}-py{sys.version_info[0]}{sys.version_info[1]}-{gpu}"
    return cache_dir() / "ext" / re.sub(r"[^A-Za-z0-9_.+-]", "_", tag)


def load() -> ModuleType:
    """The kernels module: the ahead-of-time build if installed, else the cached JIT build
    (compiled now if needed). Raises whatever the build raised (no compiler, ...)."""
    try:
        return importlib.import_module("kvtier._C")
    except ImportError:
        pass
    from torch.utils import cpp_extension

    cuda = _with_cuda()
    sources = [str(SOURCE_DIR / "kv_ops.cpp")]
    flags = list(CXX_FLAGS)
    if cuda:
        sources.append(str(SOURCE_DIR / "kv_ops_cuda.cu"))
        flags.append("-DKVTIER_WITH_CUDA")
    directory = build_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvtier.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        (directory / "lock").unlink(missing_ok=True)  # torch's baton: stale while we hold ours
        if not (directory / "kvtier_C.so").exists():
            logger.info("kvtier: compiling the C++ copy kernel for this torch (once) in %s",
                        directory)
        return cpp_extension.load(
            name="kvtier_C", sources=sources, extra_cflags=flags, extra_ldflags=["-fopenmp"],
            extra_cuda_cflags=["-O3", "-DKVTIER_WITH_CUDA"], build_directory=str(directory),
            with_cuda=cuda, verbose=os.environ.get("KVTIER_BUILD_VERBOSE") == "1")

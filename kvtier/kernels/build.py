"""The compiled copy kernels (`kvtier/kernels/csrc/`), built once per build recipe, before serving.

A wheel of kvtier carries the C++/CUDA sources, not a binary: a binary would be tied to one torch
version and C++ ABI, and an isolated pip build would compile it against a torch it then throws
away. So kvtier compiles them with `torch.utils.cpp_extension` into a cache directory
(`$KVTIER_CACHE_DIR`, else `$XDG_CACHE_HOME/kvtier`, else `~/.cache/kvtier`) named after a hash
of the whole recipe: source bytes, flags, include paths (they name the venv), the compiler and
the torch/Python/CUDA versions. Two environments on one host never rebuild over each other, and
a changed source or compiler gets a new directory instead of a silent in-place rebuild.

`load(compile=False)` only loads what is built (milliseconds); `load()` compiles when needed
(seconds) and logs it with the thread and the duration. The serving path never compiles: the
engine calls `kernels.ops.prepare()` when it is built, before the server takes requests
(see `ops.py`), and `make setup` builds ahead of time.

Several processes may start at once (one per TP rank, several servers): an exclusive `flock`
serializes the build, and since the kernel drops a dead holder's lock, a build killed halfway
never blocks the next one (torch's own lock file, which would, is cleared under it). An
ahead-of-time build (`KVTIER_BUILD_EXT=1 pip install --no-build-isolation .`, which puts
`kvtier._C` in the package) is used when present.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib
import importlib.util
import logging
import os
import re
import shutil
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

__all__ = ["load", "cache_dir", "build_dir", "SOURCE_DIR", "Build", "builds"]

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
# at::parallel_for is header-only: without OpenMP it silently runs on one thread.
CXX_FLAGS = ("-O3", "-g0", "-fopenmp")
LD_FLAGS = ("-fopenmp",)
CUDA_FLAGS = ("-O3", "-DKVTIER_WITH_CUDA")
MODULE = "kvtier_C"


@dataclass(frozen=True)
class Build:
    """One compile this process ran: where, on which thread, how long."""

    directory: Path
    thread: str
    seconds: float


_builds: list[Build] = []


def builds() -> list[Build]:
    """The compiles this process ran (tests assert none ran on a serving thread)."""
    return list(_builds)


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


def _sources(cuda: bool) -> list[Path]:
    return [SOURCE_DIR / "kv_ops.cpp", SOURCE_DIR / "kv_codec.cpp",
            SOURCE_DIR / "kv_module.cpp",
            *([SOURCE_DIR / "kv_ops_cuda.cu"] if cuda else [])]


def _compiler_identity() -> str:
    """The C++ compiler torch will call, by resolved path, size and mtime (a toolchain
    upgrade replaces the binary): no subprocess, so this is cheap on every start."""
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx)
    if path is None:
        return f"{cxx}:missing"
    real = os.path.realpath(path)
    st = os.stat(real)
    return f"{real}:{st.st_size}:{int(st.st_mtime)}"


def _recipe(cuda: bool) -> list[str]:
    """Everything that changes the binary, as text lines."""
    import torch
    from torch.utils import cpp_extension

    lines = [f"torch {torch.__version__} abi {int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             # Resolved: `python` and `python3` of one venv are one environment (the
             # include paths below name the venv itself).
             f"python {sys.version_info[0]}.{sys.version_info[1]} "
             f"{os.path.realpath(sys.executable)} {os.path.realpath(sys.prefix)}",
             f"cuda {torch.version.cuda if cuda else 'none'}",
             f"cxx {_compiler_identity()}", f"cflags {' '.join(CXX_FLAGS)}",
             f"ldflags {' '.join(LD_FLAGS)}", f"cudaflags {' '.join(CUDA_FLAGS) if cuda else ''}",
             *(f"include {p}" for p in cpp_extension.include_paths("cuda" if cuda else "cpu"))]
    for path in sorted(SOURCE_DIR.iterdir()):
        if path.suffix in (".cpp", ".cu", ".h"):
            lines.append(f"source {path.name} {hashlib.sha256(path.read_bytes()).hexdigest()}")
    return lines


def build_dir() -> Path:
    """This environment's build directory: a readable tag plus a hash of the recipe."""
    import torch

    cuda = _with_cuda()
    digest = hashlib.sha256("\n".join(_recipe(cuda)).encode()).hexdigest()[:16]
    gpu = f"cuda{torch.version.cuda}" if cuda else "cpu"
    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{gpu}-{digest}"
    return cache_dir() / "ext" / re.sub(r"[^A-Za-z0-9_.+-]", "_", tag)


def load(*, compile: bool = True) -> ModuleType | None:
    """The kernels module: the ahead-of-time build if installed, else this recipe's cached
    build, else (with `compile`) a build made now, under a lock shared with other processes.

    Returns None when nothing is built and `compile` is False. Raises whatever the build
    raised (no compiler, ...).
    """
    try:
        return importlib.import_module("kvtier._C")
    except ImportError:
        pass
    directory = build_dir()
    if (directory / f"{MODULE}.so").exists():
        return _import(directory)
    if not compile:
        return None
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "kvtier.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if this process dies
        if (directory / f"{MODULE}.so").exists():  # another process built it while we waited
            return _import(directory)
        (directory / "lock").unlink(missing_ok=True)  # torch's baton: stale while we hold ours
        return _compile(directory)


def _compile(directory: Path) -> ModuleType:
    from torch.utils import cpp_extension

    cuda = _with_cuda()
    thread = threading.current_thread().name
    logger.warning("kvtier: compiling the C++ copy kernel in %s on thread %s (once per "
                   "environment; `make setup` does it ahead of time)", directory, thread)
    start = time.monotonic()
    flags = [*CXX_FLAGS, *(["-DKVTIER_WITH_CUDA"] if cuda else [])]
    module = cpp_extension.load(
        name=MODULE, sources=[str(s) for s in _sources(cuda)], extra_cflags=flags,
        extra_ldflags=list(LD_FLAGS), extra_cuda_cflags=list(CUDA_FLAGS),
        build_directory=str(directory), with_cuda=cuda,
        verbose=os.environ.get("KVTIER_BUILD_VERBOSE") == "1")
    (directory / "recipe.txt").write_text("\n".join(_recipe(cuda)) + "\n")
    seconds = time.monotonic() - start
    _builds.append(Build(directory, thread, seconds))
    logger.warning("kvtier: compiled the C++ copy kernel in %.1fs on thread %s", seconds, thread)
    return module


def _import(directory: Path) -> ModuleType:
    import torch  # noqa: F401  (the extension links against torch's libraries)

    spec = importlib.util.spec_from_file_location(MODULE, directory / f"{MODULE}.so")
    assert spec is not None and spec.loader is not None, directory
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

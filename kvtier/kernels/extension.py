"""The compiled extension behind `kvtier.kernels.ops`: loading it (`prepare`, before serving;
the copies themselves never compile), choosing it or the PyTorch reference for a device
(`KVTIER_KERNEL`: `auto`, `cpp`, `torch`), and turning the errors it returns into exceptions
(`check_result`). Why a copy runs on the reference is logged once per reason.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from types import ModuleType

import torch

from kvtier.errors import ConfigError

__all__ = ["check_result", "kernel", "kernel_name", "kernel_status", "loaded", "prepare"]

logger = logging.getLogger(__name__)

_ext: ModuleType | None = None
_ext_error: str | None = None  # why the kernels could not be compiled or loaded
_probed = False  # looked for an already built kernel (without compiling)
_prepare_lock = threading.Lock()
_logged: set[str] = set()


_RAISED = {"ValueError": ValueError, "RuntimeError": RuntimeError}


def check_result(outcome: tuple[str, str]) -> None:
    """Raise what a compiled copy returned: its (exception name, message), ("", "") when it ran.
    The kernels return errors instead of raising them (see `kv_module.cpp`, `reporting`)."""
    kind, message = outcome
    if kind:
        raise _RAISED[kind](message)


def prepare() -> str:
    """Load the compiled kernels now, compiling them if this environment has none (seconds,
    once per environment; logged with its duration). Call it before serving: the copies
    themselves never compile. Idempotent and thread-safe; returns `kernel_name()`.

    Raises:
        ConfigError: `KVTIER_KERNEL=cpp` and the kernels cannot be built or loaded.
    """
    global _ext, _ext_error, _probed
    choice = _choice()
    if choice != "torch":
        with _prepare_lock:
            if _ext is None and _ext_error is None:
                from kvtier.kernels import build

                start = time.monotonic()
                try:
                    _ext = build.load(compile=True)
                except Exception as exc:  # no compiler, no headers, ...: the reference works
                    _ext_error = _summary(exc)
                _probed = True
                if _ext is not None:
                    logger.info("kvtier: C++ copy kernel ready in %.3fs",
                                time.monotonic() - start)
    if choice == "cpp" and _ext is None:
        raise ConfigError(f"KVTIER_KERNEL=cpp but the C++ kernel cannot be built or loaded: "
                          f"{_ext_error}")
    if _ext is None and choice != "torch":
        _log_once(_fallback_reason())
    return kernel_name()


def kernel_name() -> str:
    """The implementation `gather`/`scatter` use now for GPU pools if a GPU is present, else
    for CPU pools: "cuda", "cpp" or "torch" (never compiles; see `prepare`)."""
    return kernel_status()[0]


def kernel_status() -> tuple[str, str | None]:
    """`kernel_name()` and, for "torch", why the compiled kernel is not used (None otherwise).
    Logs nothing: for a caller that shows the reason itself (`kvtier info`)."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ext, reason = _select(device)
    if ext is None:
        return "torch", reason
    return "cuda" if device.type == "cuda" else "cpp", None


def _choice() -> str:
    choice = os.environ.get("KVTIER_KERNEL", "auto")
    if choice not in ("auto", "cpp", "torch"):
        raise ConfigError(f"environment KVTIER_KERNEL must be 'auto', 'cpp' or 'torch', got "
                          f"{choice!r}")
    return choice


def kernel(device: torch.device) -> ModuleType | None:
    """The compiled extension if it should serve tensors on `device`, else None (reference,
    its reason logged once)."""
    ext, reason = _select(device)
    if reason is not None:
        _log_once(reason)
    return ext


def _select(device: torch.device) -> tuple[ModuleType | None, str | None]:
    """The compiled extension for tensors on `device`, or None and why not."""
    choice = _choice()
    if choice == "torch":
        return None, "KVTIER_KERNEL=torch: using the PyTorch reference for gather/scatter"
    ext = loaded()
    if ext is None:
        if choice == "cpp":
            raise ConfigError(f"KVTIER_KERNEL=cpp but the C++ kernel is not loaded: "
                              f"{_ext_error or 'call kvtier.kernels.ops.prepare() first'}")
        return None, _fallback_reason()
    if device.type == "cuda" and not ext.WITH_CUDA:
        return None, "the compiled kernels have no CUDA: using the PyTorch reference on GPU"
    if device.type not in ("cpu", "cuda"):
        return None, f"no kvtier kernel for {device.type} tensors; using the PyTorch reference"
    return ext, None


def loaded() -> ModuleType | None:
    """The kernels if loaded, or already built and loadable now; never compiles (this runs on
    serving threads, where a compile would stall every request for seconds)."""
    global _ext, _ext_error, _probed
    if _ext is None and not _probed:
        from kvtier.kernels import build

        # Never wait here for a `prepare()` compiling on another thread: use the reference
        # until it is done.
        if not _prepare_lock.acquire(blocking=False):
            return None
        try:
            if not _probed:
                try:
                    _ext = build.load(compile=False)
                except Exception as exc:  # a broken build: the reference still works
                    _ext_error = _summary(exc)
                _probed = True
        finally:
            _prepare_lock.release()
    return _ext


def _fallback_reason() -> str:
    if _ext_error is not None:
        return (f"the C++ copy kernel is not available ({_ext_error}); using the PyTorch "
                f"reference (slower)")
    return ("the C++ copy kernel is not built yet (copies never compile it); using the PyTorch "
            "reference (slower) until kvtier.kernels.ops.prepare() runs")


def _summary(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[-1][:300]}" if text else type(exc).__name__


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("%s", reason)

"""SGLang's CPU engine, switched on by kvtier's plugin for `--device cpu`.

SGLang 0.5.23 runs on a CPU only with `SGLANG_USE_CPU_ENGINE=1` in every process's environment
(without it the launch fails importing `vllm`) and an importable `sgl_kernel` (its CPU build is
not on PyPI: without it, `No module named 'sgl_kernel'`). A launch with `--enable-kvtier
--device cpu` gets both from the plugin, in the launcher before any worker starts, so the
workers inherit them: the variable, and `cpu_shims/` (kvtier's stand-in for `sgl_kernel`,
shipped in the package) on `PYTHONPATH`, unless a real `sgl_kernel` is importable. With
`huge_pages` (kvtier's config key), also `THP_MEM_ALLOC_ENABLE=1`: PyTorch's CPU allocator then
advises huge pages for every allocation of 2 MiB and more, so the KV pool faults in on huge
pages as it is created (collapsing a pool that is already filled took ~3 s per GB on a 2-core
KVM guest; see `kvtier.connectors.hugepages`). At `--tp N` > 1, also the cores each rank's
OpenMP threads run on (`SGLANG_CPU_OMP_THREADS_BIND`, ranks apart by `|`): SGLang derives them
from NUMA nodes, one per rank, and a one-node host has too few. What a user set is left alone.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from collections.abc import MutableMapping, Sequence
from pathlib import Path

from kvtier.integration.sglang.launch.cpu_attention import HOOK_ENV

__all__ = ["SHIM_DIR", "CPU_ENGINE_ENV", "THP_ENV", "BIND_ENV", "prepare_cpu_engine",
           "shims_needed", "thread_binds"]

logger = logging.getLogger(__name__)

SHIM_DIR = Path(__file__).resolve().parent / "cpu_shims"
CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
THP_ENV = "THP_MEM_ALLOC_ENABLE"  # read by PyTorch's CPU allocator (c10/core/alloc_cpu.cpp)
BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def thread_binds(ranks: int, cpus: Sequence[int] | None = None) -> str:
    """`SGLANG_CPU_OMP_THREADS_BIND` for `ranks` worker ranks (DP x TP x PP) over `cpus`
    (default: the cores this process may run on), an equal share each: "0|1" for 2 ranks on 2
    cores, "0,1|2,3" on 4. With fewer cores than ranks, ranks share the last one."""
    if ranks < 1:
        raise ValueError(f"ranks must be >= 1, got {ranks}")
    cores = sorted(os.sched_getaffinity(0) if cpus is None else cpus)
    share = max(1, len(cores) // ranks)
    shares = [cores[r * share:(r + 1) * share] or cores[-1:] for r in range(ranks)]
    return "|".join(",".join(map(str, rank)) for rank in shares)


def shims_needed() -> bool:
    """Whether `sgl_kernel` must come from `SHIM_DIR`: no real one is importable here (the
    stand-in itself, already on this process's path, does not count)."""
    spec = importlib.util.find_spec("sgl_kernel")
    if spec is None or spec.origin is None:
        return True
    return Path(spec.origin).resolve().is_relative_to(SHIM_DIR)


def prepare_cpu_engine(env: MutableMapping[str, str] = os.environ, *, huge_pages: bool = False,
                       prefix_attention: bool = False, ranks: int = 1) -> list[str]:
    """Switch SGLang's CPU engine on in `env` (and make the `sgl_kernel` stand-in importable
    here and in processes started with `env`; with `huge_pages`, PyTorch's huge-page
    allocations; with `prefix_attention`, kvtier's extend over a cached prefix in the workers,
    see `cpu_attention`; with more than one worker rank, DP x TP x PP, each rank's cores);
    returns what it changed, for the log."""
    done = []
    if ranks > 1 and env.get(BIND_ENV) is None:
        env[BIND_ENV] = thread_binds(ranks)
        done.append(f"{BIND_ENV}={env[BIND_ENV]} (each rank's cores)")
    if prefix_attention:
        env[HOOK_ENV] = "1"
        done.append("an extend over a cached prefix computes the new tokens' attention only "
                    "(cpu_prefix_attention)")
    else:
        env.pop(HOOK_ENV, None)
    for name, wanted in ((CPU_ENGINE_ENV, True), (THP_ENV, huge_pages)):
        if wanted and env.get(name) is None:
            env[name] = "1"
            done.append(f"{name}=1")
    if shims_needed():
        shims = str(SHIM_DIR)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (shims, env.get("PYTHONPATH", "")) if p)
        if shims not in sys.path:
            sys.path.insert(0, shims)
        done.append(f"kvtier's sgl_kernel stand-in ({shims}) on PYTHONPATH")
    return done

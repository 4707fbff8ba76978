"""One `kvtier demo` run's set-up: what it runs (`DemoOptions`, the generated models' shapes),
the kvtier config its servers get (`demo_config`), the served model's shape (`model_shape`),
and `DemoRun`, the run's servers and what it measured so far (the phases and the results in
kvtier/demo/runner.py read and fill it).
"""

from __future__ import annotations

import json
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.demo.models import LlamaSpec
from kvtier.demo.quiet import HostMeter, WriteWaits, load_average
from kvtier.demo.server import SGLangServer, cpu_shims_dir, gpu_available
from kvtier.demo.workload import Prompts, TextPrompts, Workload

__all__ = ["CHUNK_SIZE", "DemoOptions", "DemoRun", "FULL_MODEL", "SMALL_MODEL", "demo_config",
           "model_shape", "ModelShape"]

# A generated model: 2K-token prefill ~1.0 s, 4K ~2.5 s on 2 cores; 27 M parameters, 54 MB on
# disk (bfloat16).
FULL_MODEL = LlamaSpec(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536,
                       max_positions=16384, dtype="bfloat16")
# For tests: a 1.5K-token prefill still costs several times a load.
SMALL_MODEL = LlamaSpec(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1024,
                        max_positions=4096, dtype="bfloat16")
CHUNK_SIZE = 256


@dataclass(frozen=True)
class DemoOptions:
    """What `kvtier demo` runs; see `kvtier demo --help`."""

    workload: Workload
    model: LlamaSpec | None = None  # None: the real model (kvtier/demo/smollm2.py)
    out_dir: Path = Path("demo-results")
    redis_url: str | None = None
    small: bool = False
    keep_model: bool = False
    threads: int = 0  # per server; 0: every core
    progress: bool = True


def demo_config(disk_dir: Path | None, redis_url: str | None, salt: str,
                arena_gb: float) -> str:
    """The kvtier YAML the demo's servers run with (embedded; written to a temp file).

    The default `prefetch_policy: adaptive` makes a request wait for the part of its load from
    disk or Redis that arrives sooner than it could be recomputed, so its TTFT includes that
    load. The salt keeps this run's keys apart from anything an earlier run left in a shared
    Redis.
    """
    lines = [f"chunk_size: {CHUNK_SIZE}", "local_cpu: true",
             f"max_local_cpu_size: {arena_gb:.3f}", f"hash_salt: {json.dumps(salt)}"]
    if disk_dir is not None:
        lines += [f"local_disk: {json.dumps(str(disk_dir))}", "max_local_disk_size: 4.0"]
    if redis_url:
        lines += [f"remote_url: {json.dumps(redis_url)}", "remote_serde: naive"]
    return "\n".join(lines) + "\n"


class ModelShape(NamedTuple):
    context: int  # tokens
    kv_bytes_per_token: int  # in a float32 pool: K and V, every layer


def model_shape(model: Path) -> ModelShape:
    """What the demo sizes its servers by, from the model's `config.json`."""
    cfg = json.loads((model / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return ModelShape(int(cfg["max_position_embeddings"]),
                      2 * cfg["num_hidden_layers"] * kv_heads * head_dim * 4)


def _tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model))


class DemoRun:
    """One demo run's servers and results (internal to run_demo)."""

    def __init__(self, opts: DemoOptions, work: Path, model: Path):
        self.opts = opts
        self.work = work
        self.model = model
        self.salt = uuid.uuid4().hex[:12]
        wl = opts.workload
        self.max_tokens = max(2048, wl.max_prompt_tokens() + 512)
        shape = model_shape(model)
        self.context = shape.context
        stored = wl.conversations * wl.max_prompt_tokens() * shape.kv_bytes_per_token
        self.arena_gb = max(0.25, 3 * stored / 1e9)
        self.warmup = (min(wl.system_prompt_tokens, 2048), wl.vocab)  # (tokens, vocab)
        self.baseline_outputs: dict[tuple[int, int], list[int]] = {}
        self.baseline_ttft: dict[tuple[int, int], float] = {}
        self.last_prompts: list[tuple[int, list[int]]] = []  # (conversation, last turn's prompt)
        self.servers: list[SGLangServer] = []  # every server started, stopped at the end
        self.tokenizer = _tokenizer(model) if opts.model is None else None
        self.prompts: Prompts = wl if self.tokenizer is None else TextPrompts(wl, self.tokenizer)
        # CPU time over the measured requests only (HostMeter windows), and the waits that keep
        # the kvtier server's background writes out of the baseline's measurements.
        self.meter = HostMeter(groups=lambda: [s.proc.pid for s in self.servers if s.proc])
        self.load_first: tuple[float, float, float] | None = None  # at the first measurement
        self.writes = WriteWaits()

    def server(self, name: str, config: str | None, metrics: bool = False) -> SGLangServer:
        """A server of the demo's; with `metrics`, kvtier's samples are on its own port
        (`--enable-metrics`: a port picked ahead for `metrics_port` could be taken by another
        process while the server starts), for the write-queue gauge the demo waits on before
        the baseline measures (quiet.WriteWaits)."""
        args = ["--max-total-tokens", str(self.max_tokens),
                "--context-length", str(self.context), "--sleep-on-idle",
                *(["--enable-metrics"] if metrics else [])]
        if config is not None:
            path = self.work / f"{name}.yaml"
            path.write_text(config)
            args += ["--enable-kvtier", "--kvtier-config-file", str(path)]
        threads = self.opts.threads or os.cpu_count() or 1
        shims = [] if gpu_available() else [cpu_shims_dir()]
        server = SGLangServer(self.model, self.work / f"{name}.log", args=args,
                              env={"OMP_NUM_THREADS": str(threads)}, pythonpath=shims)
        self.servers.append(server)
        return server

    def kvtier_config(self, disk: bool) -> str:
        return demo_config(self.work / "disk" if disk else None, self.opts.redis_url,
                           self.salt, self.arena_gb)

    def measure(self, server: SGLangServer, prompt: list[int], max_new: int) -> Any:
        server.flush_cache()  # nothing may come from the device cache
        self.load_first = self.load_first or load_average()
        self.meter.open()
        try:
            return server.stream_generate(prompt, max_new)
        finally:
            self.meter.close()

    def host(self, start: dict[str, Any]) -> dict[str, Any]:
        """The results' `host` section: the host before the servers started, during the
        measured requests, and the waits for the kvtier server's writes."""
        return {"cores": self.meter.cores, "start": start,
                "measured": {"load_average_first": self.load_first,
                             "load_average_peak": self.meter.load_peak,
                             "load_average_end": load_average(), **self.meter.cores_used()},
                "write_waits": self.writes.summary()}

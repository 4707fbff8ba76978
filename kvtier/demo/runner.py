"""`kvtier demo`: real SGLang servers, a multi-turn workload, TTFT with and without kvtier.

Servers (all on the same model, same flags apart from kvtier; the model is SmolLM2-135M-Instruct,
trained weights, prompts of real text, unless a generated model is asked for, as `--small` does):
    baseline   no --enable-kvtier: SGLang alone
    kvtier     --enable-kvtier, tiers cpu + disk (+ redis with --redis-url)
    restarted  the kvtier server restarted on the same disk directory (its CPU tier is empty)
    second     with --redis-url: another instance with tiers cpu + redis only

Every measured request runs right after `/flush_cache` on its server, so nothing comes from
SGLang's device prefix cache: the baseline recomputes the whole prompt (what serving does when a
prefix has been evicted), and every cached token on a kvtier server was loaded from a kvtier
tier. Which tier is known by construction: the kvtier server's CPU tier holds all it stored (the
arena is sized for the workload), a restarted server's CPU tier is empty and its disk is first,
and the second instance has no disk. kvtier's own log ("kvtier: loaded N tokens") confirms each
load. The workload runs turn by turn; each turn's answer (from the baseline) extends the prompt.
The two servers share the host's cores: each baseline request first waits for the kvtier
server's background writes, and the host's load is read before the servers start and over the
measured requests (kvtier/demo/quiet.py).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvtier.config.names import CPU, DISK, REDIS
from kvtier.demo.models import LlamaSpec, cached_llama, make_llama
from kvtier.demo.quiet import HostMeter, WriteWaits, load_average
from kvtier.demo.report import format_host_start
from kvtier.demo.server import SGLangServer, cpu_shims_dir, free_port, gpu_available
from kvtier.demo.workload import FIRST_ID, Conversation, Prompts, TextPrompts, Workload

__all__ = ["DemoOptions", "run_demo", "FULL_MODEL", "SMALL_MODEL", "demo_config", "model_shape",
           "ModelShape"]

# A generated model: 2K-token prefill ~1.0 s, 4K ~2.5 s on 2 cores; 27 M parameters, 54 MB on
# disk (bfloat16).
FULL_MODEL = LlamaSpec(hidden=512, layers=8, heads=8, kv_heads=2, intermediate=1536,
                       max_positions=16384, dtype="bfloat16")
# For tests: a 1.5K-token prefill still costs several times a load.
SMALL_MODEL = LlamaSpec(hidden=384, layers=4, heads=6, kv_heads=2, intermediate=1024,
                        max_positions=4096, dtype="bfloat16")
CHUNK_SIZE = 256
MIN_START_WINDOW_S = 1.0  # the shortest window the host's load before the servers is read over
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")


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
                arena_gb: float, metrics_port: int | None = None) -> str:
    """The kvtier YAML the demo's servers run with (embedded; written to a temp file).

    The default `prefetch_policy: adaptive` makes a request wait for the part of its load from
    disk or Redis that arrives sooner than it could be recomputed, so its TTFT includes that
    load. The salt keeps this run's keys apart from anything an earlier run left in a shared
    Redis. `metrics_port`: kvtier's metrics endpoint, whose write-queue gauge the demo waits
    on before the baseline measures (quiet.WriteWaits).
    """
    lines = [f"chunk_size: {CHUNK_SIZE}", "local_cpu: true",
             f"max_local_cpu_size: {arena_gb:.3f}", f"hash_salt: {json.dumps(salt)}"]
    if disk_dir is not None:
        lines += [f"local_disk: {json.dumps(str(disk_dir))}", "max_local_disk_size: 4.0"]
    if redis_url:
        lines += [f"remote_url: {json.dumps(redis_url)}", "remote_serde: naive"]
    if metrics_port is not None:
        lines.append(f"metrics_port: {metrics_port}")
    return "\n".join(lines) + "\n"


class _Log:
    """Tokens kvtier reports loading in a server log since the last call."""

    def __init__(self, server: SGLangServer):
        self.server = server
        self.offset = 0

    def loaded_since(self) -> int:
        text = self.server.log()
        new, self.offset = text[self.offset:], len(text)
        return sum(int(m) for m in _LOADED.findall(new))


class _Run:
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
        self.metrics_port = free_port()

    def server(self, name: str, config: str | None) -> SGLangServer:
        args = ["--max-total-tokens", str(self.max_tokens),
                "--context-length", str(self.context), "--sleep-on-idle"]
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

    def kvtier_config(self, disk: bool, metrics: bool = False) -> str:
        return demo_config(self.work / "disk" if disk else None, self.opts.redis_url,
                           self.salt, self.arena_gb, self.metrics_port if metrics else None)

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


def _start(servers: Sequence[SGLangServer], warmup: tuple[int, int],
           note: Callable[[str], None], kept: Path) -> None:
    """Start `servers` together, then warm each up: the servers skip SGLang's own warm-up,
    and a process's first long prefill pays one-time costs no later request does. `kept`:
    where the logs are copied when the demo ends (the work directory is then deleted)."""
    names = ", ".join(s.log_path.stem for s in servers)
    note(f"starting SGLang ({names}); logs in {servers[0].log_path.parent} while it runs, "
         f"kept in {kept} when the demo ends")
    for s in servers:
        s.launch()
    for s in servers:
        s.wait_ready()
    for s in servers:
        # Tokens no workload prompt starts with (a different seed per server), so the warm-up
        # can never be a hit, nor leave one behind.
        rng = random.Random(f"warmup-{s.log_path.stem}")
        tokens, vocab = warmup
        for _ in range(2):
            s.flush_cache()
            s.generate([rng.randrange(FIRST_ID, vocab) for _ in range(tokens)], 4)


def _host_start(meter: HostMeter, started: float, say: Callable[[str], None]) -> dict[str, Any]:
    """The host before any server starts: CPU over the demo's first second at least (its model
    preparation included; the demo's own process does not count as another)."""
    time.sleep(max(0.0, MIN_START_WINDOW_S - (time.monotonic() - started)))
    meter.close()
    start = {"load_average": load_average(), **meter.cores_used()}
    for line in format_host_start(meter.cores, start):
        say(line)
    return start


def _row(phase: str, tier: str, conv: int, turn: int, prompt: list[int], base_ttft: float,
         got: Any, loaded: int, expected: list[int]) -> dict[str, Any]:
    return {
        "phase": phase, "conversation": conv, "turn": turn, "prompt_tokens": len(prompt),
        "ttft_without_s": round(base_ttft, 4), "ttft_with_s": round(got.ttft_s, 4),
        "ratio": round(got.ttft_s / base_ttft, 4) if base_ttft > 0 else None,
        "hit_tokens": got.cached_tokens, "tier": tier if got.cached_tokens else "none",
        "hit_tokens_per_tier": {tier: got.cached_tokens} if got.cached_tokens else {},
        "kvtier_logged_tokens": loaded, "identical": got.output_ids == expected,
    }


def _multi_turn(run: _Run, base: SGLangServer, kv: SGLangServer,
                emit: Callable[[dict[str, Any]], None], bar: Any) -> list[dict[str, Any]]:
    wl = run.opts.workload
    convs = [Conversation(i + 1) for i in range(wl.conversations)]
    log = _Log(kv)
    rows = []
    for turn in range(1, wl.turns + 1):
        for conv in convs:
            prompt = conv.next_prompt(run.prompts, turn)
            # The kvtier server writes disk and Redis while it is idle: not while this measures.
            run.writes.wait(kv, run.metrics_port)
            without = run.measure(base, prompt, wl.answer_tokens)
            log.loaded_since()
            with_kv = run.measure(kv, prompt, wl.answer_tokens)
            key = (conv.index, turn)
            run.baseline_outputs[key], run.baseline_ttft[key] = without.output_ids, without.ttft_s
            row = _row("multi-turn", CPU, conv.index, turn, prompt, without.ttft_s, with_kv,
                       log.loaded_since(), without.output_ids)
            # What the previous turn computed (its prompt and answer): all of it can hit.
            row["previous_turn_tokens"] = len(conv.history) if conv.history else None
            rows.append(row)
            emit(row)
            bar.update(1)
            conv.answered(prompt, without.output_ids)
            if turn == wl.turns:
                run.last_prompts.append((conv.index, prompt))
    return rows


def _replay(run: _Run, server: SGLangServer, phase: str, tier: str,
            emit: Callable[[dict[str, Any]], None], bar: Any) -> list[dict[str, Any]]:
    """Each conversation's last prompt again, on a server that has not seen it."""
    wl = run.opts.workload
    log = _Log(server)
    log.loaded_since()
    rows = []
    for conv, prompt in run.last_prompts:
        got = run.measure(server, prompt, wl.answer_tokens)
        key = (conv, wl.turns)
        row = _row(phase, tier, conv, wl.turns, prompt, run.baseline_ttft[key], got,
                   log.loaded_since(), run.baseline_outputs[key])
        rows.append(row)
        emit(row)
        bar.update(1)
    return rows


def run_demo(opts: DemoOptions, note: Callable[[str], None] | None = None,
             emit: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the demo; returns the results (also what `report.write_results` saves).

    `note` gets status lines, `emit` each result row as it is measured.
    """
    from tqdm import tqdm

    say = note or (lambda msg: print(msg, file=sys.stderr))
    show = emit or (lambda row: None)
    started, before = time.monotonic(), HostMeter()
    before.open()
    with tempfile.TemporaryDirectory(prefix="kvtier-demo-") as tmp:
        work = Path(tmp)
        model, built = _model(opts, work)
        say(f"model {model} ({'built' if built else 'cached'})")
        run = _Run(opts, work, model)
        wl = opts.workload
        steps = wl.turns * wl.conversations + wl.conversations * (2 if opts.redis_url else 1)
        base = run.server("baseline", None)
        kv = run.server("kvtier", run.kvtier_config(True, metrics=True))
        phases: dict[str, list[dict[str, Any]]] = {}
        start = _host_start(before, started, say)
        try:
            _start([base, kv], run.warmup, say, opts.out_dir / "logs")
            with tqdm(total=steps, desc="kvtier demo", unit="req", disable=not opts.progress,
                      file=sys.stderr) as bar:
                phases["multi-turn"] = _multi_turn(run, base, kv, show, bar)
                kv.stop()
                restarted = run.server("kvtier-restarted", run.kvtier_config(True))
                _start([restarted], run.warmup, bar.write, opts.out_dir / "logs")
                phases["restart"] = _replay(run, restarted, "restart", DISK, show, bar)
                restarted.stop()
                if opts.redis_url:
                    second = run.server("second-instance", run.kvtier_config(False))
                    _start([second], run.warmup, bar.write, opts.out_dir / "logs")
                    phases["second-instance"] = _replay(run, second, "second-instance",
                                                        REDIS, show, bar)
                    second.stop()
        finally:
            for server in run.servers:
                server.stop()
            _keep_logs(work, opts.out_dir / "logs")
        return _results(opts, run, model, phases, start)


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


def _model(opts: DemoOptions, work: Path) -> tuple[Path, bool]:
    if opts.model is None:
        from kvtier.demo.smollm2 import cached_smollm2

        return cached_smollm2()
    if opts.small and not opts.keep_model:
        return make_llama(work / "model", spec=opts.model), True
    return cached_llama(opts.model)


def _sample(run: _Run) -> dict[str, Any] | None:
    """The first conversation's last turn as text: its question and the answer both arms
    gave (they are identical where `identical` says so)."""
    if run.tokenizer is None or not run.last_prompts:
        return None
    conv, _ = run.last_prompts[0]
    question = run.prompts.user_message(conv, run.opts.workload.turns)
    answer = run.baseline_outputs[(conv, run.opts.workload.turns)]
    decode = run.tokenizer.decode
    return {"conversation": conv, "question": decode(question).strip(),
            "answer": decode(answer, skip_special_tokens=True).strip()}


def _keep_logs(work: Path, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        (out_dir / log.name).write_bytes(log.read_bytes())


def _results(opts: DemoOptions, run: _Run, model: Path,
             phases: dict[str, list[dict[str, Any]]], start: dict[str, Any]) -> dict[str, Any]:
    from kvtier.demo.report import summarize

    rows = [row for phase in phases.values() for row in phase]
    return {
        "model": {"path": str(model),
                  **(asdict(opts.model) if opts.model else {"name": "SmolLM2-135M-Instruct"})},
        "sample": _sample(run),
        "workload": asdict(opts.workload),
        "servers": {"threads": opts.threads or os.cpu_count(), "gpu": gpu_available(),
                    "max_total_tokens": run.max_tokens},
        "kvtier_config": run.kvtier_config(True),
        "host": run.host(start),
        "rows": rows,
        "summary": summarize(rows, opts.workload.system_prompt_tokens),
    }

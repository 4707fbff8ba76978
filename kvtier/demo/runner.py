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

import os
import random
import re
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvtier.config.names import CPU, DISK, REDIS
from kvtier.demo.demo_run import (
    CHUNK_SIZE,
    FULL_MODEL,
    SMALL_MODEL,
    DemoOptions,
    DemoRun,
    ModelShape,
    demo_config,
    model_shape,
)
from kvtier.demo.models import cached_llama, make_llama
from kvtier.demo.quiet import HostMeter, load_average
from kvtier.demo.report import format_host_start
from kvtier.demo.server import SGLangServer, gpu_available
from kvtier.demo.workload import FIRST_ID, Conversation

__all__ = ["DemoOptions", "run_demo", "FULL_MODEL", "SMALL_MODEL", "demo_config", "model_shape",
           "ModelShape", "CHUNK_SIZE"]

MIN_START_WINDOW_S = 1.0  # the shortest window the host's load before the servers is read over
_LOADED = re.compile(r"kvtier: loaded (\d+) tokens")


class _Log:
    """Tokens kvtier reports loading in a server log since the last call."""

    def __init__(self, server: SGLangServer):
        self.server = server
        self.offset = 0

    def loaded_since(self) -> int:
        text = self.server.log()
        new, self.offset = text[self.offset:], len(text)
        return sum(int(m) for m in _LOADED.findall(new))


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


def _multi_turn(run: DemoRun, base: SGLangServer, kv: SGLangServer,
                emit: Callable[[dict[str, Any]], None], bar: Any) -> list[dict[str, Any]]:
    wl = run.opts.workload
    convs = [Conversation(i + 1) for i in range(wl.conversations)]
    log = _Log(kv)
    rows = []
    for turn in range(1, wl.turns + 1):
        for conv in convs:
            prompt = conv.next_prompt(run.prompts, turn)
            # The kvtier server writes disk and Redis while it is idle: not while this measures.
            run.writes.wait(kv)
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


def _replay(run: DemoRun, server: SGLangServer, phase: str, tier: str,
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
        run = DemoRun(opts, work, model)
        wl = opts.workload
        steps = wl.turns * wl.conversations + wl.conversations * (2 if opts.redis_url else 1)
        base = run.server("baseline", None)
        kv = run.server("kvtier", run.kvtier_config(True), metrics=True)
        phases: dict[str, list[dict[str, Any]]] = {}
        start = _host_start(before, started, say)
        try:
            _start([base, kv], run.warmup, say, opts.out_dir / "logs")
            with tqdm(total=steps, desc="kvtier demo", unit="req", disable=not opts.progress,
                      file=sys.stderr) as bar:
                phases["multi-turn"] = _multi_turn(run, base, kv, show, bar)
                kv.stop()  # drains its writes: the disk and Redis now hold what it stored
                # Both replay servers start together (one start's wait instead of two): each
                # measures while the other is idle (--sleep-on-idle); the second instance has
                # no disk, and its hits are what the kvtier server wrote to Redis.
                restarted = run.server("kvtier-restarted", run.kvtier_config(True))
                second = (run.server("second-instance", run.kvtier_config(False))
                          if opts.redis_url else None)
                _start([s for s in (restarted, second) if s is not None], run.warmup,
                       bar.write, opts.out_dir / "logs")
                phases["restart"] = _replay(run, restarted, "restart", DISK, show, bar)
                restarted.stop()
                if second is not None:
                    phases["second-instance"] = _replay(run, second, "second-instance",
                                                        REDIS, show, bar)
                    second.stop()
        finally:
            for server in run.servers:
                server.stop()
            _keep_logs(work, opts.out_dir / "logs")
        return _results(opts, run, model, phases, start)


def _model(opts: DemoOptions, work: Path) -> tuple[Path, bool]:
    if opts.model is None:
        from kvtier.demo.smollm2 import cached_smollm2

        return cached_smollm2()
    if opts.small and not opts.keep_model:
        return make_llama(work / "model", spec=opts.model), True
    return cached_llama(opts.model)


def _sample(run: DemoRun) -> dict[str, Any] | None:
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


def _results(opts: DemoOptions, run: DemoRun, model: Path,
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

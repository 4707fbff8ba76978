"""The README's CPU launch line, run as written with nothing in the environment but PATH and
HOME: kvtier's plugin switches SGLang's CPU engine on (its variable and the `sgl_kernel`
stand-in shipped in the package), and the server serves a kvtier hit. And an arena that fits
physical memory but not beside SGLang's own CPU KV pool stops the launch, naming both numbers,
before any worker starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks.serving.bench_readme_cpu import bare_server, readme_cpu_launch
from kvtier.config.host import MEMORY_HEADROOM_BYTES, available_memory_bytes
from tests.integration.sglang.conftest import full_hit, prompt, write_config

pytestmark = pytest.mark.sglang


def test_the_readme_cpu_launch_line_serves_a_kvtier_hit(tiny_llama: Path,
                                                         tmp_path: Path) -> None:
    config = write_config(tmp_path / "kvtier.yaml")
    args = readme_cpu_launch()
    assert args[:2] == ["--model-path", "M"] and "kvtier.yaml" in args
    args = [str(config) if a == "kvtier.yaml" else a for a in args[2:]]
    server = bare_server(tiny_llama, tmp_path / "server.log", args)
    with server:
        ids = prompt(21, 40)
        first = server.generate(ids)
        server.flush_cache()
        again = server.generate(ids)
        log = server.log()
    assert again["meta_info"]["cached_tokens"] == full_hit(server, 40), log[-3000:]
    assert again["output_ids"] == first["output_ids"]
    assert "kvtier: --device cpu: SGLANG_USE_CPU_ENGINE=1" in log
    assert "sgl_kernel stand-in" in log
    assert "kvtier: --device cpu: THP_MEM_ALLOC_ENABLE=1" in log  # the pool faults in huge
    assert "kvtier: KV pool: " in log and "advised for huge pages" in log
    # a hit saves the prefix's attention too: kvtier's own hook, no demo plugin on this path
    assert "kvtier: an extend over a cached prefix computes the new tokens' attention only" \
        in log


def test_an_arena_that_does_not_fit_beside_the_engines_pool_stops_the_server(
        tiny_llama: Path, tmp_path: Path) -> None:
    before = available_memory_bytes()
    assert before is not None
    pool_tokens = 16 * 2**20  # 4 GiB of KV at this model's 256 bytes a token (fp16)
    # Fits physical memory and what is free now, but not once the pool is allocated.
    arena_gb = round((before - MEMORY_HEADROOM_BYTES - 2 * 2**30) / 1e9, 2)
    assert arena_gb > 1, f"too little memory free for this test: {before / 1e9:.1f} GB"
    config = write_config(tmp_path / "kvtier.yaml", max_local_cpu_size=arena_gb)
    server = bare_server(tiny_llama, tmp_path / "server.log", [
        "--device", "cpu", "--max-total-tokens", str(pool_tokens), "--enable-kvtier",
        "--kvtier-config-file", str(config)])
    server.launch()
    try:
        assert server.proc is not None
        server.proc.wait(240)
    finally:
        server.stop()
    log = server.log()
    found = re.search(rf"max_local_cpu_size: {arena_gb:g} GB x 1 rank\(s\) of arena \+ about "
                      r"([\d.]+) GB for SGLang's CPU KV pool \(--max-total-tokens \d+\) and "
                      r"weights .* at most ([\d.]+) GB per rank", log)
    assert found, log[-3000:]
    assert float(found[1]) >= 4 * 2**30 / 1e9  # the pool the launch counted
    assert float(found[2]) < arena_gb
    assert "Traceback" not in log and "arena: " not in log  # refused before any worker

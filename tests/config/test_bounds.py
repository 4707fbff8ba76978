"""Issue 20, "every value that validates also runs": bounds derived from what each value does,
`~` in paths, host checks (memory of every TP rank and the cgroup limit, disk space) that
`check-config` warns about and the launch refuses, and environment variables that can no longer
quietly override an explicit file. Each refusal names the key, the value and the bound, and
nothing is created before it."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
import yaml

from kvtier.backends import BackendContext
from kvtier.backends.disk import DiskBackend
from kvtier.cli import main
from kvtier.config import Config, load_config, load_config_report, physical_memory_bytes
from kvtier.config.host import (
    MEMORY_HEADROOM_BYTES,
    arena_now_problem,
    available_memory_bytes,
    cgroup_memory_limit,
    check_host,
    disk_problem,
    host_problems,
    memory_problem,
)
from kvtier.errors import ConfigError
from kvtier.memory import MemoryAllocator
from tests.helpers import SMALL_MHA


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "kvtier.yaml"
    path.write_text(text)
    return path


def _disk_file(tmp_path: Path, line: str) -> tuple[Path, Path]:
    """A config with a disk tier under tmp_path plus `line`; (file, disk dir)."""
    disk = tmp_path / "disk"
    return _file(tmp_path, f"local_disk: {disk}\nmax_local_disk_size: 1\n{line}\n"), disk


# ---- 1 and 5: ceilings derived from what each value does ----------------------------------

@pytest.mark.parametrize(("line", "key", "shown", "bound"), [
    ("remote_segment_mb: 1.0e-6", "remote_segment_mb", "1e-06", "[0.0625, 512]"),
    ("remote_segment_mb: 0.06", "remote_segment_mb", "0.06", "[0.0625, 512]"),
    ("remote_segment_mb: 513", "remote_segment_mb", "513", "[0.0625, 512]"),
    ("write_queue_chunks: 1000000000", "write_queue_chunks", "1000000000", "1..65536"),
    ("write_queue_chunks: 65537", "write_queue_chunks", "65537", "1..65536"),
    ("prefetch_timeout_base_ms: 6.048e+8", "prefetch_timeout_base_ms", "6.048e+08",
     "at most 60000"),
    ("prefetch_timeout_per_token_ms: 10.5", "prefetch_timeout_per_token_ms", "10.5",
     "at most 10"),
    ("prefetch_wait_complete_max_ms: 600001", "prefetch_wait_complete_max_ms", "600001",
     "at most 600000"),
    ("blocking_timeout_secs: 3601", "blocking_timeout_secs", "3601", "at most 3600"),
    ("remote_timeout_secs: 601", "remote_timeout_secs", "601", "at most 600"),
    ("tenant_max_fraction: 1.5", "tenant_max_fraction", "1.5", "(0, 1]"),
    ("tenant_max_fraction: 0", "tenant_max_fraction", "0.0", "(0, 1]"),
])
def test_values_past_their_ceiling_name_key_value_and_bound(
    tmp_path: Path, line: str, key: str, shown: str, bound: str,
) -> None:
    path, disk = _disk_file(tmp_path, line)
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    msg = str(err.value)
    assert msg.startswith(f"{path}: {key}: ") and shown in msg and bound in msg
    assert not disk.exists()  # refused before the disk tier was created


@pytest.mark.parametrize(("key", "value"), [
    ("remote_segment_mb", 0.0625), ("remote_segment_mb", 512.0),
    ("write_queue_chunks", 65536), ("prefetch_timeout_base_ms", 60_000.0),
    ("prefetch_timeout_per_token_ms", 10.0), ("prefetch_wait_complete_max_ms", 600_000.0),
    ("blocking_timeout_secs", 3600.0), ("remote_timeout_secs", 600.0),
    ("tenant_max_fraction", 1.0), ("tenant_max_fraction", 0.01),
])
def test_values_at_their_bound_load(key: str, value: float) -> None:
    assert getattr(Config(**{key: value}), key) == value  # type: ignore[arg-type]


def test_ceiling_from_the_environment_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"KVTIER_WRITE_QUEUE_CHUNKS: write_queue_chunks: "
                       r"must be in 1\.\.65536, got 100000"):
        load_config(env={"KVTIER_WRITE_QUEUE_CHUNKS": "100000"})


# ---- 2: `~` in path keys ------------------------------------------------------------------

@pytest.mark.parametrize("given", ["~/kvcache", "file://~/kvcache", " ~/kvcache "])
def test_tilde_in_local_disk_is_the_home_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str,
) -> None:
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    cfg = load_config(_file(tmp_path, f"local_disk: '{given}'\nmax_local_disk_size: 0.01\n"),
                      env={})
    assert cfg.local_disk_path == home / "kvcache"
    alloc = MemoryAllocator(int(cfg.max_local_cpu_size * 1e9) // 1000)
    DiskBackend(BackendContext(config=cfg, layout=SMALL_MHA, allocator=alloc)).close()
    assert (home / "kvcache").is_dir()
    assert list(work.iterdir()) == []  # no directory literally named "~"
    assert Config(local_disk=given, max_local_disk_size=1).local_disk_path == home / "kvcache"


@pytest.mark.parametrize("given", ["~kvtier-no-such-user-20/kv", "~/kv"])
def test_tilde_that_cannot_be_expanded_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str,
) -> None:
    monkeypatch.setenv("HOME", "")  # "~/kv" would become "/kv"
    monkeypatch.chdir(tmp_path)
    path = _file(tmp_path, f"local_disk: '{given}'\nmax_local_disk_size: 1\n")
    with pytest.raises(ConfigError, match=f"{path}: local_disk: cannot expand '~' in "
                       f"'{given}'.*absolute path"):
        load_config(path, env={})
    assert list(tmp_path.iterdir()) == [path]


# ---- 3: disk space: check-config reports it, the launch refuses --------------------------------

def test_disk_cap_larger_than_the_filesystem(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    disk = tmp_path / "not" / "yet" / "disk"
    path = _file(tmp_path, f"local_disk: {disk}\nmax_local_disk_size: 1000000\n")
    cfg = load_config(path, env={})  # the file may be meant for a host with a larger disk
    assert main(["check-config", str(path)]) == 1  # reported, not an error in the file
    out, err = capsys.readouterr()
    assert "problem: on this host, max_local_disk_size: 1e+06 GB is more than" in err
    assert "max_local_disk_size" in yaml.safe_load(out)["launch_problems"][0]
    with pytest.raises(ConfigError) as info:  # what the launch calls
        check_host(cfg)
    msg = str(info.value)
    assert msg.startswith("max_local_disk_size: 1e+06 GB") and "at most" in msg
    assert f"filesystem of {tmp_path}" in msg  # the nearest existing parent
    assert not (tmp_path / "not").exists()


def test_disk_cap_counts_what_is_already_stored(tmp_path: Path) -> None:
    disk = tmp_path / "disk"
    st = os.statvfs(tmp_path)
    free_gb = st.f_bavail * st.f_frsize / 1e9
    assert disk_problem(Config(local_disk=str(disk), max_local_disk_size=0.001)) is None
    cfg = Config(local_disk=str(disk), max_local_disk_size=free_gb + 20)  # 20 GB past free
    assert disk_problem(cfg) is not None
    (disk / "sub").mkdir(parents=True)
    with open(disk / "sub" / "record", "wb") as f:  # sparse: 40 GB held, no blocks used
        f.truncate(40 * 10**9)
    assert disk_problem(cfg) is None


# ---- 4: memory of every TP rank, and the cgroup limit --------------------------------------

def test_cgroup_memory_limit_reads_the_given_file(tmp_path: Path) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    assert cgroup_memory_limit(limit) is None
    limit.write_text("1000000000\n")
    assert cgroup_memory_limit(limit) == 10**9
    assert cgroup_memory_limit(tmp_path / "missing") is None
    own = cgroup_memory_limit()  # this process's cgroup, whatever this host has
    assert own is None or own > 0


def test_arenas_of_every_rank_must_fit_the_cgroup(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("3000000000\n")  # 2 x (0.6 GB + 1 GB kept free) does not fit
    cfg = Config(max_local_cpu_size=0.6)
    assert memory_problem(cfg, local_ranks=1, cgroup_path=limit) is None
    problem = memory_problem(cfg, local_ranks=2, cgroup_path=limit)
    assert problem is not None
    assert problem.startswith("max_local_cpu_size: 0.6 GB x 2 local rank(s) = 1.20 GB")
    assert "1.00 GB kept free beside each" in problem
    assert "cgroup memory limit (memory.max) of 3.00 GB: at most 0.50 GB per rank" in problem
    with pytest.raises(ConfigError, match=r"max_local_cpu_size: 0\.6 GB x 2"):
        check_host(cfg, local_ranks=2, cgroup_path=limit)
    limit.write_text("max\n")
    assert memory_problem(cfg, local_ranks=2, cgroup_path=limit) is None


def test_the_arenas_of_every_rank_leave_headroom_beside_them(tmp_path: Path) -> None:
    """Issue 36, item 7: arenas that filled the cgroup to the byte passed; each rank's process
    needs MEMORY_HEADROOM_BYTES beside its arena (as `arena_now_problem` keeps)."""
    limit = tmp_path / "memory.max"
    cfg = Config(max_local_cpu_size=0.5)
    for ranks in (1, 2, 4):
        fits = int(ranks * (0.5e9 + MEMORY_HEADROOM_BYTES))
        limit.write_text(f"{fits}\n")
        assert memory_problem(cfg, local_ranks=ranks, cgroup_path=limit) is None
        limit.write_text(f"{fits - 1}\n")
        problem = memory_problem(cfg, local_ranks=ranks, cgroup_path=limit)
        assert problem is not None and f"x {ranks} local rank(s)" in problem
        limit.write_text(f"{int(ranks * 0.5e9)}\n")  # the arenas alone: no room left
        problem = memory_problem(cfg, local_ranks=ranks, cgroup_path=limit)
        assert problem is not None and "at most 0.00 GB per rank" in problem


def test_arenas_of_every_rank_must_fit_physical_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    limit = tmp_path / "memory.max"
    limit.write_text("max\n")
    per_rank = round(physical_memory_bytes() * 0.4 / 1e9, 3)  # one fits, three do not
    path = _file(tmp_path, f"max_local_cpu_size: {per_rank}\n")
    cfg = load_config(path, env={})
    assert host_problems(cfg, cgroup_path=limit) == []
    problems = host_problems(cfg, local_ranks=3, cgroup_path=limit)
    assert len(problems) == 1 and "x 3 local rank(s)" in problems[0]
    assert "physical memory" in problems[0]
    with pytest.raises(ValueError, match="local_ranks"):
        memory_problem(cfg, local_ranks=0)
    # check-config reports it (its host may not be the serving host) and exits 1
    assert main(["check-config", "--tp-size", "64", str(path)]) == 1
    assert "x 64 local rank(s)" in capsys.readouterr().err
    assert main(["check-config", "--tp-size", "0", str(path)]) == 2


# ---- 6: an explicit file and the environment -----------------------------------------------

def test_lmcache_variables_do_not_override_an_explicit_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = _file(tmp_path, "chunk_size: 64\n")
    env = {"LMCACHE_CHUNK_SIZE": "128", "LMCACHE_MAX_LOCAL_CPU_SIZE": "1"}
    for explicit, kw in ((path, {}), (None, {"KVTIER_CONFIG_FILE": str(path)})):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="kvtier.config"):
            cfg = load_config(explicit, env={**env, **kw})
        assert (cfg.chunk_size, cfg.max_local_cpu_size) == (64, 5.0)
        lines = [r.getMessage() for r in caplog.records if "LMCACHE_" in r.getMessage()]
        assert len(lines) == 1
        assert "LMCACHE_CHUNK_SIZE" in lines[0] and "LMCACHE_MAX_LOCAL_CPU_SIZE" in lines[0]
    # found through LMCACHE_CONFIG_FILE: an LMCache setup, where they apply
    cfg = load_config(env={**env, "LMCACHE_CONFIG_FILE": str(path)})
    assert (cfg.chunk_size, cfg.max_local_cpu_size) == (128, 1.0)


def test_kvtier_variable_overriding_the_file_warns_once_per_key(
    tmp_path: Path, caplog: pytest.LogCaptureFixture,
) -> None:
    path = _file(tmp_path, "chunk_size: 64\nhash_salt: file-salt-123\nwrite_queue_chunks: 8\n")
    env = {"KVTIER_CHUNK_SIZE": "32", "KVTIER_HASH_SALT": "env-salt-456",
           "KVTIER_WRITE_QUEUE_CHUNKS": "8"}  # the same value: nothing to warn about
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        cfg = load_config(path, env=env)
    assert (cfg.chunk_size, cfg.hash_salt) == (32, "env-salt-456")
    lines = [r.getMessage() for r in caplog.records if "overrides" in r.getMessage()]
    assert len(lines) == 2
    assert f"KVTIER_CHUNK_SIZE=32 overrides chunk_size: 64 from {path}" in lines[0]
    assert f"KVTIER_HASH_SALT='***' overrides hash_salt: '***' from {path}" in lines[1]
    assert "salt-" not in caplog.text


def test_check_config_shows_each_keys_origin(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    path = _file(tmp_path, "chunk_size: 64\nsave_unfull_chunk: true\n")
    for name in [n for n in os.environ if n.startswith(("KVTIER_", "LMCACHE_"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("LMCACHE_CONFIG_FILE", str(path))
    monkeypatch.setenv("LMCACHE_CHUNK_SIZE", "128")
    monkeypatch.setenv("KVTIER_REMOTE_TTL_SECS", "60")
    assert main(["check-config"]) == 0
    origins = yaml.safe_load(capsys.readouterr().out)["origins"]
    assert origins["chunk_size"] == "LMCACHE_CHUNK_SIZE"
    assert origins["remote_ttl_secs"] == "KVTIER_REMOTE_TTL_SECS"
    assert origins["save_unfull_chunk"] == "file" and origins["metrics_port"] == "default"
    assert set(origins) == set(Config().redacted())
    report = load_config_report(path, env={"LMCACHE_CHUNK_SIZE": "128"})
    assert dict(report.origins)["chunk_size"] == "file"  # explicit: LMCACHE_* left out


# ---- 7: unknown KVTIER_* variables ---------------------------------------------------------

def test_unknown_kvtier_variable_warns_with_the_nearest_key(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {"KVTIER_CHUNKSIZE": "64", "KVTIER_TEST_REDIS": "redis://h:1",
           "KVTIER_CACHE_DIR": "/tmp/x", "KVTIER_BACKGROUND_NICE": "0", "KVTIER_KERNEL": "torch",
           "KVTIER_BUILD_EXT": "1", "KVTIER_BUILD_VERBOSE": "1", "KVTIER_SGLANG_CPU_SHIMS": "0",
           # what a launcher sets for its workers, which load the config too
           "KVTIER_STOP_DIR": "/tmp/stop", "KVTIER_CPU_PREFIX_ATTENTION_HOOK": "1"}
    with caplog.at_level(logging.WARNING, logger="kvtier.config"):
        assert load_config(env=env) == Config()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # the known non-config variables are silent
    assert "KVTIER_CHUNKSIZE" in lines[0]
    assert "did you mean KVTIER_CHUNK_SIZE (chunk_size)?" in lines[0]
    assert "KVTIER_TEST_REDIS" in lines[1] and "redis://" not in lines[1]


# ---- the arena against the memory available when it is allocated ---------------------------

def test_an_arena_must_fit_the_memory_available_now_with_headroom() -> None:
    cfg = Config(max_local_cpu_size=2.0)
    room = int(2e9) + MEMORY_HEADROOM_BYTES
    assert arena_now_problem(cfg, available=room) is None
    problem = arena_now_problem(cfg, available=room - 1)
    assert problem is not None
    assert problem.startswith("max_local_cpu_size: 2 GB does not fit the memory available "
                              f"now: {(room - 1) / 1e9:.2f} GB available")
    assert f"at most {(room - 1 - MEMORY_HEADROOM_BYTES) / 1e9:.2f} GB" in problem
    assert "--max-total-tokens" in problem


def test_available_memory_is_at_most_memavailable(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       8000 kB\nMemAvailable:    2048 kB\n")
    got = available_memory_bytes(meminfo)
    assert got is not None and got <= 2048 * 1024  # a cgroup limit may lower it further
    real = available_memory_bytes()
    assert real is not None and 0 < real <= physical_memory_bytes()

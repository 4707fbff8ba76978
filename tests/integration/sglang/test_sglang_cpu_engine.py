"""`kvtier.integration.sglang.launch.cpu` without SGLang: what the plugin sets for
`--device cpu`, and that a real `sgl_kernel` is never shadowed by the stand-in (the launch itself:
tests/integration/sglang/test_sglang_quickstart.py)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvtier.integration.sglang.launch.cpu import (
    BIND_ENV,
    SHIM_DIR,
    prepare_cpu_engine,
    shims_needed,
    thread_binds,
)


@pytest.fixture
def fresh_import(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """`sgl_kernel` resolved anew from the test's sys.path, restored afterwards."""
    monkeypatch.delitem(sys.modules, "sgl_kernel", raising=False)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield


@pytest.mark.usefixtures("fresh_import")
def test_the_stand_in_is_needed_unless_a_real_sgl_kernel_is_installed(tmp_path: Path) -> None:
    sys.path.insert(0, str(SHIM_DIR))  # the stand-in on the path is not a real one
    assert shims_needed()
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("")
    sys.path.insert(0, str(tmp_path))
    assert not shims_needed()
    env = {"PYTHONPATH": "/elsewhere"}
    assert prepare_cpu_engine(env) == ["SGLANG_USE_CPU_ENGINE=1"]
    assert env == {"PYTHONPATH": "/elsewhere", "SGLANG_USE_CPU_ENGINE": "1"}


@pytest.mark.usefixtures("fresh_import")
def test_prepare_sets_the_engine_and_the_stand_in_leaving_what_the_user_set() -> None:
    sys.path[:] = [p for p in sys.path if not (Path(p) / "sgl_kernel").exists()]
    env = {"SGLANG_USE_CPU_ENGINE": "0", "PYTHONPATH": "/elsewhere"}
    done = prepare_cpu_engine(env)
    assert env["SGLANG_USE_CPU_ENGINE"] == "0"  # the user's choice stands
    assert env["PYTHONPATH"] == os.pathsep.join((str(SHIM_DIR), "/elsewhere"))
    assert len(done) == 1 and "stand-in" in done[0]
    assert str(SHIM_DIR) in sys.path


def test_huge_pages_asks_pytorch_for_huge_page_allocations_unless_the_user_chose() -> None:
    env: dict[str, str] = {}
    assert "THP_MEM_ALLOC_ENABLE=1" in prepare_cpu_engine(env, huge_pages=True)
    assert env["THP_MEM_ALLOC_ENABLE"] == "1"
    env = {"THP_MEM_ALLOC_ENABLE": "0"}
    assert not any("THP" in c for c in prepare_cpu_engine(env, huge_pages=True))
    assert env["THP_MEM_ALLOC_ENABLE"] == "0"
    env = {}
    prepare_cpu_engine(env, huge_pages=False)
    assert "THP_MEM_ALLOC_ENABLE" not in env


def test_each_tp_rank_gets_its_share_of_the_cores_unless_the_user_chose() -> None:
    assert thread_binds(2, [0, 1]) == "0|1"
    assert thread_binds(2, [0, 1, 2, 3, 4]) == "0,1|2,3"
    assert thread_binds(4, [6, 7]) == "6|7|7|7"  # fewer cores than ranks: they share the last
    assert thread_binds(1, [0, 1, 2]) == "0,1,2"
    with pytest.raises(ValueError, match="ranks must be >= 1, got 0"):
        thread_binds(0, [0])
    env: dict[str, str] = {}
    done = prepare_cpu_engine(env, ranks=2)
    assert env[BIND_ENV] == thread_binds(2) and any(BIND_ENV in d for d in done)
    prepare_cpu_engine(env, ranks=1)  # TP 1 leaves what is there
    assert env[BIND_ENV] == thread_binds(2)
    chosen = {BIND_ENV: "3|5"}
    prepare_cpu_engine(chosen, ranks=2)
    assert chosen[BIND_ENV] == "3|5"

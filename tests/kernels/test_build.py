"""Where and when the copy kernel is built: never by a copy, in a directory per build recipe."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kvtier.kernels import build

REPO = Path(__file__).resolve().parents[2]

COPY_WITHOUT_PREPARE = textwrap.dedent("""
    import threading
    import torch
    from kvtier.kernels import build, ops

    layers = [torch.randn(10, 4) for _ in range(3)]
    out = torch.empty(3, 2, 4)
    worker = threading.Thread(target=ops.gather, args=(layers, torch.tensor([7, 2]), out),
                              name="kvtier-sglang-store")
    worker.start()
    worker.join()
    assert all(torch.equal(out[i], layers[i][[7, 2]]) for i in range(3))
    print("builds", len(build.builds()), "kernel", ops.kernel_name())
""")


def test_a_copy_never_compiles_the_kernel(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "empty")}
    out = subprocess.run([sys.executable, "-c", COPY_WITHOUT_PREPARE], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["builds", "0", "kernel", "torch"]
    assert "copies never compile it" in out.stderr
    assert not (tmp_path / "empty").exists()  # not even a build directory was made


def test_the_build_directory_names_the_whole_recipe(monkeypatch: pytest.MonkeyPatch,
                                                     tmp_path: Path) -> None:
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    base = build.build_dir()
    assert base.parent == tmp_path / "ext"
    assert build.build_dir() == base  # stable
    monkeypatch.setattr(build, "CXX_FLAGS", (*build.CXX_FLAGS, "-DX"))
    flagged = build.build_dir()
    monkeypatch.undo()
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    compiler = build.build_dir()
    assert len({base, flagged, compiler}) == 3


def test_a_built_kernel_loads_without_compiling(tmp_path: Path) -> None:
    # The session's own cache holds a build (the ops tests compile it if needed).
    assert build.load() is not None
    assert build.load(compile=False) is not None
    assert [b for b in build.builds() if not b.thread.startswith("MainThread")] == []


def test_every_python_of_one_environment_uses_one_build(tmp_path: Path) -> None:
    # `make setup` builds with .venv/bin/python; the `kvtier` script and servers run python3.
    names = [Path(sys.executable)]
    for name in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        alias = Path(sys.prefix) / "bin" / name
        if alias.exists():
            names.append(alias)
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path)}
    dirs = {subprocess.run([str(exe), "-c", "from kvtier.kernels import build; "
                            "print(build.build_dir())"], env=env, cwd=REPO, capture_output=True,
                           text=True, timeout=120, check=True).stdout.strip() for exe in names}
    assert len(names) >= 2 and len(dirs) == 1, dirs

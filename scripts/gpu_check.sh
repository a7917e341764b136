#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# The GPU checks (issue 27) on a machine with a CUDA GPU, torch, Triton and nvcc, and no vLLM:
# every kernel test natively (Triton compiled, the CUDA extension built for the visible GPU,
# recall's tier with pinned memory and CUDA events), then the kernel benchmark at Llama-3.1-8B
# shapes (python -m vllm_kvevict.bench.kernels) for KeyDiff, SnapKV and recall scores with the
# Triton kernels and KeyDiff with the CUDA ones. Everything lands in $1 (default gpu-results):
# env.txt, tests.log, bench.log and bench_<kernels>_<score>.json; bench PNGs are redrawn from the JSON
# (python -c "from vllm_kvevict.bench import kernels as k, json; k.plot(json.load(open(F)), 'out.png')").
#
#   bash scripts/gpu_check.sh OUT [TEST_SECONDS] [BENCH_SECONDS]
#
# BENCHES (default "triton:keydiff cuda:keydiff triton:snapkv triton:recall": KVEVICT_KERNELS:score
# pairs) and BENCH_ARGS (more arguments, e.g. "--ops --contexts 2048,32768": later ones win) choose
# the benchmark runs.
# Needs pytest, pytest-timeout and pydantic beside torch/Triton (the pydantic wheels can travel
# with the tree: see docs/kernels.md, "On a GPU"). Each step has its own deadline and a failing
# step does not stop the next; the exit status is the tests'.
set -u
OUT=${1:-gpu-results}
TEST_S=${2:-200}
BENCH_S=${3:-60}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KVEVICT_CACHE_DIR=${KVEVICT_CACHE_DIR:-/tmp/kvevict-cache}
{
    date -u
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv
    "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, torch.cuda.get_device_name())"
    nvcc --version | tail -2
} >"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# The emulated build (CPU, g++) and the wheel test are CI's, not the GPU's.
timeout "$TEST_S" "$PY" -m pytest -q -rfE -p no:cacheprovider --timeout "$TEST_S" \
    tests/test_kernels_batched.py tests/test_kernels_policy.py tests/test_csrc.py tests/test_recall.py \
    tests/test_evict_step.py tests/test_bench_kernels.py -k "not emulated and not wheel" \
    >"$OUT/tests.log" 2>&1
rc=$?
tail -40 "$OUT/tests.log"

bench() { # kernels score
    # shellcheck disable=SC2086 # BENCH_ARGS: several arguments
    KVEVICT_KERNELS=$1 timeout "$BENCH_S" "$PY" -m vllm_kvevict.bench.kernels --score "$2" --reps 5 \
        --requests 1,8,64 --contexts 2048,8192,32768 ${BENCH_ARGS:-} --out "/tmp/bench_$1_$2" >"/tmp/bench_$1_$2.log" 2>&1
    echo "bench $1 $2: rc $?" | tee -a "$OUT/bench.log"
    cat "/tmp/bench_$1_$2.log" | tee -a "$OUT/bench.log"
    cp "/tmp/bench_$1_$2/kernels.json" "$OUT/bench_$1_$2.json" 2>/dev/null
}
for b in ${BENCHES:-triton:keydiff cuda:keydiff triton:snapkv triton:recall}; do
    bench "${b%%:*}" "${b##*:}"
done
exit $rc

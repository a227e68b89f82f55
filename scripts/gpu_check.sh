#!/usr/bin/env bash
# The one device script: CUDA tests, then the GPU path's figures, on a lent CUDA machine (its image has torch,
# triton and transformers; the wheels fulcrum needs beyond those travel in .whl/, see the device README), in under
# 8 minutes. Run from the repository root; results land in $OUT (default /tmp/fulcrum-gpu), to be copied under
# benchmarks/results/. Fill .whl/ here first:
#   scripts/gpu_check.sh --fetch-wheels
set -uo pipefail
WHEELS="gguf msgspec pyzmq xgrammar apache-tvm-ffi fastapi starlette uvicorn pydantic pydantic-core annotated-types
typing-inspection typing-extensions opentelemetry-api"
if [ "${1:-}" = "--fetch-wheels" ]; then  # here, beside the project's .venv: the versions it runs with
  mkdir -p .whl
  for name in $WHEELS; do
    pin=$(.venv/bin/pip freeze 2>/dev/null | grep -i "^${name//-/[-_]}==" || echo "$name")
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 -d .whl "$pin"
  done
  exit 0
fi
OUT=${OUT:-/tmp/fulcrum-gpu}
mkdir -p "$OUT"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD PYTHONUNBUFFERED=1
{
  nvidia-smi -L
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__)"
} 2>&1 | tee "$OUT/gpu.txt"
# each stage has its own limit (about 8 minutes in all); what it printed is in $OUT either way
# 1. the Triton kernels natively against their references; graphs against eager; greedy tokens equal HF's on CUDA
#    (every family, alone and batched, chunked, prefix hits, preemption) through the kernels and graphs
timeout 90 python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/triton tests/engine/test_cuda_graphs.py \
  2>&1 | tail -25 | tee "$OUT/pytest_cuda.log"
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/engine/test_llm_parity.py tests/engine/test_async_scheduling.py \
  -k cuda 2>&1 | tail -25 | tee -a "$OUT/pytest_cuda.log"
# 2. each kernel against the PyTorch it replaces, as a share of the copy bandwidth
timeout 90 python3 benchmarks/bench_triton_kernels.py --budget-s 70 --out "$OUT/bench_triton_kernels.json" 2>&1 \
  | tee "$OUT/bench_triton_kernels.log"
# 3. the engine: batch-1 decode (async loop, graphs, eager kernels, the PyTorch path) against the roofline,
#    64 requests against HF's static batch, nano-vllm's shape
timeout 240 python3 benchmarks/bench_gpu.py --out "$OUT/bench_gpu.json" ${BENCH_FLAGS:-} 2>&1 \
  | grep -v -e Warning -e "it/s" | tee "$OUT/bench_gpu.log"

#!/usr/bin/env bash
# The CUDA checks, for a lent GPU machine (its image has torch, transformers, pytest).
# Run from the repository root; results land in $OUT (default /tmp/fulcrum-gpu).
set -uo pipefail
OUT=${OUT:-/tmp/fulcrum-gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
# 1. parity on CUDA: greedy tokens equal HF's (every family, alone and batched), float32
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/engine/test_llm_parity.py tests/models/test_parity.py \
  -k "cuda or float32" 2>&1 | tail -15 | tee "$OUT/pytest_cuda.log"
# 2. throughput against HF on the 0.5B-shape model and the bundled model, bf16
timeout 300 python3 benchmarks/bench_throughput.py --model qwen05 --device cuda --out "$OUT/throughput_qwen05.json" \
  2>&1 | grep -v -e Warning -e "it/s" | tee "$OUT/throughput_qwen05.log"
timeout 100 python3 benchmarks/bench_prefix_cache.py --model qwen05 --device cuda --out "$OUT/prefix.json" \
  2>&1 | grep -v -e Warning -e "it/s" | tee "$OUT/prefix.log"
# 3. serving levers through fulcrum bench (needs aiohttp, rich, matplotlib, fastapi, uvicorn, pyzmq, msgspec)
if python3 -c "import aiohttp, rich, matplotlib, fastapi, uvicorn, zmq, msgspec" 2>/dev/null; then
  timeout 240 python3 benchmarks/bench_serve_levers.py --model qwen05 --device cuda --dtype bfloat16 \
    --only sweep,prefix --sweep-prompts 128 --results "$OUT/serve" 2>&1 | tail -20 | tee "$OUT/serve.log"
fi

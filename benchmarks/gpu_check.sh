#!/usr/bin/env bash
# The checks of one session on a GPU machine, in one go (about 12 minutes on an H100):
#   1. the CUDA tests (tests/test_cuda.py: parity, AdamW on the device against torch.optim bit for
#      bit, fs.cuda_graph against the eager step bit for bit, a compiled step and an fs.jit step
#      captured against them uncaptured, the refusals, 8 fake ranks);
#   2. python -m benchmarks.gpu at one rank (NCCL), every variant (fs.jit's among them);
#   3. the same at 8 fake ranks on the GPU (the variants without torch.compile).
# Logs and result JSONs go to OUT (at most 7 files). Run from the repository root:
#   benchmarks/gpu_check.sh OUT [--configs 36M,271M]       # on the GPU machine
#   benchmarks/gpu_check.sh /tmp/check --device cpu --quick  # the same steps on CPU, tiny
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [benchmarks.gpu options]}
shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
configs=(--configs 36M,271M)
for a in "$@"; do [[ $a == --quick || $a == --configs ]] && configs=(); done
fake_variants="plain torch,plain torch, CUDA graph,FSDP2,funcshard,funcshard, CUDA graph"

{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv 2>&1 || true
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
  timeout 300 $py -m pytest -q -rfEsP -p no:cacheprovider tests/test_cuda.py
  echo "tests rc=$?"
} 2>&1 | tee "$out/tests.log"

timeout 420 $py -m benchmarks.gpu "${configs[@]}" --out "$out" "$@" 2>&1 \
  | grep -v "^USDT" | tee "$out/bench.log"
echo "bench rc=${PIPESTATUS[0]}" | tee -a "$out/bench.log"

timeout 120 $py -m benchmarks.gpu "${configs[@]}" --fake-world 8 --variants "$fake_variants" \
  --out "$out" "$@" 2>&1 | grep -v "^USDT" | tee "$out/bench_fake8.log"
echo "bench fake8 rc=${PIPESTATUS[0]}" | tee -a "$out/bench_fake8.log"

grep -h "tests rc\|passed\|failed\|Targets:\|rc=" "$out"/*.log

#!/usr/bin/env bash
# One GPU session's checks in one go, most important first, within BUDGET seconds (default 570:
# the device tool's 10-minute call; the machine's start-up comes on top). Each part has its own
# timeout and writes its JSON into OUT as it goes, so a run cut short keeps what finished:
#   0. the carried wheels (.whl/: optree, cloudpickle, tqdm) installed where missing (~5 s); and,
#      in the background, fs.explain's prediction of the 8B step (CPU work, ~30 s):
#      gpu8b-predict-<device>.json;
#   1. Llama-3.1-8B, one rank of 8 fake ranks (python -m benchmarks.gpu_8b, <= 290 s):
#      gpu8b-<device>.json, rewritten after each variant's first steps and each set. Per set:
#      the 8B model on meta, materialized into shards once (~5 s; each variant copies them), each
#      variant's build and first step (eager ~2.5 s; inductor's compile of a block ~30 s, of
#      fs.jit's step: a block's pieces, ~30-60 s; a CUDA graph's 2 warm-up calls and capture), one
#      profiled step, then 2 alternating timed steps each (~2.2 s a step). About 185 s for
#      "full AC", 55 s for "selective AC", 105 s for "compiled": the last may be cut short;
#   2. explain's check (python -m benchmarks.gpu_8b_explain --check, <= 60 s: part 1's
#      funcshard row against explain, h100 and measured rates): gpu8b-check-<device>.json;
#   3. what the 36M/271M runs left open (python -m benchmarks.gpu, <= 80 + 55 s): graphs,
#      their memory, AdamW alone and the fs.jit step (compiled, and captured) at one rank, then
#      calls and launches at 8 fake ranks:
#      gpu-<device>-<config>[-fake8].json;
#   4. the main job (python -m benchmarks.main_job, <= 75 s): examples/train_llama.py in each
#      mode (eager, --cuda-graph, --recompute, --compile, eager again), main_job-<device>.json;
#   5. tests/test_cuda.py with what is left of BUDGET, if a minute or more.
# Logs go to OUT too. Run from the repository root:
#   benchmarks/gpu_check.sh OUT                       # on the GPU machine
#   benchmarks/gpu_check.sh OUT --device cpu --quick  # the same steps on the CPU, tiny
# (tests/test_benchmarks.py runs the second)
set -uo pipefail
out=${1:?usage: benchmarks/gpu_check.sh OUT [--device cpu] [--quick]}
shift
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET:-570}
quick=() dev=(--device cuda)
for a in "$@"; do
  case $a in
    --quick) quick=(--quick) ;;
    --device) ;;
    cpu | cuda) dev=(--device "$a") ;;
    *) echo "gpu_check.sh: unknown option $a (known: --device cpu|cuda, --quick)" >&2; exit 2 ;;
  esac
done
opts=("${dev[@]}" "${quick[@]}")
slow=1  # --quick: the CPU rehearsal, on a shared machine: the timeouts 4 times longer
((${#quick[@]})) && slow=4
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
log() { grep --line-buffered -v "^USDT" | tee "$out/$1.log"; }
step() { echo "$1 rc=$2 at ${SECONDS}s" | tee -a "$out/summary.log"; }

# 0. what the device machine lacks: the carried wheels, where their modules do not import
site=${FUNCSHARD_SITE:-/tmp/funcshard-site}
missing=()
for m in optree cloudpickle tqdm; do $py -c "import $m" 2>/dev/null || missing+=(".whl/$m-"*.whl); done
if ((${#missing[@]})); then
  $py -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
    "${missing[@]}" || echo "gpu_check.sh: installing ${missing[*]} failed" >&2
fi
export PYTHONPATH="$PWD:$PWD/tests:$site${PYTHONPATH:+:$PYTHONPATH}"
{
  date -u
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,power.limit \
    --format=csv 2>&1 || true
  $py -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} 2>&1 | log machine
timeout $((240 * slow)) $py -m benchmarks.gpu_8b_explain --predict --out "$out" "${opts[@]}" \
  >"$out/predict.log" 2>&1 &
predict=$!

# 1. the 8B rows
timeout $((290 * slow)) $py -m benchmarks.gpu_8b --out "$out" "${opts[@]}" 2>&1 | log gpu_8b
step "1. gpu_8b" "${PIPESTATUS[0]}"
wait $predict
step "0. gpu_8b_explain --predict" $?

# 2. explain's check
timeout $((60 * slow)) $py -m benchmarks.gpu_8b_explain --check --out "$out" "${opts[@]}" 2>&1 | log check
step "2. gpu_8b_explain --check" "${PIPESTATUS[0]}"

# 3. what the 36M and 271M runs left open
if ((${#quick[@]})); then one=() ranks=(); else
  one=(--configs 36M) ranks=(--configs 36M,271M)
fi
timeout $((80 * slow)) $py -m benchmarks.gpu "${one[@]}" --out "$out" "${opts[@]}" \
  --variants "plain torch,plain torch, CUDA graph,funcshard,funcshard, CUDA graph,funcshard, fs.jit,funcshard, fs.jit, CUDA graph" \
  2>&1 | log gpu
step "3. gpu, one rank" "${PIPESTATUS[0]}"
timeout $((55 * slow)) $py -m benchmarks.gpu "${ranks[@]}" --fake-world 8 --out "$out" "${opts[@]}" \
  --variants "FSDP2,funcshard,funcshard, CUDA graph" 2>&1 | log gpu_fake8
step "3. gpu, 8 fake ranks" "${PIPESTATUS[0]}"

# 4. the main job
timeout $((75 * slow)) $py -m benchmarks.main_job --out "$out" "${opts[@]}" 2>&1 | log main_job
step "4. main_job" "${PIPESTATUS[0]}"

# 5. the CUDA tests, with the time left
left=$((budget - SECONDS))
if ((left >= 60)) && [[ ${dev[1]} == cuda ]]; then
  timeout "$left" $py -m pytest -q -rfEs -p no:cacheprovider tests/test_cuda.py 2>&1 | log tests
  step "5. tests/test_cuda.py" "${PIPESTATUS[0]}"
else
  step "5. tests/test_cuda.py skipped (${left}s left, ${dev[1]})" 0
fi
grep -h "Targets:\|rc=\|passed\|failed" "$out"/*.log

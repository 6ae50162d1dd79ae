#!/usr/bin/env bash
# The GPU checks as prepared runs, each sized for one borrowed GPU: a budget of 300 s of
# work on one H100/H200-class GPU, so that one 15-minute loan (a minute or two of it to
# start the machine) holds the run and a second try of it: call it with timeout_s=350
# (120 + 2 x 350 = 820 s of the 900) while the machine is still warm. A loan gives a
# machine back after 30 s idle, and reading the first call's output takes longer: a
# second call then starts a fresh machine (another 60-120 s), leaving about 310 s; make
# it GPU_SH_BUDGET=260 with timeout_s=300 (CUDA review 7's N-L5). From the repository:
#
#   bash bench/gpu.sh                 # the slot profile, the goal figures first:
#     1. imports: which of the project's packages this Python has (and which wheels to
#        carry where some are missing), the torch/CUDA/GPU figures;
#     2. the goal figures: train.py end to end on CIFAR-sized synthetic data, resnet9 at
#        32 px on the device path, resnet18 bf16 against --amp none;
#     3. tests: tests/test_cuda.py (the CUDA reviews' cases among them) and the CUDA
#        cases of tests/pipeline/test_device_data.py, tests/reporting/test_profiling.py,
#        tests/pipeline/test_recipes.py and tests/tasks/test_seg_parts.py (pytest -x).
#   GPU_SH_RATES=1 bash bench/gpu.sh  # the rates profile (a loan of its own, or the
#     second call of the first loan when the slot profile passed): imports, then each
#     task's step rate: segmentation (a unet on the synthetic shapes), the entries of
#     STEP_RATES (a GAN's bench/gan.py, ...), then resnet9 on the DataLoader path.
#     (torch.compile, photos at 224 px and train.py against PyTorch Lightning are not goal
#     figures: the full profile runs them.)
#   GPU_SH_FULL=1 bash bench/gpu.sh   # both, compile, then every bench's GPU figures
#                                     # (about 30 minutes: not for one borrowed slot)
#   GPU_SH_SMOKE=1 bash bench/gpu.sh  # the same script on the CPU, smallest settings
#                                     # (tests/test_bench.py runs it: it cannot rot)
#
# Every figure is one line "figure: KEY VALUE [what it is]". The whole log goes to
# $OUT/gpu-sh.log and the figures to $OUT/gpu-figures.json (rewritten after every check,
# so a run cut short keeps what it measured); without $OUT, to runs/gpu-sh/. Each check
# runs under its own `timeout`, cut at the smaller of its limit and what is left of the
# budget (GPU_SH_BUDGET seconds of work, 300 in the slot and rates profiles; a check that
# would start with under GPU_SH_MIN_LEFT seconds left, 20 by default, is SKIPPED). A check
# that fails or is cut prints "FAILED: ...", the rest still runs, and the script exits 1.
# GPU_SH_RATES and GPU_SH_FULL choose the other profiles.
#
# Settings (environment): PYTHON (the interpreter, default python3; used for everything),
# GPU_SH_BUDGET, GPU_SH_MIN_LEFT, GPU_SH_SKIP (names of checks to leave out, e.g. "tests
# photos"; a check's name is what its "==" line says), and the limits in seconds
# GPU_SH_T_IMPORTS, GPU_SH_T_TESTS (the whole pytest command), GPU_SH_T_TEST (one test,
# where pytest-timeout is installed), GPU_SH_T_TRAIN (each train.py run),
# GPU_SH_T_STEP_RATE, GPU_SH_T_PHOTOS, GPU_SH_T_LIGHTNING, GPU_SH_T_COMPILE, GPU_SH_T_BENCH
# (each bench of the full profile).
set -uo pipefail
if [ -n "${OUT:-}" ]; then  # (before the cd: a relative $OUT is the caller's)
  mkdir -p "$OUT" && out=$(cd "$OUT" && pwd) || { echo "error: cannot write to $OUT"; exit 1; }
fi
cd "$(dirname "$0")/.." || exit 1
out=${out:-$PWD/runs/gpu-sh}
mkdir -p "$out" || exit 1
PY=${PYTHON:-python3}
export CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONUNBUFFERED=1  # --deterministic's cuBLAS; logs

if [ "${GPU_SH_SMOKE:-0}" = 1 ]; then
  profile=smoke device=cpu samples=64 batch=16 epochs=2 image=8 workers=0 budget=900
  net9=mlp net18=simple_cnn photos=2 photo_size=64 photo_batch=2 seg_samples=32
  lightning_args="--network mlp --image-size 8 --batch-size 16 --steps 4 --epochs 1"
  limit=300  # a loaded 2-core CPU
else
  # 100 full batches an epoch (no partial last batch to autotune or compile for); the
  # figures are the last epoch's, after cuDNN's autotuning and compiling in the first
  profile=slot device=cuda samples=51200 batch=512 epochs=2 image=32 workers=8 budget=300
  net9=resnet9 net18=resnet18 photos=256 photo_size=224 photo_batch=64 seg_samples=8192
  lightning_args="--network resnet9 --image-size 32 --batch-size 512 --steps 100 --epochs 3"
  limit=
  [ "${GPU_SH_RATES:-0}" = 1 ] && profile=rates
  [ "${GPU_SH_FULL:-0}" = 1 ] && profile=full budget=3000
fi
budget=${GPU_SH_BUDGET:-$budget} min_left=${GPU_SH_MIN_LEFT:-20}
T_IMPORTS=${GPU_SH_T_IMPORTS:-${limit:-90}}
T_TESTS=${GPU_SH_T_TESTS:-${limit:-240}}
T_TEST=${GPU_SH_T_TEST:-${limit:-150}}
T_TRAIN=${GPU_SH_T_TRAIN:-${limit:-75}}
T_STEP_RATE=${GPU_SH_T_STEP_RATE:-${limit:-75}}
T_PHOTOS=${GPU_SH_T_PHOTOS:-${limit:-100}}
T_LIGHTNING=${GPU_SH_T_LIGHTNING:-${limit:-100}}
T_COMPILE=${GPU_SH_T_COMPILE:-${limit:-180}}
T_BENCH=${GPU_SH_T_BENCH:-${limit:-600}}
for v in budget min_left T_IMPORTS T_TESTS T_TEST T_TRAIN T_STEP_RATE T_PHOTOS T_LIGHTNING \
    T_COMPILE T_BENCH; do
  [[ ${!v} =~ ^[0-9]+$ ]] ||
    { echo "error: GPU_SH_${v^^}: a number of seconds, not '${!v}'"; exit 1; }
done
command -v "$PY" > /dev/null || { echo "error: no interpreter '$PY': set PYTHON"; exit 1; }

# Step rates of other kinds of training, one "name: command" entry each; the command
# prints its own "figure:" lines and runs under GPU_SH_T_STEP_RATE. Segmentation runs
# through train_run below (a unet on the synthetic shapes, device path, bf16); a GAN:
# bench/gan.py, train.py's DCGAN steps/s against the PyTorch example's loop (and FID).
# bench/diffusion.py: train.py's DDPM steps/s against the diffusers example's loop.
# bench/pix2pix.py: train.py's pix2pix steps/s against the reference's two-optimizer loop.
# bench/detection.py: train.py's detector samples/s and mAP against torchvision's
# detection reference loop (the same synthetic boxes, detector, batch and epochs).
if [ "$profile" = smoke ]; then
  gan_args="--samples 64 --steps 8 --batch-size 16 --width 8 --fid-samples 16 \
--classifier-network mlp"
  diffusion_args="--samples 64 --steps 8 --batch-size 16 --width 8 --image-size 8 \
--fid-samples 8 --sample-steps 2 --repeats 1"
  pix2pix_args="--samples 32 --steps 4 --batch-size 8 --width 8 --repeats 1"
  detection_args="--samples 16 --size 64 --epochs 1 --batch-size 4"
else
  gan_args="--samples 16384 --steps 256 --batch-size 128 --fid-samples 1024 \
--classifier-network simple_cnn"
  diffusion_args="--samples 8192 --steps 256 --batch-size 128 --image-size 32 --width 64 \
--blocks 2 --fid-samples 512 --sample-steps 20 --repeats 1 --classifier-network simple_cnn"
  pix2pix_args="--samples 4096 --steps 512 --batch-size 32 --image-size 64 --width 64 \
--repeats 1"
  detection_args="--samples 2048 --size 320 --epochs 2 --batch-size 32 --amp bf16 \
--network fasterrcnn_mobilenet_v3_large_320_fpn --lr 0.04"
fi
STEP_RATES=("gan:$PY bench/gan.py --device $device $gan_args --classifier-epochs 1 \
--workers $workers"
            "diffusion:$PY bench/diffusion.py --device $device $diffusion_args \
--classifier-epochs 1"
            "pix2pix:$PY bench/pix2pix.py --device $device $pix2pix_args --workers $workers"
            "detection:$PY bench/detection.py --device $device $detection_args \
--workers $workers")

log=$out/gpu-sh.log json=$out/gpu-figures.json
work=$(mktemp -d) || exit 1
figs=$work/figures.txt failed=$work/failed.txt skipped=$work/skipped.txt
touch "$figs" "$failed" "$skipped"
start=$SECONDS

fail() { echo "FAILED: $*"; echo "$*" >> "$failed"; }
skipping() { echo "SKIPPED: $*"; echo "$*" >> "$skipped"; }
skip=" ${GPU_SH_SKIP:-} " && skip=${skip//,/ }
wanted() { [[ "$skip" != *" $1 "* ]]; }

# check NAME LIMIT COMMAND...: runs COMMAND under `timeout`, at most LIMIT seconds and no
# longer than the budget's rest; keeps its "figure:" lines; returns its exit status.
check() {
  local name=$1 cap=$2 rc t0=$SECONDS
  shift 2
  : > "$work/check.log"
  local left=$(( budget - (SECONDS - start) ))
  if (( left < min_left )); then skipping "$name (the ${budget} s budget is spent)"; return 1; fi
  (( cap > left )) && cap=$left
  echo "== $name (limit ${cap} s): $*"
  timeout -k 10 "$cap" "$@" 2>&1 | tee "$work/check.log"
  rc=${PIPESTATUS[0]}
  grep '^figure: ' "$work/check.log" >> "$figs"
  if (( rc == 124 || rc == 137 )); then
    fail "$name: cut by its time limit of ${cap} s"
  elif (( rc != 0 )); then
    fail "$name (exit status $rc)"
  fi
  echo "elapsed: $name $((SECONDS - t0)) s; $((SECONDS - start)) s since the start"
  write_json running
  return "$rc"
}

# figure KEY VALUE [TEXT...]: prints one figure line and keeps it.
figure() { echo "figure: $*" | tee -a "$figs"; }

# ratio KEY_A KEY_B: A's value over B's, from the figures so far (empty when one is absent).
ratio() {
  awk -v a="$1" -v b="$2" '$2 == a {x = $3} $2 == b {y = $3}
    END {if (x != "" && y > 0) printf "%.2f", x / y}' "$figs"
}

# write_json STATUS [goals]: the figures so far as JSON (atomically); "goals" also prints
# how each goal stands.
write_json() {
  "$PY" - "$figs" "$failed" "$skipped" "$json" "$profile" "$1" "$((SECONDS - start))" \
    "${2:-}" <<'EOF' || echo "warning: could not write $json"
import json, os, sys
figs, failed, skipped, path, profile, status, elapsed, goals = sys.argv[1:]
figures = {}
for line in open(figs):
    key, _, rest = line[len("figure: "):].strip().partition(" ")
    value, _, text = rest.partition(" ")
    try:
        value = float(value)
    except ValueError:
        value, text = rest, ""
    figures[key] = {"value": value, "text": text}
GOALS = [("resnet9.device.bf16.samples_per_s", 130_000), ("resnet9.device.bf16."
         "compute_efficiency", 0.95), ("resnet18.bf16_over_fp32", 2.5)]
report = {}
for key, least in GOALS:
    value = figures.get(key, {}).get("value")
    met = value >= least if isinstance(value, float) else None
    report[key] = {"at_least": least, "value": value, "met": met}
    if goals:
        state = "not measured" if met is None else ("met" if met else "NOT met")
        print(f"goal: {key} >= {least:,}: {value if met is not None else '-'} ({state})")
result = {"profile": profile, "status": status, "elapsed_s": int(elapsed),
          "failed": open(failed).read().splitlines(),
          "skipped": open(skipped).read().splitlines(),
          "figures": figures, "goals": report}
with open(path + ".tmp", "w") as f:
    json.dump(result, f, indent=1)
os.replace(path + ".tmp", path)
EOF
}

# train_run NAME NETWORK PATH AMP [FLAGS...]: train.py end to end, its last epoch's figures
# as KEY = NETWORK.PATH_NAME.AMP[.compiled].*
train_run() {
  local name=$1 network=$2 path=$3 amp=$4
  shift 4
  wanted "$name" || { skipping "$name (GPU_SH_SKIP)"; return; }
  local dir=$work/$name limit=$T_TRAIN
  [[ " $* " == *" --compile "* ]] && limit=$T_COMPILE
  check "$name" "$limit" "$PY" train.py --dataset synthetic --synthetic-size "$samples" \
    --image-size "$image" --network "$network" --epochs "$epochs" --eval-every "$epochs" \
    --batch-size "$batch" --lr 0.2 --amp "$amp" --channels-last --num-workers "$workers" \
    --device "$device" --data-on-device "$path" "$@" --run-dir "$dir" || return
  local where=device && [ "$path" = off ] && where=loader
  local key=$network.$where.$amp && [[ " $* " == *" --compile "* ]] && key=$key.compiled
  "$PY" - "$dir/metrics.jsonl" "${key//\//_}" "$*" <<'EOF' | tee -a "$figs" ||
import json, sys
path, key, flags = sys.argv[1:]
r = [json.loads(line) for line in open(path)][-1]
what = f"(train.py, epoch {r['epoch']}{', ' + flags if flags else ''})"
print(f"figure: {key}.samples_per_s {r['samples_per_sec']:.0f} {what}")
print(f"figure: {key}.compute_efficiency {r['compute_efficiency']:.3f}")
if "tflops" in r:
    print(f"figure: {key}.tflops {r['tflops']:.2f}")
if "mfu" in r:
    print(f"figure: {key}.mfu {r['mfu']:.3f}")
print(f"figure: {key}.epoch_50k_s {50_000 / r['samples_per_sec']:.2f} "
      f"(a 50,000-sample epoch, seconds)")
EOF
    fail "$name: reading $dir/metrics.jsonl"
}

part() { echo; echo "=== $1 ($((SECONDS - start)) s since the start)"; }

main() {
  echo "bench/gpu.sh: profile $profile, device $device, budget ${budget} s, $PY, log $log"
  write_json running

  part "1. imports"
  if [ "$device" = cuda ] && wanted imports; then
    check nvidia-smi 30 nvidia-smi --query-gpu=name,memory.total,driver_version \
      --format=csv,noheader
  fi
  if wanted imports && ! check imports "$T_IMPORTS" "$PY" - "$device" \
      "$work/detection-missing.txt" <<'EOF'; then
import importlib, importlib.metadata, platform, sys
device, detection_missing = sys.argv[1:]
print(f"figure: env.python {platform.python_version()} ({sys.executable})")
need = ["torch", "torchvision", "numpy", "PIL", "yaml", "tqdm", "tensorboard", "pytest"]
wheels = {"prefetch_generator": "prefetch_generator (--prefetch > 0)",
          "torchinfo": "torchinfo (the network summary; without it a warning)"}
extra = {"pytest_timeout": "a per-test limit", "lightning": "bench/lightning.py",
         "mlflow": "--mlflow, which nothing here uses"}
detection = {"torchmetrics": "every validation's figures",
             "pycocotools": "detection's mAP (torchmetrics' MeanAveragePrecision backend)"}
missing = []
for name in need + list(wheels) + list(extra) + list(detection):
    try:
        importlib.import_module(name)
    except Exception as e:  # noqa: BLE001 - reported, the script decides
        print(f"import {name}: {type(e).__name__}: {e}")
        missing.append(name)
gone = [n for n in need if n in missing]
if gone:
    print(f"error: {', '.join(gone)} cannot be imported: nothing else can run")
    sys.exit(1)
import torch
print(f"figure: env.torch {torch.__version__} (CUDA {torch.version.cuda})")
carry = [wheels[n] for n in wheels if n in missing]
if carry:
    print(f"figure: env.missing_wheels {' '.join(n for n in wheels if n in missing)}")
    print(f"note: carry the wheels of {'; '.join(carry)}: README.md, 'On a borrowed GPU'")
for name in extra:
    print(f"{name}: {'installed' if name not in missing else 'missing'}: {extra[name]}")
lacking = [n for n in detection if n in missing]
with open(detection_missing, "w") as f:  # (the detection step rate is then not started)
    f.write(", ".join(f"{n} ({detection[n]})" for n in lacking))
if lacking:
    print(f"figure: env.missing_for_detection {' '.join(lacking)}")
if device == "cuda":
    if not torch.cuda.is_available():
        print("error: torch sees no CUDA device")
        sys.exit(1)
    props = torch.cuda.get_device_properties(0)
    print(f"figure: env.gpu {props.name}, {props.total_memory / 2**30:.0f} GiB, "
          f"capability {props.major}.{props.minor}, {torch.cuda.device_count()} device(s)")
EOF
    echo "gpu.sh: the imports failed: nothing else can run"
    return 1
  fi

  if [ -s "$work/detection-missing.txt" ] && [ "$profile" != slot ] && wanted detection; then
    fail "detection: $(cat "$work/detection-missing.txt") cannot be imported: its step" \
      "rate is not run (carry the wheel: README.md, 'On a borrowed GPU')"
    skip="$skip detection "
  fi
  [ "$profile" = rates ] || slot_checks
  [ "$profile" = slot ] || rate_checks
  [ "$profile" = slot ] && echo "note: each task's step rate: GPU_SH_RATES=1 (a second" \
    "call or loan); photos, Lightning and compile are not goal figures: GPU_SH_FULL=1"
  [ "$profile" = full ] || [ "$profile" = smoke ] || return 0
  more_checks
}

# slot_checks: the goal figures, then the CUDA tests.
slot_checks() {
  part "2. the goal figures"
  train_run resnet9-device "$net9" on bf16
  train_run resnet18-bf16 "$net18" on bf16
  train_run resnet18-fp32 "$net18" on none
  local r
  r=$(ratio "$net18.device.bf16.samples_per_s" "$net18.device.none.samples_per_s")
  [ -n "$r" ] && figure "$net18.bf16_over_fp32" "$r" "(samples/s, --amp bf16 over none)"

  part "3. tests"
  if wanted tests; then
    local per_test=()
    "$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout "$T_TEST")
    # -o addopts=: in this process, without the suite's two workers (pyproject.toml): the
    # borrowed GPU's image has no pytest-xdist, and a few CUDA cases need no second process.
    check tests "$T_TESTS" "$PY" -m pytest -q -x -p no:cacheprovider -o addopts= \
      "${per_test[@]}" \
      tests/test_cuda.py tests/pipeline/test_device_data.py tests/reporting/test_profiling.py \
      tests/pipeline/test_recipes.py tests/tasks/test_seg_parts.py -k cuda
    local count what
    grep -E '^[= ]*[0-9]+ (passed|failed|skipped|errors?)' "$work/check.log" | tail -n 1 \
      | grep -oE '[0-9]+ (passed|failed|skipped|errors?)' > "$work/tests.txt"
    while read -r count what; do
      figure "tests.$what" "$count" "(pytest)"
    done < "$work/tests.txt"
  else
    skipping "tests (GPU_SH_SKIP)"
  fi
}

# rate_checks: each task's step rate, then the DataLoader path.
rate_checks() {
  part "4. each task's step rate"
  train_run segmentation unet on bf16 --task segmentation --num-classes 5 \
    --synthetic-size "$seg_samples"
  local entry
  for entry in "${STEP_RATES[@]}"; do
    if wanted "${entry%%:*}"; then
      check "${entry%%:*}" "$T_STEP_RATE" bash -c "${entry#*:}"
    fi
  done
  train_run resnet9-loader "$net9" off bf16
}

# more_checks: compile, photos and Lightning; with GPU_SH_FULL=1 every bench's figures.
more_checks() {
  local r
  part "5. compile, photos and Lightning"
  if [ "$profile" = smoke ]; then  # inductor compiles C++ for minutes on a CPU
    skipping "compile (the smoke profile: torch.compile on a CPU takes minutes)"
  else
    train_run compile "$net9" on bf16 --compile
    r=$(ratio "$net9.device.bf16.compiled.samples_per_s" "$net9.device.bf16.samples_per_s")
    [ -n "$r" ] && figure "$net9.compiled_over_eager" "$r" "(samples/s, device path, bf16)"
  fi
  if wanted photos; then
    check photos "$T_PHOTOS" "$PY" bench/photos.py --device "$device" --sizes 1mp \
      --images "$photos" --image-size "$photo_size" --batch-size "$photo_batch" \
      --workers "$workers" --finetune-steps 0 --repeats 1 --dir "$work"
    local rate
    rate=$(awk '/later epoch, device path/ {print $(NF-1)}' "$work/check.log")
    [ -n "$rate" ] && figure "photos.$photo_size.device.images_per_s" "$rate" \
      "(bench/photos.py: $photos JPEGs of 1 MP, later epochs, crops of $photo_size px)"
    rate=$(sed -n 's/^ResNet-50 training step.*: \([0-9.]*\) samples\/s.*/\1/p' \
      "$work/check.log")
    [ -n "$rate" ] && figure photos.resnet50_step.samples_per_s "$rate" "(bf16, 224 px)"
  else
    skipping "photos (GPU_SH_SKIP)"
  fi
  if wanted lightning; then
    check lightning "$T_LIGHTNING" "$PY" bench/lightning.py --device "$device" \
      $lightning_args
  else
    skipping "lightning (GPU_SH_SKIP)"
  fi

  if [ "$profile" = full ]; then
    part "6. every bench's GPU figures (GPU_SH_FULL=1)"
    local b name
    for b in "bench/precision.py --device cuda --steps 20 --repeats 2" \
        "bench/checkpoint.py --device cuda --repeats 3" \
        "bench/overhead.py --device cuda --network resnet18 --repeats 3 --steps 100" \
        "bench/prefetch.py --device cuda --workers 0,4 --steps 100 --repeats 3" \
        "bench/data.py --device cuda --workers 0,4 --samples 50000 --repeats 2" \
        "bench/train_paths.py --device cuda --workers 8 --repeats 2" \
        "bench/recipes.py --device cuda --repeats 3" \
        "bench/export.py --networks simple_cnn,resnet18 --steps 12" \
        "bench/photos.py --device cuda --workers 8 --finetune-steps 20" \
        "bench/segmentation.py --device cuda --amp bf16 --workers 8 --samples 2048" \
        "bench/gan.py --device cuda --samples 16384 --steps 1000 --fid-samples 2048"; do
      name=${b%%.py *} && name=${name#bench/}
      # shellcheck disable=SC2086  # the arguments are words
      wanted "$name" && check "$name" "$T_BENCH" "$PY" $b
    done
    if [ -d data/cifar-10-batches-py ]; then  # the fast recipe, where a copy is present
      check cifar10_fast "$T_BENCH" "$PY" train.py --config configs/cifar10_fast.yaml \
        --data-dir data --run-dir "$work/fast" && "$PY" -c "import json, sys
r = [json.loads(line) for line in open(sys.argv[1])][-1]
print(f'figure: cifar10_fast.val_acc {r[\"val_acc\"]:.4f}')" "$work/fast/metrics.jsonl" \
        | tee -a "$figs"
    fi
  fi
}

main 2>&1 | tee "$log"
rc=${PIPESTATUS[0]} status=0
[ -s "$failed" ] && status=1
(( rc != 0 )) && status=1 && [ ! -s "$failed" ] && fail "gpu.sh itself (exit status $rc)" \
  | tee -a "$log"
{
  echo
  echo "=== the figures ($((SECONDS - start)) s in all; $log, $json)"
  cat "$figs"
  write_json "$([ "$status" = 0 ] && echo passed || echo failed)" goals
  sed 's/^/FAILED: /' "$failed"
  sed 's/^/SKIPPED: /' "$skipped"
  if [ "$status" = 0 ]; then echo "gpu.sh: every check passed"
  else echo "gpu.sh: some checks FAILED"; fi
} 2>&1 | tee -a "$log"
rm -rf "$work"
exit "$status"

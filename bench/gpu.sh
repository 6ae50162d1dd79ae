#!/usr/bin/env bash
# Every GPU check in one command, for a machine with one (or more) NVIDIA GPU, in under
# ten minutes on one H100/H200-class GPU; run it from the repository root:
#
#   bash bench/gpu.sh | tee gpu-figures.txt
#
# 1. the CUDA tests (tests/test_cuda.py and the CUDA cases of tests/test_device_data.py);
# 2. the benchmarks' GPU figures: precision and memory (bench/precision.py), checkpoint
#    cost (bench/checkpoint.py), the loop's overhead (bench/overhead.py), prefetching
#    (bench/prefetch.py), the data path alone (bench/data.py) and in train.py on an image
#    folder (bench/train_paths.py), what each recipe costs a step (bench/recipes.py),
#    export on this machine's CPU (bench/export.py), photos (bench/photos.py), segmentation
#    against torchvision's reference loop (bench/segmentation.py);
# 3. train.py end to end on CIFAR-shaped data: resnet18 and resnet9, each data path,
#    eager and compiled, as "figure:" lines (samples/s, compute efficiency, MFU, the time
#    of a 50,000-sample epoch);
# 4. the fast recipe on real CIFAR-10, when a copy is in ./data (nothing is downloaded).
#
# Every figure is one line. A check that fails prints "FAILED: <what>" and the script
# goes on; it exits 1 at the end if any failed. GPU_SH_SMOKE=1 runs the same script with
# the smallest settings on the CPU (tests/test_bench.py does, so the script cannot rot).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
fail() { echo "FAILED: $*"; status=1; }
check() { "$@" || fail "$*"; }

if [ "${GPU_SH_SMOKE:-0}" = 1 ]; then
  device=cpu samples=64 batch=16 steps=4 repeats=1 workers=0 epochs=2 image=8
else
  device=cuda samples=25000 batch=512 steps=100 repeats=3 workers=8 epochs=2 image=32
  check nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
python -c "import torch; print('figure: torch', torch.__version__, 'cuda', torch.version.cuda,
      'devices', torch.cuda.device_count())" || fail "torch"

# 1. The CUDA tests.
if [ "$device" = cuda ]; then
  check python -m pytest -q -p no:cacheprovider tests/test_cuda.py
  check python -m pytest -q -p no:cacheprovider tests/test_device_data.py -k cuda
fi

# 2. The benchmarks (each prints its own table, one figure a line).
if [ "$device" = cuda ]; then
  check python bench/precision.py --device cuda --steps 20 --repeats 2
  check python bench/checkpoint.py --device cuda --repeats 3
  check python bench/overhead.py --device cuda --network resnet18 --repeats 3 --steps 100
  check python bench/prefetch.py --device cuda --workers 0,4 --steps 100 --repeats 3
  check python bench/data.py --device cuda --workers 0,4 --samples 50000 --repeats 2
  check python bench/train_paths.py --device cuda --workers 8 --repeats 2
  check python bench/recipes.py --device cuda --repeats 3
  check python bench/export.py --networks simple_cnn,resnet18 --steps 12
  check python bench/photos.py --device cuda --workers 8 --finetune-steps 20
  check python bench/segmentation.py --device cuda --network torchvision/lraspp_mobilenet_v3_large \
    --samples 1024 --size 256 --crop-size 224 --batch-size 32 --workers 8 --epochs 2 --amp bf16
else
  check python bench/data.py --samples 256 --batch-size 64 --workers 0 --repeats 1
fi

# 3. train.py end to end: one line per network, data path and compile setting.
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
runs="resnet18:off: resnet18:on: resnet9:off: resnet9:on: resnet9:on:--compile"
[ "$device" = cpu ] && runs="simple_cnn:off: simple_cnn:on:"
for run in $runs; do
  IFS=: read -r network path compile <<< "$run"
  dir="$work/$network-$path${compile:+-compiled}"
  amp=bf16 && [ "$device" = cpu ] && amp=none
  if python train.py --dataset synthetic --synthetic-size "$samples" --image-size "$image" \
      --network "$network" --epochs "$epochs" --eval-every "$epochs" --batch-size "$batch" \
      --lr 0.2 --amp "$amp" --channels-last --num-workers "$workers" --device "$device" \
      --data-on-device "$path" $compile --run-dir "$dir" > "$dir.log" 2>&1; then
    python - "$dir/metrics.jsonl" "$network" "$path" "${compile:-eager}" <<'EOF' ||
import json, sys
path, network, data_path, compile_ = sys.argv[1:]
r = [json.loads(line) for line in open(path)][-1]
per_epoch = 50_000 / r["samples_per_sec"]
mfu = f", MFU {r['mfu']:.1%}" if "mfu" in r else ""
print(f"figure: train.py {network:<10} {compile_:<9} --data-on-device {data_path:<3}: "
      f"{r['samples_per_sec']:8.0f} samples/s, efficiency {r['compute_efficiency']:.2f}"
      f"{mfu}, a 50,000-sample epoch {per_epoch:.1f} s")
EOF
      fail "reading $dir/metrics.jsonl"
  else
    fail "train.py $network --data-on-device $path $compile"; tail -n 5 "$dir.log"
  fi
done

# 4. The fast recipe on real CIFAR-10 (only where a copy is present).
if [ "$device" = cuda ] && [ -d data/cifar-10-batches-py ]; then
  start=$(date +%s)
  if python train.py --config configs/cifar10_fast.yaml --data-dir data \
      --run-dir "$work/fast" > "$work/fast.log" 2>&1; then
    python -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][-1]; \
print(f'figure: cifar10_fast val_acc {r[\"val_acc\"]:.4f} in {sys.argv[2]} s')" \
      "$work/fast/metrics.jsonl" "$(( $(date +%s) - start ))" || fail "cifar10_fast figures"
  else
    fail "cifar10_fast"; tail -n 5 "$work/fast.log"
  fi
fi
[ "$status" = 0 ] && echo "gpu.sh: every check passed" || echo "gpu.sh: some checks FAILED"
exit "$status"

#!/usr/bin/env bash
# The GPU checks, in one go, for a machine with an NVIDIA GPU (run from the repo root):
#   bash bench/gpu.sh > gpu-figures.txt 2>&1
# CUDA tests first (tests/test_cuda.py and the CUDA cases of the other files), then the
# benchmarks whose GPU figures README.md and bench/README.md still lack.
set -uo pipefail
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
python -m pytest -q tests/test_cuda.py tests/test_distributed.py -k "cuda or gpu or Cuda"
python bench/precision.py --device cuda
python bench/checkpoint.py --device cuda
python bench/overhead.py --device cuda --network resnet18 --repeats 5
python bench/prefetch.py --device cuda --workers 0,4 --steps 100
python bench/distributed.py
# The data path: per-sample DataLoader (workers) against the device path (bench/data.py),
# then samples/s and compute efficiency of resnet18 and resnet9 training on CIFAR-shaped
# synthetic data (50,000 32x32 images, batch 512, bf16, channels_last) with each path.
python -m pytest -q tests/test_device_data.py -k cuda
python bench/data.py --device cuda --workers 0,4,8 --samples 50000
python bench/data.py --device cuda --workers 8 --samples 50000 --channels-last --repeats 2
work=$(mktemp -d)
for network in resnet18 resnet9; do
  for compile in "" "--compile"; do
    for path in off on; do
      run="$work/$network-$path${compile:+-compiled}"
      python train.py --dataset synthetic --synthetic-size 50000 --image-size 32 \
        --network "$network" --epochs 2 --eval-every 2 --batch-size 512 --lr 0.2 \
        --amp bf16 --channels-last --num-workers 8 --data-on-device "$path" $compile \
        --run-dir "$run" > "$run.log" 2>&1 || { echo "failed: $network $path $compile"; tail -5 "$run.log"; }
      grep -m1 "data path:" "$run.log"
      python -c "import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][-1]; \
print(f'{sys.argv[2]:<9} {sys.argv[4] or \"eager\":<9} --data-on-device {sys.argv[3]:<4} epoch 2: \
{r[\"samples_per_sec\"]:8.0f} samples/s, efficiency {r[\"compute_efficiency\"]:.2f}, \
50,000-sample epoch {r[\"epoch_time\"]:.1f} s (data {r[\"data_time\"]:.2f} s, compute \
{r[\"compute_time\"]:.2f} s)')" "$run/metrics.jsonl" "$network" "$path" "$compile"
    done
  done
done
# The fast recipe on real CIFAR-10, when a copy is in ./data (nothing is downloaded).
if [ -d data/cifar-10-batches-py ]; then
  start=$(date +%s)
  python train.py --config configs/cifar10_fast.yaml --data-dir data \
    --run-dir "$work/fast" > "$work/fast.log" 2>&1
  echo "cifar10_fast: $(tail -1 "$work/fast/metrics.jsonl") in $(( $(date +%s) - start )) s"
fi
rm -rf "$work"

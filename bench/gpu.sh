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

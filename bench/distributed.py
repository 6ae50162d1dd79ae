"""Scaling of train.py over processes (torchrun, DDP) and GPUs (DataParallel).

    python bench/distributed.py                       # 1 vs 2 CPU processes, gloo
    python bench/distributed.py --procs 4 --threads 2 --repeats 5
    python bench/distributed.py --size 8192 --batch 256   # more work per step

Each configuration is a real ``python train.py`` or ``torchrun --standalone
--nproc_per_node P train.py`` on the synthetic 32x32 set (simple_cnn, no augmentation,
no workers, no per-step logging), with the same global batch: one process of --batch
against P processes of --batch / P. Each process gets --threads CPU threads
(OMP_NUM_THREADS), so P processes use P times the cores of one: scaling efficiency =
samples/s of P processes / (P x samples/s of one). The figure is train.py's own
``samples_per_sec`` of the last epoch (the first one warms up), median over --repeats.

On a machine with two or more CUDA devices it also compares one GPU with
``--gpus 0,1`` (nn.DataParallel in one process) and with torchrun over two GPUs (nccl),
same global batch. This prints figures; it asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--network", default="simple_cnn", help="a networks.py name")
    p.add_argument("--procs", type=int, default=2, help="processes of the DDP run")
    p.add_argument("--threads", type=int, default=1, help="CPU threads per process")
    p.add_argument("--batch", type=int, default=128, help="global batch (samples per step)")
    p.add_argument("--size", type=int, default=4096, help="synthetic training samples")
    p.add_argument("--epochs", type=int, default=2, help="epochs per run (the last is timed)")
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    return p.parse_args(argv)


def train_args(args, run_dir, batch):
    return ["--dataset", "synthetic", "--network", args.network, "--synthetic-size",
            str(args.size), "--batch-size", str(batch), "--epochs", str(args.epochs),
            "--no-augment", "--num-workers", "0", "--log-every", "1000000",
            "--warmup-epochs", "0", "--keep-last", "0", "--run-dir", run_dir]


def run(args, launcher, batch, extra=(), threads=None):
    """One train.py run; returns the last epoch's samples/s, or None (and prints why)."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = str(threads or args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = os.path.join(tmp, "run")
        cmd = [*launcher, "train.py", *train_args(args, run_dir, batch), *extra]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        path = os.path.join(run_dir, "metrics.jsonl")
        if proc.returncode != 0 or not os.path.exists(path):
            print(f"  failed ({proc.returncode}): {' '.join(cmd)}\n"
                  f"{(proc.stdout + proc.stderr)[-2000:]}")
            return None
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()][-1]["samples_per_sec"]


def median_rate(args, launcher, batch, extra=(), threads=None):
    rates = [run(args, launcher, batch, extra, threads) for _ in range(args.repeats)]
    rates = [r for r in rates if r is not None]
    if not rates:
        return None, ""
    spread = f" (min {min(rates):.0f}, max {max(rates):.0f})" if len(rates) > 1 else ""
    return statistics.median(rates), spread


def compare(args, title, one, many, factor):
    """Runs both configurations and prints their rates and the scaling efficiency."""
    print(title)
    base, base_spread = median_rate(args, *one[:-1])
    print(f"  {one[-1]:<34} {base or 0:9.0f} samples/s{base_spread}")
    rate, spread = median_rate(args, *many[:-1])
    print(f"  {many[-1]:<34} {rate or 0:9.0f} samples/s{spread}")
    if base and rate:
        print(f"  speed-up {rate / base:.2f}x, scaling efficiency {rate / (factor * base):.0%}")


def main(argv=None):
    args = parse_args(argv)
    if args.batch % args.procs:
        sys.exit(f"error: --batch {args.batch} must be divisible by --procs {args.procs}")
    python = [sys.executable]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc_per_node", str(args.procs)]
    print(f"{datetime.datetime.now().isoformat(timespec='seconds')}  {platform.node()}  "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}")
    print(f"{args.network}, synthetic {args.size} x 32x32, global batch {args.batch}, "
          f"{args.epochs} epochs (last timed), median of {args.repeats}; "
          f"{' '.join(sys.argv)}")
    if args.procs * args.threads > (os.cpu_count() or 1):
        print(f"  note: {args.procs} x {args.threads} threads exceed the {os.cpu_count()} "
              f"CPUs: the processes share cores and the efficiency reads low")
    cpu = ("--device", "cpu")
    compare(args, f"CPU, {args.threads} thread(s) per process, gloo",
            (python, args.batch, cpu, None, "1 process"),
            (torchrun, args.batch // args.procs, cpu, None,
             f"{args.procs} processes (torchrun)"), args.procs)

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus < 2:
        print(f"CUDA: {gpus} device(s) here; DataParallel and multi-GPU DDP need 2: skipped")
        return 0
    two = ["--nproc_per_node", "2"]
    compare(args, "CUDA, DataParallel (one process)",
            (python, args.batch, ("--device", "cuda:0"), 4, "1 GPU"),
            (python, args.batch, ("--gpus", "0,1"), 4, "--gpus 0,1 (DataParallel)"), 2)
    compare(args, "CUDA, DistributedDataParallel (nccl)",
            (python, args.batch, ("--device", "cuda:0"), 4, "1 GPU"),
            (torchrun[:-2] + two, args.batch // 2, ("--device", "cuda"), 4,
             "2 GPUs (torchrun)"), 2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

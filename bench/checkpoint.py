"""Checkpoint save and load time, file size, and their share of training time (issue 3).

    python bench/checkpoint.py                     # resnet18; CPU step timed at batch 16
    python bench/checkpoint.py --device cuda       # step timed at batch 128 on the GPU
    python bench/checkpoint.py --dir /scratch/x    # where your runs write checkpoints

The state is shaped like saving.Saver's for one process: model (unwrapped state_dict),
SGD state with its momentum buffers populated by real training steps, GradScaler, the
scheduler step, epoch/step/progress, RNG states from saving.rng_state(), and the
resolved config as a plain dict (train.py's defaults). A save is what Saver.save does at
an epoch end with --keep-last 2: build the state, checkpoint.save_checkpoint to last.pt
with a hard-linked epoch-NNNN.pt (temporary file, fsync, rename, directory fsync), then
checkpoint.rotate. A load is checkpoint.load_checkpoint (weights_only, to the CPU), then
restoring weights, optimizer and RNG as saving.restore does. Medians over --repeats. A
torch.save of the same state into memory is timed too: the part no faster disk removes.
Loads read a file just written, so it comes from the page cache (a warm resume).

Training time: the median of --steps timed steps of the same network and optimizer on
random images already on the device (no data loading, so the step is as short as it gets
and the shares below are upper bounds). On the CPU the step runs at a small batch and is
scaled linearly to --epoch-batch. Shares: save time / (steps between saves x step time),
for a save at every epoch of --epoch-samples (CIFAR-10: 50,000 / 128 = 391 steps) and
for --ckpt-every-steps N. The default --dir is a temporary directory under runs/ (where
runs write; /tmp may be memory, where fsync costs nothing); it is removed at the end.
This prints figures; it asserts nothing.
"""

import argparse
import contextlib
import datetime
import io
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

from common import ROOT, setup_device, sync, train_defaults  # noqa: I001

HERE = os.path.dirname(os.path.abspath(__file__))
# This file is named like the project's checkpoint module: import that one, not this.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

from losses import build_criterion  # noqa: E402
from machinery import checkpoint, saving  # noqa: E402
from networks import build_network  # noqa: E402

# train.py's defaults (the resolved config is saved in every checkpoint).
CONFIG = train_defaults()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--network", default="resnet18", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=0,
                   help="batch of the timed training step; 0: 128 on CUDA, 16 on CPU")
    p.add_argument("--steps", type=int, default=0, help="timed training steps (after "
                   "one warmup step); 0: 20 on CUDA, 5 on CPU")
    p.add_argument("--repeats", type=int, default=5, help="timed saves and loads")
    p.add_argument("--epoch-samples", type=int, default=50_000,
                   help="samples per epoch (CIFAR-10's training set)")
    p.add_argument("--epoch-batch", type=int, default=128,
                   help="batch size of the epoch the shares are computed for")
    p.add_argument("--every", default="100,1000",
                   help="comma-separated --ckpt-every-steps values to price")
    p.add_argument("--dir", default=None, help="where to write; default: a temporary "
                   "directory under runs/, removed at the end")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    args.batch_size = args.batch_size or (128 if cuda else 16)
    args.steps = args.steps or (20 if cuda else 5)
    args.every = [int(n) for n in args.every.split(",") if n.strip()]
    return args


def build_state(net, optimizer, scaler, progress):
    """The dict saving.Saver.save writes (one process)."""
    return saving.training_state(net, optimizer, scaler, dict(progress),
                                     [saving.rng_state()], CONFIG)


def tensor_mib(obj):
    """MiB of the tensors in a nested dict/list."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size() / 2**20
    if isinstance(obj, dict):
        return sum(tensor_mib(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_mib(v) for v in obj)
    return 0.0


def time_steps(net, optimizer, criterion, args, device):
    """Median seconds of one training step at --batch-size (random data on the device)."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch_size, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    net.train()
    times = []
    for i in range(args.steps + 1):  # the first is warmup; it also fills the momentum
        sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        criterion(net(x), y).backward()
        optimizer.step()
        sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times), min(times), max(times)


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    print(f"# checkpoint: {args.network}, SGD momentum, state shaped like saving.Saver's, "
          f"{args.repeats} saves and loads; training step at batch {args.batch_size}, "
          f"median of {args.steps}")
    print(f"# {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}", flush=True)

    torch.manual_seed(0)
    net = build_network(args.network, 10, 3, 32).to(device)
    optimizer = torch.optim.SGD([{"params": list(net.parameters()), "base_lr": 0.1}],
                                lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    criterion = build_criterion({"label_smoothing": 0.1})
    step_s, step_min, step_max = time_steps(net, optimizer, criterion, args, device)

    parent = args.dir or os.path.join(ROOT, "runs")
    made_parent = not os.path.isdir(parent)
    os.makedirs(parent, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-checkpoint-", dir=parent)
    ckpt_dir = os.path.join(work, "checkpoints")
    os.makedirs(ckpt_dir)
    steps_per_epoch = -(-args.epoch_samples // args.epoch_batch)
    progress = {"epoch": 0, "step": 0, "epoch_samples": 0, "loss_sum": 0.0,
                "loss_count": 0, "best": 0.5, "scaler_skips": 0}
    build_t, write_t, rotate_t, save_t, load_t, restore_t = [], [], [], [], [], []
    memory_t = []  # torch.save into memory: the part of a save that no disk can speed up
    snapshot_t = []  # build + CPU copy: all the training thread waits for (the rest is
    # written by checkpoint.BackgroundWriter while training goes on)
    try:
        for r in range(args.repeats):
            progress.update(epoch=r + 1, step=(r + 1) * steps_per_epoch)
            last = os.path.join(ckpt_dir, "last.pt")
            also = [os.path.join(ckpt_dir, f"epoch-{r + 1:04d}.pt")]
            sync(device)
            t0 = time.perf_counter()
            state = build_state(net, optimizer, scaler, progress)
            t1 = time.perf_counter()
            checkpoint.save_checkpoint(state, last, also=also)
            t2 = time.perf_counter()
            checkpoint.rotate(ckpt_dir, 2)
            t3 = time.perf_counter()
            build_t.append(t1 - t0)
            write_t.append(t2 - t1)
            rotate_t.append(t3 - t2)
            save_t.append(t3 - t0)
            t0 = time.perf_counter()
            torch.save(state, io.BytesIO())
            memory_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            snapshot = checkpoint.to_cpu(state)  # what train.py's training thread does
            sync(device)
            snapshot_t.append(build_t[-1] + time.perf_counter() - t0)
            del state, snapshot

            t0 = time.perf_counter()
            loaded = checkpoint.load_checkpoint(last)
            t1 = time.perf_counter()
            net.load_state_dict(checkpoint.unwrap_state_dict(loaded["model"]))
            optimizer.load_state_dict(loaded["optimizer"])
            saving.set_rng_state(loaded["rng"])
            sync(device)
            t2 = time.perf_counter()
            load_t.append(t1 - t0)
            restore_t.append(t2 - t0)
        size = os.path.getsize(last)
        model_mib, optim_mib = tensor_mib(loaded["model"]), tensor_mib(loaded["optimizer"])
        del loaded
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if made_parent:
            with contextlib.suppress(OSError):
                os.rmdir(parent)

    med = statistics.median
    params = sum(p.numel() for p in net.parameters())
    print()
    print(f"parameters {params:,}; file {size / 2**20:.1f} MiB (model tensors "
          f"{model_mib:.1f} MiB, optimizer {optim_mib:.1f} MiB), written under "
          f"{os.path.dirname(work)}")
    print(f"{'':<38}{'median s':>10}{'min':>9}{'max':>9}")
    for label, values in (("save: build the state", build_t),
                          ("save: save_checkpoint (fsync)", write_t),
                          ("save: rotate", rotate_t),
                          ("save, total", save_t),
                          ("(torch.save into memory, no disk)", memory_t),
                          ("training thread: state + CPU copy", snapshot_t),
                          ("load: load_checkpoint", load_t),
                          ("load + restore (weights, optim, rng)", restore_t)):
        print(f"{label:<38}{med(values):>10.3f}{min(values):>9.3f}{max(values):>9.3f}")
    save_s = med(save_t)

    scale = args.epoch_batch / args.batch_size
    step_128 = step_s * scale
    print()
    print(f"training step at batch {args.batch_size}: {step_s:.3f} s (min {step_min:.3f}, "
          f"max {step_max:.3f})" + (f"; scaled to batch {args.epoch_batch}: {step_128:.3f} s"
                                    if scale != 1 else ""))
    epoch_s = steps_per_epoch * step_128
    print(f"epoch of {args.epoch_samples:,} samples = {steps_per_epoch} steps of "
          f"{args.epoch_batch}: {epoch_s:.1f} s of training steps")
    snap_s = med(snapshot_t)
    print(f"{'checkpoint':<30}{'steps between':>14}{'whole save':>12}{'train.py waits':>16}")
    print(f"{'every epoch':<30}{steps_per_epoch:>14}{save_s / epoch_s:>12.3%}"
          f"{snap_s / epoch_s:>16.3%}")
    for n in args.every:
        label = f"--ckpt-every-steps {n}"
        print(f"{label:<30}{n:>14}{save_s / (n * step_128):>12.3%}"
              f"{snap_s / (n * step_128):>16.3%}")
    print("# train.py waits only for the state and its CPU copy; a thread writes the file")
    print(f"# every-epoch checkpointing stays under 1% of an epoch while the epoch runs "
          f"below {args.epoch_samples / (100 * snap_s):,.0f} samples/s (what train.py "
          f"waits for), or {args.epoch_samples / (100 * save_s):,.0f} samples/s if the "
          f"whole save blocked; load average after: "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print("# with --ckpt-every-steps N, train.py also saves at each epoch end: add the rows")


if __name__ == "__main__":
    main()

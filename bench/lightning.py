"""train.py's step rate against a minimal PyTorch Lightning loop, side by side.

    python bench/lightning.py --device cuda          # resnet9, batch 512, 32 px, bf16
    python bench/lightning.py --device cpu --network mlp --image-size 8 --batch-size 16 \\
        --steps 4 --epochs 1

Both loops train a copy of one seeded network on the same synthetic tensors, in the same
batches: train.py's device path (``--data-on-device on --no-augment``: the synthetic set
held on the device as uint8, each batch gathered and normalised there), so that no data
loading tells them apart:

* train.py: ``train.run_epoch`` over what ``train.build_training`` made from train.py's
  flags (as bench/overhead.py's engine rows): autocast, the step, the gradient norm, the
  loss counters, the CUDA-event timer, the log every --log-every steps.
* Lightning: a LightningModule whose ``training_step`` is the forward pass and train.py's
  criterion, with train.py's optimizer (``ops.build_optimizer``: SGD, fused on CUDA),
  fitted by ``Trainer(barebones=True)`` (no logger, checkpoint, progress bar or summary)
  at the same precision (``bf16-mixed`` or ``32-true``) on the same loader.

Each loop runs one warm-up epoch (cuDNN's autotuning, the allocator) then --epochs timed
epochs of --steps steps, each timed up to a device sync; samples/s is the median epoch.
Lightning is not one of this project's requirements (the GPU image this project borrows
has Lightning 2.6): where it cannot be imported, its row says "skipped: lightning is not
installed" and the script exits 0. Prints figures (one "figure:" line each at the end);
asserts nothing.
"""

import argparse
import contextlib
import copy
import importlib
import io
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
from common import setup_device, sync  # (puts the repository on the path)

import ops  # noqa: E402
import train  # noqa: E402
from machinery import hardware, runtime  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--network", default="resnet9", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=512, help="samples per step")
    p.add_argument("--image-size", type=int, default=32, help="side of the synthetic images")
    p.add_argument("--steps", type=int, default=100, help="steps per epoch")
    p.add_argument("--epochs", type=int, default=3, help="timed epochs of each loop (after "
                   "one warm-up epoch)")
    p.add_argument("--amp", default="auto", choices=["auto", "none", "bf16"],
                   help="auto: bf16 on CUDA, none on the CPU")
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True,
                   help="train.py's --channels-last, for both loops")
    p.add_argument("--log-every", type=int, default=50, help="train.py's --log-every")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.amp == "auto":
        args.amp = "bf16" if args.device.startswith("cuda") else "none"
    return args


def import_lightning():
    """``(module, None)``: lightning (or pytorch_lightning) imported; else ``(None, why)``.

    This file's own folder leaves the import path meanwhile: this script is called
    lightning.py too, and would be found in place of the package.
    """
    here = os.path.dirname(os.path.abspath(__file__))
    path = sys.path[:]
    sys.path[:] = [p for p in path if os.path.abspath(p or os.curdir) != here]
    errors = []
    try:
        for name in ("lightning.pytorch", "pytorch_lightning"):
            try:
                return importlib.import_module(name), None
            except ModuleNotFoundError as e:
                if e.name not in ("lightning", "pytorch_lightning"):  # it needs one missing
                    errors.append(f"{name}: {e}")
            except Exception as e:  # noqa: BLE001 - installed but broken: say how
                errors.append(f"{name}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
    finally:
        sys.path[:] = path
    return None, "; ".join(errors) or "lightning is not installed"


def train_flags(args, run_dir):
    """train.py's command line: the device path, no augmentation, --epochs + 1 epochs."""
    return ["--dataset", "synthetic", "--network", args.network, "--seed", "0",
            "--synthetic-size", str(args.steps * args.batch_size),
            "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
            "--epochs", str(args.epochs + 1), "--num-workers", "0", "--amp", args.amp,
            "--device", args.device, "--data-on-device", "on", "--no-augment",
            "--warmup-epochs", "0", "--log-every", str(args.log_every), "--run-dir", run_dir,
            *(["--channels-last"] if args.channels_last else [])]


def build(args, run_dir):
    """What train.py builds for the run: ``(training, loader, criterion)``."""
    config, _ = train.parse_config(train_flags(args, run_dir))
    train.check_config(config)
    procs = runtime.setup_processes(config)
    hardware.set_memory_options(config, procs.device)
    hardware.seed_everything(config["seed"], 0, False, procs.device)  # cuDNN benchmark too
    os.makedirs(os.path.join(run_dir, "checkpoints"))
    with contextlib.redirect_stdout(io.StringIO()):  # the summary and the set-up lines
        training, loader = train.build_training(config, procs, run_dir)
    return training, loader, training.task.criterion


def time_train_py(training, loader, criterion, epochs, device):
    """Seconds of each of ``epochs`` epochs of train.py's loop (after a warm-up epoch)."""
    stop = runtime.StopRequest()
    times = []
    try:
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):  # the bar
            for epoch in range(epochs + 1):
                training.state.epoch_samples = 0
                sync(device)
                start = time.perf_counter()
                train.run_epoch(training, loader, epoch, stop)
                sync(device)
                times.append(time.perf_counter() - start)
    finally:
        stop.restore()
    return times[1:]


def time_lightning(pl, net, config, loader, criterion, epochs, device):
    """Seconds of each of ``epochs`` epochs of ``Trainer.fit`` (after a warm-up epoch)."""

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return criterion(self.net(x), y)

        def configure_optimizers(self):
            return ops.build_optimizer(self.net, config, device)

    class EpochTimes(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_epoch_start(self, trainer, module):
            sync(device)
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            sync(device)
            self.times.append(time.perf_counter() - self.start)

    timer = EpochTimes()
    cuda = device.type == "cuda"
    trainer = pl.Trainer(
        accelerator="gpu" if cuda else "cpu", devices=[device.index or 0] if cuda else 1,
        precision="bf16-mixed" if config["amp"] == "bf16" else "32-true",
        max_epochs=epochs + 1, barebones=True, benchmark=cuda or None, callbacks=[timer])
    trainer.fit(Module(), train_dataloaders=loader)
    return timer.times[1:]


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    pl, why = import_lightning()
    version = getattr(pl, "__version__", None) if pl else None
    print(f"# lightning side by side: {args.network}, batch {args.batch_size}, "
          f"{args.image_size}x{args.image_size} synthetic on train.py's device path (no "
          f"augmentation), amp {args.amp}, channels_last {args.channels_last}; 1 warm-up + "
          f"{args.epochs} timed epochs of {args.steps} steps per loop")
    print(f"# {device} ({name}), torch {torch.__version__}, lightning {version or '-'}, "
          f"python {platform.python_version()}")
    print(f"# {' '.join(['python', *sys.argv])}", flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-lightning-") as work:
        training, loader, criterion = build(args, os.path.join(work, "run"))
        net = copy.deepcopy(training.net)  # the same initialisation for Lightning
        rates = {"train.py": time_train_py(training, loader, criterion, args.epochs, device)}
        training.run_log.close({}, None)
        if pl is not None:
            rates["lightning"] = time_lightning(pl, net, training.config, loader, criterion,
                                                args.epochs, device)
    samples = args.steps * args.batch_size
    rates = {k: statistics.median(samples / t for t in v) for k, v in rates.items()}
    print()
    print(f"{'loop':<34}{'samples/s':>12}{'ms/step':>10}{'vs train.py':>13}")
    labels = {"train.py": "train.py (train.run_epoch)",
              "lightning": f"lightning {version} (barebones Trainer)"}
    for key, rate in rates.items():
        print(f"{labels[key]:<34}{rate:>12.1f}{args.batch_size / rate * 1e3:>10.3f}"
              f"{rate / rates['train.py']:>13.3f}")
    if pl is None:
        print(f"{'lightning':<34}skipped: {why}")
    key = f"lightning.{args.network.replace('/', '_')}"
    print(f"figure: {key}.train_py.samples_per_s {rates['train.py']:.1f} (batch "
          f"{args.batch_size}, {args.image_size} px, {args.amp})")
    if "lightning" in rates:
        print(f"figure: {key}.lightning.samples_per_s {rates['lightning']:.1f} "
              f"(Lightning {version}, barebones)")
        print(f"figure: {key}.train_py_over_lightning "
              f"{rates['train.py'] / rates['lightning']:.3f}")


if __name__ == "__main__":
    main()

"""Bit identity: the same recipes trained by two versions of the code end with the same bits.

    python bench/identity.py --base 661a44d           # that commit against the working tree
    python bench/identity.py --base main --recipes ema-mixup,dcgan
    python bench/identity.py --base 661a44d --ignore-config fid_samples  # a default changed
    python bench/identity.py --base fa3a3bb --ignore-metrics train_grad_norm_denoiser

A change that only moves code (a refactor) must leave every run where it was: each recipe
below is trained by both versions, each in its own processes on the CPU with the same
threads, and every entry of its last.pt (the networks, optimizers, EMA, scaler, progress,
RNG states, config, the data identity) and every key and value of its metrics.jsonl but
the timings is compared (an entry renamed since, ``RENAMED``, under its new name): tensors
with ``torch.equal`` (dtype and shape too), the rest with ``==``. The base version runs
from a temporary ``git worktree`` of ``--base``, removed at the end. Prints one
``figure: identity.<recipe> equal|differs`` line a recipe, then the first differences of
each; exits 1 when any recipe differs. Asserts nothing else.

The recipes (what issue 35 must keep bit for bit):

* ema-mixup: EMA + MixUp/CutMix + TrivialAugment, 2 DataLoader workers (a classifier);
* device-freeze: the device path with --freeze and --unfreeze-at, under accumulation;
* tta-resnet9: --tta flip with accumulation on resnet9;
* adam-clip: Adam with --grad-clip;
* torchrun-2x8: two processes of 8 (gloo);
* unet-ema: a unet segmentation run with EMA;
* dcgan: a DCGAN with EMA and --d-steps 2, FID on the adam-clip classifier's features;
* pix2pix: pix2pix at 64 px (its hashed dropout on) with accumulation and EMA;
* ddpm: a DDPM with accumulation and EMA, FID on the adam-clip classifier's features.
"""

import argparse
import math
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = ["--dataset", "synthetic", "--synthetic-size", "96", "--image-size", "16",
        "--num-workers", "0", "--device", "cpu", "--log-every", "2", "--seed", "3",
        "--warmup-epochs", "0.5"]
RECIPES = {  # name -> (launcher, flags); "{adam-clip}" is that recipe's run directory
    "ema-mixup": ("python", [*TINY, "--network", "simple_cnn", "--epochs", "2",
                             "--batch-size", "16", "--ema-decay", "0.9", "--mixup-alpha",
                             "0.2", "--cutmix-alpha", "1.0", "--auto-augment",
                             "trivialaugment", "--num-workers", "2"]),
    "device-freeze": ("python", [*TINY, "--network", "simple_cnn", "--epochs", "3",
                                 "--batch-size", "8", "--virtual-batch-size", "16",
                                 "--data-on-device", "on", "--freeze", "features.0.*",
                                 "--unfreeze-at", "2"]),
    "tta-resnet9": ("python", [*TINY, "--network", "resnet9", "--epochs", "1",
                               "--batch-size", "8", "--virtual-batch-size", "24", "--tta",
                               "flip", "--synthetic-size", "48"]),
    "adam-clip": ("python", [*TINY, "--network", "mlp", "--epochs", "2", "--batch-size",
                             "16", "--optimizer", "adam", "--lr", "0.003", "--grad-clip",
                             "0.5", "--ckpt-every-steps", "3"]),
    "torchrun-2x8": ("torchrun", [*TINY, "--network", "mlp", "--epochs", "2",
                                  "--batch-size", "8", "--lr", "0.05"]),
    "unet-ema": ("python", [*TINY, "--task", "segmentation", "--network", "unet",
                            "--num-classes", "3", "--epochs", "2", "--batch-size", "8",
                            "--synthetic-size", "32", "--ema-decay", "0.9"]),
    "dcgan": ("python", ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", "64",
                         "--image-size", "28", "--gan-width", "8", "--latent-dim", "16",
                         "--epochs", "2", "--batch-size", "16", "--num-workers", "0",
                         "--device", "cpu", "--log-every", "2", "--seed", "3",
                         "--d-steps", "2", "--ema-decay", "0.9", "--fid-samples", "8",
                         "--fid-features", "{adam-clip}/checkpoints/best.pt"
                         ]),
    "pix2pix": ("python", ["--task", "pix2pix", "--dataset", "synthetic", "--synthetic-size",
                           "40", "--image-size", "64", "--pix2pix-width", "4",
                           "--num-classes", "3", "--epochs", "2", "--batch-size", "4",
                           "--virtual-batch-size", "8", "--ema-decay", "0.9",
                           "--num-workers", "0", "--device", "cpu", "--log-every", "2",
                           "--seed", "3"]),
    "ddpm": ("python", ["--task", "diffusion", "--dataset", "synthetic", "--synthetic-size",
                        "48", "--image-size", "16", "--diffusion-width", "8",
                        "--diffusion-steps", "50", "--sample-steps", "3", "--epochs", "2",
                        "--batch-size", "8", "--virtual-batch-size", "16", "--ema-decay",
                        "0.9", "--num-workers", "0", "--device", "cpu", "--log-every", "2",
                        "--seed", "3", "--fid-samples", "8",
                        "--fid-features", "{adam-clip}/checkpoints/best.pt"]),
}
TIMINGS = {"data_time", "compute_time", "epoch_time", "samples_per_sec", "tflops", "mfu",
           "compute_efficiency"}
VOLATILE = {("config", "run_dir"), ("config", "fid_features"),  # each side's own paths ...
            ("checksum", "value")}  # ... which the checksum covers
RENAMED = {("progress", "best_val_acc"): ("progress", "best")}  # (old name: new)


def launch(tree, name, run_dir, runs):
    """Trains recipe ``name`` with the code in ``tree`` into ``run_dir``."""
    launcher, flags = RECIPES[name]
    flags = [f.replace("{adam-clip}", os.path.join(runs, "adam-clip")) for f in flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"}
    if launcher == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", "2", "train.py"]
    else:
        command = [sys.executable, "train.py"]
    out = subprocess.run([*command, *flags, "--run-dir", run_dir], cwd=tree, env=env,
                         capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{name} failed in {tree} (exit {out.returncode}):\n{out.stderr[-3000:]}")


def flatten(value, path=()):
    """``(path, value)`` for every leaf of a nested checkpoint or record."""
    import torch

    if isinstance(value, dict):
        for key in value:
            yield from flatten(value[key], (*path, str(key)))
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple,
                                                                 torch.Tensor)) for v in value):
        for i, v in enumerate(value):
            yield from flatten(v, (*path, str(i)))
    else:
        yield path, value


def same(a, b):
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def manifest(run_dir, dropped=()):
    """Every leaf of last.pt and best.pt, each read in today's format (this tree's
    ``checkpoint.upgrade``: a diffusion model's format-3 checkpoint of one network as
    format 2), and of metrics.jsonl but the timings and the keys ``dropped``."""
    import json

    import torch

    sys.path.insert(0, ROOT)
    from machinery import checkpoint

    leaves = {}
    for name in ("last.pt", "best.pt"):
        path = os.path.join(run_dir, "checkpoints", name)
        if os.path.exists(path):
            state = checkpoint.upgrade(torch.load(path, weights_only=True,
                                                  map_location="cpu"), path)
            for key, value in flatten(state):
                if key[:2] not in VOLATILE:
                    leaves[(name, *RENAMED.get(key, key))] = value
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for i, line in enumerate(f):
            for key, value in json.loads(line).items():
                if key not in TIMINGS and key not in dropped:
                    leaves[("metrics.jsonl", str(i), key)] = value
    return leaves


def new_flags(a, b):
    """The config keys of this tree's checkpoints that the base's lack: flags added
    since, each at its default (not a difference in what was trained)."""
    return sorted({key[2] for key in set(b) - set(a) if len(key) == 3 and key[1] == "config"})


def differences(a, b, most=5, ignored=()):
    """The first ``most`` leaves that differ, in words; a flag added since (``new_flags``)
    and the config keys ``ignored`` (a default changed on purpose) are not counted."""
    found, added = [], set(new_flags(a, b))
    for key in sorted(set(a) | set(b)):
        if len(key) == 3 and key[1] == "config" and (key[2] in added or key[2] in ignored):
            continue
        if key not in a or key not in b:
            found.append(f"{'/'.join(key)}: only in {'the base' if key in a else 'this tree'}")
        elif not same(a[key], b[key]):
            found.append(f"{'/'.join(key)}: {short(a[key])} != {short(b[key])}")
        if len(found) >= most:
            break
    return found


def short(value):
    text = repr(value)
    return text if len(text) < 80 else text[:77] + "..."


def run_side(tree, names, runs, dropped=()):
    os.makedirs(runs, exist_ok=True)
    order = sorted(names, key=lambda n: n != "adam-clip")  # dcgan reads its classifier
    if {"dcgan", "ddpm"} & set(names) and "adam-clip" not in names:
        order.insert(0, "adam-clip")
    for name in order:
        launch(tree, name, os.path.join(runs, name), runs)
    return {name: manifest(os.path.join(runs, name), dropped) for name in names}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", default=None, help="the git revision to compare with")
    p.add_argument("--recipes", default=",".join(RECIPES),
                   help=f"comma-separated, of: {', '.join(RECIPES)}")
    p.add_argument("--dir", default=None, help="where the runs go (default: a temporary "
                   "directory, removed)")
    p.add_argument("--ignore-config", default="", metavar="KEYS", help="comma-separated "
                   "config keys whose recorded value changed on purpose (a flag's default)")
    p.add_argument("--ignore-metrics", default="", metavar="KEYS", help="comma-separated "
                   "metrics.jsonl keys that one side has and the other not, on purpose (a "
                   "figure dropped)")
    args = p.parse_args(argv)
    ignored = {k for k in args.ignore_config.split(",") if k}
    dropped = {k for k in args.ignore_metrics.split(",") if k}
    names = [n for n in args.recipes.split(",") if n]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {', '.join(unknown)}")
    if args.base is None:
        p.error("--base REV: the version to compare this tree with")
    if args.dir and os.path.exists(args.dir) and os.listdir(args.dir):
        p.error(f"--dir {args.dir}: not empty (the runs would resume, not start)")
    work = args.dir or tempfile.mkdtemp(prefix="identity-")
    base_tree = os.path.join(work, "base-tree")
    added = subprocess.run(["git", "worktree", "add", "--detach", "--force", base_tree,
                            args.base], cwd=ROOT, capture_output=True, text=True)
    if added.returncode != 0:  # an unknown revision, no git: one line
        last = (added.stderr.strip().splitlines() or ["git worktree add failed"])[-1]
        sys.exit(f"error: --base {args.base}: {last}")
    try:
        base = run_side(base_tree, names, os.path.join(work, "base"), dropped)
        here = run_side(ROOT, names, os.path.join(work, "here"), dropped)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", base_tree], cwd=ROOT,
                       capture_output=True)
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    differ = 0
    for name in names:
        found = differences(base[name], here[name], ignored=ignored)
        added = new_flags(base[name], here[name])
        if added:
            print(f"# {name}: {len(added)} flags added since {args.base}, at their "
                  f"defaults, not compared: {', '.join(added)}")
        print(f"figure: identity.{name} {'equal' if not found else 'differs'} "
              f"({len(base[name])} entries)")
        for line in found:
            print(f"  {line}")
        differ += bool(found)
    print(f"{len(names) - differ} of {len(names)} recipes equal to {args.base}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())

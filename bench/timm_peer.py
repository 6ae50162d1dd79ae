"""train.py beside timm's own train.py: the same timm model fine-tuned on the same photos.

    git -C <timm's repository> show HEAD:train.py > /tmp/timm_train.py   # not in its wheel
    python bench/timm_peer.py --timm-train /tmp/timm_train.py            # resnet10t, 64 px
    python bench/timm_peer.py --timm-train /tmp/timm_train.py --model test_vit --repeats 1

The bench writes an ImageFolder of photos (``--classes`` classes of coloured shapes with
noise, JPEGs of assorted sizes around 96x128, ``train/`` and ``val/``) and trains the
model with random weights on it twice over, alternating the sides, each a process of its
own with one thread (``OMP_NUM_THREADS=1``, ``MKL_NUM_THREADS=1``) and no DataLoader
workers, with what both can express:

* the model: ``timm.create_model(--model)``, ``--num-classes`` the folder's;
* SGD with Nesterov momentum 0.9 (timm's ``sgd``), --lr, weight decay 5e-5 on the weights
  only (timm filters biases and norms out by default; train.py: ``--norm-weight-decay 0
  --bias-weight-decay 0``), label smoothing 0.1;
* a cosine schedule over the optimizer steps, no warmup (timm: ``--sched-on-updates
  --warmup-epochs 0``);
* the batch, the epochs, the image size and crop_pct 0.875; training: a random-resized
  crop (area 0.08-1, ratio 3/4-4/3) and a horizontal flip (timm: no colour jitter, no
  RandAugment, bicubic as the model's data configuration); evaluation: the short side
  resized to size/crop_pct, the centre crop; normalised by the model's mean and std.

Without timm's train.py (a path that is no file) only train.py's side runs, after a
"skipped:" line. Figures per run: images/s of training as each side reports it (train.py:
metrics.jsonl's ``samples_per_sec``, the epoch's images over its wall time; timm: the
average rate of its last log line of an epoch, which averages the batches' times), both
as the median of the epochs after the first; images/s of the whole process (the epochs'
training images over its wall time: imports, the first decode, validation and checkpoints
included); the final top-1 (train.py: the last ``val_acc``; timm: summary.csv's last
``eval_top1``). Prints a ``figure:`` line for each; asserts nothing.
"""

import argparse
import csv
import glob
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
from PIL import Image, ImageDraw

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def write_photos(root, classes, per_class, val_per_class, seed=0):
    """An ImageFolder of photos: each class a colour and a shape, at a place and size
    drawn per image, over a noisy background; JPEGs of assorted sizes."""
    g = np.random.default_rng(seed)
    for split, count in (("train", per_class), ("val", val_per_class)):
        for k in range(classes):
            folder = os.path.join(root, split, f"class{k:02d}")
            os.makedirs(folder, exist_ok=True)
            colour = tuple(int(c) for c in g.integers(40, 256, 3))
            for i in range(count):
                h, w = (int(v) for v in g.integers(80, 140, 2))
                background = g.integers(0, 90, (h, w, 3), dtype=np.uint8)
                image = Image.fromarray(background)
                draw = ImageDraw.Draw(image)
                side = int(g.integers(min(h, w) // 3, min(h, w) * 2 // 3))
                top, left = int(g.integers(0, h - side)), int(g.integers(0, w - side))
                box = (left, top, left + side, top + side)
                (draw.ellipse if k % 2 else draw.rectangle)(box, fill=colour)
                image.save(os.path.join(folder, f"{i}.jpg"), quality=90)


def environment():
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def ours(args, data, out):
    """train.py's command line for the recipe."""
    return [sys.executable, os.path.join(ROOT, "train.py"), "--dataset", "imagefolder",
            "--data-dir", data, "--network", f"timm/{args.model}", "--image-size",
            str(args.image_size), "--crop-pct", "0.875", "--batch-size", str(args.batch_size),
            "--epochs", str(args.epochs), "--optimizer", "sgd", "--lr", str(args.lr),
            "--momentum", "0.9", "--nesterov", "--weight-decay", "5e-5",
            "--norm-weight-decay", "0", "--bias-weight-decay", "0", "--label-smoothing",
            "0.1", "--scheduler", "cosine", "--warmup-epochs", "0", "--num-workers", "0",
            "--device", "cpu", "--seed", "42", "--run-dir", out, "--log-every", "1000"]


def theirs(args, data, out, timm_train):
    """timm's train.py command line for the same recipe."""
    return [sys.executable, timm_train, "--data-dir", data, "--train-split", "train",
            "--val-split", "val", "--model", args.model, "--num-classes", str(args.classes),
            "--img-size", str(args.image_size), "--crop-pct", "0.875", "--batch-size",
            str(args.batch_size), "--validation-batch-size", str(args.batch_size),
            "--epochs", str(args.epochs), "--opt", "sgd", "--lr", str(args.lr),
            "--momentum", "0.9", "--weight-decay", "5e-5", "--smoothing", "0.1", "--sched",
            "cosine", "--sched-on-updates", "--warmup-epochs", "0", "--min-lr", "0",
            "--color-jitter", "0", "--train-interpolation", "bicubic", "--workers", "0",
            "--device", "cpu", "--seed", "42", "--output", out, "--experiment", "run",
            "--log-interval", "1000", "--checkpoint-hist", "1", "--no-prefetcher"]


def run(cmd, cwd):
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=environment(), capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stdout[-2000:]}"
                 f"\n{done.stderr[-3000:]}")
    return wall, done.stdout + done.stderr


def our_figures(out):
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    rates = [r["samples_per_sec"] for r in records]
    return statistics.median(rates[1:] or rates), 100 * records[-1]["val_acc"]


_RATE = re.compile(r"Train: (\d+) \[\s*(\d+)/(\d+).*?\(\s*[\d.]+s,\s*([\d.]+)/s\)")


def their_figures(out, log):
    last = {}
    for match in _RATE.finditer(log):  # the last line of each epoch: its average rate
        last[int(match.group(1))] = float(match.group(4))
    rates = [last[e] for e in sorted(last)]
    summary = glob.glob(os.path.join(out, "run", "summary.csv"))[0]
    rows = list(csv.DictReader(open(summary)))
    return statistics.median(rates[1:] or rates), float(rows[-1]["eval_top1"])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--timm-train", required=True, help="timm's train.py (from its repository)")
    p.add_argument("--model", default="resnet10t")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--per-class", type=int, default=40)
    p.add_argument("--val-per-class", type=int, default=10)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--repeats", type=int, default=2, help="runs of each side, alternated")
    args = p.parse_args(argv)
    sides = ("train.py", "timm")
    if not os.path.isfile(args.timm_train):  # (not in timm's wheel: CI has none)
        print(f"skipped: timm's side: --timm-train {args.timm_train!r} is not a file (git -C "
              f"<timm's repository> show HEAD:train.py > /tmp/timm_train.py)")
        sides = ("train.py",)
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "photos")
        write_photos(data, args.classes, args.per_class, args.val_per_class)
        images = args.classes * args.per_class * args.epochs
        rows = {side: [] for side in sides}
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for side in order:
                out = os.path.join(tmp, f"{side}-{repeat}")
                if side == "train.py":
                    wall, _ = run(ours(args, data, out), tmp)
                    rate, top1 = our_figures(out)
                else:
                    wall, log = run(theirs(args, data, out, args.timm_train), tmp)
                    rate, top1 = their_figures(out, log)
                rows[side].append((rate, images / wall, top1))
                print(f"{side:9s} run {repeat + 1}: {rate:7.1f} images/s training, "
                      f"{images / wall:6.1f} images/s whole process ({wall:.1f} s), "
                      f"top-1 {top1:.2f}", flush=True)
        print("command (train.py):", " ".join(ours(args, "DIR", "OUT")[1:]))
        print("command (timm):    ", " ".join(theirs(args, "DIR", "OUT", "train.py")[1:]))
        for side, values in rows.items():
            rate = statistics.median(v[0] for v in values)
            whole = statistics.median(v[1] for v in values)
            top1 = statistics.median(v[2] for v in values)
            print(f"figure: {side} training images/s {rate:.1f}, whole-process images/s "
                  f"{whole:.1f}, top-1 {top1:.2f}")
        if "timm" in rows:
            ratio = statistics.median(v[0] for v in rows["train.py"]) / \
                statistics.median(v[0] for v in rows["timm"])
            print(f"figure: train.py / timm training images/s {ratio:.2f}x")


if __name__ == "__main__":
    main()

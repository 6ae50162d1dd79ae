"""Segmentation: train.py against a plain loop in the style of torchvision's reference.

    python bench/segmentation.py                                  # unet, CPU, 3 epochs
    python bench/segmentation.py --device cuda --network torchvision/lraspp_mobilenet_v3_large \\
        --samples 2000 --size 256 --crop-size 224 --batch-size 32 --workers 8
    python bench/segmentation.py --samples 16 --size 32 --crop-size 24 --epochs 1  # seconds
    python bench/segmentation.py --case square64     # issue 37's: lraspp, 64 px, no augment

Writes a generated set (learnable shapes: discs and boxes, a colour per class, noise;
their outlines 255 = ignore, as VOC's) as a mask folder, ``DIR/{train,val}/images/*.png``
and ``DIR/{train,val}/masks/*.png`` (grayscale class indices) with ``classes.txt``, then
trains the same network on it for the same epochs, side by side in one run:

* plain: a loop written with torchvision alone, as torchvision's segmentation reference
  (references/segmentation) writes it: ``transforms.v2`` on ``tv_tensors.Image`` and
  ``tv_tensors.Mask`` (a random resize of the short side in [0.5, 2] x base, a horizontal
  flip, a --crop-size crop padded with 255 in the mask, to float, normalise; evaluation
  at the base size; base = crop x 520 / 480, the reference's, as train.py's), a
  DataLoader (shuffled, drop_last), SGD with momentum and a poly schedule stepped per
  iteration (PolynomialLR, power 0.9), per-pixel cross-entropy ignoring 255, the
  auxiliary loss at 0.5 where the network has one, and the reference's confusion matrix.
  Two differences: the reference gives the auxiliary head 10x the learning rate (here
  every parameter has the same, as in train.py), and its mIoU is the mean over every
  class, NaN where a class is absent from a small validation set; here the mean over
  the classes present, as train.py's.
* train.py: ``python train.py --task segmentation --dataset maskfolder`` with the same
  recipe (``--image-size`` = --crop-size), its ``samples_per_sec`` and ``val_miou`` read
  from metrics.jsonl. Below a crop of 64 px train.py takes the small-image geometry (pad
  and crop, no random resize): compare the mIoU at 64 and above.

``--case square64`` is the case of issue 37: square 64 px images at ``--image-size 64
--no-augment`` (both sides train on the images as they are and evaluate at 64 px),
torchvision's lraspp_mobilenet_v3_large, SGD 0.1 with poly, batch 16, 11 classes: where
train.py used to resize each image to 69 px and pad it to a 92 px canvas.

Prints the samples/s of the last epoch of each, the wall time of the whole run (train.py's
includes its process start) and the mIoU each reached, and the
issue's targets (train.py's samples/s at least the plain loop's; mIoU within 1 point).
Until train.py has ``--task`` that side says so in one line and the script exits 0.
Asserts nothing.
"""

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from common import ROOT, setup_device, sync  # (puts the repository on the path)
from PIL import Image
from torchvision import tv_tensors
from torchvision.io import decode_png, read_file
from torchvision.transforms import v2

import networks  # noqa: E402

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # the reference's (ImageNet's)
COLOURS = [(40, 40, 40), (200, 40, 40), (40, 180, 40), (40, 60, 200), (200, 200, 40),
           (180, 40, 200), (40, 200, 200), (230, 140, 40)]


CASES = {"square64": {"network": "torchvision/lraspp_mobilenet_v3_large", "size": 64,
                      "crop_size": 64, "classes": 11, "lr": 0.1, "batch_size": 16,
                      "augment": False, "samples": 256, "epochs": 3}}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--network", default="unet", help="networks.py's name (both sides)")
    p.add_argument("--samples", type=int, default=256, help="training images (val: 1/4)")
    p.add_argument("--size", type=int, default=80, help="side of the generated images")
    p.add_argument("--classes", type=int, default=5, help="classes, background included")
    p.add_argument("--crop-size", type=int, default=64, help="training crop (train.py's "
                   "--image-size); the base size is crop x 520 / 480")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=0.02, help="the reference's 0.02")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (both sides)")
    p.add_argument("--amp", default="none", choices=["none", "bf16"], help="autocast")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", default="both", choices=["both", "plain", "train.py"])
    p.add_argument("--dir", default=None, help="where the set and the run go (a temp dir)")
    p.add_argument("--no-augment", dest="augment", action="store_false",
                   help="both sides train on the images as they are (train.py --no-augment)")
    p.add_argument("--case", default=None, choices=sorted(CASES),
                   help="a preset of the flags above (given flags win)")
    args = p.parse_args(argv)
    if args.case:
        given = {a.dest for a in p._actions for o in a.option_strings
                 if any(x == o or x.startswith(o + "=") for x in (argv or sys.argv[1:]))}
        for key, value in CASES[args.case].items():
            if key not in given:
                setattr(args, key, value)
    args.base_size = round(args.crop_size * 520 / 480)  # the reference's 520 for 480
    return args


# ----------------------------------------------------------------------- the set

def make_set(root, n, size, classes, seed=0):
    """A mask folder of ``n`` training and ``n // 4`` (at least 2) validation images."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:size, :size]
    for split, count in (("train", n), ("val", max(n // 4, 2))):
        os.makedirs(os.path.join(root, split, "images"))
        os.makedirs(os.path.join(root, split, "masks"))
        for i in range(count):
            mask = np.zeros((size, size), np.uint8)
            for _ in range(rng.integers(1, 4)):
                c = int(rng.integers(1, classes))
                cy, cx = rng.integers(0, size, 2)
                r = rng.integers(size // 8, size // 3 + 1)
                if rng.random() < 0.5:
                    inside = (yy - cy) ** 2 + (xx - cx) ** 2 <= r * r
                else:
                    inside = (abs(yy - cy) <= r) & (abs(xx - cx) <= r)
                mask[inside] = c
            colours = np.array([COLOURS[c % len(COLOURS)] for c in range(classes)], np.float32)
            image = colours[mask] + rng.normal(0, 25, (size, size, 3))
            edge = np.zeros_like(mask, bool)  # a 1-pixel outline between regions: ignore
            edge[1:] |= mask[1:] != mask[:-1]
            edge[:, 1:] |= mask[:, 1:] != mask[:, :-1]
            mask[edge] = 255
            name = f"{i:05d}.png"
            Image.fromarray(image.clip(0, 255).astype(np.uint8)).save(
                os.path.join(root, split, "images", name))
            Image.fromarray(mask, mode="L").save(os.path.join(root, split, "masks", name))
    with open(os.path.join(root, "classes.txt"), "w") as f:
        f.write("".join(["background\n"] + [f"class{c}\n" for c in range(1, classes)]))
    return root


# ------------------------------------------------------- the plain torchvision loop

class MaskFolder(torch.utils.data.Dataset):
    """``split/images/NAME.png`` with ``split/masks/NAME.png``, as tv_tensors."""

    def __init__(self, root, split, transforms):
        self.dir = os.path.join(root, split)
        self.names = sorted(os.listdir(os.path.join(self.dir, "images")))
        self.transforms = transforms

    def __len__(self):
        return len(self.names)

    def __getitem__(self, i):
        image = decode_png(read_file(os.path.join(self.dir, "images", self.names[i])))
        mask = decode_png(read_file(os.path.join(self.dir, "masks", self.names[i])))[0]
        return self.transforms(tv_tensors.Image(image), tv_tensors.Mask(mask))


def reference_transforms(base, crop, train, augment=True):
    """The reference's SegmentationPresetTrain / SegmentationPresetEval (v2, tensors);
    without augmentation, the images as they are (a set of the crop's size)."""
    steps = [v2.RandomResize(int(0.5 * base), int(2.0 * base))] if train else \
        [v2.Resize(base)]
    if not augment:
        steps = [v2.Resize(crop), v2.CenterCrop(crop)]
    elif train:
        steps += [v2.RandomHorizontalFlip(0.5),
                  v2.RandomCrop(crop, pad_if_needed=True,
                                fill={tv_tensors.Image: 0, tv_tensors.Mask: 255})]
    steps += [v2.ToDtype({tv_tensors.Image: torch.float32, tv_tensors.Mask: torch.int64,
                          "others": None}, scale=True),
              v2.Normalize(MEAN, STD), v2.ToPureTensor()]
    return v2.Compose(steps)


def criterion(output, target):
    """The reference's: cross-entropy ignoring 255 of ``out``, plus 0.5 x ``aux``'s."""
    if not isinstance(output, dict):
        output = {"out": output}
    losses = {k: torch.nn.functional.cross_entropy(x, target, ignore_index=255)
              for k, x in output.items()}
    return losses["out"] + 0.5 * losses["aux"] if "aux" in losses else losses["out"]


def reference_miou(model, loader, classes, device, amp):
    """The reference's ConfusionMatrix (bincount); the mean IoU of the classes present."""
    mat = torch.zeros(classes, classes, dtype=torch.int64, device=device)
    model.eval()
    with torch.inference_mode():
        for image, target in loader:
            image, target = image.to(device), target.to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=amp == "bf16"):
                output = model(image)
            output = output["out"] if isinstance(output, dict) else output
            a, b = target.flatten(), output.argmax(1).flatten()
            k = (a >= 0) & (a < classes)
            mat += torch.bincount(classes * a[k] + b[k], minlength=classes ** 2) \
                .reshape(classes, classes)
    h = mat.double()
    iu = torch.diag(h) / (h.sum(1) + h.sum(0) - torch.diag(h))
    return float(iu.nanmean())  # (0 / 0: a class in neither targets nor predictions)


def plain(root, args, device):
    """The plain loop: ``(samples/s of the last epoch, mIoU after the last)``."""
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    train_set = MaskFolder(root, "train", reference_transforms(args.base_size,
                                                               args.crop_size, True,
                                                               args.augment))
    val_set = MaskFolder(root, "val", reference_transforms(args.base_size, args.crop_size,
                                                           False, args.augment))
    kw = {"num_workers": args.workers, "pin_memory": device.type == "cuda",
          "persistent_workers": args.workers > 0}
    train_loader = torch.utils.data.DataLoader(train_set, args.batch_size, shuffle=True,
                                               drop_last=True, **kw)
    val_loader = torch.utils.data.DataLoader(val_set, args.batch_size, **kw)
    model = networks.build_network(args.network, args.classes, 3, args.crop_size).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9,
                                weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.PolynomialLR(
        optimizer, total_iters=len(train_loader) * args.epochs, power=0.9)
    rate = float("nan")
    for _ in range(args.epochs):
        model.train()
        sync(device)
        start, seen = time.perf_counter(), 0
        for image, target in train_loader:
            image, target = image.to(device), target.to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp == "bf16"):
                loss = criterion(model(image), target)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            scheduler.step()
            seen += image.shape[0]
        sync(device)
        rate = seen / (time.perf_counter() - start)
    miou = reference_miou(model, val_loader, args.classes, device, args.amp)
    return rate, miou, time.perf_counter() - started


# ------------------------------------------------------------------------ train.py

def has_task_flag():
    """Whether train.py has ``--task`` yet (its --help names it)."""
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    return re.search(r"--task[ {=]", out.stdout) is not None


def train_py(root, args, device, run_dir):
    """train.py with the same recipe: ``(samples/s of the last epoch, val_miou)``."""
    argv = [sys.executable, "train.py", "--task", "segmentation", "--dataset", "maskfolder",
            "--data-dir", root, "--network", args.network, "--num-classes",
            str(args.classes), "--image-size", str(args.crop_size), "--epochs",
            str(args.epochs), "--batch-size", str(args.batch_size), "--optimizer", "sgd",
            "--lr", str(args.lr), "--momentum", "0.9", "--no-nesterov", "--weight-decay",
            "1e-4", "--scheduler", "poly", "--warmup-epochs", "0", "--label-smoothing",
            "0", "--num-workers", str(args.workers), "--device", str(device), "--amp",
            args.amp, "--seed", str(args.seed), "--eval-every", str(args.epochs),
            "--run-dir", run_dir, *([] if args.augment else ["--no-augment"])]
    started = time.perf_counter()
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        sys.exit(f"train.py failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    return last["samples_per_sec"], last.get("val_miou", float("nan")), wall


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    work = tempfile.TemporaryDirectory(prefix="bench-segmentation-", dir=args.dir)
    root = make_set(os.path.join(work.name, "set"), args.samples, args.size, args.classes,
                    args.seed)
    print(f"# segmentation: {args.network}, {args.samples} images of {args.size} px, "
          f"{args.classes} classes, base {args.base_size}, crop {args.crop_size}, "
          f"{args.epochs} epochs of batch {args.batch_size}, {args.workers} workers, "
          f"{'augmented' if args.augment else 'no augmentation'}, amp "
          f"{args.amp}; {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, load "
          f"average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"{'side':<10}{'samples/s':>12}{'mIoU':>9}{'wall s':>9}")
    rows = {}
    if args.side in ("both", "plain"):
        rows["plain"] = plain(root, args, device)
        print(f"{'plain':<10}{rows['plain'][0]:>12.1f}{rows['plain'][1]:>9.4f}"
              f"{rows['plain'][2]:>9.1f}")
    if args.side in ("both", "train.py"):
        if not has_task_flag():
            print("train.py has no --task yet: its side waits for the task seam (issue 26)")
            return 0
        rows["train.py"] = train_py(root, args, device, os.path.join(work.name, "run"))
        print(f"{'train.py':<10}{rows['train.py'][0]:>12.1f}{rows['train.py'][1]:>9.4f}"
              f"{rows['train.py'][2]:>9.1f}")
    if len(rows) == 2:
        (p_rate, p_miou, _), (t_rate, t_miou, _) = rows["plain"], rows["train.py"]
        print(f"targets: train.py samples/s / plain {t_rate / p_rate:.2f} (>= 1: "
              f"{'yes' if t_rate >= p_rate else 'no'}); mIoU difference "
              f"{100 * (t_miou - p_miou):+.2f} points (within 1: "
              f"{'yes' if abs(t_miou - p_miou) <= 0.01 else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

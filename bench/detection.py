"""Detection: train.py against a plain torchvision detection loop in the reference's recipe.

    python bench/detection.py                                   # SSDlite, 96 px, CPU
    python bench/detection.py --device cuda --network fasterrcnn_mobilenet_v3_large_320_fpn \\
        --samples 2048 --size 320 --batch-size 16 --workers 8 --epochs 4
    python bench/detection.py --samples 32 --size 64 --epochs 1   # seconds

The same synthetic set on both sides (pipeline/detection_data.py's ``SyntheticBoxes``:
0-3 shapes an image with their tight boxes, from the seed), the same detector from scratch
(torchvision's, ``--num-classes`` + background, its resize set to ``--size``), the same
batch, epochs and recipe, side by side in one process run:

* plain: a loop written with torchvision alone, as torchvision's detection reference
  (references/detection/train.py) writes it: a Dataset giving ``tv_tensors.Image`` and
  ``tv_tensors.BoundingBoxes``, ``transforms.v2`` (the reference's ``lsj`` policy at this
  size: horizontal flip, ``ScaleJitter`` to [0.5, 1.5] of the size, a crop padded where
  smaller, the boxes clipped and the emptied ones removed, to float, ``ToPureTensor`` as
  the reference's presets end: a tv_tensor subclass reaching the detector made its steps
  up to 10x slower here), a DataLoader
  (shuffled, ``collate_fn=tuple(zip(*batch))``), SGD with momentum and weight decay, a
  linear warm-up over the first epoch then a cosine decay stepped per iteration, the sum
  of the detector's losses; evaluation with torchmetrics' ``MeanAveragePrecision``
  (pycocotools, COCO's evaluation as the reference's ``CocoEvaluator``), the images
  resized and padded as train.py evaluates them.
* train.py: ``train.main`` in this process with ``--task detection --dataset synthetic``
  and the same recipe; its ``samples_per_sec`` and ``val_map`` read from metrics.jsonl.

``--alternate-epochs N`` instead runs both sides in one run: ``train.main`` with an epoch
of the plain loop before each of its epochs (after it, every other turn), so that the
swings of a shared machine fall on both sides alike; the figure is the median of the
turns' ratios, the first turn left out (bench/pix2pix.py's harness).

Prints ``figure: KEY VALUE`` lines: each side's samples/s of its last epoch and mAP, and
``detection.train_py_over_plain`` (the issue's target: at least 0.95) and
``detection.map_delta`` (train.py's minus the plain loop's; the target: above -0.01).
Asserts nothing.
"""

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import tempfile
import time

import torch
from common import ROOT, setup_device, sync  # (puts the repository on the path)
from torchvision import tv_tensors
from torchvision.transforms import v2

from pipeline import detection_data  # noqa: E402
from tasks.detection import build_detector  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--network", default="ssdlite320_mobilenet_v3_large")
    p.add_argument("--samples", type=int, default=256, help="training images (val: a fifth)")
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--num-classes", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--weight-decay", type=float, default=4e-5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--amp", default="none", choices=["none", "bf16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["plain", "train.py"], default=None)
    p.add_argument("--alternate-epochs", type=int, default=0, metavar="N",
                   help="instead: N epochs of each side in one run, an epoch of each in turn")
    return p.parse_args(argv)


class PlainSet(torch.utils.data.Dataset):
    """The synthetic images as the reference's datasets give them: an image and a target
    dict, through ``transforms.v2``."""

    def __init__(self, base, transform):
        self.base, self.transform = base, transform

    def __len__(self):
        return len(self.base)

    def __getitem__(self, i):
        image, target = self.base[i]
        h, w = image.shape[-2:]
        keep = ~target["crowd"]
        boxes = tv_tensors.BoundingBoxes(target["boxes"][keep], format="XYXY",
                                         canvas_size=(h, w))
        return self.transform(tv_tensors.Image(image),
                              {"boxes": boxes, "labels": target["labels"][keep]})


def plain_transforms(size, train):
    if not train:
        return v2.Compose([v2.Resize(None, max_size=size),
                           v2.ToDtype(torch.float32, scale=True), v2.ToPureTensor()])
    return v2.Compose([v2.RandomHorizontalFlip(0.5),
                       v2.ScaleJitter((size, size), scale_range=detection_data.SCALE_RANGE),
                       v2.RandomCrop(size, pad_if_needed=True), v2.ClampBoundingBoxes(),
                       v2.SanitizeBoundingBoxes(min_size=1.0),
                       v2.ToDtype(torch.float32, scale=True), v2.ToPureTensor()])


def collate(batch):
    return tuple(zip(*batch))


def lr_at(step, total, warmup):
    if step < warmup:
        return (step + 1) / warmup
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return 0.5 * (1 + math.cos(math.pi * progress))


def plain(args, device):
    """The reference's loop: ``(samples_per_sec of the last epoch, mAP)``."""
    result = {}
    rate = 0.0
    for seconds, seen in plain_epochs(args, device, args.epochs, result):
        rate = seen / seconds
    return rate, result["map"]


def plain_epochs(args, device, epochs, result):
    """The reference's loop, an epoch at a time: yields each epoch's ``(seconds,
    images)``; after the last, ``result["map"]`` is the validation set's mAP."""
    from torchmetrics.detection import MeanAveragePrecision

    torch.manual_seed(args.seed)
    train_base = detection_data.SyntheticBoxes(args.samples, args.num_classes, args.size,
                                               args.seed, "train")
    val_base = detection_data.SyntheticBoxes(max(args.samples // 5, 1), args.num_classes,
                                             args.size, args.seed, "val")
    loader = torch.utils.data.DataLoader(
        PlainSet(train_base, plain_transforms(args.size, True)), batch_size=args.batch_size,
        shuffle=True, num_workers=args.workers, collate_fn=collate,
        persistent_workers=args.workers > 0)
    val_loader = torch.utils.data.DataLoader(
        PlainSet(val_base, plain_transforms(args.size, False)), batch_size=args.batch_size,
        num_workers=args.workers, collate_fn=collate)
    model = build_detector(args.network, args.num_classes, args.size).to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(params, lr=args.lr, momentum=0.9,
                                weight_decay=args.weight_decay)
    total = len(loader) * epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_at(step, total, len(loader)))
    def autocast():  # (a fresh one each time, as train.py's loop; none without --amp)
        return torch.autocast(device.type, dtype=torch.bfloat16) if args.amp == "bf16" \
            else contextlib.nullcontext()

    for _ in range(epochs):
        model.train()
        sync(device)
        start, seen = time.perf_counter(), 0
        for images, targets in loader:
            images = [i.to(device, non_blocking=True) for i in images]
            targets = [{k: v.to(device, non_blocking=True) for k, v in t.items()}
                       for t in targets]
            with autocast():
                losses = model(images, targets)
            loss = sum(losses.values())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            seen += len(images)
        sync(device)
        yield time.perf_counter() - start, seen
    model.eval()
    metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="pycocotools")
    with torch.no_grad():
        for i, (images, _) in enumerate(val_loader):
            with autocast():
                out = model([image.to(device) for image in images])
            for k, o in enumerate(out):
                index = i * args.batch_size + k
                original = val_base.targets[index]
                scale = images[k].shape[-1] / val_base.images[index].shape[-1]
                metric.update([{"boxes": o["boxes"].float().cpu() / scale,
                                "scores": o["scores"].float().cpu(),
                                "labels": o["labels"].cpu()}],
                              [{"boxes": original["boxes"], "labels": original["labels"]}])
    result["map"] = float(metric.compute()["map"])


def alternating(args, device, run_dir):
    """``--alternate-epochs N``: both sides in one run, an epoch of each in turn (the plain
    loop's before train.py's in even turns, after it in odd ones), so that a shared
    machine's swings, longer than a turn, fall on both alike. Returns the turns'
    ``(plain images/s, train.py images/s)``, the first turn (warm-up) left out, and both
    sides' mAP. train.py's epochs are timed around ``train.run_epoch``."""
    import train

    plain_result = {}
    epochs = plain_epochs(args, device, args.alternate_epochs, plain_result)
    turns, run_epoch = [], train.run_epoch

    def both(training, loader, *a, **k):
        timed = {}
        for side in ("plain", "train.py")[::1 if len(turns) % 2 == 0 else -1]:
            if side == "plain":
                seconds, seen = next(epochs)
                timed[side] = seen / seconds
            else:
                start = time.perf_counter()
                ended = run_epoch(training, loader, *a, **k)
                sync(device)
                timed[side] = loader.batch_sampler.size / (time.perf_counter() - start)
        turns.append((timed["plain"], timed["train.py"]))
        return ended

    train.run_epoch = both
    try:
        _, train_map = train_py(args, run_dir, epochs=args.alternate_epochs)
    finally:
        train.run_epoch = run_epoch
    for _ in epochs:  # the plain loop's validation
        pass
    return turns[1:], plain_result["map"], train_map


def train_py(args, run_dir, epochs=None):
    """train.py in this process: ``(samples_per_sec of the last epoch, val_map)``."""
    epochs = epochs or args.epochs
    import train

    argv = ["--task", "detection", "--dataset", "synthetic", "--network",
            f"torchvision/{args.network}", "--synthetic-size", str(args.samples),
            "--num-classes", str(args.num_classes), "--image-size", str(args.size),
            "--batch-size", str(args.batch_size), "--epochs", str(epochs),
            "--eval-every", str(epochs), "--optimizer", "sgd", "--lr", str(args.lr),
            "--momentum", "0.9", "--weight-decay", str(args.weight_decay),
            "--warmup-epochs", "1", "--scheduler", "cosine", "--num-workers",
            str(args.workers), "--device", args.device, "--amp", args.amp, "--seed",
            str(args.seed), "--run-dir", run_dir, "--log-every", "50"]
    code = train.main(argv)
    if code != 0:
        raise SystemExit(f"train.py exited with {code}")
    records = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    last = records[-1]
    return last["samples_per_sec"], last["val_map"]


def main(argv=None):
    args = parse_args(argv)
    device, hardware = setup_device(args)
    print(f"detection bench: {args.network}, {args.samples} images at {args.size} px, batch "
          f"{args.batch_size}, {args.epochs} epochs, {args.workers} workers, {device}, "
          f"{hardware} (root {ROOT})")
    if args.alternate_epochs:
        with tempfile.TemporaryDirectory() as run_dir:
            turns, plain_map, train_map = alternating(args, device, run_dir)
        for n, (p, t) in enumerate(turns, 2):
            print(f"turn {n}: plain {p:.1f} images/s, train.py {t:.1f} images/s ({t / p:.3f})")
        ratio = statistics.median(t / p for p, t in turns)
        print(f"figure: detection.alternating.plain.samples_per_s "
              f"{statistics.median(p for p, _ in turns):.1f}")
        print(f"figure: detection.alternating.train_py.samples_per_s "
              f"{statistics.median(t for _, t in turns):.1f}")
        print(f"figure: detection.alternating.train_py_over_plain {ratio:.3f} (the turns' "
              f"median; target: at least 0.95)")
        print(f"figure: detection.alternating.map_delta {train_map - plain_map:+.4f} "
              f"(train.py {train_map:.4f}, plain {plain_map:.4f}; target: above -0.01)")
        return 0
    figures = {}
    if args.only in (None, "plain"):
        figures["plain"] = plain(args, device)
    if args.only in (None, "train.py"):
        with tempfile.TemporaryDirectory() as run_dir:
            figures["train_py"] = train_py(args, run_dir)
    for side, (rate, mean_ap) in figures.items():
        print(f"figure: detection.{side}.samples_per_s {rate:.1f}")
        print(f"figure: detection.{side}.map {mean_ap:.4f}")
    if len(figures) == 2:
        ratio = figures["train_py"][0] / figures["plain"][0]
        delta = figures["train_py"][1] - figures["plain"][1]
        print(f"figure: detection.train_py_over_plain {ratio:.3f} (target: at least 0.95)")
        print(f"figure: detection.map_delta {delta:+.4f} (train.py's minus the plain loop's; "
              f"target: above -0.01)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

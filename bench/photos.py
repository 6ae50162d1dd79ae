"""Photos: how fast a folder of large JPEGs reaches the network (issue 19's targets).

    python bench/photos.py                          # 64 photos of 12 MP and of 3 MP, CPU
    python bench/photos.py --device cuda            # + the device path and ResNet-50 on GPU
    python bench/photos.py --images 2 --sizes 1mp --image-size 64 --finetune-steps 0

Makes a folder of photo-like JPEGs (smooth random scenes with noise, quality 90; as a
camera's, several megabytes at 12 MP), then, per resolution, in images/s:

* plain: a naive loop, one process: PIL decodes the whole JPEG, converts to RGB and
  resizes the short side to 256 (what ``v2.Resize(256)`` of torchvision's reference
  preset does on a PIL image, every epoch); it and the cache builds below take --repeats
  turns, side by side, and their medians are printed;
* first epoch: the decoded cache built from it (JPEG draft mode: decoded at 1/2, 1/4 or
  1/8 size when that is still large enough; EXIF orientation; short side 256), with 0 and
  then --workers DataLoader workers (0 workers: one core);
* later epochs: the training batches read from that cache, random-resized crop to 224,
  flip, normalise: through the per-sample DataLoader (0 and --workers workers) and on
  the device path (--device);

and the targets: the first pass at least 2.5x, later epochs at least 10x the plain loop
(per core: the 0-worker figures). Then train.py end to end: a torchvision ResNet-18
fine-tuning at 224 on the folder (--finetune-steps steps), samples/s. On CUDA also the
samples/s of a ResNet-50 training step (bf16, channels_last): the rate at which the data
path must feed it not to make it wait. Prints figures; asserts nothing.
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch
from common import setup_device, sync  # (puts the repository on the path)
from PIL import Image

from config import with_defaults  # noqa: E402
from pipeline import (
    data,  # noqa: E402
    decoded_cache,  # noqa: E402
    device_data,  # noqa: E402
    images,  # noqa: E402
    presets,  # noqa: E402
)

SIZES = {"12mp": (4000, 3000), "3mp": (2000, 1500), "1mp": (1152, 864)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--images", type=int, default=64, help="photos per resolution")
    p.add_argument("--sizes", default="12mp,3mp", help=f"of {', '.join(SIZES)}")
    p.add_argument("--image-size", type=int, default=224, help="the crop the network sees")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (besides 0)")
    p.add_argument("--batch-size", type=int, default=32, help="batches of the data paths")
    p.add_argument("--finetune-steps", type=int, default=6, help="train.py steps of "
                   "torchvision/resnet18 (0: skip)")
    p.add_argument("--repeats", type=int, default=3, help="turns of the plain loop and the "
                   "cache build (medians)")
    p.add_argument("--device", default="cpu", help="cpu or cuda: the device path's device")
    p.add_argument("--dir", default=None, help="where to write; default: a temporary "
                   "directory")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process "
                   "(0: torch's default)")
    return p.parse_args(argv)


def make_photos(root, n, size, seed=0):
    """``n`` photo-like JPEGs of ``size`` in two classes under ``root/train``, and a few
    under ``root/val``: smooth scenes (a low-resolution random field upsampled) with
    fine noise, as cameras' images compress."""
    g = np.random.default_rng(seed)
    w, h = size
    for split, count in (("train", n), ("val", max(n // 4, 2))):
        for c in ("a", "b"):
            os.makedirs(os.path.join(root, split, c), exist_ok=True)
        for i in range(count):
            coarse = g.integers(0, 256, (12, 16, 3), dtype=np.uint8)
            scene = Image.fromarray(coarse).resize((w, h), Image.BICUBIC)
            noise = g.normal(0, 6, (h, w, 3))
            pixels = np.clip(np.asarray(scene, dtype=np.float32) + noise, 0, 255)
            Image.fromarray(pixels.astype(np.uint8)).save(
                os.path.join(root, split, "ab"[i % 2], f"{i:04d}.jpg"), quality=90)
    return root


def plain_pass(folder, side):
    """The naive loop: whole decode, RGB, resize of the short side (images/s)."""
    start = time.perf_counter()
    for path, _ in folder.samples:
        with Image.open(path) as image:
            image = image.convert("RGB")
            image.resize(images.stored_size(*image.size, side), Image.BILINEAR)
    return len(folder.samples) / (time.perf_counter() - start)


def first_pass(folder, side, cache_dir, workers):
    """The decoded cache built from nothing (images/s)."""
    for name in os.listdir(cache_dir) if os.path.isdir(cache_dir) else []:
        os.remove(os.path.join(cache_dir, name))
    start = time.perf_counter()
    with contextlib.redirect_stderr(io.StringIO()):
        decoded_cache.decoded_folder(folder, presets.ShortSide(
            side, presets.preset({"pretrained": None})["interpolation"]), cache_dir,
            workers, log=lambda line: None)
    return len(folder.samples) / (time.perf_counter() - start)


def later_epoch(loader, n, device):
    """One pass over a loader's batches, to ``device`` (images/s)."""
    sync(device)
    start = time.perf_counter()
    for x, _ in loader:
        x = x.to(device, non_blocking=True)
    sync(device)
    return n / (time.perf_counter() - start)


def finetune(root, args, device):
    """train.py on the folder: torchvision/resnet18 at --image-size, samples/s."""
    import train

    run = os.path.join(os.path.dirname(root), f"run-{os.path.basename(root)}")
    argv = ["--dataset", "imagefolder", "--data-dir", root, "--network",
            "torchvision/resnet18", "--image-size", str(args.image_size), "--batch-size",
            "16", "--max-steps", str(args.finetune_steps), "--epochs", "100",
            "--num-workers", str(args.workers), "--device", str(device), "--lr", "0.01",
            "--run-dir", run, "--log-every", "1000"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = train.main(argv)
    assert code == 0, "train.py failed"
    with open(os.path.join(run, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records[-1]["samples_per_sec"] if records else float("nan")


def resnet50_rate(device, batch=128, steps=20):
    """samples/s of a ResNet-50 training step at 224 (bf16, channels_last) on CUDA."""
    import torchvision

    net = torchvision.models.resnet50().to(device, memory_format=torch.channels_last)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, fused=True)
    x = torch.randn(batch, 3, 224, 224, device=device).to(memory_format=torch.channels_last)
    y = torch.randint(0, 1000, (batch,), device=device)
    times = []
    for i in range(steps + 3):
        sync(device)
        start = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - start)
    return batch / statistics.median(times)


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    work = tempfile.TemporaryDirectory(prefix="bench-photos-", dir=args.dir)
    side = presets.stored_side(args.image_size, 0.875)
    print(f"# photos: {args.images} JPEGs per resolution, short side kept at {side}, crops "
          f"of {args.image_size}; {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, load "
          f"average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"{'photos':<8}{'path':<36}{'images/s':>10}{'vs plain':>10}")
    for key in args.sizes.split(","):
        root = make_photos(os.path.join(work.name, key), args.images, SIZES[key])
        folder = data.SafeImageFolder(os.path.join(root, "train"), check=False)
        n = len(folder.samples)
        cache_dir = os.path.join(root, ".cache")
        workers = sorted({0, args.workers})
        runs = {"plain": [], **{w: [] for w in workers}}
        plain_pass(folder, side)  # warm-up (file cache, the allocator's large blocks)
        for _ in range(args.repeats):  # side by side, in turns: the machine's load hits all
            runs["plain"].append(plain_pass(folder, side))
            for w in workers:
                runs[w].append(first_pass(folder, side, cache_dir, w))
        plain = statistics.median(runs["plain"])
        rows = [("plain PIL decode + resize, 1 process", plain)]
        for w in workers:
            rows.append((f"first epoch (cache build), {w} workers", statistics.median(runs[w])))
        cfg = with_defaults({"dataset": "imagefolder", "data_dir": root, "image_size":
                             args.image_size, "num_workers": args.workers, "seed": 0})
        with contextlib.redirect_stderr(io.StringIO()):
            train_set, val_set = data.build_datasets(cfg, log=lambda line: None)
        sampler = data.EpochBatchSampler(n, args.batch_size, 0)
        for w in sorted({0, args.workers}):
            loader = data.build_loader(train_set, batch_sampler=sampler, num_workers=w)
            later_epoch(loader, n, device)  # the workers start
            rows.append((f"later epoch, DataLoader, {w} workers", later_epoch(loader, n,
                                                                               device)))
            data.shutdown_loader(loader)
        loader, _ = device_data.build_device_loaders(cfg, train_set, val_set, sampler,
                                                     device, log=lambda line: None)
        later_epoch(loader, n, device)
        rows.append((f"later epoch, device path ({device})", later_epoch(loader, n, device)))
        for what, rate in rows:
            print(f"{key:<8}{what:<36}{rate:>10.1f}{rate / plain:>9.1f}x")
        first = dict(rows)["first epoch (cache build), 0 workers"]
        later = dict(rows)["later epoch, DataLoader, 0 workers"]
        print(f"{key:<8}targets, per core: first pass {first / plain:.1f}x (>= 2.5x), later "
              f"epochs {later / plain:.1f}x (>= 10x)")
        if args.finetune_steps:
            print(f"{key:<8}train.py torchvision/resnet18 at {args.image_size}, "
                  f"{args.workers} workers: {finetune(root, args, device):.1f} samples/s")
    if device.type == "cuda":
        print(f"ResNet-50 training step at 224 (bf16, channels_last, batch 128): "
              f"{resnet50_rate(device):.0f} samples/s: the device path above must feed "
              f"that many not to make it wait")
    work.cleanup()


if __name__ == "__main__":
    main()

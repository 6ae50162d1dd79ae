"""train.py end to end on a real ImageFolder tree with each data path, side by side.

    python bench/train_paths.py                       # simple_cnn, 32x32, CPU
    python bench/train_paths.py --images 4000 --repeats 3 --device cuda --network resnet9

Writes ``--images`` random 32x32 PNGs into a temporary ImageFolder tree (10 classes,
a tenth of them for validation), then runs ``train.main`` with ``--data-on-device off``
(a DataLoader with ``--workers`` processes decoding and augmenting each sample) and
``--data-on-device on`` (the decoded cache, whole batches augmented in memory), in turns.
Each run trains 3 epochs; the figures are the last epoch's samples/s and compute
efficiency from metrics.jsonl (the first epoch of the device path includes building the
decoded cache; its second run reuses it). Medians over ``--repeats``. This prints
figures; it asserts nothing.
"""

import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import tempfile

import torch
from common import setup_device  # noqa: F401  (puts the repository on the path)
from PIL import Image

import train  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=3000, help="training images (val: +10%%)")
    p.add_argument("--network", default="simple_cnn", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers (off path)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each path")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    return p.parse_args(argv)


def write_tree(root, images):
    g = torch.Generator().manual_seed(0)
    for split, count in (("train", images), ("val", max(images // 10, 10))):
        for i in range(count):
            folder = os.path.join(root, split, f"c{i % 10}")
            os.makedirs(folder, exist_ok=True)
            pixels = torch.randint(0, 256, (32, 32, 3), generator=g, dtype=torch.uint8)
            Image.fromarray(pixels.numpy()).save(os.path.join(folder, f"{i}.png"))


def run(args, tree, run_dir, path):
    argv = ["--dataset", "imagefolder", "--data-dir", tree, "--image-size", "32",
            "--network", args.network, "--batch-size", str(args.batch_size), "--epochs",
            "3", "--num-workers", str(args.workers), "--data-on-device", path,
            "--device", args.device, "--run-dir", run_dir, "--log-every", "1000"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        code = train.main(argv)
    assert code == 0, f"train.py exited {code}"
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f][-1]
    return last["samples_per_sec"], last["compute_efficiency"]


def main(argv=None):
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-paths-") as tmp:
        tree = os.path.join(tmp, "data")
        write_tree(tree, args.images)
        figures = {"off": [], "on": []}
        for r in range(args.repeats):
            for path in (("off", "on") if r % 2 == 0 else ("on", "off")):
                figures[path].append(run(args, tree, os.path.join(tmp, f"{path}{r}"), path))
    print(f"# train.py, {args.network}, ImageFolder of {args.images} 32x32 PNGs, batch "
          f"{args.batch_size}, {args.device}, {torch.get_num_threads()} threads, "
          f"{args.repeats} runs each, last of 3 epochs; load average "
          f"{' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    print(f"{'data path':<34}{'samples/s':>10}{'min':>9}{'max':>9}{'efficiency':>12}")
    names = {"off": f"per-sample, {args.workers} workers", "on": "device (decoded cache)"}
    for path in ("off", "on"):
        rates = [s for s, _ in figures[path]]
        eff = statistics.median(e for _, e in figures[path])
        print(f"{names[path]:<34}{statistics.median(rates):>10.0f}{min(rates):>9.0f}"
              f"{max(rates):>9.0f}{eff:>12.2f}")
    ratio = statistics.median(s for s, _ in figures["on"]) / statistics.median(
        s for s, _ in figures["off"])
    print(f"# device path / per-sample path: {ratio:.2f}x samples/s")


if __name__ == "__main__":
    main()

"""GANs: train.py against a plain two-optimizer loop in the style of the PyTorch examples'
dcgan (examples/dcgan/main.py).

    python bench/gan.py                                        # 32 px, CPU, 200 steps
    python bench/gan.py --device cuda --steps 2000 --samples 20000 --fid-samples 2000
    python bench/gan.py --samples 64 --steps 3 --batch-size 16 --fid-samples 16 \\
        --width 8 --classifier-epochs 1                        # seconds

Generates a set of coloured blobs (two soft discs of one of four colours on a dark noisy
background, the colour its class), writes it as an image folder
(``DIR/{train,val}/<colour>/<i>.png``) and trains the same DCGAN networks (dcgan.py) on
it for the same number of steps, side by side in one run:

* plain: the example's loop, written out: a DataLoader over the images in memory (in
  [-1, 1], shuffled), Adam 2e-4 with betas (0.5, 0.999) for each network, and per batch
  the discriminator's step on BCE(D(real), 1) + BCE(D(G(z).detach()), 0), then the
  generator's on BCE(D(G(z)), 1) (non-saturating; logits and ``BCEWithLogitsLoss``
  where the example has a sigmoid and ``BCELoss``: the same loss, stable).
* train.py: ``python train.py --task gan --network dcgan --dataset imagefolder
  --data-on-device on`` (``train.main``, in this process) with the same recipe for the
  same steps (``--steps`` is rounded up to whole epochs), its steps/s after the first
  epoch and its ``val_fid_classifier`` from metrics.jsonl. (A train.py without ``--task
  gan`` is said in one line; the script then exits 0.) Its data path holds the images
  decoded once, as the plain loop holds them.

The FID of each is measured the same way (gan_metrics.py): ``--fid-samples`` images from
the fixed latents of ``--seed`` against as many validation images, on the penultimate
features of a classifier (``--fid-features CHECKPOINT``, or one train.py trains here on
the blobs' colours for ``--classifier-epochs``): classifier-feature FID, comparable only
within this run, not with Inception FID. Prints steps/s of each (after ``--warmup``
steps) and the FID and KID each reached, and the issue's targets (train.py's steps/s at
least 0.95x the plain loop's; its FID no worse). Asserts nothing.
"""

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn as nn
from common import setup_device, sync  # (puts the repository on the path)
from PIL import Image

import dcgan  # noqa: E402
from reporting import gan_metrics  # noqa: E402

COLOURS = {"red": (0.9, 0.2, 0.2), "green": (0.2, 0.8, 0.3), "blue": (0.2, 0.35, 0.9),
           "yellow": (0.9, 0.85, 0.2)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=2048, help="training images (val: 1/4)")
    p.add_argument("--image-size", type=int, default=32, choices=dcgan.IMAGE_SIZES)
    p.add_argument("--steps", type=int, default=200, help="steps of each side (one D and "
                   "one G update each)")
    p.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    p.add_argument("--batch-size", type=int, default=128, help="the DCGAN paper's")
    p.add_argument("--latent-dim", type=int, default=100, help="the DCGAN paper's")
    p.add_argument("--width", type=int, default=64, help="ngf = ndf (dcgan.py's width)")
    p.add_argument("--lr", type=float, default=2e-4, help="both networks' (the paper's)")
    p.add_argument("--fid-samples", type=int, default=512, help="images on each side of FID")
    p.add_argument("--fid-features", default=None, metavar="CHECKPOINT",
                   help="a classifier checkpoint of train.py; default: train one here")
    p.add_argument("--classifier-epochs", type=int, default=3, help="without --fid-features")
    p.add_argument("--classifier-network", default="resnet9", help="without --fid-features: "
                   "networks.py's name (its last Linear's input are the features: 512 for "
                   "resnet9 and mlp; FID's cost grows with their cube)")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (both sides)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--side", default="both", choices=["both", "plain", "train.py"])
    p.add_argument("--dir", default=None, help="where the set and the runs go (a temp dir)")
    args = p.parse_args(argv)
    if args.samples < 4 * len(COLOURS):
        p.error(f"--samples must be at least {4 * len(COLOURS)}: every colour in val")
    if args.fid_samples > args.samples // 4 or args.fid_samples < 2:
        p.error(f"--fid-samples must be 2 to the {args.samples // 4} validation images")
    if args.steps <= args.warmup:
        p.error("--steps must be more than --warmup")
    return args


def make_blobs(n, size, seed):
    """``n`` images ``(n, 3, size, size)`` uint8 and their labels (colour index): two soft
    discs of the label's colour at random places and radii, on dark noise."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) % len(COLOURS))[torch.randperm(n, generator=g)]  # balanced
    colours = torch.tensor(list(COLOURS.values()))[labels].view(n, 3, 1, 1)
    side = torch.arange(size, dtype=torch.float32) + 0.5
    yy, xx = side.view(1, size, 1), side.view(1, 1, size)
    images = 0.1 + 0.05 * torch.rand(n, 3, size, size, generator=g)
    for _ in range(2):
        cy, cx = (0.2 + 0.6 * torch.rand(2, n, 1, 1, generator=g)) * size
        radius = (0.08 + 0.12 * torch.rand(n, 1, 1, generator=g)) * size
        disc = torch.exp(-((yy - cy) ** 2 + (xx - cx) ** 2) / (2 * radius ** 2))  # (n, H, W)
        images = torch.maximum(images, colours * disc[:, None])
    return (images * 255).round().clamp(0, 255).to(torch.uint8), labels


def write_set(root, args):
    """The blobs as an image folder; returns ``{split: images in [-1, 1]}``, the same
    pixels as the files."""
    names = list(COLOURS)
    out = {}
    for split, n, seed in (("train", args.samples, args.seed),
                           ("val", args.samples // 4, args.seed + 1)):
        images, labels = make_blobs(n, args.image_size, seed)
        for name in names:
            os.makedirs(os.path.join(root, split, name))
        for i, (image, label) in enumerate(zip(images, labels)):
            Image.fromarray(image.permute(1, 2, 0).numpy()).save(
                os.path.join(root, split, names[label], f"{i}.png"))
        out[split] = images.float() / 127.5 - 1
    return out


def run_train_py(argv, run_dir, every=False):
    """Runs train.py in this process (``train.main``: side by side with the plain loop,
    under the same threads and allocator); its metrics.jsonl's last record (``every``:
    all of them). Its output is kept and shown only when it fails."""
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train.main([*argv, "--run-dir", run_dir])
    if code != 0:
        sys.exit(f"train.py failed (exit {code}):\n{out.getvalue()[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return records if every else records[-1]


def train_classifier(root, args, device, work):
    """A classifier of the blobs' colours trained by train.py: the FID's features."""
    run = os.path.join(work, "classifier")
    run_train_py(["--dataset", "imagefolder", "--data-dir", root, "--network",
                  args.classifier_network, "--image-size", str(args.image_size), "--epochs",
                  str(args.classifier_epochs), "--batch-size", "32", "--optimizer", "adam",
                  "--lr", "1e-3", "--weight-decay", "0", "--scheduler", "none",
                  "--warmup-epochs", "0", "--num-workers", str(args.workers), "--device",
                  str(device), "--seed", str(args.seed)], run)
    return os.path.join(run, "checkpoints", "best.pt")


def plain(real, args, device, features):
    """The example's loop for ``--steps`` steps: ``(steps/s, FID/KID dict)``."""
    torch.manual_seed(args.seed)
    net_g = dcgan.Generator(args.latent_dim, 3, args.image_size, width=args.width).to(device)
    net_d = dcgan.Discriminator(3, args.image_size, width=args.width).to(device)
    criterion = nn.BCEWithLogitsLoss()
    opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.5, 0.999))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(real["train"]), batch_size=args.batch_size,
        shuffle=True, num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed))
    step, start = 0, None
    while step < args.steps:
        for (x,) in loader:
            if step == args.warmup:
                sync(device)
                start = time.perf_counter()
            x = x.to(device, non_blocking=True)
            b = x.shape[0]
            ones = torch.ones(b, device=device)
            # (1) D: maximise log D(x) + log(1 - D(G(z)))
            net_d.zero_grad()
            err_real = criterion(net_d(x), ones)
            err_real.backward()
            fake = net_g(torch.randn(b, args.latent_dim, 1, 1, device=device))
            err_fake = criterion(net_d(fake.detach()), torch.zeros_like(ones))
            err_fake.backward()
            opt_d.step()
            # (2) G: maximise log D(G(z))
            net_g.zero_grad()
            err_g = criterion(net_d(fake), ones)
            err_g.backward()
            opt_g.step()
            step += 1
            if step == args.steps:
                break
    sync(device)
    rate = (args.steps - args.warmup) / (time.perf_counter() - start)
    scores = gan_metrics.generator_scores(net_g, real["val"], features, args.fid_samples,
                                          args.seed)
    return rate, scores


def has_gan_task():
    """Whether train.py has ``--task gan`` (tasks.TASKS names it)."""
    import tasks

    return "gan" in tasks.TASKS


def train_py(root, args, device, features_path, run_dir):
    """train.py with the same recipe for ``--steps`` steps (whole epochs: ``steps_of``):
    ``(steps/s, FID/KID dict)`` from metrics.jsonl. Steps/s is over every epoch but the
    first (warm, as the plain loop's clock starts after ``--warmup`` steps; the only one
    when there is one); the data path is the device
    path (``--data-on-device on``: the images decoded once and held as a uint8 tensor, as
    the plain loop holds them), validation only at the end."""
    epochs = args.steps // steps_per_epoch(args)
    records = run_train_py(
        ["--task", "gan", "--network", "dcgan", "--dataset", "imagefolder", "--data-dir",
         root, "--image-size", str(args.image_size), "--no-augment", "--latent-dim",
         str(args.latent_dim), "--gan-width", str(args.width), "--gan-loss", "vanilla",
         "--d-steps", "1", "--epochs", str(epochs), "--eval-every", str(epochs),
         "--batch-size", str(args.batch_size), "--optimizer", "adam", "--lr", str(args.lr),
         "--betas", "0.5", "0.999", "--weight-decay", "0", "--scheduler", "none",
         "--warmup-epochs", "0", "--fid-samples", str(args.fid_samples), "--fid-features",
         features_path, "--num-workers", str(args.workers), "--data-on-device", "on",
         "--log-every", "1000000", "--device", str(device), "--seed", str(args.seed)],
        run_dir, every=True)
    warm = records[1:] or records
    scores = {k[len("val_"):]: v for k, v in records[-1].items()
              if k.startswith(("val_fid", "val_kid"))}
    return steps_per_epoch(args) * len(warm) / sum(r["epoch_time"] for r in warm), scores


def steps_per_epoch(args):
    """Batches of one epoch of the training images (the last may be smaller)."""
    return -(-args.samples // args.batch_size)


def _row(side, rate, scores):
    fid = scores.get("fid_classifier", float("nan"))
    kid = scores.get("kid_classifier", float("nan"))
    return f"{side:<10}{rate:>10.2f}{fid:>17.3f}{kid:>17.5f}"


def main(argv=None):
    args = parse_args(argv)
    per_epoch = steps_per_epoch(args)
    args.steps = -(-args.steps // per_epoch) * per_epoch  # whole epochs, for train.py's
    args.warmup = min(args.warmup, per_epoch - 1) if per_epoch > 1 else 0
    device, name = setup_device(args)
    work = tempfile.TemporaryDirectory(prefix="bench-gan-", dir=args.dir)
    root = os.path.join(work.name, "set")
    real = write_set(root, args)
    print(f"# gan: dcgan {args.image_size} px (width {args.width}, latent "
          f"{args.latent_dim}), {args.samples} blob images, {args.steps} steps of batch "
          f"{args.batch_size}, Adam {args.lr:g} betas (0.5, 0.999), FID on "
          f"{args.fid_samples} images; {device} ({name}), torch {torch.__version__}, "
          f"python {platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    features_path = args.fid_features or train_classifier(root, args, device, work.name)
    features = gan_metrics.classifier_features(features_path).to(device)
    print(f"# FID features: the penultimate layer of {features_path} (classifier features, "
          f"not Inception)")
    print(f"{'side':<10}{'steps/s':>10}{'fid_classifier':>17}{'kid_classifier':>17}")
    rows = {}
    if args.side in ("both", "plain"):
        rows["plain"] = plain(real, args, device, features)
        print(_row("plain", *rows["plain"]))
    if args.side in ("both", "train.py"):
        if not has_gan_task():
            print("train.py has no --task gan yet: its side waits for the GAN task (issue 27)")
            return 0
        rows["train.py"] = train_py(root, args, device, features_path,
                                    os.path.join(work.name, "run"))
        print(_row("train.py", *rows["train.py"]))
    if len(rows) == 2:
        (p_rate, p_scores), (t_rate, t_scores) = rows["plain"], rows["train.py"]
        p_fid, t_fid = p_scores["fid_classifier"], t_scores.get("fid_classifier", np.nan)
        print(f"targets: train.py steps/s / plain {t_rate / p_rate:.2f} (>= 0.95: "
              f"{'yes' if t_rate >= 0.95 * p_rate else 'no'}); FID {t_fid:.3f} vs "
              f"{p_fid:.3f} (no worse: {'yes' if t_fid <= p_fid else 'no'})")
        # bench/gpu.sh collects these lines
        print(f"figure: gan.plain.steps_per_s {p_rate:.2f}")
        print(f"figure: gan.train_py.steps_per_s {t_rate:.2f}")
        print(f"figure: gan.train_py_over_plain {t_rate / p_rate:.3f}")
        print(f"figure: gan.plain.fid_classifier {p_fid:.3f}")
        print(f"figure: gan.train_py.fid_classifier {t_fid:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

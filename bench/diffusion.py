"""Diffusion: train.py's DDPM steps/s against a plain loop of the same network and schedule
in the shape of the diffusers DDPM example (examples/unconditional_image_generation).

    python bench/diffusion.py                                  # 16 px, CPU, under 2 min
    python bench/diffusion.py --device cuda --image-size 32 --width 64 --blocks 2 \\
        --samples 8192 --steps 2000 --batch-size 128 --fid-samples 1024 --repeats 3

Generates bench/gan.py's set of coloured blobs (two soft discs of one of four colours on
dark noise), writes it as an image folder and trains ddpm.py's U-Net on it for the same
number of steps, side by side in one run, ``--repeats`` times (plain, train.py, plain,
train.py, ...):

* plain: the example's loop, written out: a DataLoader over the images in memory (in
  [-1, 1], shuffled), Adam 2e-4 (no weight decay), and per batch a random horizontal flip,
  ``noise = torch.randn_like(x)``, ``t = torch.randint(0, T, (b,))`` on the device,
  ``x_t = q_sample(x, t, noise)`` (the example's ``scheduler.add_noise``), the MSE of the
  U-Net's prediction against the noise, backward, the gradient clipped at 1, a step.
* train.py: ``python train.py --task diffusion --network ddpm --dataset imagefolder
  --data-on-device on`` (``train.main``, in this process) with the same recipe for the
  same steps (``--steps`` rounded up to whole epochs): its steps/s over the epochs after
  the first, its ``val_fid_classifier`` from metrics.jsonl. Its draws come from (seed,
  epoch, step) (exact resume, N processes == 1), the plain loop's from the global RNG.
  Turn k seeds both sides with ``--seed`` + k - 1 (the set and the classifier stay): each
  seed gives its own FID, so the medians weigh the samplers' spread, not one draw.

FID of each is measured alike (gan_metrics.measure): ``--fid-samples`` DDIM samples
(``--sample-steps``) against as many validation images, on the penultimate features of a
classifier (``--fid-features CHECKPOINT``, or one train.py trains here on the blobs'
colours): classifier-feature FID, comparable only within this run. Prints steps/s of each
turn, their medians, the FIDs, and the issue's targets (train.py's steps/s at least 0.95x
the plain loop's; its FID no worse: the seeds move FID more than a loop can, so each
side's turns are compared as two samples, their means by an exact one-sided permutation
test, ``fid_worse``). Asserts nothing.
"""

import argparse
import datetime
import itertools
import math
import os
import platform
import statistics
import sys
import tempfile
import time

import torch
import torch.nn.functional as F
from common import setup_device, sync  # (puts the repository on the path)
from gan import COLOURS, run_train_py, train_classifier, write_set

import ddpm  # noqa: E402
from reporting import gan_metrics  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=256, help="training images (val: 1/4)")
    p.add_argument("--image-size", type=int, default=16)
    p.add_argument("--width", type=int, default=16, help="ddpm.py's --diffusion-width")
    p.add_argument("--blocks", type=int, default=1, help="ddpm.py's --diffusion-blocks")
    p.add_argument("--diffusion-steps", type=int, default=1000, help="T")
    p.add_argument("--schedule", default="linear", choices=ddpm.SCHEDULES)
    p.add_argument("--steps", type=int, default=40, help="optimizer steps of each side")
    p.add_argument("--warmup", type=int, default=2, help="steps before the clock starts")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--lr", type=float, default=2e-4, help="Ho et al.'s")
    p.add_argument("--fid-samples", type=int, default=32, help="images on each side of FID")
    p.add_argument("--sample-steps", type=int, default=10, help="DDIM steps for FID")
    p.add_argument("--fid-features", default=None, metavar="CHECKPOINT",
                   help="a classifier checkpoint of train.py; default: train one here")
    p.add_argument("--classifier-epochs", type=int, default=1, help="without --fid-features")
    p.add_argument("--classifier-network", default="mlp", help="without --fid-features")
    p.add_argument("--repeats", type=int, default=2, help="turns of each side")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (plain)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dir", default=None, help="where the set and the runs go (a temp dir)")
    args = p.parse_args(argv)
    if args.samples < 4 * len(COLOURS):
        p.error(f"--samples must be at least {4 * len(COLOURS)}: every colour in val")
    if args.fid_samples > args.samples // 4 or args.fid_samples < 2:
        p.error(f"--fid-samples must be 2 to the {args.samples // 4} validation images")
    if args.steps <= args.warmup:
        p.error("--steps must be more than --warmup")
    return args


def steps_per_epoch(args):
    """Batches of one epoch of the training images (the last may be smaller)."""
    return -(-args.samples // args.batch_size)


def plain(real, args, device, features, seed):
    """The example's loop for ``--steps`` steps, its draws from ``seed``: ``(steps/s,
    FID/KID dict)``."""
    torch.manual_seed(seed)
    unet = ddpm.UNet(3, args.image_size, args.width, args.blocks).to(device)
    schedule = ddpm.Schedule(args.schedule, args.diffusion_steps)
    optimizer = torch.optim.Adam(unet.parameters(), lr=args.lr, weight_decay=0.0)
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(real["train"]), batch_size=args.batch_size,
        shuffle=True, num_workers=args.workers,
        generator=torch.Generator().manual_seed(seed))
    step, start = 0, None
    while step < args.steps:
        for (x,) in loader:
            if step == args.warmup:
                sync(device)
                start = time.perf_counter()
            x = x.to(device, non_blocking=True)
            b = x.shape[0]
            flip = torch.rand(b, 1, 1, 1, device=device) < 0.5
            x = torch.where(flip, x.flip(-1), x)
            noise = torch.randn_like(x)
            t = torch.randint(0, args.diffusion_steps, (b,), device=device)
            loss = F.mse_loss(unet(schedule.q_sample(x, t, noise), t), noise)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step == args.steps:
                break
    sync(device)
    rate = (args.steps - args.warmup) / (time.perf_counter() - start)
    sampler = ddpm.Sampler(unet, schedule, "ddim", args.sample_steps, seed)
    fake = gan_metrics.generate(sampler, torch.arange(args.fid_samples), args.batch_size)
    return rate, gan_metrics.measure(features, real["val"][:args.fid_samples], fake,
                                     args.seed, args.batch_size)


def train_py(root, args, device, features_path, run_dir, seed):
    """train.py with the same recipe for ``--steps`` steps, ``--seed`` ``seed``: ``(steps/s,
    FID/KID dict)``
    from metrics.jsonl; steps/s over every epoch but the first (the only one when there
    is one), validation (the FID) only at the end."""
    epochs = args.steps // steps_per_epoch(args)
    records = run_train_py(
        ["--task", "diffusion", "--network", "ddpm", "--dataset", "imagefolder", "--data-dir",
         root, "--image-size", str(args.image_size), "--diffusion-width", str(args.width),
         "--diffusion-blocks", str(args.blocks), "--diffusion-steps",
         str(args.diffusion_steps), "--noise-schedule", args.schedule, "--sampler", "ddim",
         "--sample-steps", str(args.sample_steps), "--epochs", str(epochs), "--eval-every",
         str(epochs), "--batch-size", str(args.batch_size), "--optimizer", "adam", "--lr",
         str(args.lr), "--weight-decay", "0", "--scheduler", "none", "--warmup-epochs", "0",
         "--grad-clip", "1", "--fid-samples", str(args.fid_samples), "--fid-features",
         features_path, "--num-workers", "0", "--data-on-device", "on", "--log-every",
         "1000000", "--device", str(device), "--seed", str(seed)],
        run_dir, every=True)
    warm = records[1:] or records
    scores = {k[len("val_"):]: v for k, v in records[-1].items()
              if k.startswith(("val_fid", "val_kid"))}
    return steps_per_epoch(args) * len(warm) / sum(r["epoch_time"] for r in warm), scores


def fid_worse(plain_fids, train_fids):
    """Whether train.py's FIDs are worse than the plain loop's beyond the seeds' spread: the
    means and standard deviations of each side's turns (one seed each), and the exact
    one-sided permutation test of the difference of the means (every split of the pooled
    FIDs into two groups of these sizes: the share whose train.py mean exceeds the plain
    one's by at least the observed difference). "worse: no" when train.py's mean is not
    above the plain loop's, "not shown" when it is but p >= 0.05, "yes" when p < 0.05."""
    n, m = len(plain_fids), len(train_fids)
    pooled = [*plain_fids, *train_fids]
    if n < 2 or m < 2 or any(math.isnan(v) for v in pooled):
        better = statistics.median(train_fids) <= statistics.median(plain_fids)
        return f"train.py worse: {'no' if better else 'yes'} (the medians alone; --repeats 2+)"
    observed = statistics.mean(train_fids) - statistics.mean(plain_fids)
    splits = list(itertools.combinations(range(n + m), m))
    as_far = sum(statistics.mean(pooled[i] for i in chosen)
                 - statistics.mean(pooled[i] for i in range(n + m) if i not in chosen)
                 >= observed - 1e-9 for chosen in splits)
    p = as_far / len(splits)
    verdict = "no" if observed <= 0 else ("not shown (p >= 0.05)" if p >= 0.05 else "yes")
    return (f"means plain {statistics.mean(plain_fids):.1f} +- "
            f"{statistics.stdev(plain_fids):.1f}, train.py {statistics.mean(train_fids):.1f} "
            f"+- {statistics.stdev(train_fids):.1f}; train.py - plain {observed:+.1f}, "
            f"one-sided permutation p {p:.3f}; train.py worse: {verdict}")


def _row(side, turn, rate, scores):
    fid = scores.get("fid_classifier", float("nan"))
    kid = scores.get("kid_classifier", float("nan"))
    return f"{side:<10}{turn:>5}{rate:>10.2f}{fid:>17.3f}{kid:>17.5f}"


def main(argv=None):
    args = parse_args(argv)
    per_epoch = steps_per_epoch(args)
    args.steps = -(-args.steps // per_epoch) * per_epoch  # whole epochs, for train.py's
    args.warmup = min(args.warmup, per_epoch - 1) if per_epoch > 1 else 0
    device, name = setup_device(args)
    work = tempfile.TemporaryDirectory(prefix="bench-diffusion-", dir=args.dir)
    root = os.path.join(work.name, "set")
    real = write_set(root, args)
    print(f"# diffusion: ddpm U-Net {args.image_size} px (width {args.width}, "
          f"{args.blocks} block(s)), {args.diffusion_steps} {args.schedule} timesteps, "
          f"{args.samples} blob images, {args.steps} steps of batch {args.batch_size}, Adam "
          f"{args.lr:g}, clip 1, flips; FID on {args.fid_samples} DDIM samples of "
          f"{args.sample_steps} steps; {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, load "
          f"average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    features_path = args.fid_features or train_classifier(root, args, device, work.name)
    features = gan_metrics.classifier_features(features_path).to(device)
    print(f"# FID features: the penultimate layer of {features_path} (classifier features, "
          f"not Inception)")
    print(f"{'side':<10}{'turn':>5}{'steps/s':>10}{'fid_classifier':>17}{'kid_classifier':>17}")
    rows = {"plain": [], "train.py": []}
    for turn in range(1, args.repeats + 1):  # side by side, alternating
        seed = args.seed + turn - 1  # each turn its own draws: FID's spread shows
        rows["plain"].append(plain(real, args, device, features, seed))
        print(_row("plain", turn, *rows["plain"][-1]))
        rows["train.py"].append(train_py(root, args, device, features_path,
                                         os.path.join(work.name, f"run{turn}"), seed))
        print(_row("train.py", turn, *rows["train.py"][-1]))
    p_rate = statistics.median(r for r, _ in rows["plain"])
    t_rate = statistics.median(r for r, _ in rows["train.py"])
    p_fid = statistics.median(s["fid_classifier"] for _, s in rows["plain"])
    t_fid = statistics.median(s.get("fid_classifier", float("nan")) for _, s in rows["train.py"])
    print(f"medians of {args.repeats}: plain {p_rate:.2f} steps/s, FID {p_fid:.3f}; train.py "
          f"{t_rate:.2f} steps/s, FID {t_fid:.3f}")
    fids = [[s.get("fid_classifier", float("nan")) for _, s in rows[side]]
            for side in ("plain", "train.py")]
    worse = fid_worse(*fids)
    print(f"targets: train.py steps/s / plain {t_rate / p_rate:.2f} (>= 0.95: "
          f"{'yes' if t_rate >= 0.95 * p_rate else 'no'}); FID {t_fid:.3f} vs {p_fid:.3f} "
          f"(medians; {worse})")
    # bench/gpu.sh collects these lines
    print(f"figure: diffusion.plain.steps_per_s {p_rate:.2f}")
    print(f"figure: diffusion.train_py.steps_per_s {t_rate:.2f}")
    print(f"figure: diffusion.train_py_over_plain {t_rate / p_rate:.3f}")
    print(f"figure: diffusion.plain.fid_classifier {p_fid:.3f}")
    print(f"figure: diffusion.train_py.fid_classifier {t_fid:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

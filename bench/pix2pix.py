"""pix2pix: train.py against a plain two-optimizer loop in the shape of
junyanz/pytorch-CycleGAN-and-pix2pix (models/pix2pix_model.py: ``optimize_parameters``).

    python bench/pix2pix.py                                    # 32 px, CPU, about a minute
    python bench/pix2pix.py --device cuda --samples 4096 --steps 1024 --width 64 \\
        --image-size 64 --batch-size 32
    python bench/pix2pix.py --samples 32 --steps 4 --batch-size 8 --width 8 --repeats 1

Both sides train the same networks (pix2pix.py's U-Net and PatchGAN, InstanceNorm) on the
same synthetic pairs (pair_data.py: coloured outlines in, the shapes filled out; no
augmentation), with the same recipe (Adam 2e-4, betas (0.5, 0.999), vanilla GAN loss +
100 x L1), for the same number of steps, side by side in one process, ``--repeats``
times in turn (plain first in the odd repeats, train.py in the even ones):

* plain: the reference's loop written out: the pairs in memory in a shuffled DataLoader,
  per batch ``fake = G(x)``; the discriminator's step on ``(BCE(D(x, fake.detach()), 0) +
  BCE(D(x, y), 1)) / 2``; then, D's parameters set not to require gradients, the
  generator's on ``BCE(D(x, fake), 1) + 100 * |fake - y|``.
* train.py: ``python train.py --task pix2pix --dataset synthetic`` (``train.main``, in
  this process) with the same recipe for the same steps (rounded up to whole epochs), its
  epochs' times (metrics.jsonl's epoch_time) and its ``val_psnr``.

Each side's steps/s is timed per epoch, the first of each run left out (warm-up): each
repeat's median, and every warm epoch of every repeat pooled (their median; and the
fastest epoch, the one least disturbed by other jobs on a shared machine, as ``timeit``
takes its minimum).

``--alternate-epochs N`` then runs both sides once more, in one run: ``train.main`` with
an epoch of the plain loop before each of its epochs (after it, every other pair), so that
the swings of a shared machine, longer than a turn of a few epochs, fall on both sides
alike; the figure is the ratio of the two sides' median epochs.

PSNR is measured the same way for both (tasks.pix2pix's ``Pix2PixEvaluation``: torchmetrics'
PeakSignalNoiseRatio of the outputs in [0, 1] on the validation pairs, eval mode). Prints
each repeat's steps/s and PSNR of both sides, the pooled figures, and the issue's targets
(train.py's steps/s at least 0.95x the plain loop's, pooled medians; its PSNR no worse).
Asserts nothing.
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

import torch
import torch.nn as nn
import torch.nn.functional as F
from common import setup_device, sync  # (puts the repository on the path)

import pix2pix  # noqa: E402
from config import with_defaults  # noqa: E402
from pipeline import pair_data  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--samples", type=int, default=512, help="training pairs (val: 1/5)")
    p.add_argument("--image-size", type=int, default=32, help="a multiple of 32")
    p.add_argument("--steps", type=int, default=96, help="steps of each side (one D and "
                   "one G update each), rounded up to whole epochs")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--width", type=int, default=16, help="ngf = ndf (the paper's 64)")
    p.add_argument("--lr", type=float, default=2e-4, help="both networks' (the paper's)")
    p.add_argument("--l1-weight", type=float, default=100.0, help="the paper's lambda")
    p.add_argument("--repeats", type=int, default=2, help="times each side runs, in turn")
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers (both sides)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--alternate-epochs", type=int, default=0, metavar="N",
                   help="then N epochs of each side in one run, an epoch of each in turn "
                   "(0: not)")
    p.add_argument("--dir", default=None, help="where the runs go (a temp dir)")
    args = p.parse_args(argv)
    if args.image_size % 32 or args.samples < 5 or args.repeats < 1:
        p.error("--image-size must be a multiple of 32, --samples at least 5, --repeats 1+")
    return args


def the_pairs(args):
    """The synthetic pairs train.py trains on, unaugmented, as tensors in [-1, 1]:
    ``{split: (inputs, targets)}``."""
    config = with_defaults({"task": "pix2pix", "dataset": "synthetic", "seed": args.seed,
                            "image_size": args.image_size, "synthetic_size": args.samples,
                            "num_classes": 4, "augment": False})
    out = {}
    for split, dataset in zip(("train", "val"), pair_data.build_datasets(config)):
        a, b = zip(*(dataset[i] for i in range(len(dataset))))
        out[split] = (torch.stack(a), torch.stack(b))
    return out


def psnr(generator, val, device):
    """The validation PSNR, SSIM and L1 of ``generator`` as train.py measures them."""
    from tasks.pix2pix import Pix2PixEvaluation

    evaluation = Pix2PixEvaluation(device)
    generator.eval()
    with torch.no_grad():
        for x, y in zip(val[0].split(64), val[1].split(64)):
            x, y = x.to(device), y.to(device)
            evaluation.update(generator(x), y, x)
    generator.train()
    return evaluation.compute()["psnr"]


def plain_epochs(pairs, args, device):
    """The reference's loop, an epoch at a time: ``(generator, epochs)``, the generator it
    trains (for its PSNR) and an iterator that trains an epoch per ``next`` and gives its
    wall time, for as many epochs as asked."""
    torch.manual_seed(args.seed)
    net_g, net_d = (n.to(device) for n in pix2pix.build(
        {"image_size": args.image_size, "pix2pix_width": args.width}, 3, 3))
    criterion = nn.BCEWithLogitsLoss()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=args.lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=args.lr, betas=(0.5, 0.999))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(*pairs["train"]), batch_size=args.batch_size,
        shuffle=True, num_workers=args.workers,
        generator=torch.Generator().manual_seed(args.seed))

    def epochs():
        while True:
            sync(device)
            start = time.perf_counter()
            for x, y in loader:
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                fake = net_g(x)
                # (1) D: real pairs against the generator's, detached
                net_d.requires_grad_(True)
                opt_d.zero_grad()
                pred_fake = net_d(torch.cat([x, fake.detach()], 1))
                pred_real = net_d(torch.cat([x, y], 1))
                loss_d = (criterion(pred_fake, torch.zeros_like(pred_fake))
                          + criterion(pred_real, torch.ones_like(pred_real))) * 0.5
                loss_d.backward()
                opt_d.step()
                # (2) G: fool D, and be near the target
                net_d.requires_grad_(False)
                opt_g.zero_grad()
                pred = net_d(torch.cat([x, fake], 1))
                loss_g = criterion(pred, torch.ones_like(pred)) + \
                    args.l1_weight * F.l1_loss(fake, y)
                loss_g.backward()
                opt_g.step()
            sync(device)
            yield time.perf_counter() - start

    return net_g, epochs()


def plain(pairs, args, device):
    """The reference's loop for ``--steps`` steps (whole epochs): ``(times, PSNR)``, the
    wall time of each epoch after the first."""
    net_g, epochs = plain_epochs(pairs, args, device)
    times = [next(epochs) for _ in range(args.steps // steps_per_epoch(args))]
    return warm(times), psnr(net_g, pairs["val"], device)


def alternating(pairs, args, device, run_dir):
    """``--alternate-epochs N``: both sides in one run, an epoch of each in turn (the
    plain loop's epoch before train.py's in odd pairs, after it in even ones), so that
    the machine's swings fall on both alike: the epoch pairs' times, the first left out.
    train.py runs as ``train_py`` runs it; its epochs are timed around ``run_epoch``."""
    import train

    _, epochs = plain_epochs(pairs, args, device)
    pairs_timed, run_epoch = [], train.run_epoch

    def both(*a, **k):
        turn = len(pairs_timed)
        timed = {}
        for side in ("plain", "train.py")[::1 if turn % 2 == 0 else -1]:
            if side == "plain":
                timed[side] = next(epochs)
            else:
                start = time.perf_counter()
                ended = run_epoch(*a, **k)
                sync(device)
                timed[side] = time.perf_counter() - start
        pairs_timed.append((timed["plain"], timed["train.py"]))
        return ended

    train.run_epoch = both
    try:
        train_py(args, device, run_dir, epochs=args.alternate_epochs)
    finally:
        train.run_epoch = run_epoch
    return pairs_timed[1:]


def warm(times):
    """The epochs after the first (the first alone when there is one)."""
    return times[1:] or times


def run_train_py(argv, run_dir):
    """train.py in this process (``train.main``); its metrics.jsonl records. Its output is
    shown only when it fails."""
    import train

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = train.main([*argv, "--run-dir", run_dir])
    if code != 0:
        sys.exit(f"train.py failed (exit {code}):\n{out.getvalue()[-3000:]}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def train_py(args, device, run_dir, epochs=None):
    """train.py with the same recipe for ``--steps`` steps (or ``epochs``): ``(times,
    PSNR)``, the ``epoch_time`` of each epoch after the first (validation only at the
    end)."""
    epochs = epochs or args.steps // steps_per_epoch(args)
    records = run_train_py(
        ["--task", "pix2pix", "--dataset", "synthetic", "--synthetic-size", str(args.samples),
         "--num-classes", "4", "--image-size", str(args.image_size), "--no-augment",
         "--pix2pix-width", str(args.width), "--pix2pix-gan-loss", "vanilla", "--l1-weight",
         str(args.l1_weight), "--epochs", str(epochs), "--eval-every", str(epochs),
         "--batch-size", str(args.batch_size), "--optimizer", "adam", "--lr", str(args.lr),
         "--betas", "0.5", "0.999", "--weight-decay", "0", "--scheduler", "none",
         "--num-workers", str(args.workers), "--log-every", "1000000", "--device",
         str(device), "--seed", str(args.seed)], run_dir)
    return warm([r["epoch_time"] for r in records]), records[-1]["val_psnr"]


def steps_per_epoch(args):
    return -(-args.samples // args.batch_size)


def main(argv=None):
    args = parse_args(argv)
    per_epoch = steps_per_epoch(args)
    args.steps = -(-args.steps // per_epoch) * per_epoch  # whole epochs, for train.py's
    device, name = setup_device(args)
    work = tempfile.TemporaryDirectory(prefix="bench-pix2pix-", dir=args.dir)
    print(f"# pix2pix: U-Net + PatchGAN at {args.image_size} px (width {args.width}, "
          f"InstanceNorm), {args.samples} synthetic pairs, {args.steps} steps of batch "
          f"{args.batch_size}, Adam {args.lr:g} betas (0.5, 0.999), GAN + {args.l1_weight:g} "
          f"x L1, {args.repeats} repeat(s); {device} ({name}), torch {torch.__version__}, "
          f"python {platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}")
    pairs = the_pairs(args)
    print(f"{'repeat':<8}{'side':<10}{'steps/s':>10}{'val_psnr':>10}  (each: the median "
          f"of its {max(args.steps // per_epoch - 1, 1)} warm epoch(s))")
    times = {"plain": [], "train.py": []}
    psnrs = {"plain": [], "train.py": []}
    for r in range(args.repeats):
        for side in ("plain", "train.py")[::1 if r % 2 == 0 else -1]:  # ABBA: drift cancels
            took, value = plain(pairs, args, device) if side == "plain" else \
                train_py(args, device, os.path.join(work.name, f"run{r}"))
            times[side] += took
            psnrs[side].append(value)
            print(f"{r + 1:<8}{side:<10}{per_epoch / statistics.median(took):>10.2f}"
                  f"{value:>10.3f}")
    # Every warm epoch of every repeat, pooled: the median, and the fastest (the least
    # disturbed by other jobs on a shared machine, as timeit takes its minimum)
    (p_rate, p_best, p_psnr), (t_rate, t_best, t_psnr) = (
        (per_epoch / statistics.median(times[s]), per_epoch / min(times[s]),
         statistics.median(psnrs[s])) for s in ("plain", "train.py"))
    print(f"pooled over {len(times['plain'])} and {len(times['train.py'])} warm epochs: "
          f"plain {p_rate:.2f} steps/s (fastest epoch {p_best:.2f}), PSNR {p_psnr:.3f}; "
          f"train.py {t_rate:.2f} steps/s (fastest epoch {t_best:.2f}), PSNR {t_psnr:.3f}")
    print(f"targets: train.py steps/s / plain {t_rate / p_rate:.2f} (>= 0.95: "
          f"{'yes' if t_rate >= 0.95 * p_rate else 'no'}; fastest epochs "
          f"{t_best / p_best:.2f}); PSNR {t_psnr:.3f} vs {p_psnr:.3f} "
          f"(no worse: {'yes' if t_psnr >= p_psnr else 'no'})")
    if args.alternate_epochs:
        timed = alternating(pairs, args, device, os.path.join(work.name, "alternating"))
        p_med, t_med = (statistics.median(t[i] for t in timed) for i in (0, 1))
        paired = statistics.median(p / t for p, t in timed)
        print(f"alternating, {len(timed)} warm epochs of each in turn: plain "
              f"{per_epoch / p_med:.2f} steps/s, train.py {per_epoch / t_med:.2f}; "
              f"train.py / plain {p_med / t_med:.3f} (medians; the epoch pairs' median "
              f"ratio {paired:.3f}; >= 0.95: {'yes' if p_med / t_med >= 0.95 else 'no'})")
        print(f"figure: pix2pix.alternating.train_py_over_plain {p_med / t_med:.3f}")
    # bench/gpu.sh collects these lines
    print(f"figure: pix2pix.plain.steps_per_s {p_rate:.2f}")
    print(f"figure: pix2pix.train_py.steps_per_s {t_rate:.2f}")
    print(f"figure: pix2pix.train_py_over_plain {t_rate / p_rate:.3f}")
    print(f"figure: pix2pix.train_py_over_plain_fastest {t_best / p_best:.3f}")
    print(f"figure: pix2pix.plain.psnr {p_psnr:.3f}")
    print(f"figure: pix2pix.train_py.psnr {t_psnr:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

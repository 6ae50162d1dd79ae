"""What --prefetch (prefetch_generator.BackgroundGenerator) adds, with and without workers.

    python bench/prefetch.py                         # simple_cnn, augmented, batch 128
    python bench/prefetch.py --workers 0,2,4 --prefetch 0,2,8 --device cuda --steps 100

A realistic loop: ``engine.train_one_epoch`` (engine.steps to the end of an epoch; one
process, a tqdm bar
to os.devnull, no per-step logging besides the engine's own counters), simple_cnn on the
synthetic 32x32 set with train.py's augmentation (random crop with padding, horizontal
flip, seeded per sample), batch 128. One DataLoader per --workers value (data.build_loader,
persistent workers), one freshly seeded network per configuration, crossed with each
--prefetch depth (0: the loader is iterated directly). Each repeat runs every
configuration for one epoch of --steps batches, in an order that rotates from repeat to
repeat; the figures are medians over repeats, each configuration relative to
workers 0 / prefetch 0 of the same repeat.

Memory: before each timed epoch the peak resident set size of this process and of the
loader's worker processes is reset (Linux /proc/<pid>/clear_refs); after it, the peak
(VmHWM) minus the resident size at the start, summed over those processes, is the
epoch's peak growth: batches held by the queues and the workers. All configurations share
this process, so a slow growth (a leak) shows only for the whole run: its resident size
after the warmup and at the end are printed. Without /proc the figures read n/a.
This prints figures; it asserts nothing.
"""

import argparse
import contextlib
import datetime
import os
import platform
import re
import statistics
import sys
import time

import torch  # noqa: E402
from common import setup_device, sync  # noqa: E402  (puts the repository on the path)

from config import with_defaults  # noqa: E402
from losses import build_criterion  # noqa: E402
from machinery import engine, meters  # noqa: E402
from networks import build_network  # noqa: E402
from pipeline import data  # noqa: E402
from tasks.classification import Classification  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--network", default="simple_cnn", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step")
    p.add_argument("--steps", type=int, default=30, help="steps (batches) per timed epoch")
    p.add_argument("--repeats", type=int, default=7, help="timed epochs per configuration")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each first")
    p.add_argument("--workers", default="0,2", help="comma-separated --num-workers values")
    p.add_argument("--prefetch", default="0,2", help="comma-separated --prefetch depths")
    p.add_argument("--augment", action=argparse.BooleanOptionalAction, default=True,
                   help="random crop and flip, as train.py does by default")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    args.prefetch = [int(d) for d in args.prefetch.split(",") if d.strip()]
    return args


def _status_kib(pid, field):
    try:
        with open(f"/proc/{pid}/status") as f:
            match = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak(pid):
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")  # peak RSS (VmHWM) := current RSS
        return True
    except OSError:
        return False


def worker_pids(loader):
    iterator = getattr(loader, "_iterator", None)
    return [w.pid for w in getattr(iterator, "_workers", [])]


class Config:
    """One (workers, prefetch) configuration: its loader, network, optimizer, engine."""

    def __init__(self, loader, workers, depth, net, device):
        self.loader, self.workers, self.depth, self.net = loader, workers, depth, net
        group = {"params": list(net.parameters()), "base_lr": 0.1}
        self.optimizer = torch.optim.SGD([group], lr=0.1, momentum=0.9, nesterov=True,
                                         weight_decay=5e-4)
        self.loop = engine.LoopSettings(
            device=device, scaler=torch.amp.GradScaler(device.type, enabled=False),
            prefetch=depth, show_progress=True, timer=engine.StepTimer(device),
            counters=meters.Counters(device))
        self.progress = engine.TrainState()
        self.times, self.peaks = [], []
        self.efficiency = []

    @property
    def name(self):
        return f"workers {self.workers}, prefetch {self.depth}"

    def epoch(self, criterion, epoch):
        self.loop.timer.reset()
        self.progress.epoch_samples = 0
        with open(os.devnull, "w") as null, contextlib.redirect_stderr(null):
            engine.train_one_epoch(self.net, self.loader, self.optimizer,
                                   Classification(10, criterion=criterion), self.loop,
                                   self.progress)
        self.loop.counters.read()  # the one sync train.py's logging would do


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    size = args.steps * args.batch_size
    config = with_defaults({"dataset": "synthetic", "data_dir": "data", "seed": args.seed,
                            "augment": args.augment, "image_size": 32,
                            "synthetic_size": size, "num_classes": 10})
    train_set, _ = data.build_datasets(config)
    criterion = build_criterion({"label_smoothing": 0.1})
    samplers, loaders = {}, {}
    for w in args.workers:
        samplers[w] = data.EpochBatchSampler(size, args.batch_size, args.seed)
        loaders[w] = data.build_loader(train_set, batch_sampler=samplers[w], num_workers=w,
                                       pin_memory=device.type == "cuda")
    configs = []
    for w in args.workers:
        for d in args.prefetch:
            torch.manual_seed(args.seed)
            net = build_network(args.network, 10, 3, 32).to(device)
            configs.append(Config(loaders[w], w, d, net, device))

    print(f"# prefetch: engine.train_one_epoch, {args.network}, synthetic 32x32 "
          f"({'augmented' if args.augment else 'no augmentation'}), batch {args.batch_size}, "
          f"{args.repeats} x {args.steps} timed steps (+{args.warmup} warmup) per config")
    print(f"# {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}", flush=True)

    for c in configs:  # warmup; also starts the persistent workers
        samplers[c.workers].set_epoch(0, start=max(size - args.warmup * args.batch_size, 0))
        c.epoch(criterion, 0)
    sync(device)

    me = os.getpid()
    rss_start = _status_kib(me, "VmRSS")
    for r in range(args.repeats):
        order = configs[r % len(configs):] + configs[:r % len(configs)]
        for c in order:
            samplers[c.workers].set_epoch(r + 1)
            pids = [me, *worker_pids(c.loader)]
            start_rss = {pid: _status_kib(pid, "VmRSS") for pid in pids}
            can_reset = all(_reset_peak(pid) for pid in pids)
            sync(device)
            start = time.perf_counter()
            c.epoch(criterion, r + 1)
            sync(device)
            c.times.append(time.perf_counter() - start)
            data_t, compute_t, _ = c.loop.timer.totals()
            c.efficiency.append(engine.efficiency(data_t, compute_t))
            peaks = {pid: _status_kib(pid, "VmHWM") for pid in pids}
            if can_reset and None not in peaks.values() and None not in start_rss.values():
                c.peaks.append(sum(peaks[p] - start_rss[p] for p in pids) / 1024)
    rss_end = _status_kib(me, "VmRSS")
    for w in args.workers:
        data.shutdown_loader(loaders[w])

    def mib(value):
        return f"{value:.1f}" if value is not None else "n/a"

    base = next(c for c in configs if c.workers == args.workers[0]
                and c.depth == args.prefetch[0])
    print()
    print(f"{'configuration':<24}{'samples/s':>10}{'min':>8}{'max':>8}"
          f"{f'vs {base.workers}/{base.depth}':>9}{'efficiency':>11}"
          f"{'peak +MiB':>11}")
    rates = {}
    for c in configs:
        r = [size / t for t in c.times]
        rates[c.name] = statistics.median(r)
        ratio = statistics.median(b / t for b, t in zip(base.times, c.times))
        peak = statistics.median(c.peaks) if c.peaks else None
        print(f"{c.name:<24}{rates[c.name]:>10.1f}{min(r):>8.1f}{max(r):>8.1f}"
              f"{ratio:>9.3f}{statistics.median(c.efficiency):>11.2f}"
              f"{mib(peak):>11}")
    print(f"# load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}; "
          f"efficiency = compute / (compute + data wait), engine's StepTimer; this "
          f"process: {mib(rss_start and rss_start / 1024)} MiB resident after the warmup, "
          f"{mib(rss_end and rss_end / 1024)} MiB at the end")
    # The recommendation: a depth becomes the default only if it was faster than prefetch 0
    # in every repeat (paired: same repeat, same workers), with train.py's default workers
    # (2) when measured. Otherwise the thread is not worth its memory and complexity.
    wins = {}  # workers -> {depth: (median speed-up over depth 0, repeats it was faster)}
    for w in args.workers:
        by_depth = {c.depth: c.times for c in configs if c.workers == w}
        if 0 not in by_depth:
            continue
        wins[w] = {}
        for d, times in by_depth.items():
            if d:
                ups = [z / t - 1 for z, t in zip(by_depth[0], times)]
                wins[w][d] = (statistics.median(ups), sum(u > 0 for u in ups))
    n = args.repeats
    parts = [f"workers {w}: " + ", ".join(f"prefetch {d} {g:+.1%} (faster in {k}/{n})"
                                          for d, (g, k) in ws.items())
             for w, ws in wins.items() if ws]
    print(f"# speed-up over prefetch 0 with the same workers, median of paired repeats: "
          f"{'; '.join(parts)}")
    w_default = 2 if 2 in wins else (args.workers[-1] if args.workers[-1] in wins else None)
    if w_default is None or not wins[w_default]:
        print("recommendation: none (measure prefetch 0 and another depth)")
        return
    depth, (gain, k) = max(wins[w_default].items(), key=lambda kv: kv[1][0])
    choice = depth if k == n and gain > 0 else 0
    print(f"recommendation: default --prefetch {choice}: with --num-workers {w_default}, "
          f"--prefetch {depth} was {gain:+.1%} (faster in {k} of {n} repeats)")

if __name__ == "__main__":
    main()

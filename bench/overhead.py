"""What train.py's loop costs over a bare training loop.

    python bench/overhead.py                        # simple_cnn, batch 128, 50 steps x 5
    python bench/overhead.py --threads 1            # steadier on a shared, busy CPU
    python bench/overhead.py --device cuda --steps 200 --num-workers 4
    python bench/overhead.py --network mlp --image-size 8 --batch-size 32   # overhead/step

The same network (one seeded initialisation, a copy per loop), the same DataLoader
(data.build_loader over data.EpochBatchSampler on the synthetic set), the same batches
and the same criterion (losses.build_criterion, label smoothing 0.1) go through:

* bare: ``for x, y in loader``: copy to the device, zero_grad, forward, loss, backward,
  step. Nothing else.
* engine: ``engine.steps`` with what train.py gives it (LoopSettings with a disabled
  GradScaler, the cosine lr_factor, StepTimer, Counters; a runlog.Progress), and
  train.py's own ``log_train`` every --log-every steps: it reads the counters (the one
  sync) and the timer totals, writes train/loss and train/lr to TensorBoard (a RunLog in
  a temporary directory) and shows the figures. By default (--bar null) stderr goes to
  os.devnull, which is no terminal: the Progress prints plain lines, as in a log file.
  One engine row per --prefetch depth (a BackgroundGenerator thread when > 0).

Augmentation is off by default: data costs the same in every loop, so cheaper data makes
the engine's own cost a larger, easier to see share of each step (--augment turns it on).
The synthetic set holds --chunk batches, so one epoch is --chunk steps. A repeat is
--steps steps of every loop, run as epochs of --chunk steps that take turns, in an order
that rotates at every turn, so that changes in the machine's load hit every loop alike;
a loop's time in a repeat is the wall time of its epochs (iterator start and the bar
included, so short chunks count the engine's per-epoch setup more often than a real
epoch would; on CUDA up to a synchronize). --chunk equal to --steps runs whole epochs.
Figures are medians over repeats; "vs bare" is the median of each repeat's ratio to the
bare loop of the same repeat. CPU time (time.process_time: every thread of this process,
not the workers) is printed too: other programs on a busy machine change it much less
than the wall clock (caches and memory bandwidth are still shared). This prints figures;
it asserts nothing.
"""

import argparse
import contextlib
import copy
import datetime
import functools
import os
import platform
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402
from common import setup_device  # noqa: E402  (puts the repository on the path)

import data  # noqa: E402
import engine  # noqa: E402
import ops  # noqa: E402
import runlog  # noqa: E402
import runtime  # noqa: E402
import train  # noqa: E402
from losses import build_criterion  # noqa: E402
from networks import build_network  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--network", default="simple_cnn", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step")
    p.add_argument("--image-size", type=int, default=32, help="side of the synthetic images")
    p.add_argument("--steps", type=int, default=50, help="timed steps per repeat and loop")
    p.add_argument("--chunk", type=int, default=10, help="steps per epoch: the loops take "
                   "turns every --chunk steps")
    p.add_argument("--repeats", type=int, default=7, help="timed repeats of each loop")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps of each loop first")
    p.add_argument("--num-workers", type=int, default=0, help="DataLoader workers")
    p.add_argument("--prefetch", default="0,2", help="comma-separated BackgroundGenerator "
                   "depths: one engine row each")
    p.add_argument("--log-every", type=int, default=50, help="log every N steps")
    p.add_argument("--augment", action=argparse.BooleanOptionalAction, default=False,
                   help="random crop and flip (train.py's default); off: data is cheaper")
    p.add_argument("--bar", default="null", choices=["null", "stderr", "off"],
                   help="the engine's tqdm bar: to os.devnull, to stderr, or disabled")
    p.add_argument("--tensorboard", action=argparse.BooleanOptionalAction, default=True,
                   help="log scalars to a SummaryWriter as train.py does")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    p.add_argument("--seed", type=int, default=0, help="data and initialisation seed")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.prefetch = [int(d) for d in args.prefetch.split(",") if d.strip()]
    args.chunk = min(max(args.chunk, 1), args.steps)
    args.rounds = -(-args.steps // args.chunk)
    args.steps = args.rounds * args.chunk
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_optimizer(net):
    """SGD as train.py's build_optimizer makes it with the default flags."""
    group = {"params": [p for p in net.parameters() if p.requires_grad], "base_lr": 0.1}
    return torch.optim.SGD([group], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4)


def bare_epoch(model, loader, optimizer, criterion, device):
    """The reference: the minimal training loop."""
    model.train()
    for x, y in loader:
        x = x.to(device, non_blocking=True)
        y = y.to(device, non_blocking=True)
        optimizer.zero_grad(set_to_none=True)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()


class EngineLoop:
    """train.py's loop: engine.steps, with train.log_train / train.show deciding, as
    train.run_epochs does, when to log (no checkpoints, no validation)."""

    def __init__(self, net, device, prefetch, args, total_steps, log_dir):
        self.log_every, self.bar = args.log_every, args.bar
        optimizer = make_optimizer(net)
        loop = engine.LoopSettings(
            device=device, epochs=args.repeats * args.rounds + 1, prefetch=prefetch,
            scaler=torch.amp.GradScaler(device.type, enabled=False),
            show_progress=args.bar != "off",
            lr_factor=functools.partial(ops.lr_factor, total_steps=total_steps,
                                        schedule="cosine", warmup_steps=total_steps // 10),
            timer=engine.StepTimer(device), counters=engine.Counters(device))
        engine.set_lr(optimizer, loop.lr_factor(0))
        self.t = train.Training(
            config={"log_every": args.log_every, "max_nonfinite": 10}, procs=runtime.Processes(
                0, 1, device), net=net, model=net, optimizer=optimizer, loop=loop,
            state=engine.TrainState(), meter=engine.LossMeter(loop.counters), saver=None,
            run_log=runlog.RunLog(log_dir, 0, 0, enabled=log_dir is not None),
            val_loader=None, datasets=())

    def epoch(self, loader, criterion, epoch):
        t = self.t
        t.state.epoch_samples = 0
        t.loop.timer.reset()
        t.meter.restart(t.state.step)
        with contextlib.ExitStack() as stack:
            if self.bar == "null":  # the bar takes sys.stderr when it is made
                null = stack.enter_context(open(os.devnull, "w"))
                stack.enter_context(contextlib.redirect_stderr(null))
            bar = stack.enter_context(runlog.Progress(f"epoch {epoch}", len(loader),
                                                      t.loop.show_progress))
            steps = stack.enter_context(contextlib.closing(engine.steps(
                t.model, loader, t.optimizer, criterion, t.loop, t.state, bar)))
            for step in steps:
                if step % self.log_every == 0:
                    train.log_train(t, bar)
                elif bar.due():
                    train.show(t, bar)


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    size = args.chunk * args.batch_size
    config = {"dataset": "synthetic", "data_dir": "data", "seed": args.seed,
              "augment": args.augment, "image_size": args.image_size,
              "synthetic_size": size, "num_classes": 10}
    train_set, _ = data.build_datasets(config)
    sampler = data.EpochBatchSampler(size, args.batch_size, args.seed)
    loader = data.build_loader(train_set, batch_sampler=sampler, num_workers=args.num_workers,
                               pin_memory=device.type == "cuda")
    criterion = build_criterion({"label_smoothing": 0.1})
    torch.manual_seed(args.seed)
    net0 = build_network(args.network, 10, 3, args.image_size)

    tb_dir = tempfile.TemporaryDirectory(prefix="bench-overhead-") if args.tensorboard \
        else None

    loops = {}  # name -> callable(epoch)
    bare_net = copy.deepcopy(net0).to(device)
    bare_opt = make_optimizer(bare_net)
    loops["bare"] = lambda e: bare_epoch(bare_net, loader, bare_opt, criterion, device)
    total_steps = args.steps * args.repeats + args.warmup
    engines = {}
    for depth in args.prefetch:
        loop = EngineLoop(copy.deepcopy(net0).to(device), device, depth, args, total_steps,
                          tb_dir.name if tb_dir else None)
        engines[depth] = loop
        loops[f"engine --prefetch {depth}"] = lambda e, loop=loop: loop.epoch(loader,
                                                                             criterion, e)
    names = list(loops)

    print(f"# overhead: {args.network}, synthetic {args.image_size}x{args.image_size} "
          f"({'augmented' if args.augment else 'no augmentation'}), batch {args.batch_size},"
          f" {args.repeats} x {args.steps} timed steps in turns of {args.chunk} "
          f"(+{args.warmup} warmup) per loop, "
          f"num_workers {args.num_workers}, log every {args.log_every}, bar {args.bar}")
    print(f"# {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}", flush=True)

    # Warmup: the last --warmup batches of epoch 0, through every loop.
    sampler.set_epoch(0, start=max(size - args.warmup * args.batch_size, 0))
    for n in names:
        loops[n](0)
    sync(device)

    times = {n: [0.0] * args.repeats for n in names}
    cpu = {n: [0.0] * args.repeats for n in names}
    for r in range(args.repeats):
        for k in range(args.rounds):
            epoch = r * args.rounds + k + 1
            turn = epoch % len(names)
            for n in names[turn:] + names[:turn]:
                sampler.set_epoch(epoch)  # every loop sees the same batches
                sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                loops[n](epoch)
                sync(device)
                times[n][r] += time.perf_counter() - start
                cpu[n][r] += time.process_time() - start_cpu

    for loop in engines.values():
        loop.t.run_log.close({}, None)
    if tb_dir is not None:
        tb_dir.cleanup()
    data.shutdown_loader(loader)

    print()
    print(f"{'wall clock':<22}{'samples/s':>10}{'min':>9}{'max':>9}{'vs bare':>9}"
          f"{'ratio range':>14}{'ms/step over bare':>19}")
    med = statistics.median
    for n in names:
        rates = [args.steps * args.batch_size / t for t in times[n]]
        line = f"{n:<22}{med(rates):>10.1f}{min(rates):>9.1f}{max(rates):>9.1f}"
        if n != "bare":
            ratios = [b / t for b, t in zip(times["bare"], times[n])]  # paired, per repeat
            extra = [(t - b) / args.steps * 1e3 for b, t in zip(times["bare"], times[n])]
            line += (f"{med(ratios):>9.3f}{f'{min(ratios):.3f}..{max(ratios):.3f}':>14}"
                     f"{med(extra):>+19.2f}")
        print(line)
    print()
    print(f"{'CPU time, this process':<22}{'ms/step':>10}{'min':>9}{'max':>9}{'vs bare':>9}"
          f"{'ratio range':>14}{'ms/step over bare':>19}")
    for n in names:
        per_step = [c / args.steps * 1e3 for c in cpu[n]]
        line = f"{n:<22}{med(per_step):>10.2f}{min(per_step):>9.2f}{max(per_step):>9.2f}"
        if n != "bare":
            ratios = [b / c for b, c in zip(cpu["bare"], cpu[n])]
            extra = [(c - b) / args.steps * 1e3 for b, c in zip(cpu["bare"], cpu[n])]
            line += (f"{med(ratios):>9.3f}{f'{min(ratios):.3f}..{max(ratios):.3f}':>14}"
                     f"{med(extra):>+19.2f}")
        print(line)
    print(f"# load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}; "
          f"vs bare = bare time / loop time in the same repeat (median), 1.000 = no "
          f"overhead; CPU time counts every thread of this process (not workers), so it "
          f"waits less on a busy machine than the wall clock")


if __name__ == "__main__":
    main()

"""What train.py's loop costs over a bare training loop.

    python bench/overhead.py                        # simple_cnn, batch 128, 50 steps x 5
    python bench/overhead.py --threads 1            # steadier on a shared, busy CPU
    python bench/overhead.py --device cuda --steps 200 --num-workers 4
    python bench/overhead.py --network mlp --image-size 8 --batch-size 32   # overhead/step

The same network (one seeded initialisation, a copy per loop), the same DataLoader
(data.build_loader over data.EpochBatchSampler on the synthetic set), the same batches
and the same criterion (losses.build_criterion, label smoothing 0.1) go through:

* bare: ``for x, y in loader``: copy to the device, zero_grad, forward, loss, backward,
  step (the engine's SGD implementation: fused on CUDA). Nothing else.
* engine: train.py's own step loop, ``train.run_epoch``, over a ``train.Training`` that
  ``train.build_training`` made from train.py's flags (what a run of ``python train.py
  --dataset synthetic --no-augment ...`` builds: the LoopSettings with a disabled
  GradScaler, the cosine schedule, StepTimer, Counters, a RunLog, a Saver in a
  temporary run directory, and the hang watchdog's thread as train.fit starts it).
  Between steps it decides what a run decides: stop? log
  (every --log-every steps ``log_train`` reads the counters, the one sync, and the timer
  totals, writes train/loss and train/lr to TensorBoard and shows the figures)? save?
  By default (--bar null) stderr goes to os.devnull, which is no terminal: the Progress
  prints plain lines, as in a log file. One engine row per --prefetch depth (a
  BackgroundGenerator thread when > 0). The loaders are the runs' own; the bare loop
  iterates the first one.

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
import io
import os
import platform
import statistics
import sys
import tempfile
import time

import torch  # noqa: E402
from common import setup_device, sync  # noqa: E402  (puts the repository on the path)

import train  # noqa: E402
from machinery import hardware, runtime, watchdog  # noqa: E402
from pipeline import data  # noqa: E402
from reporting import runlog  # noqa: E402


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


def make_optimizer(net, like):
    """SGD as train.py's build_optimizer makes it with the default flags, with the
    implementation of ``like`` (the engine's optimizer): fused on CUDA, as the engine's,
    so that the two loops differ in the loop alone."""
    group = {"params": [p for p in net.parameters() if p.requires_grad], "base_lr": 0.1}
    return torch.optim.SGD([group], lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4,
                           fused=like.defaults["fused"], foreach=like.defaults["foreach"])


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


def train_flags(args, prefetch, size, epochs, run_dir):
    """train.py's command line for the engine rows."""
    return ["--dataset", "synthetic", "--network", args.network, "--seed", str(args.seed),
            "--synthetic-size", str(size), "--image-size", str(args.image_size),
            "--batch-size", str(args.batch_size), "--epochs", str(epochs),
            "--num-workers", str(args.num_workers), "--prefetch", str(prefetch),
            "--log-every", str(args.log_every), "--device", str(args.device),
            "--data-on-device", "off", "--warmup-epochs", str(0.1 * epochs),
            "--augment" if args.augment else "--no-augment", "--run-dir", run_dir]


class EngineLoop:
    """train.py's loop: ``train.run_epoch`` over what ``train.build_training`` built."""

    def __init__(self, args, prefetch, size, epochs, run_dir, stop):
        config, _ = train.parse_config(train_flags(args, prefetch, size, epochs, run_dir))
        train.check_config(config)
        procs = runtime.Processes(0, 1, torch.device(args.device))
        hardware.seed_everything(args.seed, 0, False, procs.device)  # one initialisation
        os.makedirs(os.path.join(run_dir, "checkpoints"))
        with contextlib.redirect_stdout(io.StringIO()):  # the torchinfo summary
            self.training, self.loader = train.build_training(
                config, procs, run_dir)
        # The hang watchdog, as train.fit starts it (--hang-timeout's automatic default).
        self.training.watchdog = watchdog.Watchdog(
            config["hang_timeout"], run_dir, 0, self.training.state).start()
        self.bar, self.stop = args.bar, stop

    def epoch(self, epoch, start=0):
        training = self.training
        training.state.epoch_samples = start  # every loop sees the same batches of `epoch`
        with contextlib.ExitStack() as stack:
            if self.bar == "null":  # the bar takes sys.stderr when it is made
                null = stack.enter_context(open(os.devnull, "w"))
                stack.enter_context(contextlib.redirect_stderr(null))
            if self.bar == "off":
                training.run_log.progress = _no_bar
            train.run_epoch(training, self.loader, epoch, self.stop)

    def close(self):
        self.training.watchdog.stop()
        self.training.run_log.close({}, None)
        data.shutdown_loader(self.loader)


def _no_bar(epoch, epochs, total):
    return runlog.Progress(f"epoch {epoch + 1}/{epochs}", total, enabled=False)


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    size = args.chunk * args.batch_size
    epochs = args.repeats * args.rounds + 1
    stop = runtime.StopRequest()
    work = tempfile.TemporaryDirectory(prefix="bench-overhead-")
    engines = {depth: EngineLoop(args, depth, size, epochs,
                                 os.path.join(work.name, f"prefetch-{depth}"), stop)
               for depth in args.prefetch}
    first = engines[args.prefetch[0]]
    loader, criterion = first.loader, first.training.task.criterion
    sampler = loader.batch_sampler

    loops = {}  # name -> callable(epoch)
    bare_net = copy.deepcopy(first.training.net)  # the same initialisation as every row
    bare_opt = make_optimizer(bare_net, first.training.optimizer)
    def bare(epoch, start=0):
        sampler.set_epoch(epoch, start)
        bare_epoch(bare_net, loader, bare_opt, criterion, device)

    loops["bare"] = bare
    for depth, loop in engines.items():
        loops[f"engine --prefetch {depth}"] = loop.epoch
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
    for n in names:
        loops[n](0, max(size - args.warmup * args.batch_size, 0))
    sync(device)

    times = {n: [0.0] * args.repeats for n in names}
    cpu = {n: [0.0] * args.repeats for n in names}
    for r in range(args.repeats):
        for k in range(args.rounds):
            epoch = r * args.rounds + k + 1
            turn = epoch % len(names)
            for n in names[turn:] + names[:turn]:
                sync(device)
                start, start_cpu = time.perf_counter(), time.process_time()
                loops[n](epoch)
                sync(device)
                times[n][r] += time.perf_counter() - start
                cpu[n][r] += time.process_time() - start_cpu

    for loop in engines.values():
        loop.close()
    stop.restore()
    work.cleanup()

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

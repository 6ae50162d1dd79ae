"""The LR range test (``--find-lr``): a short sweep of the learning rate instead of a run.

``train.fit`` builds the run as usual (``build_training``) and hands its parts to ``run``
(the network, optimizer, task, loop settings, state, run log and loaders), which
takes ``--find-lr-steps`` real optimizer steps (``engine.steps``, with the run's
accumulation, precision, clipping and mixing), the learning rate of step ``i`` being

    lr_i = min * (max / min) ** (i / (steps - 1))

on every param group, over as many epochs of the sampler as it takes. Each step's loss
(the mean over all processes) goes into an exponentially smoothed curve (beta 0.98 with
bias correction, as fastai's ``lr_find``); the sweep stops early when the smoothed loss
is not finite or above 4x its minimum so far (it diverged), or on a stop signal.

The suggestion is the learning rate where the smoothed loss falls fastest (the most
negative slope against log10(lr), the first and last few points left out); the minimum's
learning rate / 10 is reported beside it. Process 0 writes ``lr_find.png`` (the curve, the
suggestion marked), ``lr_find.json`` and, through ``RunLog``, the TensorBoard scalars
``z_lr_find/loss`` and ``z_lr_find/lr`` (x: the step) and the image ``z_lr_find/plot``. A
file the file system refuses (a full disk) is one ``warning:`` naming it and why, and the
suggestion is printed all the same; the closing line names only the files written. No
checkpoint is written, so the run directory takes a real run (or ``--resume auto``, which
starts fresh) afterwards.
"""

import contextlib
import dataclasses
import io
import itertools
import json
import math
import os
import re
import signal
import sys

import numpy as np
import torch.distributed as dist

import ops
from machinery import engine, files, runtime
from ops import UserError
from pipeline import data
from reporting import metrics, runlog

BETA = 0.98          # the smoothing of the loss (an exponential moving average)
DIVERGED = 4.0       # the sweep stops once the smoothed loss exceeds this times its minimum
SKIP_START, SKIP_END = 10, 5  # points the suggestion leaves out (at most a tenth, a 20th)
PNG, JSON = "lr_find.png", "lr_find.json"
RULE = "steepest fall of the smoothed loss"


def check_config(config):
    """--find-lr with --resume is a user error: the test starts from fresh weights and
    saves nothing, so it has nothing to continue."""
    if config["find_lr"] and config["resume"] is not None:
        raise UserError(f"--find-lr runs an LR range test from fresh weights and saves no "
                        f"checkpoint: it cannot --resume {config['resume']}; drop one of them")


def sweep_lrs(low, high, steps):
    """The learning rate of each of ``steps`` steps, exponentially from ``low`` to ``high``."""
    return [low * (high / low) ** (i / (steps - 1)) for i in range(steps)]


class Curve:
    """The losses of the sweep, raw and smoothed (bias-corrected EMA, ``BETA``)."""

    def __init__(self):
        self.lrs, self.losses, self.smoothed = [], [], []
        self._average, self.best = 0.0, math.inf
        self.tensorboard_failed = False  # the disk refused it once (said): no more tries

    def add(self, lr, loss):
        """Records a step; returns True when the smoothed loss diverged (not finite, or
        above ``DIVERGED`` times the best so far)."""
        self._average = BETA * self._average + (1 - BETA) * loss
        smooth = self._average / (1 - BETA ** (len(self.lrs) + 1))
        self.lrs.append(lr)
        self.losses.append(loss)
        self.smoothed.append(smooth)
        if not math.isfinite(smooth) or (len(self.lrs) > 1 and smooth > DIVERGED * self.best):
            return True
        self.best = min(self.best, smooth)
        return False


def suggest(lrs, smoothed):
    """The suggested learning rate and the minimum's / 10, from the finite part of the
    smoothed curve.

    Returns:
        ``(steepest, min_over_10)``; ``(None, None)`` with fewer than 3 finite points.
    """
    finite = next((i for i, v in enumerate(smoothed) if not math.isfinite(v)), len(smoothed))
    lrs, smoothed = np.array(lrs[:finite]), np.array(smoothed[:finite])
    if len(lrs) < 3:
        return None, None
    start, end = min(SKIP_START, len(lrs) // 10), min(SKIP_END, len(lrs) // 20)
    window = slice(start, len(lrs) - end)
    if len(lrs[window]) < 3:
        window = slice(0, len(lrs))
    slope = np.gradient(smoothed[window], np.log10(lrs[window]))
    steepest = float(lrs[window][int(np.argmin(slope))])
    return steepest, float(lrs[int(np.argmin(smoothed))]) / 10


def run(config, procs, model, optimizer, task, loop, state, run_log, loaders, stop):
    """The LR range test on a run ``train.build_training`` built; writes its files.

    Args:
        config: the run's (``find_lr_min``, ``find_lr_max``, ``find_lr_steps``,
            ``run_dir``, ``network``, ``dataset``, ``batch_size``, the flags it ignores).
        procs: ``runtime.Processes``.
        model: what is called (maybe DDP / compiled).
        optimizer: its param groups take the sweep's learning rates.
        task: the run's task (tasks.py): its batches and loss.
        loop: the ``engine.LoopSettings`` (accumulation, precision, counters, timer).
        state: the ``engine.TrainState`` the steps advance.
        run_log: the run's ``runlog.RunLog`` (TensorBoard, MLflow); closed here.
        loaders: ``(train_loader, val_loader)``: the first is swept; both are shut down.
        stop: the run's ``runtime.StopRequest``.

    Returns:
        The exit code: 0, or 128 + the signal's number when a stop signal ended it.
    """
    train_loader, val_loader = loaders
    low, high, steps = config["find_lr_min"], config["find_lr_max"], config["find_lr_steps"]
    ignored = [flag for flag, on in (("--profile-steps", config.get("profile_steps")),
                                     ("--early-stop-patience",
                                      config.get("early_stop_patience"))) if on]
    if ignored:
        runtime.main_print(f"note: the LR range test (--find-lr) ignores "
                           f"{' and '.join(ignored)}")
    runtime.main_print(f"LR range test: {steps} steps, lr from {low:g} to {high:g} "
                       f"(exponential), {config['network']} on {config['dataset']} "
                       f"({procs.world_size} process(es), {procs.device}); no checkpoint is "
                       f"written")
    try:
        curve, why = sweep(config, procs, model, optimizer, task, loop, state, run_log,
                           train_loader, stop, sweep_lrs(low, high, steps))
    finally:
        data.shutdown_loader(train_loader)
        data.shutdown_loader(val_loader)
    steepest, min_over_10 = suggest(curve.lrs, curve.smoothed)
    written = []
    if procs.is_main:  # a file the disk refuses is a warning: the suggestion is still said
        written = write(config, run_log, curve, steepest, min_over_10, why)
    with _warning_instead("TensorBoard's event file", config["run_dir"]) \
            if not curve.tensorboard_failed else contextlib.suppress(OSError, ops.RunFailed):
        run_log.close(config, None if why == "signal" else {})  # MLflow's end too
    if procs.world_size > 1:  # no process exits (torchrun would stop the rest) before the
        dist.barrier()        # files are written
    say_result(config, curve, steepest, min_over_10, why, stop, written)
    return stop.exit_code if why == "signal" else 0


@contextlib.contextmanager
def _warning_instead(what, where):
    """A write the file system refuses (full, read-only, gone): one ``warning:`` line
    naming the file and why, instead of an error that would lose the suggestion.

    Yields:
        A list that holds the error, if there was one.
    """
    failed = []
    try:
        yield failed
    except (OSError, ops.RunFailed) as e:
        if isinstance(e, OSError):
            why = e.strerror or e
        else:  # RunLog's line for a training run: "writing X into D failed (WHY); ..."
            found = re.search(r" failed \((.+?)\); ", str(e))
            why = found.group(1) if found else e
        runtime.say(f"warning: could not write {what} ({where}): {why}", file=sys.stderr)
        failed.append(e)


def sweep(config, procs, model, optimizer, task, loop, state, run_log, train_loader, stop,
          lrs):
    """The steps, each at its learning rate; the loss of each read back (one sync). The
    arguments are ``run``'s; ``lrs``: the learning rate of each step.

    Returns:
        ``(curve, why)``: the ``Curve`` and why it ended: None (all steps), "diverged"
        or "signal".
    """
    for group in optimizer.param_groups:  # engine.set_lr: lr = base_lr * factor = lrs[step]
        group["base_lr"] = 1.0             # (never saved: the test writes no checkpoint)
    def lr_at(step):  # engine.steps asks after each step for the next one's
        return lrs[min(step, len(lrs) - 1)]

    loop = dataclasses.replace(loop, lr_factor=lr_at)  # the run's own is left as it is
    engine.set_lr(optimizer, loop.lr_factor(0))
    counters, sampler, curve = loop.counters, train_loader.batch_sampler, Curve()
    counters.reset()
    loop.timer.reset()
    total = len(lrs) * loop.accum  # the bar counts micro-batches
    with runlog.Progress("lr range test", total, procs.is_main) as bar:
        for epoch in itertools.count():
            state.epoch, state.epoch_samples = epoch, 0
            sampler.set_epoch(epoch, 0)
            with contextlib.closing(engine.steps(model, train_loader, optimizer, task, loop,
                                                 state, bar)) as each:
                for step in each:
                    lr = lrs[step - 1]
                    loss = step_loss(counters, loop.device, procs.world_size)
                    diverged = curve.add(lr, loss)
                    log_step(config, procs, loop, run_log, bar, curve, step - 1)
                    if stop.agreed(procs):
                        return curve, "signal"
                    if diverged:
                        return curve, "diverged"
                    if step >= len(lrs):
                        return curve, None


def step_loss(counters, device, world_size):
    """The mean loss of the last step over all processes (nan if any was not finite)."""
    values = counters.read()
    loss_sum, count, samples = ops.sum_over_processes(
        [values["loss_sum"], values["loss_count"], values["samples"]], device, world_size)
    return loss_sum / count if count and count == samples else math.nan


def log_step(config, procs, loop, run_log, bar, curve, i):
    """Step ``i`` to TensorBoard (``z_lr_find/loss``: the smoothed loss) and the bar."""
    smooth = curve.smoothed[-1]
    if math.isfinite(smooth) and not curve.tensorboard_failed:
        with _warning_instead("TensorBoard's event file", config["run_dir"]) as failed:
            run_log.scalars({metrics.LR_FIND_LOSS: smooth, metrics.LR_FIND_LR: curve.lrs[-1]},
                            i)
        curve.tensorboard_failed = bool(failed)
    data_t, compute_t, wall = loop.timer.totals()
    rate = len(curve.lrs) * config["batch_size"] * loop.accum * procs.world_size \
        / max(wall, 1e-9)
    bar.show(smooth, rate, engine.efficiency(data_t, compute_t), log_step=True)


def _number(value):
    return value if value is not None and math.isfinite(value) else None  # JSON has no nan


def write(config, run_log, curve, steepest, min_over_10, why):
    """lr_find.json, lr_find.png and the TensorBoard image (process 0); a file the file
    system refuses is a warning (``_warning_instead``).

    Returns:
        The paths of the files written.
    """
    run_dir = config["run_dir"]
    record = {"lrs": curve.lrs, "losses": [_number(v) for v in curve.losses],
              "smoothed": [_number(v) for v in curve.smoothed],
              "suggested_lr": steepest, "rule": RULE, "min_loss_lr_div10": min_over_10,
              "min": config["find_lr_min"], "max": config["find_lr_max"],
              "steps": config["find_lr_steps"], "steps_taken": len(curve.lrs),
              "stopped_early": why is not None, "stopped_by": why,
              "beta": BETA, "diverged_above": DIVERGED}
    written = []
    path = os.path.join(run_dir, JSON)
    with _warning_instead(path, "the curve and the suggestion") as failed:
        files.atomic_write(path, lambda f: json.dump(record, f, indent=1, allow_nan=False))
    written += [] if failed else [path]
    png, path = plot(curve, steepest, config), os.path.join(run_dir, PNG)
    with _warning_instead(path, "the plot") as failed:
        files.atomic_write(path, lambda f: f.write(png), mode="wb")
    written += [] if failed else [path]
    from PIL import Image

    pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
    if not curve.tensorboard_failed:
        with _warning_instead(f"the TensorBoard image {metrics.LR_FIND_PLOT}", run_dir) \
                as failed:
            if run_log.image(metrics.LR_FIND_PLOT, pixels, 0):
                run_log.flush()
        curve.tensorboard_failed = bool(failed)
    return sorted(written, key=lambda p: p.endswith(JSON))  # the plot first


def plot(curve, steepest, config):
    """The smoothed loss against the learning rate (log axis), as PNG bytes (Agg)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(7, 4.5), dpi=100)
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    finite = [(lr, loss) for lr, loss in zip(curve.lrs, curve.smoothed) if math.isfinite(loss)]
    if finite:
        ax.plot(*zip(*finite), label="smoothed loss")
        raw = [(lr, loss) for lr, loss in zip(curve.lrs, curve.losses) if math.isfinite(loss)]
        ax.plot(*zip(*raw), alpha=0.3, linewidth=0.8, label="loss")
        first, low = finite[0][1], min(loss for _, loss in finite)
        top = min(max(loss for _, loss in finite), first + max(first - low, 0.1 * abs(first)))
        span = max(top - low, 1e-3 * max(abs(low), 1e-12))  # the divergence stays in view
        ax.set_ylim(low - 0.05 * span, top + 0.05 * span)    # only as far as the start
    else:
        ax.text(0.5, 0.5, "no finite loss", ha="center", va="center", transform=ax.transAxes)
    if steepest is not None:
        at = curve.smoothed[curve.lrs.index(steepest)]
        ax.axvline(steepest, color="tab:red", linestyle="--", linewidth=1)
        ax.plot([steepest], [at], "o", color="tab:red", label=f"suggested --lr {steepest:.3g}")
    ax.set_xscale("log")
    ax.set_xlim(config["find_lr_min"], config["find_lr_max"])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    ax.set_title(f"LR range test: {config['network']} on {config['dataset']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(loc="best")
    figure.tight_layout()
    out = io.BytesIO()
    figure.savefig(out, format="png")
    return out.getvalue()


def say_result(config, curve, steepest, min_over_10, why, stop, written=None):
    """The lines that end the test: why it stopped, the suggestion, where the files are
    (``written``: those of process 0 that were written, all where None)."""
    log, steps, run_dir = runtime.main_print, config["find_lr_steps"], config["run_dir"]
    if why == "diverged":
        log(f"stopped at step {len(curve.lrs)} of {steps}: the smoothed loss diverged "
            f"(not finite, or above {DIVERGED:g}x its minimum) at lr {curve.lrs[-1]:.3g}")
    elif why == "signal":
        log(f"{signal.Signals(stop.signum).name}: stopped the LR range test after "
            f"{len(curve.lrs)} of {steps} steps; no checkpoint is written")
    if steepest is None:
        log(f"no suggestion: {len(curve.lrs)} step(s) with a finite loss are too few "
            f"(at least 3); try more --find-lr-steps or a lower --find-lr-max")
    else:
        log(f"suggested --lr {steepest:.3g} ({RULE}; the minimum / 10 is {min_over_10:.3g})")
    if written is None:
        written = [os.path.join(run_dir, PNG), os.path.join(run_dir, JSON)]
    if written:
        log(f"LR range test: {', '.join(written)} (TensorBoard: {metrics.LR_FIND_LOSS}, "
            f"{metrics.LR_FIND_PLOT})")

"""Everything a run writes into its run directory, except checkpoints.

``RunDirectory`` creates and locks the directory and records how the run was made
(config.yaml, command.txt). ``RunLog`` is the only writer of TensorBoard and of
metrics.jsonl (one line per finished epoch), summary.txt, the first-batch image grid and
the hparams. ``Progress`` is the epoch's progress bar, or plain lines in a log file.
Only the main process writes.
"""

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

import torch
import yaml
from tqdm import tqdm

import checkpoint
import ops
import runtime
from config import NOT_SAVED_IN_CONFIG
from ops import RunFailed, UserError


def default_run_dir(config):
    """``runs/<time>-<network>-<dataset>``."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = config["network"].replace("/", "-")
    return os.path.join("runs", f"{stamp}-{name}-{config['dataset']}")


class RunDirectory:
    """The run directory, created and locked for this run by the main process.

    Use it as a context manager around the run. One run at a time: a second run in the
    same directory gets a UserError naming the first (``checkpoint.RunLock``). A run
    that fails before it wrote a checkpoint removes a directory it created, so an
    offline typo leaves nothing behind.

    Args:
        path: the directory.
        is_main: whether this is the main process (the others only read).
    """

    def __init__(self, path, is_main):
        self.path, self.is_main = path, is_main
        self.created = False
        self.lock = None

    def __enter__(self):
        if not self.is_main:
            return self
        ckpt_dir = os.path.join(self.path, "checkpoints")
        self.created = not os.path.lexists(self.path)
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise UserError(f"--run-dir {self.path!r} is a file, not a directory")
        try:
            os.makedirs(ckpt_dir, exist_ok=True)
            checkpoint.probe_writable(ckpt_dir)
        except OSError as e:
            self._remove_if_created()
            raise UserError(f"--run-dir {self.path!r} cannot be written "
                            f"({e.strerror or e}{': ' + e.filename if e.filename else ''})"
                            ) from None
        self.lock = checkpoint.RunLock(self.path, warn=runtime.main_print)
        try:
            self.lock.acquire()
        except BaseException:
            self.lock = None
            self._remove_if_created()
            raise
        return self

    def __exit__(self, kind, error, traceback):
        if self.lock is not None:
            self.lock.release()
        if kind is not None:
            self._remove_if_created()
        return False

    def _remove_if_created(self):
        ckpt_dir = os.path.join(self.path, "checkpoints")
        if self.created and not (os.path.isdir(ckpt_dir) and any(
                name.endswith(".pt") for name in os.listdir(ckpt_dir))):
            shutil.rmtree(self.path, ignore_errors=True)

    def record(self, config, argv, resuming):
        """Writes config.yaml and appends to command.txt; a fresh run refuses a directory
        that already holds checkpoints (all processes check, the main one writes)."""
        ckpt_dir = os.path.join(self.path, "checkpoints")
        if not resuming and config["resume"] != "auto" and os.path.isdir(ckpt_dir) and any(
                f.endswith(".pt") for f in os.listdir(ckpt_dir)):
            raise UserError(f"{self.path!r} already holds checkpoints; continue it with "
                            f"--resume auto, or choose another --run-dir")
        if not self.is_main:
            return
        saved = {k: v for k, v in config.items() if k not in NOT_SAVED_IN_CONFIG}
        checkpoint.atomic_write(os.path.join(self.path, "config.yaml"),
                                lambda f: yaml.safe_dump(saved, f, sort_keys=False))
        with open(os.path.join(self.path, "command.txt"), "a") as f:
            f.write(f"{datetime.datetime.now().isoformat(timespec='seconds')}  "
                    f"{shlex.join(['python', 'train.py', *argv])}\n"
                    f"  git {_git_commit()}  torch {torch.__version__}  {platform.node()}\n")


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (commit + (" (with uncommitted changes)" if dirty else "")) or "unknown"


def read_metrics(path, up_to_epoch):
    """The lines of metrics.jsonl for epochs up to ``up_to_epoch``, as JSON text.

    Lines that do not parse (half-written by a killed run or a full disk, not UTF-8,
    not a JSON object with an integer ``epoch``) are dropped with a warning.
    """
    kept, damaged = [], 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.strip():
                continue
            try:
                record = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError):
                record = None
            epoch = record.get("epoch") if isinstance(record, dict) else None
            if not isinstance(epoch, int) or isinstance(epoch, bool):
                damaged += 1
            elif epoch <= up_to_epoch:
                kept.append(json.dumps(record) + "\n")
    if damaged:
        runtime.say(f"warning: {path}: dropped {damaged} damaged line(s) (a run killed "
                    f"while writing, or a full disk); the other lines are kept",
                    file=sys.stderr)
    return kept


class RunLog:
    """TensorBoard and metrics.jsonl, summary.txt and the first-batch grid.

    The only writer of TensorBoard. A resumed run drops what the stopped one logged
    after its checkpoint at ``step`` (everything at ``step`` itself was logged before
    the save), so each tag shows one continuous curve and each epoch appears once.

    Args:
        run_dir: the run directory.
        step: optimizer steps of the checkpoint resumed from (0 for a fresh run).
        epoch: finished epochs of that checkpoint.
        enabled: False on every process but the main one.
    """

    def __init__(self, run_dir, step, epoch, enabled):
        self.enabled, self.run_dir = enabled, run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run_dir, purge_step=step + 1 if step > 0 else None)
        kept = read_metrics(self.path, epoch) if os.path.exists(self.path) else []
        checkpoint.atomic_write(self.path, lambda f: f.writelines(kept))

    def scalars(self, values, step):
        if self.enabled:
            with self._failing("TensorBoard"):
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)

    @contextlib.contextmanager
    def _failing(self, what):
        """A write that the file system refused stops the run with one line (exit 1)."""
        try:
            yield
        except OSError as e:
            raise RunFailed(f"writing {what} into {self.run_dir!r} failed "
                            f"({e.strerror or e}); the checkpoints are intact: continue "
                            f"with --resume auto once there is room") from None

    def epoch(self, record):
        """Appends one finished epoch to metrics.jsonl (flushed and fsynced)."""
        if self.enabled:
            perf = {"perf/compute_efficiency": "compute_efficiency",
                    "perf/samples_per_sec": "samples_per_sec", "perf/tflops": "tflops",
                    "perf/mfu": "mfu"}
            self.scalars({tag: record[key] for tag, key in perf.items() if key in record},
                         record["step"])
            with self._failing("metrics.jsonl"), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def summary(self, net, train_set, device):
        """Prints the torchinfo summary and writes it to summary.txt with parameter counts.

        torchinfo runs the network on a random input: the global RNG is forked around
        it, so a resumed run's RNG stays as the checkpoint left it.
        """
        if not self.enabled:
            return
        import torchinfo

        trainable, frozen = ops.count_parameters(net)
        shape = (1, train_set.in_channels, train_set.image_size, train_set.image_size)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            text = str(torchinfo.summary(net, input_size=shape, device=device, mode="eval",
                                         verbose=0, col_names=("output_size", "num_params",
                                                               "trainable")))
        text += f"\nTrainable parameters: {trainable:,}\nFrozen parameters: {frozen:,}\n"
        checkpoint.atomic_write(os.path.join(self.run_dir, "summary.txt"),
                                lambda f: f.write(text))
        runtime.say(text)

    def first_batch(self, train_set, sampler):
        """An image grid of the first training batch, to check what the network sees."""
        if not self.enabled:
            return
        import torchvision

        keys = next(iter(sampler))[:64]
        images = torch.stack([train_set[key][0] for key in keys])
        grid = torchvision.utils.make_grid(images[:, :3], nrow=8, normalize=True)
        self.writer.add_image("train/first_batch", grid, 0)

    def progress(self, epoch, epochs, total):
        """The progress display of one epoch (0-based ``epoch``) of ``total`` batches."""
        return Progress(f"epoch {epoch + 1}/{epochs}", total, self.enabled)

    def flush(self):
        if self.enabled:
            with self._failing("TensorBoard"):
                self.writer.flush()

    def close(self, config, final, step=0):
        """Writes the hparams with the final metrics (when the run finished) and closes."""
        if not self.enabled:
            return
        with self._failing("TensorBoard"):
            self._close(config, final, step)

    def _close(self, config, final, step):
        if final:
            from torch.utils.tensorboard.summary import hparams

            hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                  for k, v in config.items() if k not in NOT_SAVED_IN_CONFIG}
            metrics = {f"hparam/{k}": v for k, v in final.items()}
            for summary in hparams(hp, metrics):
                self.writer.file_writer.add_summary(summary)
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)
        self.writer.close()


def epoch_line(record, config):
    """The line printed when an epoch ends (and hints when the data path is slow)."""
    val = f"  val_loss {record['val_loss']:.4f}  val_acc {record['val_acc']:.4f}" \
        if "val_acc" in record else ""
    if "val_acc_ema" in record:
        val += f"  val_acc_ema {record['val_acc_ema']:.4f}"
    lines = [f"epoch {record['epoch']}/{config['epochs']}  step {record['step']}  "
             f"train_loss {record['train_loss']:.4f}{val}  "
             f"{record['samples_per_sec']:.0f} samples/s  efficiency "
             f"{record['compute_efficiency']:.2f} (data {record['data_time']:.1f}s, "
             f"compute {record['compute_time']:.1f}s)"]
    if "mfu" in record:
        lines.append(f"  {record['tflops']:.1f} TFLOP/s, model FLOPs utilisation "
                     f"{record['mfu']:.1%}")
    if record["compute_efficiency"] < 0.7:
        lines.append(f"  the loop waited for data {1 - record['compute_efficiency']:.0%} of "
                     f"the time: try more --num-workers (now {config['num_workers']}) or "
                     f"--prefetch 2")
    if record.get("unreadable_images"):
        lines.append(f"  {record['unreadable_images']} unreadable image(s) skipped so far "
                     f"(named in the warnings above)")
    return "\n".join(lines)


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


class Progress:
    """One epoch's progress: a tqdm bar in a terminal; in a log file, plain lines.

    A scheduler's log gets no carriage-return redraws: without a terminal, ``show``
    prints a plain line at log steps (every --log-every steps), at most one every
    ``PLAIN_EVERY`` seconds.

    Args:
        desc: e.g. ``"epoch 2/30"``.
        total: batches in the epoch.
        enabled: False on every process but the main one.
    """

    PLAIN_EVERY = 10.0
    BAR_EVERY = 0.5  # redraw the bar's figures between log steps at most this often

    def __init__(self, desc, total, enabled):
        self.desc, self.total, self.enabled = desc, total, enabled
        self.done, self.shown, self.printed = 0, 0.0, -math.inf
        self.bar = None
        if enabled and _isatty(sys.stderr):
            self.bar = tqdm(total=total, desc=desc, unit="batch", leave=False,
                            dynamic_ncols=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.bar is not None:
            self.bar.close()
        return False

    def update(self, n):
        self.done += n
        if self.bar is not None:
            self.bar.update(n)

    def due(self):
        """Whether the bar's figures are worth refreshing between log steps."""
        return self.bar is not None and time.perf_counter() - self.shown > self.BAR_EVERY

    def show(self, loss, rate, efficiency, log_step=False):
        """Shows the loss, samples/s and compute efficiency since the last log."""
        now = time.perf_counter()
        self.shown = now
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{loss:.4f}", samples_s=f"{rate:.0f}",
                                 eff=f"{efficiency:.2f}")
        elif self.enabled and log_step and now - self.printed >= self.PLAIN_EVERY:
            self.printed = now
            runtime.say(f"{self.desc}  {self.done}/{self.total} batches  loss {loss:.4f}  "
                        f"{rate:.0f} samples/s  efficiency {efficiency:.2f}",
                        file=sys.stderr)

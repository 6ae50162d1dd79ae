"""Everything a run writes into its run directory, except checkpoints.

``RunDirectory`` creates and locks the directory (``RunLock``: one run per directory)
and records how the run was made (config.yaml, command.txt). ``RunLog`` is the only
writer of TensorBoard and of metrics.jsonl (one line per finished epoch), summary.txt,
the first-batch image grid and the hparams; the names it writes under come from
metrics.py. ``Progress`` is the epoch's progress bar, or plain lines in a log file.
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
import socket
import subprocess
import sys
import tempfile
import time

import torch
import yaml
from tqdm import tqdm

import ops
from machinery import checkpoint, elastic, files, runtime
from ops import RunFailed, UserError
from reporting import metrics

NOT_SAVED_IN_CONFIG = ("config", "resume", "run_dir")  # per invocation, not per recipe


def default_run_dir(config):
    """``runs/<time>-<network>-<dataset>``."""
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    name = config["network"].replace("/", "-")
    return os.path.join("runs", f"{stamp}-{name}-{config['dataset']}")


class RunDirectory:
    """The run directory, created and locked for this run by the main process.

    Use it as a context manager around the run. One run at a time: a second run in the
    same directory gets a UserError naming the first (``RunLock``). A run that fails
    before it wrote a checkpoint (or a non-finite record, replay.py) removes the directory
    it created, and the parents it created for it, so an offline typo or a name the file
    system refuses (too long) leaves nothing behind.

    Args:
        path: the directory.
        is_main: whether this is the main process (the others only read).
    """

    def __init__(self, path, is_main):
        self.path, self.is_main = path, is_main
        self.created = []  # the directories this run made, the run directory first
        self.lock = None

    def __enter__(self):
        if not self.is_main:
            return self
        ckpt_dir = os.path.join(self.path, "checkpoints")
        if os.path.lexists(self.path) and not os.path.isdir(self.path):
            raise UserError(f"--run-dir {self.path!r} is a file, not a directory")
        missing = os.path.abspath(self.path)
        while not os.path.lexists(missing) and os.path.dirname(missing) != missing:
            self.created.append(missing)  # from the run directory up to its first parent
            missing = os.path.dirname(missing)  # that exists
        try:
            os.makedirs(ckpt_dir, exist_ok=True)
            files.probe_writable(ckpt_dir)
        except OSError as e:
            self._remove_if_created()
            raise UserError(f"--run-dir {self.path!r} cannot be written "
                            f"({e.strerror or e}{': ' + e.filename if e.filename else ''})"
                            ) from None
        self.lock = RunLock(self.path, warn=runtime.main_print)
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
        if not self.created or (os.path.isdir(ckpt_dir) and any(  # kept: what can resume,
                name.endswith(".pt") or name.startswith("nonfinite-step-")  # or replay
                for name in os.listdir(ckpt_dir))):
            return
        shutil.rmtree(self.created[0], ignore_errors=True)
        for parent in self.created[1:]:  # the parents made for it, where empty
            with contextlib.suppress(OSError):  # (or never made: a name too long)
                os.rmdir(parent)

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
        files.atomic_write(os.path.join(self.path, "config.yaml"),
                                lambda f: yaml.safe_dump(saved, f, sort_keys=False))
        with open(os.path.join(self.path, "command.txt"), "a",
                  errors="surrogateescape") as f:  # a path's own bytes: pasted, it runs
            f.write(f"{datetime.datetime.now().isoformat(timespec='seconds')}  "
                    f"{shlex.join(['python', 'train.py', *argv])}\n"
                    f"  git {_git_commit()}  torch {torch.__version__}  {platform.node()}\n")



# --------------------------------------------------------------------------- run lock

class RunLock:
    """One run per run directory: an exclusive ``<run_dir>/.lock`` file.

    The file holds JSON ``{"pid", "host", "started", "proc_start"}`` and is created
    atomically with its content: written to a temporary file that is then hard-linked
    to ``.lock`` (link(2) fails if ``.lock`` exists, as ``O_CREAT|O_EXCL`` would, but
    no other run can see it empty); where the file system has no hard links, it is
    created with ``O_CREAT|O_EXCL`` and then written.

    If ``.lock`` exists:

    * it was taken by process 0 of an earlier round of this torchrun job (its ``"job"``:
      the same TORCHELASTIC_RUN_ID, a lower restart count) that is not running here:
      torchrun ended that round before restarting the group, so it is taken over with a
      ``note:`` (``elastic.earlier_round_of_this_job``);
    * its holder runs on this host (``os.kill(pid, 0)`` succeeds and the process is the
      one that started then): ``UserError`` naming pid, host and start time;
    * its holder has exited (or the file is empty or unreadable: a crash while creating
      it): the lock is taken over with a ``warning:``, by an atomic ``os.replace`` of a
      new file, then re-read to check that no other run took it at the same moment;
    * it was taken on another host: ``UserError``, since that process cannot be checked
      from here; delete the file if that run is gone.

    Use ``with RunLock(run_dir):`` or ``acquire()``/``release()``. Only one process of
    a distributed run (rank 0) takes it. A run killed with SIGKILL leaves the file; the
    next run takes it over. Hosts sharing a hostname and file system but not a pid
    namespace (containers) cannot tell each other's runs apart.
    """

    NAME = ".lock"

    def __init__(self, run_dir, warn=print):
        """
        Args:
            run_dir: the run directory (created by ``acquire`` if missing).
            warn: called with the ``warning:`` line when a stale lock is taken over.
        """
        self.run_dir = os.fspath(run_dir)
        self.path = os.path.join(self.run_dir, self.NAME)
        self.warn = warn
        self._record = None

    @property
    def held(self):
        """Whether this object holds the lock."""
        return self._record is not None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
        return False

    def _new_record(self):
        return {"pid": os.getpid(), "host": socket.gethostname(),
                "started": datetime.datetime.now().isoformat(timespec="seconds"),
                "proc_start": runtime.process_start(os.getpid()), "job": elastic.job()}

    def _read(self):
        """``(raw bytes, parsed record or None)``; raw is None if there is no file."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None, None
        except OSError:
            return b"", None
        try:
            record = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            return raw, None
        if not (isinstance(record, dict) and isinstance(record.get("pid"), int)
                and record["pid"] > 0 and isinstance(record.get("host"), str)):
            return raw, None
        return raw, record

    def _write_temp(self, record):
        fd, tmp = tempfile.mkstemp(prefix=".lock.tmp-", dir=self.run_dir)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~files.umask())
        except BaseException:
            files.remove_quietly(tmp)
            raise
        return tmp

    def _create(self, record):
        """Creates ``.lock`` holding ``record``; False if it exists."""
        tmp = self._write_temp(record)
        try:
            os.link(tmp, self.path)
            return True
        except FileExistsError:
            return False
        except OSError:
            pass  # no hard links here: O_EXCL, then write
        finally:
            files.remove_quietly(tmp)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            return False
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(record, f)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            files.remove_quietly(self.path)
            raise
        return True

    def _describe(self, holder):
        return (f"pid {holder['pid']} on host {holder['host']}, "
                f"started {holder.get('started', '?')}")

    def _check_stale(self, raw, holder):
        """The warning for taking over a stale lock; raises UserError for a live one."""
        if holder is None:
            return (f"warning: taking over {self.path!r}, which is empty or unreadable "
                    f"(a run that crashed while creating it)")
        here = holder["host"] == socket.gethostname()
        if elastic.earlier_round_of_this_job(holder) and not (  # torchrun restarted the
                here and runtime.process_alive(holder["pid"], holder.get("proc_start"))):
            return (f"note: taking over {self.path!r} from restart round "  # group
                    f"{holder['job']['restart']} of this torchrun job "
                    f"({self._describe(holder)}), which torchrun ended")
        if not here:
            raise UserError(
                f"run directory {self.run_dir!r} is locked by a run on another host "
                f"({self._describe(holder)}), which cannot be checked from here; if that "
                f"run is gone, delete {self.path!r}, or choose another --run-dir")
        if runtime.process_alive(holder["pid"], holder.get("proc_start")):
            raise UserError(
                f"run directory {self.run_dir!r} is used by another run "
                f"({self._describe(holder)}); wait for it or choose another --run-dir")
        return (f"warning: taking over {self.path!r} from a run that is gone "
                f"({self._describe(holder)})")

    def acquire(self):
        """Takes the lock (see the class); returns ``self``.

        Raises:
            UserError: another run holds it.
        """
        if self.held:
            return self
        os.makedirs(self.run_dir, exist_ok=True)
        for _ in range(10):
            record = self._new_record()
            if self._create(record):
                self._record = record
                return self
            raw, holder = self._read()
            if raw is None:
                continue  # released meanwhile: try again
            if holder is None and raw.strip() == b"":
                time.sleep(0.2)  # O_EXCL creation without hard links: being written?
                again, holder = self._read()
                if again != raw:
                    continue
            message = self._check_stale(raw, holder)
            current, _ = self._read()
            if current != raw:
                continue  # another run acted meanwhile: judge again
            tmp = self._write_temp(record)
            try:
                os.replace(tmp, self.path)
            except BaseException:
                files.remove_quietly(tmp)
                raise
            files.fsync_dir(self.run_dir)
            _, now = self._read()
            if now == record:
                self.warn(message)
                self._record = record
                return self
            # another run took it over at the same moment: judge its lock
        raise UserError(f"could not lock run directory {self.run_dir!r}: other runs keep "
                        f"taking {self.path!r}; choose another --run-dir")

    def release(self):
        """Removes the lock file if it still holds this lock; harmless if not held."""
        if not self.held:
            return
        record, self._record = self._record, None
        _, current = self._read()
        if current == record:
            files.remove_quietly(self.path)


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
            if isinstance(epoch, float) and record.get("final") is True:
                epoch = math.floor(epoch)  # a run's final record inside an epoch (1.75)
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
        tracker: a ``tracking.Tracker`` (--mlflow) that gets the log steps' scalars, the
            epochs' records, config.yaml and summary.txt, and the end; or None.
    """

    def __init__(self, run_dir, step, epoch, enabled, tracker=None):
        self.enabled, self.run_dir = enabled, run_dir
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.writer, self.closed = None, False
        self.tracker = tracker if enabled else None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run_dir, purge_step=step + 1 if step > 0 else None)
        kept = read_metrics(self.path, epoch) if os.path.exists(self.path) else []
        files.atomic_write(self.path, lambda f: f.writelines(kept))
        last = json.loads(kept[-1]) if kept else {}  # a --max-steps run's final record at
        self.final_at = last.get("step") if last.get("final") is True else None  # its end

    def scalars(self, values, step):
        if self.enabled:
            with self._failing("TensorBoard"):
                for tag, value in values.items():
                    self.writer.add_scalar(tag, value, step)
            if self.tracker is not None:
                self.tracker.scalars(values, step)

    def image(self, tag, image, step):
        """An image (an HxWx3 uint8 array, e.g. ``plots.confusion_image``) to TensorBoard.

        A picture the file system refuses (full, read-only) is a ``warning:`` naming it and
        why; the run goes on (its next scalar or checkpoint write says the disk is full).

        Returns:
            Whether the image was handed to the writer.
        """
        if not self.enabled:
            return False
        try:
            self.writer.add_image(tag, image, step, dataformats="HWC")
        except OSError as e:
            runtime.say(f"warning: could not write the TensorBoard image {tag} (step {step}) "
                        f"into {self.run_dir!r}: {e.strerror or e}", file=sys.stderr)
            return False
        return True

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
        """Appends one finished epoch to metrics.jsonl (flushed and fsynced). A final
        record at the step of the one the file ends with (a run resumed at its --max-steps
        validates again) replaces it: each validation appears once."""
        if self.enabled:
            if record.get("final") is True and record.get("step") == self.final_at:
                kept = read_metrics(self.path, math.inf)[:-1]
                files.atomic_write(self.path, lambda f: f.writelines(kept))
            self.final_at = None
            self.scalars(metrics.perf_scalars(record), record["step"])
            with self._failing("metrics.jsonl"), open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
            if self.tracker is not None:
                self.tracker.epoch(record)

    def summary(self, net, inputs, device):
        """Prints the torchinfo summary and writes it to summary.txt with parameter counts;
        ``inputs`` (``Task.summarised``): ``[(name, module, one input's shape)]``, one
        summary each (a model of named networks: each on its own input; name None: the
        model alone).

        torchinfo runs the network on a random input: the global RNG is forked around
        it, so a resumed run's RNG stays as the checkpoint left it.
        """
        if not self.enabled:
            return
        try:
            import torchinfo
        except ImportError:  # a GPU image may lack it: the run goes on without its summary
            runtime.say("warning: torchinfo is not installed: no network summary "
                        "(pip install torchinfo)")
            if self.tracker is not None:
                self.tracker.artifacts()  # config.yaml still
            return
        trainable, frozen = ops.count_parameters(net)
        text = ""
        for name, module, sample in inputs:
            shape = (1, *sample)
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                text += (f"{name}\n" if name else "") + str(torchinfo.summary(
                    module, input_size=shape, device=device, mode="eval", verbose=0,
                    col_names=("output_size", "num_params", "trainable"))) + "\n"
        text = text[:-1]
        text += f"\nTrainable parameters: {trainable:,}\nFrozen parameters: {frozen:,}\n"
        files.atomic_write(os.path.join(self.run_dir, "summary.txt"),
                                lambda f: f.write(text))
        runtime.say(text)
        if self.tracker is not None:  # config.yaml and summary.txt, both written by now
            self.tracker.artifacts()

    def first_batch(self, train_set, sampler):
        """An image grid of the first training batch, to check what the network sees."""
        if not self.enabled:
            return
        import torchvision

        keys = next(iter(sampler))[:64]
        images = torch.stack([train_set[key][0] for key in keys])
        grid = torchvision.utils.make_grid(images[:, :3], nrow=8, normalize=True)
        self.writer.add_image(metrics.FIRST_BATCH, grid, 0)

    def progress(self, epoch, epochs, total):
        """The progress display of one epoch (0-based ``epoch``) of ``total`` batches."""
        return Progress(f"epoch {epoch + 1}/{epochs}", total, self.enabled)

    def flush(self):
        if self.enabled and not self.closed:
            with self._failing("TensorBoard"):
                self.writer.flush()

    def close(self, config, final):
        """Writes the hparams with the final metrics (when the run finished) and closes."""
        if not self.enabled or self.closed:
            return
        self.closed = True  # a close the disk refused is not tried again (flush, close)
        if self.tracker is not None:  # final is None when a signal stopped the run
            self.tracker.close("FINISHED" if final is not None else "KILLED")
        with self._failing("TensorBoard"):
            self._close(config, final)

    def failed(self):
        """The run ends with an error line: --mlflow's run is marked FAILED (TensorBoard and
        metrics.jsonl keep what was written)."""
        if self.tracker is not None:
            self.tracker.close("FAILED")
            self.tracker = None

    def _close(self, config, final):
        if final:
            from torch.utils.tensorboard.summary import hparams

            hp = {k: (v if isinstance(v, (int, float, bool)) else files.printable(str(v)))
                  for k, v in config.items() if k not in NOT_SAVED_IN_CONFIG}
            # metrics named after curves of this run: HPARAMS shows their last values
            for summary in hparams(hp, metrics.hparam_metrics(final)):
                self.writer.file_writer.add_summary(summary)
        self.writer.close()


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


def choose_run_dir(config, resume_path, saved):
    """``--run-dir``; else, for ``--resume PATH``, the checkpoint's own run directory, but
    only when PATH is that run's newest checkpoint (continuing from an older one would
    rewind the run); else a new ``runs/<time>-<network>-<dataset>``."""
    if config["run_dir"]:
        return config["run_dir"]
    if saved is None:
        return default_run_dir(config)
    recorded = saved["config"].get("run_dir") or ""
    ckpt_dir = os.path.join(recorded, "checkpoints")
    if not (os.path.isdir(ckpt_dir) and os.path.samefile(
            os.path.dirname(os.path.abspath(resume_path)), ckpt_dir)):
        raise UserError(f"{resume_path!r} is not in the run directory it records "
                        f"({recorded!r}); pass --run-dir to say where this run goes on")
    _, newest = checkpoint.find_latest(recorded, warn=_quiet)  # skipped files: said later
    if newest is not None and newest["step"] > saved["step"]:
        raise UserError(f"{resume_path!r} (step {saved['step']}) is not the newest "
                        f"checkpoint of {recorded!r} (step {newest['step']}): continuing "
                        f"there would rewind that run. Continue it with --resume auto "
                        f"--run-dir {recorded}, or start a new run from this checkpoint "
                        f"with --run-dir NEW_DIR")
    return recorded


def _quiet(message):
    """Drops a message."""



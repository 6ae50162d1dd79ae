"""The hang watchdog (--hang-timeout): a process whose optimizer steps stop coming says
where it stands, then exits so that torchrun or SLURM can restart it.

A DDP run whose peer stalls otherwise waits in a collective until the backend's own
timeout (10-30 minutes) and dies with an error that names no line of Python. Here a daemon
thread wakes a few times per timeout; when no optimizer step finished in that time, every
process writes the Python stacks of all its threads (``faulthandler``) to
``RUN_DIR/hang-rank<N>.txt`` and the collectives' flight recorder to
``RUN_DIR/hang-flight-recorder/rank_<N>``, prints one ``error:`` line, and exits with
``EXIT_HUNG``. The checkpoints are untouched: they are written atomically, and the
temporary file of a write cut short is removed by the next run's ``saving.Saver``.

Per step the loop calls ``Watchdog.step``: one ``time.monotonic()`` appended to a bounded
deque, no device sync. (Re-arming ``faulthandler.dump_traceback_later`` after each step was
measured as the alternative: it joins and starts a C thread at each call, about 50 us
against 0.2 us here, and can neither exit with a code of its own nor write the flight
recorder; see bench/README.md.)
"""

import collections
import contextlib
import faulthandler
import os
import statistics
import sys
import threading
import time

EXIT_HUNG = 3  # 0, 1, 2 and 128 + a signal's number are taken (train.main)
FLOOR = 300.0  # seconds: the automatic timeout is never shorter
FACTOR = 20    # times the median step time
MEASURED = 5   # step intervals before the median is trusted; the floor until then
WINDOW = 64    # the latest step times the median is taken over
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives kept per process (TORCH_FR_BUFFER_SIZE)
COLLECTIVE_TIMEOUT = 7200.0  # seconds: the process group's own, behind the automatic rule


def collective_timeout(setting):
    """The process group's timeout (seconds; None: torch's, 10 minutes for NCCL), longer
    than the watchdog's, so that the watchdog writes the stacks and the flight recorder
    first: NCCL's default would abort a run whose median step is over 30 s before
    ``FACTOR`` x it passed (the CUDA review's L4).

    Args:
        setting: ``--hang-timeout``: None (automatic: ``COLLECTIVE_TIMEOUT``, ahead of any
            median step under 6 minutes), 0 (the watchdog off: torch's own), else seconds
            (twice that, at least 10 minutes).
    """
    if setting == 0:
        return None
    if setting is None:
        return COLLECTIVE_TIMEOUT
    return max(2.0 * setting, 600.0)


def timeout_for(setting, intervals):
    """The seconds without a finished step after which a process counts as hung.

    Args:
        setting: ``--hang-timeout``: None for the automatic rule, 0 for off, else seconds.
        intervals: the latest step times (seconds between consecutive finished steps).

    Returns:
        ``setting`` when given; else ``max(FLOOR, FACTOR x the median step time)``, the
        floor alone until ``MEASURED`` step times are known; 0 means off.
    """
    if setting is not None:
        return float(setting)
    if len(intervals) < MEASURED:
        return FLOOR
    return max(FLOOR, FACTOR * statistics.median(intervals))


def enable_flight_recorder(config):
    """Before the process group starts: makes torch.distributed record its collectives
    (NCCL's flight recorder, and gloo's), unless the user chose a buffer size already or
    the watchdog is off. Must run before ``init_process_group``."""
    if config["hang_timeout"] == 0 or "TORCH_NCCL_TRACE_BUFFER_SIZE" in os.environ:
        return  # (the older name, still read by torch 2.14)
    os.environ.setdefault("TORCH_FR_BUFFER_SIZE", FLIGHT_RECORDER_ENTRIES)
    if config.get("run_dir") and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # NCCL's own dump (when its watchdog fires first) lands in the run directory,
        # beside ours, not in torch's default /tmp prefix (a file prefix: no folder made)
        os.environ.setdefault("TORCH_NCCL_DEBUG_INFO_TEMP_FILE",
                              os.path.join(config["run_dir"], "hang-nccl-trace-rank"))


class Watchdog:
    """Watches that optimizer steps keep finishing; a daemon thread acts when they stop.

    Not armed before the first step this process finishes (set-up, the decoded cache's
    build, torch.compile's first step are not timed), nor while ``paused`` (validation,
    checkpoint saves, the profiler's export), nor while torch.compile compiles (a
    recompile for the epoch's smaller last batch or after --unfreeze-at: the CUDA
    review's L3; dynamo's compile callbacks, hooked while the watchdog runs).

    Args:
        setting: ``--hang-timeout`` (None: automatic, 0: off, else seconds).
        run_dir: where ``hang-rank<N>.txt`` goes.
        rank: this process's rank.
        state: the run's ``engine.TrainState`` (its ``step`` is named in the message).
        distributed: whether a process group runs (its flight recorder is dumped).
    """

    def __init__(self, setting, run_dir, rank=0, state=None, distributed=False):
        self.setting, self.run_dir, self.rank = setting, run_dir, rank
        self.state, self.distributed = state, distributed
        self.path = os.path.join(run_dir, f"hang-rank{rank}.txt")
        self._times = collections.deque(maxlen=WINDOW)  # step ends; None marks a pause
        self.step = self._step_off if setting == 0 else self._step
        self._paused = True
        self._resumed_at = 0.0
        self._compiling = 0  # torch.compile's compilations under way (their callbacks)
        self._stopping = threading.Event()
        self._thread = None
        self._hooked = None

    # -- the training thread's side: cheap, no locks, no device work

    def _step(self):
        self._times.append(time.monotonic())

    @staticmethod
    def _step_off():
        pass

    def resume(self):
        """The step loop (re)starts: the time since the last step counts from now."""
        self._times.append(None)  # the pause is not a step time
        self._resumed_at = time.monotonic()
        self._paused = False

    def pause(self):
        """The step loop ends (validation, a save, the run's end follow): not timed."""
        self._paused = True

    @contextlib.contextmanager
    def paused(self):
        """Not timed inside the block; timed again after it if it was before."""
        was = self._paused
        self._paused = True
        try:
            yield
        finally:
            if not was:
                self.resume()

    # -- the watching thread

    def compile_started(self, *args):
        """torch.compile began compiling: not timed until it ends."""
        self._compiling += 1

    def compile_ended(self, *args):
        """A compilation ended: the time since the last step counts from now."""
        self._compiling = max(self._compiling - 1, 0)
        self._resumed_at = time.monotonic()

    def start(self):
        """Starts the watching thread (nothing when --hang-timeout is 0) and, where
        torch.compile is in use (dynamo loaded), hooks its compile callbacks; returns
        self."""
        if self.setting != 0 and self._thread is None:
            if "torch._dynamo" in sys.modules and self._hooked is None:
                from torch._dynamo.callback import callback_handler
                callback_handler.register_start_callback(self.compile_started)
                callback_handler.register_end_callback(self.compile_ended)
                self._hooked = callback_handler
            self._thread = threading.Thread(target=self._watch, name="hang-watchdog",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self):
        """Stops the watching thread and unhooks the compile callbacks."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._hooked is not None:
            self._hooked.remove_start_callback(self.compile_started)
            self._hooked.remove_end_callback(self.compile_ended)
            self._hooked = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def _watch(self):
        # A few wakes per timeout: how late it acts, not what a step costs.
        wake = 10.0 if self.setting is None else min(max(self.setting / 10, 0.05), 10.0)
        while not self._stopping.wait(wake):
            waited, timeout = self.overdue()
            if waited is not None:
                self._fire(waited, timeout, grace=2 * wake + 1 if self.distributed else 0)

    def overdue(self):
        """Whether the process counts as hung now.

        Returns:
            ``(seconds since the last step or the loop's resumption, timeout)`` when past
            the timeout, else ``(None, timeout)``; ``(None, None)`` when not timed now
            (paused, or no step finished yet).
        """
        try:
            times = tuple(self._times)
        except RuntimeError:  # appended to while copied: look again at the next wake
            return None, None
        steps = [t for t in times if t is not None]
        if self._paused or self._compiling or not steps:
            return None, None
        intervals = [b - a for a, b in zip(times, times[1:])
                     if a is not None and b is not None]
        timeout = timeout_for(self.setting, intervals)
        waited = time.monotonic() - max(steps[-1], self._resumed_at)
        return (waited if waited > timeout else None), timeout

    def _fire(self, waited, timeout, grace=0.0):
        """Writes the stacks and the flight recorder, says so, exits with EXIT_HUNG after
        ``grace`` seconds: under DDP the other processes' watchdogs fire within a wake or
        two of this one, and this exit (torchrun then stops them, or their collective
        fails) must not come before they have written their stacks too."""
        step = getattr(self.state, "step", "?")
        rule = f"--hang-timeout {timeout:g}" if self.setting is not None else \
            f"--hang-timeout auto: {timeout:.0f} s"
        where = self.path
        try:
            with open(self.path, "w", encoding="utf-8") as f:
                f.write(f"process {self.rank} (pid {os.getpid()}): no optimizer step "
                        f"finished in {waited:.0f} s ({rule}); the last was step {step}. "
                        f"Python stacks of every thread, most recent call first:\n\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
        except OSError as e:  # a full or gone disk: the stacks go to stderr instead
            where = f"stderr (writing {self.path} failed: {e.strerror or e})"
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        recorder = dump_flight_recorder(self.run_dir, self.rank) if self.distributed \
            else None
        stop_children()  # DataLoader workers: gone before the line, so nothing follows it
        also = f", the collectives in {recorder}" if recorder else ""
        try:
            print(f"error: no step finished in {waited:.0f} s ({rule}; process {self.rank}, "
                  f"the last step was {step}): stacks in {where}{also}; exiting with "
                  f"{EXIT_HUNG}, the checkpoints are intact: continue with --resume auto",
                  file=sys.stderr, flush=True)
            time.sleep(grace)
        finally:
            os._exit(EXIT_HUNG)  # the training thread may be stuck in C: no clean exit


def stop_children():
    """Kills this process's multiprocessing children (DataLoader workers) at once: left
    to notice their parent's exit, one of them printed a ``BrokenPipeError`` traceback
    after the watchdog's ``error:`` line (round 5's F13). They hold nothing to save."""
    import multiprocessing
    import signal

    for child in multiprocessing.active_children():
        with contextlib.suppress(OSError):
            os.kill(child.pid, signal.SIGKILL)


def dump_flight_recorder(run_dir, rank):
    """Writes torch.distributed's flight recorder (the latest collectives, their state
    and stacks) to ``RUN_DIR/hang-flight-recorder/rank_<N>``: a pickle that
    ``python -m torch.distributed.flight_recorder.fr_trace RUN_DIR/hang-flight-recorder``
    reads across ranks. NCCL's dump (``_dump_nccl_trace``) adds the communicators' state;
    without NCCL the backend-neutral ``_dump_fr_trace`` (gloo records too).

    Returns:
        The file's path, or None when there is no recorder or the dump failed (the
        stacks are written already: a failure here must not stop the exit).
    """
    try:
        import torch
        import torch.distributed as dist
        from torch._C import _distributed_c10d as c10d
        nccl = dist.is_initialized() and torch.cuda.is_available() and \
            "nccl" in str(dist.get_backend()).lower()
        dump = c10d._dump_nccl_trace if nccl and hasattr(c10d, "_dump_nccl_trace") \
            else c10d._dump_fr_trace
        blob = dump()
        folder = os.path.join(run_dir, "hang-flight-recorder")
        os.makedirs(folder, exist_ok=True)
        path = os.path.join(folder, f"rank_{rank}")
        with open(path, "wb") as f:
            f.write(blob)
        return path
    except Exception:  # noqa: BLE001 - private API, may change or be absent: stacks suffice
        return None

"""--profile-steps N: a torch.profiler trace of N optimizer steps, and what it says.

``window`` is the context manager ``train.fit`` holds around the epoch loop; ``run_epoch``
calls ``Profile.step`` after every optimizer step (one ``if`` when the flag is 0: no
profiler is built). The schedule waits ``WAIT`` step (the first batch, lazy set-up),
warms up ``WARMUP`` step, then records N steps, spanning epochs where N is longer than
one, and writes one Chrome trace per process, ``<run-dir>/profile/rank<R>.<ns>.pt.trace.json``:
the name TensorBoard's profiler plugin (torch-tb-profiler) looks for; Perfetto
(ui.perfetto.dev) and chrome://tracing open it too. CPU operators on the CPU; on CUDA
the kernels, memory and tensor shapes as well.

Once the N steps are recorded, process 0 prints the top operators by self time (CPU
self time on the CPU, CUDA self time on CUDA), the trace's path, and whether the window
was data-bound or compute-bound, from the loop's own ``engine.StepTimer``: data-bound
when it waited for data more than ``DATA_BOUND`` of the time. A run with fewer steps
left than asked is profiled over what it has (the plan says so); a run stopped inside
the window (a signal) writes what was recorded; a failed run closes the profiler and
writes nothing. The profiler only observes: the weights end bit for bit as without it.

The trace is exported under a temporary name that carries the writer's
``runtime.owner_tag()`` and renamed once complete: libkineto reports a failed write (a full
disk) only in its log and leaves a partial ``.tmp`` file, so the file is checked, and a
trace that could not be written is a ``warning:`` saying why, never announced. What a
killed export left (SIGKILL, a lost node) is removed when the next run in that directory
starts (``remove_orphans``).
"""

import contextlib
import errno
import os
import sys
import time

import torch
from torch.autograd import DeviceType

from machinery import files, runtime

WAIT, WARMUP = 1, 1  # steps before the recording: skipped, then profiled but not kept
DATA_BOUND = 0.10    # a window that waited for data longer than this share is data-bound
TOP_OPERATORS = 10


def plan(asked, remaining):
    """``(wait, warmup, active)`` steps for ``asked`` profiled steps in a run with
    ``remaining`` optimizer steps left: at least one active step, then the warm-up,
    then the wait, then the rest of what was asked; ``(0, 0, 0)`` when none is left."""
    if remaining <= 0:
        return 0, 0, 0
    warmup = min(WARMUP, remaining - 1)
    wait = min(WAIT, remaining - 1 - warmup)
    return wait, warmup, min(asked, remaining - wait - warmup)


def steps_left(config, sampler, accum, step):
    """Optimizer steps the run has after ``step``: every epoch's (``accum`` batches a
    step, the last maybe fewer), at most --max-steps, as ``engine.build_loop`` counts."""
    batches = -(-sampler.size // (sampler.batch_size * sampler.world_size))
    total = -(-batches // accum) * config["epochs"]
    if config["max_steps"]:
        total = min(total, config["max_steps"])
    return total - step


def bound_line(data_time, compute_time, steps, recorded=None, on_device=False):
    """The one line that says whether ``steps`` steps waited for data (data-bound) or not;
    ``recorded`` (more than ``steps``): the timer restarted in the window (a new epoch),
    the figures are those of its last ``steps`` steps. ``on_device``: the batches are made
    on the device (--data-on-device), where workers and prefetching do not apply."""
    total = data_time + compute_time
    share = data_time / total if total > 0 else 0.0
    over = f"over {steps} step{'s' if steps != 1 else ''}"
    if recorded is not None and recorded > steps:
        over += f", the last of the {recorded} recorded: the loop's timer restarts each epoch"
    figures = (f"waited for data {share:.1%} of the time (data {data_time:.3f} s, compute "
               f"{compute_time:.3f} s {over})")
    if share > DATA_BOUND and on_device:
        return (f"profile: data-bound: {figures}; the batches are gathered and augmented on "
                f"the device: lighter augmentation (--auto-augment, --random-erase) or a "
                f"larger --batch-size spreads that cost")
    if share > DATA_BOUND:
        return (f"profile: data-bound: {figures}; try more --num-workers, --prefetch N "
                f"or --data-on-device")
    return f"profile: compute-bound: {figures}"


def top_operators(prof, cuda, count=TOP_OPERATORS):
    """Lines for the ``count`` operators with the most self time, from a stopped
    profiler: CUDA self time with ``cuda``, else CPU self time. The ProfilerStep spans
    are left out (their self time is what ran between operators: Python, waits).

    On CUDA only the device's own rows count (the kernels, copies and memsets), as in
    torch's own table: kineto also credits each kernel's time to the CPU operator that
    launched it, so summing every row would count the GPU's time twice.
    """
    key = "self_device_time_total" if cuda else "self_cpu_time_total"

    def kept(e):
        if cuda and (e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation",
                                                                 False)):
            return False
        return not e.key.startswith("ProfilerStep") and getattr(e, key) > 0

    rows = sorted((e for e in prof.key_averages() if kept(e)), key=lambda e: getattr(e, key),
                  reverse=True)
    total = sum(getattr(e, key) for e in rows)
    where = "CUDA" if cuda else "CPU"
    lines = [f"profile: top operators by self {where} time (of {total / 1000:.3f} ms over "
             f"{len(rows)} operators):"]
    for e in rows[:count]:
        us, name = getattr(e, key), e.key if len(e.key) <= 72 else e.key[:71] + "~"  # kernels
        lines.append(f"  {us / total if total else 0:6.1%} {us / 1000:10.3f} ms  {name} "
                     f"({e.count} call{'s' if e.count != 1 else ''})")
    return lines


@contextlib.contextmanager
def window(config, procs, loop, step, sampler, on_device=False):
    """The run's profiler: a ``Profile`` with --profile-steps, else None (nothing is
    built). Closed however the block ends.

    Args:
        config: the run's (``run_dir``, ``profile_steps``, ``epochs``, ``max_steps``).
        procs: ``runtime.Processes``.
        loop: the ``engine.LoopSettings`` (its timer, the accumulation).
        step: the optimizer steps taken so far.
        sampler: the training ``EpochBatchSampler`` (the steps left in the run).
        on_device: the batches are made on the device (its advice differs).
    """
    remove_orphans(os.path.join(config["run_dir"], "profile"))
    asked = config["profile_steps"]
    if not asked:
        yield None
        return
    remaining = steps_left(config, sampler, loop.accum, step)
    wait, warmup, active = plan(asked, remaining)
    if not active:
        runtime.main_print("profile: --profile-steps: the run has no optimizer step left "
                           "to profile")
        yield None
        return
    if active < asked:
        runtime.main_print(f"profile: --profile-steps {asked}: the run has {remaining} "
                           f"optimizer step(s) left; profiling {active} of them, after "
                           f"{wait} skipped and {warmup} warm-up")
    profile = Profile(os.path.join(config["run_dir"], "profile"), procs, loop.timer,
                      (wait, warmup, active), step, on_device=on_device)
    with profile:
        yield profile


def remove_orphans(directory):
    """Removes the temporary trace files (``.tmp-<owner>~...``) of exports whose process is
    gone (``runtime.orphan``: this host's, no longer running), e.g. killed mid-export."""
    try:
        names = os.listdir(directory)
    except OSError:  # no profile directory: nothing was ever exported here
        return
    for name in names:
        if name.startswith(".tmp-") and runtime.orphan(name):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(directory, name))


def _export_failed(directory):
    """The OSError of a trace export that left no file: libkineto logs the failure of its
    write but raises nothing. The file system is asked why: full (ENOSPC: under a MiB
    free, with the partial file still there), or refusing a new file (a probe's own
    error); else the reason is unknown."""
    with contextlib.suppress(OSError):
        st = os.statvfs(directory)
        if st.f_bavail * st.f_frsize < 2**20 or st.f_favail == 0:  # its partial file in it
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    try:
        files.probe_writable(directory)
    except OSError as e:
        return e
    return OSError(errno.EIO, "the profiler wrote no file (its log above may say why)")


class Profile:
    """A torch.profiler.profile over one window of optimizer steps, and its report.

    Args:
        directory: where the trace goes (``<run-dir>/profile``; made when written).
        procs: the run's ``runtime.Processes`` (the rank names the trace; 0 reports).
        timer: the loop's ``engine.StepTimer``, read at the window's start and end only
            (on CUDA ``totals`` synchronises).
        schedule: ``(wait, warmup, active)`` steps (``plan``).
        step: the optimizer steps taken before the first one this sees.
        on_device: the batches are made on the device (the advice when data-bound).
    """

    def __init__(self, directory, procs, timer, schedule, step=0, on_device=False):
        self.directory, self.rank, self.is_main = directory, procs.rank, procs.is_main
        self.on_device = on_device  # the device data path: other advice when data-bound
        self.world_size = procs.world_size
        self.cuda = procs.device.type == "cuda"
        self.timer = timer
        self.wait, self.warmup, self.active = schedule
        self.first_step = step + self.wait + self.warmup + 1  # the first one recorded
        self.calls = 0              # optimizer steps seen
        self.trace = None           # the file written
        self.done = False           # the window is over and the profiler closed
        self._failing = False       # the run is failing: write no trace
        self._top = []
        self._start = None          # the timer's (data, compute, wall) at the window's start
        self._wall_start = None     # the timer's reset that reading belongs to
        self._covered_from = None   # the first step the timer figures cover (1-based)
        self._last_call = None
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.cuda:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        else:  # libkineto's start/stop lines and "gpuGetDeviceCount failed" on stderr
            os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._prof = torch.profiler.profile(
            activities=activities, record_shapes=self.cuda, profile_memory=self.cuda,
            schedule=torch.profiler.schedule(wait=self.wait, warmup=self.warmup,
                                             active=self.active, repeat=1),
            on_trace_ready=self._write)

    def __enter__(self):
        self._prof.start()
        if self.wait + self.warmup == 0:  # recording from the first step
            self._begin()
        return self

    def __exit__(self, exc_type, exc, tb):
        if self.done:
            return
        self.done = True
        if exc_type is not None:  # the run failed: close the profiler, keep its error
            self._failing = True
            with contextlib.suppress(Exception):
                self._prof.__exit__(None, None, None)
            return
        recorded = self.calls - self.wait - self.warmup
        figures = self._reading(at_close=True) if recorded > 0 else None
        self._failing = recorded <= 0  # no step whole: no trace
        self._prof.__exit__(None, None, None)  # writes what was recorded
        if recorded <= 0:
            runtime.main_print(f"profile: the run ended after {self.calls} optimizer "
                               f"step(s), before a step was recorded (from step "
                               f"{self.first_step}): no trace")
            return
        runtime.main_print(f"profile: the run ended after {recorded} of the {self.active} "
                           f"steps to profile (the trace's last span is what ran after "
                           f"step {self.first_step + recorded - 1})")
        self._report(figures)

    def step(self):
        """After each optimizer step: moves the profiler's schedule on by one step."""
        if self.done:
            return
        self.calls += 1
        start = self.wait + self.warmup
        if self.calls == start:
            self._begin()
        elif self.calls > start:
            self._last_call = time.perf_counter()
            if self.timer.wall_start != self._wall_start:  # a new epoch reset the timer
                self._start, self._wall_start = None, self.timer.wall_start
                self._covered_from = self.calls
        if self.calls < start + self.active:
            self._prof.step()
            return
        figures = self._reading()
        self._prof.step()  # the window's end: writes the trace (``_write``)
        self._prof.__exit__(None, None, None)
        self.done = True
        self._report(figures)

    def _begin(self):
        """The timer's reading where the recording begins."""
        self._start, self._wall_start = self.timer.totals(), self.timer.wall_start
        self._covered_from = self.calls + 1

    def _reading(self, at_close=False):
        """``(data, compute, steps)`` of the recorded steps since the timer's last reset
        (or the window's start, if later). At an early close, on CUDA, the wall time
        ends at the last step seen, not at the close (validation, a save)."""
        data, compute, wall = self.timer.totals()
        if at_close and self.cuda and self._last_call is not None:
            data = max(self._last_call - self.timer.wall_start - compute, 0.0)
        if self._start is not None:
            data, compute = data - self._start[0], compute - self._start[1]
        return max(data, 0.0), max(compute, 0.0), self.calls - self._covered_from + 1

    def _write(self, prof):
        """on_trace_ready: one Chrome trace per process; a failed write warns."""
        if self._failing:
            return
        if self.is_main:
            self._top = top_operators(prof, self.cuda)
        name = f"rank{self.rank}.{time.time_ns()}.pt.trace.json"
        path = os.path.join(self.directory, name)
        tmp = os.path.join(self.directory, f".tmp-{runtime.owner_tag()}~{name}")
        try:
            os.makedirs(self.directory, exist_ok=True)
            prof.export_chrome_trace(tmp)  # libkineto: tmp + ".tmp", renamed to tmp when whole
            if not os.path.isfile(tmp):
                raise _export_failed(self.directory)
            files.fsync_path(tmp)
            os.replace(tmp, path)
        except OSError as e:
            for leftover in (tmp, tmp + ".tmp"):
                with contextlib.suppress(OSError):
                    os.remove(leftover)
            runtime.say(f"warning: process {self.rank}: could not write the profiler trace "
                        f"{path}: {e.strerror or e}; the run goes on without it",
                        file=sys.stderr)
            return
        self.trace = path

    def _report(self, figures):
        """Process 0's lines: the top operators, the trace, data- or compute-bound."""
        if not self.is_main:
            return
        for line in self._top:
            runtime.say(line)
        if self.trace:
            last = self.first_step + self.calls - self.wait - self.warmup - 1
            others = " (and one per other process)" if self.world_size > 1 else ""
            steps = f"step {last}" if last == self.first_step else \
                f"steps {self.first_step}-{last}"
            runtime.say(f"profile: {steps} in {self.trace}{others}: "
                        f"tensorboard --logdir {os.path.dirname(self.trace)} (its PyTorch "
                        f"Profiler tab) or ui.perfetto.dev")
        runtime.say(bound_line(*figures, recorded=self.calls - self.wait - self.warmup,
                               on_device=self.on_device))

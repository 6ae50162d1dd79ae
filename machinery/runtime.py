"""Processes, devices and signals: the run's machinery.

Shared by train.py and test.py: torchrun set-up (DistributedDataParallel), what the
processes tell each other (the first to build, a resume point, a lost peer), the device a
flag names, and the signals that stop a run at a step boundary (SIGINT, SIGTERM, SIGHUP).
What the hardware can do (autocast dtypes, FLOPs, memory, seeds) is hardware.py's.
"""

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist

from machinery import elastic, files, watchdog
from ops import STOP_SIGNALS, Interrupted, RunFailed, UserError

# --deterministic's cuBLAS needs this variable, and PyTorch reads it once per process, at
# its first cuBLAS gemm (which may come before any run starts: a notebook, a test, a run
# before). Set on import, before any: it only sizes cuBLAS's workspace (32 MiB, the size
# torch itself picks on Hopper GPUs), so other runs are not slowed. A value set outside wins.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


def _no_buffer_broadcast():
    """DDP's keyword that stops the buffer broadcast before each forward: torch 2.14
    renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (which still syncs them once
    when DDP is built, as the old one did not; they start equal here anyway)."""
    import inspect

    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers": False} if "forward_sync_buffers" in params \
        else {"broadcast_buffers": False}


NO_BUFFER_BROADCAST = _no_buffer_broadcast()


def distributed(net, device, broadcast_buffers=True):
    """``net`` in DistributedDataParallel (``device_ids`` on CUDA; without the buffer
    broadcast before each forward when ``broadcast_buffers`` is False), its gradient
    buckets settled before the first step (``settle_buckets``)."""
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=[device.index] if device.type == "cuda" else None,
        **({} if broadcast_buffers else NO_BUFFER_BROADCAST))
    settle_buckets(model)
    return model


def settle_buckets(model):
    """Gives a new DDP ``model`` the gradient buckets of all its steps before its first.

    A new DDP all-reduces its first backward in one bucket, then rebuilds its buckets in
    the order the gradients arrived; with 3 or more processes an all-reduce sums an
    element in an order set by its place in the bucket, so a resumed run's first step (or
    the step after ``--preflight``, or after ``--unfreeze-at``'s new wrapper) ended in
    other bits than the uninterrupted run's on rebuilt buckets (CUDA review 6, M2). So
    the network's forward is replaced, for one call, by a sum of its trainable parameters
    times zero, chained so that their gradients arrive in the reverse of the parameters'
    order (a backward pass's, DDP's own first guess); the zero gradients are all-reduced
    and cleared (None). The network does not run: no buffer or random state moves. Every
    step of every run then all-reduces on the buckets rebuilt from that order. The cost
    (docs/distributed.md): one all-reduce of zeros per wrapper, nothing per step.
    """
    params = [p for p in model.module.parameters() if p.requires_grad]
    if not params:
        return

    def zero_chain(*args, **kwargs):
        total = params[0].new_zeros(())
        for p in params:  # the last added is the first whose gradient arrives
            total = total + p.sum() * 0
        return total

    own = model.module.__dict__.get("forward")  # an instance's own (torch.compile's
    model.module.forward = zero_chain  # OptimizedModule, a wrapper): put back after
    try:
        with torch.enable_grad():  # (an input: DDP with device_ids indexes the inputs)
            model(params[0].new_zeros(())).backward()
    finally:
        if own is None:
            del model.module.forward
        else:
            model.module.forward = own  # (CUDA review 7's N-L2)
    for p in params:
        p.grad = None


class Processes(NamedTuple):
    """This process's place: its rank among ``world_size`` processes, and its device.

    ``host_group`` is the process group of the agreements between steps (whether to stop):
    gloo on CPU tensors, so that agreeing never waits for a GPU; None is the default group
    (itself gloo on CPU processes).
    """

    rank: int
    world_size: int
    device: torch.device
    host_group: object = None

    @property
    def is_main(self):
        return self.rank == 0


def process_rank():
    """The rank torchrun gave this process (0 without torchrun), before any set-up."""
    return int(os.environ.get("RANK", "0"))


def main_print(message, file=None):
    """Prints on the main process only (once per run, not once per process)."""
    if process_rank() == 0:
        say(message, file)


def setup_processes(config, stop=None):
    """Starts torch.distributed when launched by torchrun; picks the device.

    Under torchrun the processes join this round's group (``elastic.join_process_group``:
    after a restart too), waiting for each other while answering ``stop``
    (``StopRequest.pending``).

    Returns:
        A ``Processes``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = process_rank(), int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = config["device"] != "cpu" and torch.cuda.is_available()
    if world_size > 1:
        if config["gpus"]:
            raise UserError("--gpus (DataParallel) and torchrun (DDP) do not mix; use one")
        device = torch.device("cpu")
        if want_cuda:
            count = torch.cuda.device_count()
            if local_rank >= count:
                raise UserError(f"process {rank} is local rank {local_rank} of its machine, "
                                f"which has {count} GPU(s): start at most {count} processes "
                                f"per machine (torchrun --nproc_per_node {count}), or train "
                                f"on CPU processes with --device cpu")
            device = select_device(torch.device("cuda", local_rank))
        elastic.join_process_group("nccl" if device.type == "cuda" else "gloo", rank,
                                   world_size, stop, device, collective_timeout=watchdog
                                   .collective_timeout(config.get("hang_timeout")))
        if device.type == "cuda":
            default_gloo_interface()  # the side group binds where NCCL was told to
        host = dist.new_group(backend="gloo") if device.type == "cuda" else None
        return Processes(rank, world_size, device, host)
    if config["gpus"]:
        return Processes(0, 1, select_device(torch.device("cuda", gpu_ids(config["gpus"])[0])))
    return Processes(0, 1, select_device(parse_device(config["device"])))


def default_gloo_interface(environ=os.environ, interfaces=None):
    """Sets GLOO_SOCKET_IFNAME, when unset, to the first network interface that
    NCCL_SOCKET_IFNAME selects, and returns it (else None, nothing set).

    An NCCL run's agreements go over a gloo group, which otherwise binds the address the
    host name resolves to: on clusters whose /etc/hosts maps it to 127.0.1.1 gloo fails
    across machines where NCCL (told its interface) works. NCCL's syntax is read as NCCL
    reads it: names are prefixes ("eth" is eth0, eth1...), "=" makes them exact, "^"
    excludes them; gloo wants one exact name.

    Args:
        environ: the environment to read and set.
        interfaces: the machine's interface names (default: ``socket.if_nameindex``).
    """
    wanted = environ.get("NCCL_SOCKET_IFNAME", "").strip()
    if environ.get("GLOO_SOCKET_IFNAME") or not wanted:
        return None
    if interfaces is None:
        interfaces = [name for _, name in socket.if_nameindex()]
    exclude = wanted.startswith("^")
    wanted = wanted.lstrip("^")
    exact = wanted.startswith("=")
    names = [n.strip() for n in wanted.lstrip("=").split(",") if n.strip()]

    def named(interface):
        return any(interface == n if exact else interface.startswith(n) for n in names)

    chosen = [i for i in interfaces if named(i) != exclude
              and not (exclude and i.startswith(("lo", "docker")))]  # NCCL's own default
    if not chosen:
        return None
    environ["GLOO_SOCKET_IFNAME"] = chosen[0]
    return chosen[0]


def select_device(device):
    """Makes a CUDA ``device`` this process's current one (what CUDA events, pinned memory
    and kernels launched without a device use: otherwise GPU 0, with a second context
    there); returns it with its index."""
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


DEVICE_NAMES = re.compile(r"auto|cpu|mps|cuda(:(0|[1-9][0-9]*))?")  # what --device takes


def parse_device(text):
    """The torch.device that a --device value names: auto, cpu, cuda, cuda:N (or mps).

    Raises:
        UserError: not a device, or not one this machine has.
    """
    if text == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not DEVICE_NAMES.fullmatch(str(text)):  # checked first: torch.device warns for some
        raise UserError(f"--device {text!r} is not a device; use auto, cpu, cuda or "
                        f"cuda:N")
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError):
        raise UserError(f"--device {text!r} is not a device; use auto, cpu, cuda or "
                        f"cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or
                                  (device.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"--device {text}: no such CUDA device here "
                        f"({torch.cuda.device_count()} visible)")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"--device {text!r}: no MPS device here")
    return device


def process_start(pid):
    """A Linux process's start time (clock ticks since boot), or None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def process_alive(pid, start=None):
    """Whether process ``pid`` of this host runs (and is the one that started at
    ``start``, when known: pids are reused). A zombie counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, under another user
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    except (OSError, IndexError):
        pass
    if start is not None:
        now = process_start(pid)
        if now is not None and now != start:
            return False  # the pid belongs to a newer process
    return True


def owner_tag():
    """``<pid>.<start>.<host>``: names a temporary file so that another process can tell
    whether the one writing it still runs (``orphan``)."""
    start = process_start(os.getpid())
    return f"{os.getpid()}.{'x' if start is None else start}.{socket.gethostname()}"


_OWNER = re.compile(r"(\d+)\.(\d+|x)\.([^~]+)~")


def orphan(name):
    """Whether a file named ``<anything><owner_tag()>~...`` was left by a process of this
    host that is gone (False where it is not of that form, or of another host)."""
    match = _OWNER.search(name)
    if match is None or match.group(3) != socket.gethostname():
        return False
    start = None if match.group(2) == "x" else int(match.group(2))
    return not process_alive(int(match.group(1)), start)


def main_process_first(procs, what, build, *args, stop=None, **kwargs):
    """``build(*args, **kwargs)`` on the main process, then on the others: the main one
    downloads a dataset or writes a cache that the others then read.

    The others wait for as long as it takes (a large image folder's cache takes hours; a
    barrier would fail at the process group's timeout, 10 minutes with NCCL): they poll
    the process group's store once a second, so that they still answer a stop signal
    (torchrun's SIGTERM when a peer died: ``ops.Interrupted``), and end with one line
    when the main process failed (``RunFailed``): it tells them through the store and
    waits (at most ``TELL_TIMEOUT_S``) until they have read it, since under another
    launcher its exit takes the store with it, and no signal comes.

    Args:
        procs: ``Processes``.
        what: what the main process does, for the messages (e.g. "downloading cifar10").
        build: the function; its result is returned on every process.
        stop: returns the signal number of a stop request, or None (``StopRequest.
            pending``); None: waiting cannot be interrupted.
    """
    if procs.world_size == 1:
        return build(*args, **kwargs)
    key = _next_key("main_process_first")
    store = dist.distributed_c10d._get_default_store()
    if procs.is_main:
        main_print(f"process 0 is {what}; the other {procs.world_size - 1} wait for it, "
                   f"however long it takes")
        try:
            result = build(*args, **kwargs)
        except BaseException as e:
            store.set(key, f"failed: {type(e).__name__}: {e}"[:500])
            _wait_for_the_others(store, f"{key}/left", procs.world_size - 1)
            raise
        store.set(key, "done")
        return result
    while not store.check([key]):
        if stop is not None and stop() is not None:
            _leave(store, f"{key}/left")
            raise Interrupted(stop(), f"while process 0 was {what}")
        time.sleep(1.0)
    state = store.get(key).decode()
    if state != "done":
        _leave(store, f"{key}/left")
        raise RunFailed(f"process 0 failed while {what} ({state[len('failed: '):]})")
    return build(*args, **kwargs)


TELL_TIMEOUT_S = 10.0  # the longest a failed process 0 waits for the others to read why


def _leave(store, key):
    """A waiting process stops waiting for process 0 (which waits for this when it
    failed: ``_wait_for_the_others``)."""
    with contextlib.suppress(Exception):
        store.add(key, 1)


def _wait_for_the_others(store, key, others):
    """A failed process 0 waits, at most ``TELL_TIMEOUT_S``, until the ``others`` have read
    why, or stopped waiting for a signal (``_leave``). Under a launcher other than torchrun
    process 0 serves the store itself, and its exit takes the store away: a process that
    had not looked yet (they look once a second) would find only a lost connection."""
    deadline = time.monotonic() + TELL_TIMEOUT_S
    with contextlib.suppress(Exception):  # a store already gone: nothing to wait for
        while store.add(key, 0) < others and time.monotonic() < deadline:
            time.sleep(0.05)


_KEYS = {}


def _next_key(name):
    """A store key that every process computes alike: the name, the torchrun restart (a
    restarted group shares the agent's store with the group before it) and a count."""
    _KEYS[name] = _KEYS.get(name, 0) + 1
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return f"styleguide/{name}/{restart}/{_KEYS[name]}"


_PEER_LOST = ("Connection reset by peer", "Connection closed by peer", "Connection refused",
              "Broken pipe", "gloo", "NCCL", "ProcessGroup", "c10d")


def lost_peer(error):
    """Whether ``error`` is a collective that failed because another process of a
    torch.distributed run is gone (what gloo and NCCL raise then)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and (
        isinstance(error, dist.DistError) or any(k in str(error) for k in _PEER_LOST))


def check_same_resume_point(saved, procs):
    """Each process read the checkpoint from its own disk: they must have found the same."""
    step = torch.tensor([-1 if saved is None else saved["step"]], device=procs.device)
    steps = [torch.zeros_like(step) for _ in range(procs.world_size)]
    dist.all_gather(steps, step)
    if len({int(s) for s in steps}) > 1:
        raise UserError(f"the processes found different checkpoints to resume from (step "
                        f"by rank, -1 = none: {[int(s) for s in steps]}); on several "
                        f"machines --run-dir must be on a file system they share")


def gpu_ids(text):
    try:
        ids = [int(i) for i in str(text).split(",") if i.strip() != ""]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated GPU ids like 0,1, not {text!r}") \
            from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [i for i in ids if not 0 <= i < count]
    if not ids or bad:
        raise UserError(f"--gpus {text}: no GPU {bad or ids} here ({count} visible)")
    return ids


# Ctrl-C, schedulers, a dropped SSH session, SLURM's warning before a time limit
# (--signal=USR1@90) or another signal chosen for it (--requeue-signal).
def saved_world_size(saved):
    """The number of processes that saved checkpoint ``saved`` (one RNG state each)."""
    return len(saved.get("rng_per_rank") or [saved["rng"]])


def check_step_size(saved, config, world=None):
    """On resume: the samples per optimizer step (the global batch: --batch-size, or
    --virtual-batch-size, times the processes) against the checkpoint's.

    On another number of processes (a job requeued onto other nodes) a step must take the
    checkpoint's samples: the sampler cuts every epoch's order into global batches of
    them, so the same global batch is the same samples at every step whatever the
    processes (``data.EpochBatchSampler``), and another would train other steps. Else
    ``UserError``: one line naming the flags that keep it. On the same processes a changed
    --batch-size is the user's choice: a note.

    Args:
        saved: the checkpoint.
        config: the resumed run's config (merged).
        world: this run's processes (default: torchrun's WORLD_SIZE, else 1).
    """
    before, world = saved_world_size(saved), world or int(os.environ.get("WORLD_SIZE", "1"))
    old = saved["config"]
    per_step = (old.get("virtual_batch_size") or old["batch_size"]) * before
    batch, virtual = config["batch_size"], config["virtual_batch_size"]
    now = (virtual or batch) * world
    if per_step == now:
        return
    took = (f"the checkpoint took {per_step} samples per optimizer step ({before} "
            f"process(es)), this run takes {now} ({world})")
    if world == before:
        main_print(f"note: {took}; to continue the same training, set --batch-size (per "
                   f"process) so that they match")
        return
    if per_step % world:
        raise UserError(f"{took}: {world} processes cannot share {per_step} samples per "
                        f"step; to continue the same training, run a number of processes "
                        f"that divides {per_step}, with --batch-size {per_step} / processes")
    share = per_step // world  # each process's samples per step
    keep = [f"--batch-size {share}" + (" --virtual-batch-size 0" if virtual else "")]
    if share % batch == 0 and share > batch:  # the same micro-batch, accumulated
        keep.insert(0 if virtual else 1, f"--virtual-batch-size {share} (accumulating "
                                         f"{share // batch} batches of {batch})")
    raise UserError(f"{took}: to continue the same training on {world} process(es), pass "
                    f"{' or '.join(keep)}")


class StopRequest:
    """Remembers SIGINT/SIGTERM/SIGHUP; the loop stops at the next optimizer step and saves.

    The handler only records the signal: the save happens in the loop, and a second
    signal during the save changes nothing (the save finishes, then the run exits with
    128 + the first signal's number: 130, 143 or 129).
    """

    def __init__(self):
        self.signum = None
        self._interrupting = None  # inside ``interruptible``: what is interrupted
        self._old = {}
        for signum in STOP_SIGNALS:
            self._old[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            if self._interrupting is None:
                say(f"\n{signal.Signals(signum).name}: stopping after this step and saving "
                    f"a checkpoint (a second signal is ignored)", file=sys.stderr)
        if self._interrupting is not None:
            what, self._interrupting = self._interrupting, None
            raise Interrupted(self.signum, what)

    @contextlib.contextmanager
    def interruptible(self, what, world_size=1):
        """Inside the block a stop signal (or one that came before it) raises
        ``Interrupted`` at once: for work that is safe to drop because what it follows is
        saved (a validation after its checkpoint; round 5's F7, round 6's F4). Under DDP
        (``world_size`` > 1) the block runs to its end: one process leaving would strand
        the others in its collectives (the processes agree on a stop at a step)."""
        if world_size > 1:
            yield
            return
        if self.signum is not None:
            raise Interrupted(self.signum, what)
        self._interrupting = what
        try:
            yield
        finally:
            self._interrupting = None

    def agreed(self, procs):
        """Whether to stop now; under DDP every process stops at the same step (a signal
        to one process stops them all). Called after every step: the processes agree on
        a CPU tensor over ``procs.host_group``, so no GPU is waited for (under NCCL a CUDA
        tensor's value would have to be read back, a device sync each step)."""
        wanted = self.signum is not None
        if procs.world_size > 1:  # the signal's number too: every process exits alike
            flag = torch.tensor([int(self.signum or 0)])
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=procs.host_group)
            wanted = bool(flag[0])
            if wanted:
                self.signum = int(flag[0])
        return wanted

    def pending(self):
        """The number of the stop signal received, or None (this process only)."""
        return self.signum

    @property
    def exit_code(self):
        return 128 + int(self.signum)

    def restore(self):
        for signum, handler in self._old.items():
            signal.signal(signum, handler)


class Stopped(BaseException):
    """SIGINT or SIGTERM in a script with nothing to save (test.py): ``signals_raise``."""

    def __init__(self, signum):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.name = int(signum), signal.Signals(signum).name


@contextlib.contextmanager
def signals_raise():
    """SIGINT and SIGTERM raise ``Stopped`` inside the block (the main thread's handlers,
    put back after), so a script ends in one line and 128 + the number, not a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stopped(signum, frame):
        raise Stopped(signum)

    before = {s: signal.signal(s, stopped) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def slurm_requeue():
    """Under SLURM (``SLURM_JOB_ID`` set), ``scontrol requeue`` of this job (of an array's
    task: ``<SLURM_ARRAY_JOB_ID>_<SLURM_ARRAY_TASK_ID>``), once; the line to print, or
    None outside SLURM. Where scontrol is missing (a container) or fails, the line says
    how to requeue from outside."""
    job = os.environ.get("SLURM_JOB_ID")
    if not job:
        return None
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    name = f"{array}_{task}" if array and task else job
    scontrol = shutil.which("scontrol")
    if scontrol is None:
        return (f"SLURM job {name}: scontrol is not on this machine's PATH (in a container?): "
                f"requeue it from outside with: scontrol requeue {name}")
    try:
        result = subprocess.run([scontrol, "requeue", name], capture_output=True, text=True,
                                timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        return f"SLURM job {name}: scontrol requeue failed ({e}); run: scontrol requeue {name}"
    if result.returncode != 0:
        why = (result.stderr.strip().splitlines() or [f"exit {result.returncode}"])[0]
        return f"SLURM job {name}: scontrol requeue failed ({why}); run: scontrol requeue {name}"
    return f"SLURM job {name}: requeued (scontrol requeue {name}); it continues with --resume auto"


def ignore_stop_signals(worker_id=None):
    """A DataLoader worker's start: it ignores the signals that stop a run. Ctrl-C and
    schedulers signal the whole process group; the main process saves, then shuts its
    workers down, so the save never sees a dead worker."""
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)


def say(message, file=None):
    """Prints a line; a closed stdout/stderr (``train.py | head``) never stops the run.

    Once the reader of a pipe is gone, further output to it goes to /dev/null. A file name
    that is not UTF-8 is escaped as everywhere (``files.printable``): a strict terminal
    would raise, and stderr would show its bytes otherwise.
    """
    file = file or sys.stdout
    try:
        print(files.printable(str(message)), file=file, flush=True)
    except (BrokenPipeError, ValueError):  # ValueError: the stream was closed
        _silence(file)


def shown(value, width=60):
    """``repr(value)`` cut to ``width`` characters, for a message that quotes a value."""
    text = repr(value)
    return text if len(text) <= width else text[:width - 3] + "..."


def _silence(stream):
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, stream.fileno())  # also what the interpreter flushes at exit
        os.close(devnull)
    except (OSError, ValueError):
        pass


def quiet_writer_threads():
    """Drops the traceback that TensorBoard's writer thread prints when a write fails (a
    full disk): TensorBoard raises the same error in the training thread at its next
    write, where train.py turns it into one ``error:`` line."""
    if threading.excepthook is not _quiet_writer_hook:
        global _previous_hook
        _previous_hook = threading.excepthook
        threading.excepthook = _quiet_writer_hook


_previous_hook = threading.excepthook


def _quiet_writer_hook(args):
    if isinstance(args.exc_value, OSError) and \
            type(args.thread).__name__ == "_AsyncWriterThread":
        return
    _previous_hook(args)



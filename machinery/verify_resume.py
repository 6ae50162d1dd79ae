"""--verify-resume: the resume promise checked on the user's own command line.

``python train.py <the run's flags> --verify-resume`` (or under ``torchrun``) trains the
same run three times in a temporary directory, each time in fresh processes running
train.py itself:

1. uninterrupted to step N (``--verify-resume-steps``, fewer if the run is shorter);
2. stopped at a step K in [1, N-1] drawn from ``--seed``, by a SIGTERM that arrives
   inside its accumulation window (before micro-batch M of the step, also drawn): the
   run finishes the step, saves and exits, as a pre-empted job does;
3. resumed from there as ``--resume auto`` would, to step N.

Then every tensor and value of the two final checkpoints (the networks, optimizers, EMA,
GradScaler, RNG states, progress; not the config, which names the directories) and the
two sample ledgers (``--sample-ledger``: the sample ids each step saw) are compared:
"resume exact" and exit 0, or the first tensor that differs, its largest difference and
the part of the state it belongs to, exit 1. Each child also records a digest of every
micro-batch it trained on and of the weights after each step, so a difference is traced
to its first step after the resume: other batches there (the data draws from a random
state the checkpoint does not hold: a dataset's ``__getitem__`` using the global RNG in a
DataLoader worker) or the same batches and other weights (the step draws from one: a
dropout with a generator of its own). When the resumed run differs, a second
uninterrupted run says whether the run is reproducible at all. On CUDA the runs train
with ``--deterministic`` (added, with a note at the start, where the command lacks it:
without it cuDNN's autotuned kernels make even two uninterrupted runs differ).

The children are ``python -m machinery.verify_resume --child SPEC TRAIN_PY ARGS``: the
hook on ``engine.steps`` that counts micro-batches and signals, then train.py run as
``__main__``. Under torchrun, process 0 starts a torchrun of its own with as many
processes (on this machine), the others end at once. The user's run directory, MLflow
store and checkpoints are never touched. A stop signal (Ctrl-C, SIGTERM) ends the check at
once: the child running gets the signal too (and is killed if it has not ended within
``CHILD_STOP_S``), the temporary directory is removed, and the exit code is 128 + the
signal's number, in one line (review 6's F9).
"""

import contextlib
import hashlib
import json
import os
import random
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile

if __name__ == "__main__":  # a child: Ctrl-C while torch loads exits quietly with 130
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import torch

from machinery import checkpoint, ledger, runtime
from ops import Interrupted, RunFailed, UserError

OURS = ("--verify-resume", "--verify-resume-steps")  # not passed on
VALUED = {"--verify-resume-steps": 1, "--run-dir": 1}
NOT_STATE = ("config", "checksum", "version", "format", "mlflow_run_id")  # differ by design
PARTS = {"model": "the network's weights", "networks": "the networks' weights",
         "optimizer": "the optimizer's state", "optimizers": "the optimizers' state",
         "ema": "the EMA weights", "scaler": "the GradScaler", "scheduler": "the LR schedule",
         "rng": "the RNG states", "rng_per_rank": "the RNG states",
         "progress": "the progress", "epoch": "the progress", "step": "the progress",
         "data": "the training set's identity", "threads": "the CPU thread count"}
_TORCHRUN_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE",
                 "MASTER_ADDR", "MASTER_PORT")
CHILD_STOP_S = 60  # a child sent the stop signal: the time it has to save and end
# What starts a run's process (subprocess.Popen's signature); the tests start theirs as forks
# of a process that has imported train.py (tests/fork_server.py), the same code run.
start_process = subprocess.Popen


# ----------------------------------------------------------------------- comparing

def first_difference(a, b, path=()):
    """The first place where two checkpoint structures differ, or None.

    Tensors must be equal bit for bit (NaN where the other has NaN), of one dtype and
    shape; dicts must have the same keys; everything else must be ``==``.

    Returns:
        ``(path, detail)``: the keys down to it (a tuple) and what differs (a sentence
        fragment: the largest difference of two tensors).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return _tensor_difference(a, b, path)
    if isinstance(a, dict) and isinstance(b, dict):
        for key in [*a, *(k for k in b if k not in a)]:
            if key not in b or key not in a:
                return path + (key,), ("only in the uninterrupted run" if key in a
                                       else "only in the resumed run")
            found = first_difference(a[key], b[key], path + (key,))
            if found:
                return found
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return path, f"{len(a)} items against {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            found = first_difference(x, y, path + (i,))
            if found:
                return found
        return None
    if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        return path, f"{a!r} against {b!r}"
    return None


def _tensor_difference(a, b, path):
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return path, f"a {type(a).__name__} against a {type(b).__name__}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return path, f"{a.dtype} {tuple(a.shape)} against {b.dtype} {tuple(b.shape)}"
    a, b = a.detach().cpu(), b.detach().cpu()
    if torch.equal(a, b):
        return None
    if a.is_floating_point() or a.is_complex():
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        if bool(same.all()):
            return None
    diff = (a.double() - b.double()).abs() if a.dtype != torch.bool else (a != b).double()
    diff = torch.nan_to_num(diff, nan=float("inf"))
    where = int(diff.flatten().argmax())
    return path, (f"largest difference {float(diff.max()):.3g} (element {where} of "
                  f"{a.numel()}, {int((diff > 0).sum())} differ)")


def part_of(path):
    """Which part of a checkpoint ``path`` is in, in words."""
    part = PARTS.get(path[0], f"'{path[0]}'") if path else "the checkpoint"
    if path and path[0] in ("networks", "optimizers") and len(path) > 1:
        part = f"{part} ({path[1]})"
    return part


def compare_checkpoints(whole, resumed):
    """``first_difference`` of two training checkpoints, leaving out what differs between
    two run directories by design (``NOT_STATE``: the config, the checksum over it)."""
    keep = [{k: v for k, v in state.items() if k not in NOT_STATE} for state in (whole, resumed)]
    return first_difference(*keep)


def compare_ledgers(whole_dir, resumed_dir):
    """The first step whose samples differ between the two runs' ledgers, as a line, or
    None (each step's line per process; the resumed run's restart header left out)."""
    for rank, path in ledger.rank_files(whole_dir):
        other = ledger.path_of(resumed_dir, rank)
        a = [line for line in ledger.read_lines(path) if "step" in line]
        b = [line for line in ledger.read_lines(other) if "step" in line] \
            if os.path.exists(other) else []
        for x, y in zip(a, b):
            if x != y:
                return (f"the samples seen (--sample-ledger) differ at step {x['step']} of "
                        f"process {rank}: {_short(x['samples'])} uninterrupted, "
                        f"{_short(y['samples'])} resumed")
        if len(a) != len(b):
            return (f"the samples seen (--sample-ledger): process {rank} recorded {len(a)} "
                    f"steps uninterrupted, {len(b)} resumed")
    return None


def _short(items, n=8):
    return str(items[:n])[:-1] + (", ...]" if len(items) > n else "]")


# ------------------------------------------------------------- the child processes

def digest(tensors):
    """A hex digest of the bytes, dtypes and shapes of the tensors in a nested structure
    (a batch, a state_dict)."""
    h = hashlib.blake2b(digest_size=12)
    for t in _tensors(tensors):
        t = t.detach().cpu().contiguous().reshape(-1)
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for key in value:
            yield from _tensors(value[key])
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


class _Watched:
    """The task, seen by ``engine.steps``: each micro-batch it loads is counted, its digest
    recorded, and at the planned one (step, micro-batch) this process sends itself SIGTERM."""

    def __init__(self, task, state, child):
        self._task, self._state, self._child = task, state, child

    def __getattr__(self, name):
        return getattr(self._task, name)

    def to_device(self, *args, **kwargs):
        batch = self._task.to_device(*args, **kwargs)
        self._child.micro_batch(self._state.step + 1, batch)
        return batch


class _Child:
    def __init__(self, spec):
        self.stop_step, self.stop_micro = spec["stop_step"], spec["stop_micro"]
        self.fired, self.step, self.micro = False, None, 0
        os.makedirs(spec["record"], exist_ok=True)
        self.out = open(os.path.join(spec["record"], f"rank{runtime.process_rank()}.jsonl"),
                        "a", encoding="utf-8")

    def write(self, line):
        self.out.write(json.dumps(line) + "\n")
        self.out.flush()

    def micro_batch(self, step, batch):
        if step != self.step:
            self.step, self.micro = step, 0
        self.write({"step": step, "micro": self.micro, "batch": digest(batch)})
        due = step > self.stop_step or (step == self.stop_step and self.micro >= self.stop_micro)
        if self.stop_step and not self.fired and due:
            self.fired = True
            self.write({"signal": step, "micro": self.micro})
            os.kill(os.getpid(), signal.SIGTERM)  # saved after this step, as a pre-emption
        self.micro += 1

    def steps(self, original):
        def watched_steps(model, loader, optimizer, task, loop, state, bar):
            for step in original(model, loader, optimizer, _Watched(task, state, self), loop,
                                 state, bar):
                self.write({"step": step, "weights": digest(model.state_dict())})
                yield step
        return watched_steps


def child(argv):
    """``--child SPEC TRAIN_PY ARGS...``: train.py under the hook; returns its exit code,
    0 for the planned stop (SIGTERM's 143)."""
    from machinery import engine

    spec, train_py, args = json.loads(argv[0]), argv[1], argv[2:]
    watcher = _Child(spec)
    engine.steps = watcher.steps(engine.steps)
    sys.argv = [train_py, *args]
    code = 0
    try:
        runpy.run_path(train_py, run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    return 0 if watcher.fired and code == 128 + signal.SIGTERM else code


# ------------------------------------------------------------------------ the check

def strip_flags(argv):
    """The user's arguments without --verify-resume's own flags and --run-dir (argparse
    takes unambiguous prefixes: ``--verify-r`` is one of them)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        name = token.split("=", 1)[0]
        mine = [o for o in (*OURS, "--run-dir") if token.startswith("--") and len(name) > 2
                and o.startswith(name)]
        if not mine:
            out.append(token)
            i += 1
            continue
        option = name if name in mine else mine[0]
        takes = VALUED.get(option, 0)
        i += 1
        if "=" not in token and takes:
            i += 1
    return out


class _Runs:
    """The three runs' commands, in a temporary directory."""

    def __init__(self, config, argv, train_py, root):
        self.root, self.train_py = root, train_py
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.args = strip_flags(argv) + ["--sample-ledger"]
        if config.get("mlflow"):  # into a store of the check's own
            self.args += ["--mlflow", "file:" + os.path.join(root, "mlruns")]
        self.env = {k: v for k, v in os.environ.items()
                    if k not in _TORCHRUN_ENV and not k.startswith("TORCHELASTIC_")}
        project = os.path.dirname(os.path.abspath(train_py))
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (project, self.env.get("PYTHONPATH")) if p)

    def train(self, name, stop_step, stop_micro=0, resume=False):
        """Runs train.py into ``<root>/<name>``; returns its final checkpoint."""
        run_dir = os.path.join(self.root, name)
        spec = {"stop_step": stop_step, "stop_micro": stop_micro,
                "record": os.path.join(self.root, f"{name}-record")}
        launcher = [sys.executable]
        if self.world > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                         str(self.world)]
        cmd = [*launcher, "-m", "machinery.verify_resume", "--child", json.dumps(spec),
               self.train_py, *self.args, "--run-dir", run_dir,
               *(["--resume", "auto"] if resume else [])]
        log = os.path.join(self.root, f"{name}.log")
        with open(log, "ab") as out:
            child = start_process(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL)
            try:
                code = _wait(child)
            except BaseException as e:  # a stop signal (Interrupted), Ctrl-C: it stops too
                _stop_child(child, getattr(e, "signum", signal.SIGINT))
                raise
        path = os.path.join(run_dir, "checkpoints", "last.pt")
        if code != 0 or not os.path.exists(path):
            raise RunFailed(f"--verify-resume: the {name} run failed (exit {code}): "
                            f"{_error_line(log)}; its output: {log}")
        return checkpoint.load_checkpoint(path)

    def records(self, name):
        """``{(rank, step, micro): batch digest}`` and ``{(rank, step): weights digest}``."""
        batches, weights = {}, {}
        for rank in range(self.world):
            path = os.path.join(self.root, f"{name}-record", f"rank{rank}.jsonl")
            with contextlib.suppress(OSError), open(path, encoding="utf-8") as f:
                for line in map(json.loads, f):
                    if "batch" in line:
                        batches[rank, line["step"], line["micro"]] = line["batch"]
                    elif "weights" in line:
                        weights[rank, line["step"]] = line["weights"]
        return batches, weights


def _wait(child):
    """The child's exit code. Waited for in short sleeps, not one blocking wait: a signal
    that the kernel hands to another thread of this process (torch's) then still reaches
    the main thread's handler at once."""
    while True:
        try:
            return child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            pass


def _stop_child(child, signum):
    """Sends ``signum`` to a child (a torchrun passes it on to its processes) and waits for
    it to end; one still running after ``CHILD_STOP_S`` is killed."""
    with contextlib.suppress(OSError):
        child.send_signal(signum)
    try:
        child.wait(timeout=CHILD_STOP_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _error_line(log):
    with open(log, encoding="utf-8", errors="replace") as f:
        lines = [line.strip() for line in f if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    return (errors or lines or ["no output"])[-1]


def stop_point(seed, steps, accum):
    """The step (1..steps-1) and micro-batch (1..accum-1; 0 without accumulation) at which
    the interrupted run gets its signal, drawn from the seed."""
    rng = random.Random(seed * 7919 + 38)
    return rng.randint(1, steps - 1), (rng.randint(1, accum - 1) if accum > 1 else 0)


def device_type(config):
    """The type of device the runs would train on: ``cuda`` with --gpus, else --device's
    (``runtime.parse_device``: auto is CUDA where there is one)."""
    return "cuda" if config.get("gpus") else runtime.parse_device(config["device"]).type


def determinism(kind, deterministic):
    """What --verify-resume adds to its runs' flags on a device of type ``kind``, and the
    note it prints at its start (review 6's L4): on CUDA without --deterministic,
    --deterministic (the check compares bits, and cuDNN's autotuned and atomic kernels
    would make even two uninterrupted runs differ, found only after four runs); else
    nothing.

    Returns:
        ``(flags, note)``: a list, and a line or None.
    """
    if kind == "cuda" and not deterministic:
        return ["--deterministic"], (
            "note: --verify-resume on CUDA trains its runs with --deterministic: it compares "
            "them bit for bit, and without it cuDNN's autotuned kernels make even two "
            "uninterrupted runs differ")
    return [], None


def run(config, argv, train_py, say=runtime.say, stop=None):
    """--verify-resume: the three runs and the comparison; returns the exit code (0: the
    resume is exact; a difference is a ``RunFailed``, exit 1; 128 + the signal's number
    when ``stop``, the ``StopRequest``, gets one: the check ends at once, its temporary
    directory removed)."""
    if runtime.process_rank() != 0:  # process 0 starts a torchrun of its own
        return 0
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != int(os.environ.get("LOCAL_WORLD_SIZE", world)):
        raise UserError(f"--verify-resume runs its processes on one machine: start it with "
                        f"torchrun --nnodes 1 --nproc_per_node {world}")
    added, note = determinism(device_type(config), config["deterministic"])
    if note:
        say(note)
    root = tempfile.mkdtemp(prefix="verify-resume-")
    try:
        with stop.interruptible("--verify-resume") if stop else contextlib.nullcontext():
            return _check(config, [*argv, *added], train_py, say, root, world)
    except Interrupted as e:
        shutil.rmtree(root, ignore_errors=True)
        say(f"{signal.Signals(e.signum).name}: --verify-resume interrupted: its runs are "
            f"stopped and its temporary directory is removed", file=sys.stderr)
        return 128 + e.signum


def _check(config, argv, train_py, say, root, world):
    """``run``'s three runs in ``root`` and their comparison."""
    accum = (config["virtual_batch_size"] or config["batch_size"]) // config["batch_size"]
    runs = _Runs(config, argv, train_py, root)
    wanted = config["verify_resume_steps"]
    say(f"verify-resume: in {root}, {world} process(es): an uninterrupted run to step "
        f"{wanted} ...")
    whole = runs.train("uninterrupted", wanted)
    steps = whole["step"]
    if steps < 2:
        shutil.rmtree(root, ignore_errors=True)
        raise UserError(f"--verify-resume needs a run of at least 2 optimizer steps; this one "
                        f"has {steps}")
    stop, micro = stop_point(config["seed"], steps, accum)
    window = f"before micro-batch {micro + 1} of {accum}" if accum > 1 else \
        "while its batch loads"
    say(f"verify-resume: a run stopped at step {stop} ({window}), then resumed in a fresh "
        f"process to step {steps} ...")
    stopped = runs.train("resumed", stop, micro)
    if stopped["step"] != stop:
        raise RunFailed(f"--verify-resume: the stop signal at step {stop} saved step "
                        f"{stopped['step']}; its output: {os.path.join(root, 'resumed.log')}")
    resumed = runs.train("resumed", wanted, 0, resume=True)  # (or to the run's end)
    found = compare_checkpoints(whole, resumed)
    samples = compare_ledgers(os.path.join(root, "uninterrupted"), os.path.join(root, "resumed"))
    if found is None and samples is None:
        state = {k: v for k, v in whole.items() if k not in NOT_STATE}
        parts = list(dict.fromkeys(part_of((key,)) for key in state))
        shutil.rmtree(root, ignore_errors=True)
        say(f"resume exact: stopped at step {stop} and resumed, the state at step {steps} "
            f"equals the uninterrupted run's in all {sum(1 for _ in _tensors(state))} "
            f"tensors ({', '.join(parts)}) and in every step's samples")
        return 0
    raise RunFailed(_difference_line(found, samples, runs, stop, (steps, wanted), whole) +
                    f" (the runs: {root})")


def _difference_line(found, samples, runs, stop, steps, whole):
    steps, wanted = steps  # the steps run, and the stop the uninterrupted run was given
    if found is not None:
        path, detail = found
        what = "/".join(map(str, path))
        line = f"resume differs at step {steps}: {what} ({part_of(path)}): {detail}"
    else:
        line = f"resume differs: {samples}"
    line += "; " + _diagnosis(runs, stop, steps)
    if found is not None:  # is the run reproducible at all?
        again = compare_checkpoints(whole, runs.train("again", wanted))
        if again is not None:
            path, detail = again
            line += (f"; two uninterrupted runs differ too ({'/'.join(map(str, path))}: "
                     f"{detail}): the run is not reproducible without a resume either (on "
                     f"CUDA: --deterministic; else something draws from an unseeded source)")
    return line


def _diagnosis(runs, stop, steps):
    """Where the difference first shows: the batches or the weights of a step after the
    resume."""
    batches_a, weights_a = runs.records("uninterrupted")
    batches_b, weights_b = runs.records("resumed")
    for step in range(stop + 1, steps + 1):
        for key in sorted(k for k in batches_a if k[1] == step):
            if batches_a[key] != batches_b.get(key):
                rank, _, micro = key
                return (f"from step {step} (the first after the resume at step {stop}: "
                        f"{step - stop}) the batches differ (micro-batch {micro + 1}, "
                        f"process {rank}): the data draws from a random state the checkpoint "
                        f"does not hold (a dataset's __getitem__ or a transform using the "
                        f"global RNG in a DataLoader worker?)")
        for rank in range(runs.world):
            if weights_a.get((rank, step)) != weights_b.get((rank, step)):
                return (f"step {step} (after the resume at step {stop}) trained on the same "
                        f"batches and ended with other weights: the step draws from a random "
                        f"state the checkpoint does not hold (a dropout or noise with a "
                        f"generator of its own?), or a kernel is not deterministic")
    return (f"every step after the resume at step {stop} trained on the same batches to the "
            f"same weights: the difference is in what the checkpoint holds besides them")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        sys.exit(child(sys.argv[2:]))
    print("usage: python train.py <flags> --verify-resume", file=sys.stderr)
    sys.exit(2)

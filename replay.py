"""The batch that made a loss or a gradient norm non-finite: kept, and replayed.

Two halves:

- ``record_nonfinite`` (called by train.read_losses, at log steps, where the device
  counters are read anyway): the counters say which micro-batch of the window since the
  last read had the first non-finite loss (any process) and which optimizer step the first
  non-finite gradient norm; the sampler's plan, a pure function of (seed, epoch, index),
  turns that into the step, the epoch and the sample indices of the step's micro-batches,
  for every process. One record per run, ``RUN_DIR/checkpoints/nonfinite-step-NNNNNNNN.json``
  (written atomically), and one line with the command that replays it. Nothing runs per
  step for this: a list append in ``meters.Counters``.
- ``run`` (``python train.py --replay RECORD``): the run rebuilt at its last good
  checkpoint in a scratch run directory (deleted at the end: the recorded run and its
  checkpoints are only read), trained forward in one process to the recorded step with the
  same data order, then that step under ``torch.autograd.set_detect_anomaly(True)`` with a
  forward hook on every module and a hook on every module output's and parameter's
  gradient: the first module whose output or gradient is not finite is named, with the
  samples (their files, for an image folder) in which it is not.
"""

import contextlib
import io
import json
import os
import shlex
import signal
import sys
import tempfile
import warnings

import torch

from config import check_config, merge_resumed_config, with_defaults
from machinery import checkpoint, engine, files, hardware, runtime
from ops import Interrupted, RunFailed, UserError
from pipeline import data
from reporting import runlog

RECORD_FORMAT = 1
# Flags that would make a replay write somewhere, or do something other than replay.
NOT_WITH_REPLAY = ("resume", "run_dir", "find_lr", "mlflow")


# ----------------------------------------------------------------- keeping the batch

def record_nonfinite(found, config, state, procs, loop, set_size, last_saved):
    """Writes the record of the first non-finite value the last counter read found, and
    prints the command that replays it; train.py calls it once a run.

    Args:
        found: ``LossMeter.nonfinite`` (set by ``collect``): what was not finite, where.
        config, state, procs, loop: the run's config, TrainState, Processes, LoopSettings
            (its accumulation and GradScaler).
        set_size: the training set's number of samples.
        last_saved: the last checkpoint written, or None.

    Returns:
        The record's path; "recorded" on the other processes (the main one writes every
        process's share); None where nothing is recorded (fp16's infinite gradients
        alone, which the GradScaler skips).
    """
    if loop.scaler.is_enabled():  # fp16: inf gradients are the GradScaler's to skip
        found = {**found, "grad_norm": None}
        if found["loss"] is None:
            return None
    if not procs.is_main:
        return "recorded"
    where = locate(found, state, config["batch_size"] * procs.world_size, loop.accum,
                   set_size)
    batches = [batch_samples(set_size, config["batch_size"], config["seed"],
                             procs.world_size, state.epoch, b) for b in where["batches"]]
    path = os.path.join(config["run_dir"], "checkpoints",
                        f"nonfinite-step-{where['step']:08d}.json")
    record = {
        "format": RECORD_FORMAT, "what": where["what"], "step": where["step"],
        "epoch": state.epoch, "micro_batch": where["micro_batch"],
        "world_size": procs.world_size,
        "micro_batches": [{"batch": b, "samples": [i for part in parts for i in part],
                           "per_process": parts}
                          for b, parts in zip(where["batches"], batches)],
        "checkpoint": os.path.abspath(last_saved) if last_saved else None,
        "run_dir": os.path.abspath(config["run_dir"]),
        "config": config,
        "command": f"python train.py --replay {shlex.quote(path)}",
    }
    try:
        files.atomic_write(path, lambda f: json.dump(record, f, indent=1, default=str))
    except OSError as e:  # the run goes on; its own checks decide whether it stops
        runtime.say(f"warning: the non-finite {where['what']} at step {where['step']} "
                    f"could not be recorded in {path} ({e.strerror or e})", file=sys.stderr)
        return None
    runtime.say(f"non-finite {where['what']} at step {where['step']} (epoch "
                f"{state.epoch + 1}): its batch is recorded; replay it with: "
                f"{record['command']}", file=sys.stderr)
    return path


def locate(found, state, global_batch, accum, size):
    """The step, and the batches of the epoch that made it, of a window's first
    non-finite value.

    The window is the micro-batches since the last counter read, which ended at the run's
    position (``state``): reads happen between optimizer steps and every epoch's last
    step is read before the next epoch begins, so the window lies in epoch
    ``state.epoch`` and ends at its batch ``ceil(epoch_samples / global_batch)``.

    Args:
        found: ``meters.LossMeter.nonfinite``.
        state: the run's ``engine.TrainState`` at the read.
        global_batch: samples in a batch, all processes together.
        accum: micro-batches per optimizer step.
        size: samples in the training set.

    Returns:
        A dict: ``what`` ("loss" or "gradient norm"), ``step``, ``batches`` (the step's
        batch numbers in the epoch), ``micro_batch`` (which of them had the non-finite
        loss; None for a gradient norm).
    """
    consumed = -(-state.epoch_samples // global_batch)  # batches of the epoch so far
    total = -(-size // global_batch)
    last_step_in_epoch = (consumed - 1) // accum
    candidates = []
    if found["loss"] is not None:
        batch = consumed - found["micro_batches"] + found["loss"]
        candidates.append((state.step - (last_step_in_epoch - batch // accum), 0, batch))
    if found["grad_norm"] is not None:
        candidates.append((state.step - (found["steps"] - 1 - found["grad_norm"]), 1, None))
    step, kind, batch = min(candidates)  # the loss first when both are of one step
    first = (last_step_in_epoch - (state.step - step)) * accum
    batches = list(range(first, min(first + accum, total)))
    return {"what": ("loss", "gradient norm")[kind], "step": step, "batches": batches,
            "micro_batch": None if batch is None else batch - first}


def batch_samples(size, batch_size, seed, world_size, epoch, batch):
    """The sample indices each process trained on in batch ``batch`` of ``epoch``.

    Returns:
        A list by rank of lists of indices (empty for a process whose share of a last,
        short batch was nothing: it ran a stand-in sample weighted 0).
    """
    parts = []
    for rank in range(world_size):
        sampler = data.EpochBatchSampler(size, batch_size, seed, rank=rank,
                                         world_size=world_size)
        sampler.set_epoch(epoch)
        local = sampler.plan()[batch][1]
        indices = next(b for k, b in enumerate(sampler.index_batches()) if k == batch)
        parts.append(indices.tolist() if local else [])
    return parts


# ------------------------------------------------------------------------ replaying

def read_record(path):
    """The record at ``path``, checked; a missing or damaged file is a UserError."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
    except OSError as e:
        raise UserError(f"--replay {path!r} cannot be read ({e.strerror or e})") from None
    except ValueError as e:
        raise UserError(f"--replay {path!r} is not a non-finite record ({e})") from None
    if not _well_formed(record):
        raise UserError(f"--replay {path!r} is not a non-finite record of this project "
                        f"(train.py writes them as checkpoints/nonfinite-step-NNNNNNNN.json)")
    if record["format"] > RECORD_FORMAT:
        raise UserError(f"--replay {path!r} is of format {record['format']}, newer than this "
                        f"project reads ({RECORD_FORMAT}): update the project")
    return record


def _well_formed(record):
    """Whether ``record`` has the keys and types ``record_nonfinite`` writes."""
    types = {"format": int, "step": int, "epoch": int, "world_size": int, "config": dict,
             "micro_batches": list, "what": str}
    if not isinstance(record, dict) or any(not isinstance(record.get(k), t)
                                           for k, t in types.items()):
        return False
    if not isinstance(record.get("checkpoint"), (str, type(None))) or \
            record["step"] < 1 or record["world_size"] < 1:
        return False
    return all(isinstance(mb, dict) and isinstance(mb.get("batch"), int) and
               isinstance(mb.get("samples"), list) for mb in record["micro_batches"])


def start_checkpoint(record, path):
    """The checkpoint to replay from: the recorded one, or, when it was written over since
    (last.pt of a run that went on), the newest file beside it from before the step.

    Returns:
        ``(checkpoint path, its state)``, or ``(None, None)``: the run had none and
        started fresh, so the replay does too.
    """
    named = record["checkpoint"]
    if named is None:
        return None, None
    step = record["step"]
    if os.path.isfile(named):
        saved = _training_checkpoint(named, path)
        if saved["step"] < step:
            return named, saved
    # Beside the record: its run directory may have been moved or copied since.
    beside = os.path.join(os.path.dirname(os.path.abspath(path)), os.path.basename(named))
    if beside != named and os.path.isfile(beside):
        saved = _training_checkpoint(beside, path)
        if saved["step"] < step:
            return beside, saved
    best = None, None
    for folder in dict.fromkeys([os.path.dirname(named), os.path.dirname(beside)]):
        for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else ():
            candidate = os.path.join(folder, name)
            if not name.endswith(".pt") or candidate in (named, beside):
                continue
            with contextlib.suppress(UserError):  # not a training checkpoint: not a candidate
                saved = _training_checkpoint(candidate, path)
                if saved["step"] < step and (best[1] is None or
                                             saved["step"] > best[1]["step"]):
                    best = candidate, saved
    if best[0] is None:
        raise UserError(f"--replay {path!r}: no checkpoint from before step {step} is left "
                        f"beside it ({named!r} was written over or removed)")
    return best


RUN_IDENTITY = ("task", "network", "dataset", "seed", "optimizer", "lr", "batch_size",
                "virtual_batch_size", "image_size", "num_classes")  # what a run is


def check_same_run(record, saved_config, checkpoint_path, path):
    """One line when the checkpoint beside a record is of another run than the record's
    (the weights would be another run's, and a replay that differs would blame the device)."""
    recorded = with_defaults(record["config"])
    for key in RUN_IDENTITY:
        if recorded.get(key) != saved_config.get(key):
            raise UserError(f"--replay {path!r}: {checkpoint_path!r} is of another run than "
                            f"the record's ({record.get('run_dir')!r}): its {key} is "
                            f"{saved_config.get(key)!r}, the record's {recorded.get(key)!r}; "
                            f"put the recorded run's checkpoints beside the record")


def _training_checkpoint(candidate, path):
    """A training checkpoint's state (``checkpoint.require``: step, weights, config...);
    one ``UserError`` line for a file that is not one (a state_dict, --pretrained weights)."""
    saved = checkpoint.load_checkpoint(candidate)
    missing = ["/".join(k) if isinstance(k, tuple) else k
               for k in checkpoint.missing_keys(saved, checkpoint.RESUME_KEYS)]
    if missing or type(saved.get("step")) is not int:
        raise UserError(f"--replay {path!r}: {candidate!r} is not a training checkpoint "
                        f"(it has no {', '.join(missing) or 'step count'}); put the run's "
                        f"checkpoint back beside the record")
    return saved


def replay_config(record, config, explicit):
    """The recorded run's config for a one-process replay: the flags given with --replay
    (say --device cpu) override it; DDP's processes become one process with their
    batches together (the sampler's global batches are the same)."""
    given = explicit - {"replay"}
    for key in NOT_WITH_REPLAY:
        if key in given:
            raise UserError(f"--replay runs in a scratch directory and writes nothing into "
                            f"the recorded run: drop --{key.replace('_', '-')}")
    saved = with_defaults(record["config"])
    merged = merge_resumed_config(saved, config, given)
    world = record["world_size"]
    virtual = saved["virtual_batch_size"]
    merged.update(replay=config["replay"], resume=None, mlflow=None, find_lr=False,
                  compile=False, gpus=None, prefetch=0, profile_steps=0,
                  memory_snapshot=False, batch_size=saved["batch_size"] * world,
                  virtual_batch_size=virtual * world if virtual else virtual)
    check_config(merged)
    return merged


def run(config, explicit, stop, build_training, unfreeze_point, unfreeze):
    """``python train.py --replay RECORD``: replays the recorded step and reports.

    Args:
        config, explicit: ``config.parse_config``'s.
        stop: the ``runtime.StopRequest``.
        build_training, unfreeze_point, unfreeze: train.py's (the run is built and
            unfrozen exactly as training does it).

    Returns:
        0 when the replay reproduced the non-finite value and named where it arose;
        128 + the signal's number when a stop signal ended it (nothing is written).

    Raises:
        UserError: a bad record or flag; RunFailed: not reproduced (one line).
    """
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--replay runs in one process (it replays every process's batch): "
                        "start it with python train.py, not torchrun")
    path = config["replay"]
    record = read_record(path)
    config = replay_config(record, config, explicit)
    resume_path, saved = start_checkpoint(record, path)
    if saved is not None:
        saved["config"] = with_defaults(saved["config"])
        check_same_run(record, saved["config"], resume_path, path)
    with tempfile.TemporaryDirectory(prefix="replay-") as scratch:
        run_dir = os.path.join(scratch, "run")
        config["run_dir"] = run_dir
        with runlog.RunDirectory(run_dir, is_main=True):
            procs = runtime.setup_processes(config, stop.pending)
            hardware.set_memory_options(config, procs.device)
            # cuDNN's timed choice can differ from one replay to the next: its default
            # algorithms instead, the same each time
            hardware.seed_everything(config["seed"], 0, config["deterministic"], procs.device,
                                    benchmark=False)
            start = f"{resume_path} (step {saved['step']})" if saved else "the initial weights"
            together = f" ({record['world_size']} processes' batches together on one " \
                f"device: --device cpu where they do not fit)" if record["world_size"] > 1 \
                else ""
            runtime.say(f"replaying step {record['step']} from {start} in a scratch "
                        f"directory{together}")
            with contextlib.redirect_stdout(io.StringIO()):
                training, loader = build_training(config, procs, run_dir, saved, resume_path,
                                                  stop.pending)  # its lines are the run's
            try:
                watch = replay_to(training, loader, record, unfreeze_point, unfreeze, stop)
            except Interrupted as e:
                runtime.say(f"{signal.Signals(e.signum).name}: stopped {e.what}; nothing was "
                            f"written (the recorded run is only read)", file=sys.stderr)
                return 128 + e.signum
            finally:
                data.shutdown_loader(loader)
                data.shutdown_loader(training.val_loader)
                training.run_log.close(config, None)
    return report(record, watch, start, training.datasets[0])


def replay_to(training, loader, record, unfreeze_point, unfreeze, stop):
    """Trains from the restored state to the recorded step, then runs that step watched.

    Returns:
        The ``Watch`` of the recorded step.

    Raises:
        ops.Interrupted: a stop signal (``stop``, a ``runtime.StopRequest``) came.
    """
    state, sampler, target = training.state, loader.batch_sampler, record["step"]
    watch = Watch(training.net, training.task, len(record["micro_batches"]))
    with contextlib.ExitStack() as armed:
        if state.step == target - 1:
            armed.enter_context(watch.armed())
        for epoch in range(state.epoch, record["epoch"] + 1):
            if (epoch, state.epoch_samples) == unfreeze_point(training.config):
                unfreeze(training)
            sampler.set_epoch(epoch, state.epoch_samples)
            if epoch == record["epoch"]:
                check_same_batches(record, sampler)
            try:
                with contextlib.closing(engine.steps(
                        training.model, loader, training.optimizer, training.task,
                        training.loop, state, _NoBar())) as each_step:
                    for step in each_step:
                        if step == target:
                            return watch
                        if step == target - 1:
                            armed.enter_context(watch.armed())
                        _check_finite_before(training, step)
                        if stop.pending():  # a stop signal: the replay leaves nothing
                            raise Interrupted(stop.pending(), f"the replay at step {step} "
                                              f"of {target}")
            except RuntimeError as e:  # anomaly detection stopped the watched backward
                if not watch.active:
                    raise
                watch.stopped_by_anomaly(str(e).strip().splitlines()[0])
                return watch
            state.epoch, state.epoch_samples = state.epoch + 1, 0
    raise RunFailed(f"the replay ended at step {state.step} without reaching step {target}: "
                    f"the data or the flags differ from the recorded run's")


def _check_finite_before(training, step):
    """Stops a replay that went non-finite before the recorded step (it did not take the
    recorded run's path)."""
    values = training.loop.counters.read()
    if values["worst_streak"] or values["first_nonfinite_grad_norm"] is not None:
        raise RunFailed(f"not reproduced: the replay went non-finite at step {step}, before "
                        f"the recorded step (the computation differs: another device, "
                        f"threads or library version?)")


def check_same_batches(record, sampler):
    """The replay's sampler gives the recorded step's samples, or the data changed."""
    per_step = sampler.batch_size * sampler.world_size
    first_batch = sampler.start // per_step
    wanted = {mb["batch"]: mb["samples"] for mb in record["micro_batches"]}
    for k, indices in enumerate(sampler.index_batches()):
        batch = first_batch + k
        if batch in wanted and indices.tolist() != wanted[batch]:
            raise UserError(f"--replay: batch {batch} of epoch {record['epoch'] + 1} is not "
                            f"the recorded one (another data set size, seed or batch size)")


class _NoBar:
    def update(self, n):
        pass


class Watch:
    """Hooks on every module of ``net`` (and the task's criterion) while armed: the first
    non-finite module output in the forward pass, and in the backward pass the first
    module output and parameter whose gradient is not finite. A task of several networks
    (``task.phases``: ``net`` a ModuleDict, its modules named ``discriminator.main.0``...)
    is told by its ``phase_loss`` calls which micro-batch and phase each forward is of.

    Args:
        net: the plain network (or networks).
        task: the task (its ``criterion``, where a module, is watched as ``loss``).
        per_step: the micro-batches of the recorded step.
    """

    def __init__(self, net, task, per_step=1):
        self.modules = list(net.named_modules())
        self.net, self.task, self.per_step = net, task, per_step
        criterion = task.criterion
        if isinstance(criterion, torch.nn.Module):
            self.modules.append(("loss", criterion))
        self.active, self.micro_batch, self.phase, self.anomaly = False, -1, None, None
        self.forward = self.backward = self.parameter = None
        self.last_finite_grad = None  # the module whose output gradient was last finite

    @contextlib.contextmanager
    def armed(self):
        """Hooks in place and anomaly detection on, for the recorded step."""
        handles = []
        if self.task.phases:  # told by the task's phase_loss calls (an instance attribute)
            self._phase_loss, self._calls = self.task.phase_loss, 0
            self.task.phase_loss = self._counted_phase_loss
        else:
            handles.append(self.net.register_forward_pre_hook(self._count))
        for name, module in self.modules:
            handles.append(module.register_forward_hook(self._forward_hook(name)))
        for name, p in self.net.named_parameters():
            if p.requires_grad:
                handles.append(p.register_hook(self._parameter_hook(name)))
        self.active = True
        try:
            with warnings.catch_warnings(), torch.autograd.set_detect_anomaly(True):
                warnings.simplefilter("ignore")  # anomaly mode's forward tracebacks
                yield self
        finally:
            self.active = False
            self.task.__dict__.pop("phase_loss", None)
            for handle in handles:
                handle.remove()

    def stopped_by_anomaly(self, message):
        """Anomaly detection stopped the backward at a NaN before any hook saw it: the
        module whose output gradient was the last seen finite made it."""
        self.anomaly = message
        if self.forward is None and self.backward is None and self.last_finite_grad:
            name, kind, micro_batch, phase = self.last_finite_grad
            self.backward = {"module": name, "type": kind, "micro_batch": micro_batch,
                             "rows": None, "after": None, "inside": True, "phase": phase}

    def found(self):
        return self.forward or self.backward or self.parameter or self.anomaly

    def _count(self, module, args):
        self.micro_batch += 1

    def _counted_phase_loss(self, network, *args):
        """The task's ``phase_loss``, counted: ``engine._phase_steps`` calls it phase by
        phase, then repeat by repeat, then micro-batch by micro-batch."""
        self.micro_batch, self.phase = self._calls % self.per_step, network
        self._calls += 1
        return self._phase_loss(network, *args)

    def _forward_hook(self, name):
        def hook(module, args, output):
            outputs = list(_tensors(output))
            if self.forward is None and outputs and not all(_finite(t) for t in outputs):
                inputs_finite = all(_finite(t) for t in _tensors(args))
                self.forward = {"module": name, "type": type(module).__name__,
                                "micro_batch": self.micro_batch, "rows": _bad_rows(outputs),
                                "inputs_finite": inputs_finite, "phase": self.phase}
            for t in outputs:
                if t.requires_grad:
                    t.register_hook(self._gradient_hook(name, type(module).__name__))
        return hook

    def _gradient_hook(self, name, kind):
        micro_batch, phase = self.micro_batch, self.phase

        def hook(grad):
            if self.backward is not None:
                return
            if _finite(grad):
                self.last_finite_grad = name, kind, micro_batch, phase
            else:
                self.backward = {"module": name, "type": kind, "micro_batch": micro_batch,
                                 "rows": _bad_rows([grad]), "inside": False,
                                 "after": self.last_finite_grad, "phase": phase}
        return hook

    def _parameter_hook(self, name):
        def hook(grad):
            if self.parameter is None and not _finite(grad):
                self.parameter = {"parameter": name, "micro_batch": self.micro_batch}
        return hook


def _tensors(value):
    """The floating-point tensors in a module's output or inputs (tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        if value.is_floating_point():
            yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _finite(t):
    return bool(torch.isfinite(t).all())


def _bad_rows(tensors):
    """The rows (samples of the micro-batch) in which the tensors are not finite; None for
    tensors without a batch dimension (a mean loss)."""
    rows = set()
    for t in tensors:
        if t.dim() == 0:
            return None
        rows.update((~torch.isfinite(t.detach()).flatten(1).all(1)).nonzero()[:, 0].tolist()
                    if t.dim() > 1 else (~torch.isfinite(t.detach())).nonzero()[:, 0].tolist())
    return sorted(rows)


def sample_name(dataset, index):
    """The file of sample ``index`` where the set is read from files (an image folder,
    its decoded cache), else None."""
    seen = 0
    while dataset is not None and seen < 8:
        samples = getattr(dataset, "samples", None)
        if isinstance(samples, list) and index < len(samples):
            return samples[index][0]
        dataset = getattr(dataset, "base", None) or getattr(dataset, "folder", None)
        seen += 1
    return None


def report(record, watch, start, dataset):
    """Prints what the replay found; returns 0, or raises RunFailed (not reproduced)."""
    step = record["step"]
    if not watch.found():
        ddp = f", {record['world_size']} processes' BatchNorm statistics taken apart" \
            if record["world_size"] > 1 else ""
        raise RunFailed(f"not reproduced: step {step} replayed from {start} was finite "
                        f"everywhere (every module's output and gradient, the loss); the "
                        f"recorded run's non-finite {record['what']} came from something the "
                        f"replay does not repeat (another device, threads, or library "
                        f"version{ddp})")
    lines = [f"replay of step {step} (epoch {record['epoch'] + 1}) from {start}: "
             f"reproduced the non-finite {record['what']}"]
    where = watch.forward or watch.backward
    of = "" if where is None else f"micro-batch {where['micro_batch'] + 1} of " \
        f"{len(record['micro_batches'])}" + \
        (f" (the {where['phase']}'s phase)" if where["phase"] else "")
    if watch.forward:
        f = watch.forward
        lines.append(f"  first non-finite output: module '{f['module']}' ({f['type']}) in "
                     f"the forward pass of {of}; its inputs were "
                     f"{'finite' if f['inputs_finite'] else 'already not finite (the data?)'}")
    elif watch.backward:
        b = watch.backward
        if b["inside"]:
            lines.append(f"  first non-finite gradient: made in the backward pass of module "
                         f"'{b['module']}' ({b['type']}), {of}; the gradient of its output "
                         f"was finite")
        else:
            after = f", made in the backward pass of '{b['after'][0]}' ({b['after'][1]})" \
                if b["after"] else ""
            lines.append(f"  first non-finite gradient: of the output of module "
                         f"'{b['module']}' ({b['type']}){after}, {of}")
    if watch.parameter:
        lines.append(f"  first non-finite parameter gradient: {watch.parameter['parameter']}")
    if watch.anomaly:
        lines.append(f"  anomaly detection: {watch.anomaly}")
    if where is not None and 0 <= where["micro_batch"] < len(record["micro_batches"]):
        samples = record["micro_batches"][where["micro_batch"]]["samples"]
        rows = where["rows"]
        chosen = [samples[r] for r in rows if r < len(samples)] if rows else samples
        what = "samples" if rows else "samples of that micro-batch (not told apart)"
        lines.append(f"  {what}: " + ", ".join(_named(i, dataset) for i in chosen))
    runtime.say("\n".join(lines))
    return 0 if where is not None or watch.parameter else _not_named(step)


def _named(index, dataset):
    name = sample_name(dataset, index)
    return f"{index} ({name})" if name else str(index)


def _not_named(step):
    raise RunFailed(f"step {step} was reproduced (anomaly detection stopped it) but no "
                    f"module's output or gradient was seen non-finite")


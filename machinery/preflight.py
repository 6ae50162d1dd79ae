"""--preflight: every stage of a run once, before its first step, then all put back.

    python train.py ... --preflight           # the stages, then exit 0 (or 1)
    python train.py ... --preflight train     # the stages, then the run itself

A run that crashes at its first validation or cannot read its own checkpoint is found out
hours in. The preflight takes each path the run will take, on the run's own objects, in
seconds (``run``):

1. the output directories: a file made and removed in the run directory (TensorBoard's
   event files and metrics.jsonl go there) and in its ``checkpoints/``;
2. the training step: ``engine.steps`` itself (AMP, the GradScaler, clipping, MixUp,
   a task's phases) for one accumulation window of the real batches at the run's position,
   then the EMA's update; its loss and the weights after it must be finite;
3. the evaluation: ``engine.evaluate`` with the network on one validation batch (with
   --tta as set), the task's figures and pictures from it; a task whose figures need
   more images than one batch holds (an FID on --fid-samples images) takes one batch's
   for the while (``Task.evaluating_on``), and one that refuses one batch anyway gets the
   whole validation set;
4. the evaluation of the moving average (--ema-decay), the same way;
5. the checkpoint: the run's own ``Saver`` writes it into a temporary directory (never
   the run's), ``checkpoint.load_checkpoint`` reads it back, and every tensor and value
   is compared with the state it was written from (``verify_resume.first_difference``).

Then everything is put back (``Snapshot``): the weights and BatchNorm statistics, the
optimizer(s), the GradScaler, the EMA, the run state (``TrainState``: step, position),
the loss counters, the Saver's directory and last file, each module's train/eval mode and
the RNG states (python, numpy, torch CPU and CUDA). The step ran on loaders built for the
preflight (``loaders``: a sampler of its own at the run's position), so the run's sampler
and DataLoader workers never moved, and nothing of the preflight reaches TensorBoard,
metrics.jsonl or MLflow: the run that follows is bit for bit the run without it.

A failure is one line naming the stage (``PreflightFailed``, a RunFailed: exit 1), e.g.
``error: preflight: the checkpoint read back differs at model/fc.weight ...``; a mistake in
what the user gave (``UserError``: a damaged file, a task's figures) is exit 2, as the run
would end (``PreflightMistake``). A stop signal during ``--preflight`` alone ends it at once
(exit 130/143: nothing was to be saved); ``--preflight train`` finishes it, then the run
stops at its first step and saves.
"""

import contextlib
import copy
import io
import itertools
import os
import tempfile
import time

import torch

import ops
from machinery import checkpoint, engine, files, param_groups, runtime, saving, verify_resume
from ops import Interrupted, RunFailed, TooFewImages, UserError


class PreflightFailed(RunFailed):
    """A stage of the preflight failed: one line, exit 1."""


class PreflightMistake(UserError):
    """A stage of the preflight met a mistake of the user's (a damaged file, a task's
    figures): one line, exit 2, as the run would end."""


@contextlib.contextmanager
def stage(name, training=None):
    """Runs a stage; whatever goes wrong in it is a ``PreflightFailed`` naming ``name``.
    A stop signal (``Interrupted``) and Ctrl-C pass through unchanged."""
    try:
        yield
    except (Interrupted, KeyboardInterrupt, PreflightFailed, PreflightMistake):
        raise
    except ops.OutOfMemory as e:
        config, net = (training.config, training.net) if training else (None, None)
        raise PreflightFailed(f"preflight: {name}: "
                              f"{ops.out_of_memory_message(e, config, net)}") from None
    except UserError as e:  # the user's input: exit 2, as the run would end
        raise PreflightMistake(f"preflight: {name}: {e}") from None
    except RunFailed as e:
        raise PreflightFailed(f"preflight: {name}: {e}") from None
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise PreflightFailed(f"preflight: {name}: {e.strerror or e}{where}") from None
    except Exception as e:  # noqa: BLE001 - any failure of a stage is one line
        raise PreflightFailed(f"preflight: {name} failed: {type(e).__name__}: "
                              f"{ops.first_sentence(e)}") from None


class _NoBar:
    """The progress display ``engine.steps`` updates: nothing shown."""

    def update(self, n=1):
        pass


class Snapshot:
    """Everything of a run that the preflight's stages change, copied when it is made (the
    tensors to the CPU: the device holds no second copy of the weights and the optimizer's
    state meanwhile) and put back by ``put_back``."""

    def __init__(self, training):
        self.training = training
        loop, saver, net = training.loop, training.saver, training.net
        self.net = checkpoint.to_cpu(net.state_dict())  # weights and BatchNorm statistics
        self.modes = [m.training for m in net.modules()]
        self.requires_grad = [p.requires_grad for p in net.parameters()]
        self.optimizer = checkpoint.to_cpu(training.optimizer.state_dict())  # and each lr
        self.scaler = checkpoint.to_cpu(loop.scaler.state_dict())
        self.ema = None if training.ema is None else checkpoint.to_cpu(training.ema.state_dict())
        self.state = copy.deepcopy(vars(training.state))  # step, position, sums, best
        self.counters = copy.deepcopy(vars(loop.counters))
        self.saver = (saver.dir, saver.last_saved)
        self.rng = saving.rng_state()  # python, numpy, torch CPU and CUDA

    def put_back(self):
        training, net = self.training, self.training.net
        net.load_state_dict(self.net)  # in place: the optimizer's parameters stay
        for module, mode in zip(net.modules(), self.modes):
            module.training = mode
        for parameter, requires_grad in zip(net.parameters(), self.requires_grad):
            parameter.requires_grad_(requires_grad)
            parameter.grad = None  # (a stage that failed inside a window left some)
        training.optimizer.load_state_dict(self.optimizer)
        ops.place_fused_steps(training.optimizer)
        if self.scaler:  # (an enabled GradScaler's; a disabled one has none)
            training.loop.scaler.load_state_dict(self.scaler)
        if training.ema is not None:
            training.ema.load_state_dict(self.ema)
        vars(training.state).update(copy.deepcopy(self.state))
        vars(training.loop.counters).clear()
        vars(training.loop.counters).update(copy.deepcopy(self.counters))
        training.loop.timer.reset()
        training.saver.dir, training.saver.last_saved = self.saver
        saving.set_rng_state(self.rng)


def run(training, train_loader, build_loaders, close, tta, stop=None):
    """The preflight of the run ``training`` (train.py's ``Training``), then the put back.

    Args:
        training: the built run, resumed if it resumes, before its first step.
        train_loader: the run's training loader: its ``EpochBatchSampler`` is copied (to
            the run's position), never moved, and the loader itself is not iterated.
        build_loaders: the task class's ``loaders``: ``(config, procs, train_set, val_set,
            sampler, stop)`` to ``(train_loader, val_loader)``, as the run's are built.
        close: stops a loader's workers (``data.shutdown_loader``).
        tta: the run's test-time augmentation (``tasks.use_tta``).
        stop: the run's ``StopRequest`` (what takes long in building the loaders stops;
            during ``--preflight`` alone a stop signal ends the preflight at once).

    Returns:
        The names of the stages that ran.

    Raises:
        PreflightFailed: one line naming the stage that failed.
        PreflightMistake: the same, for a mistake of the user's (exit 2).
        Interrupted: a stop signal during ``--preflight`` alone (review 6's F8).
    """
    start = time.perf_counter()
    saved = Snapshot(training)
    built, took = [], {}
    only = stop is not None and training.config["preflight"] == "only"
    pending = stop.pending if stop is not None else None
    try:
        with _interruptible(stop, only, training.procs.world_size):
            with stage("building its loaders", training):
                sampler = copy.copy(train_loader.batch_sampler)
                sampler.observer = None  # (--sample-ledger's: the run's batches only)
                state = training.state
                if state.epoch_samples >= sampler.size:  # resumed at an epoch's end
                    sampler.set_epoch(state.epoch + 1, 0)
                else:
                    sampler.set_epoch(state.epoch, state.epoch_samples)
                with contextlib.redirect_stdout(io.StringIO()):  # the run's data path,
                    built[:] = build_loaders(training.config, training.procs,  # said once
                                             *training.datasets, sampler, pending)
            seen = []  # the evaluations' results: the task's best figure in one of them
            stages = [(check_directories, ()), (train_step, (built[0],))]
            stages += [(evaluate, (built[1], tta, *model, seen))
                       for model in evaluated(training)]
            stages += [(check_checkpoint, ())]
            for function, args in stages:
                begun = time.perf_counter()
                name = function(training, *args)
                took[name] = time.perf_counter() - begun
    finally:
        for loader in built:
            close(loader)
        saved.put_back()
    if only and pending():  # (under torchrun: the stages ran to their end)
        raise Interrupted(pending(), "during the preflight")
    runtime.main_print(f"preflight: {len(took)} stages ok in "
                       f"{time.perf_counter() - start:.1f} s ("
                       + ", ".join(f"{name} {t:.2f} s" for name, t in took.items())
                       + "); everything put back")
    runtime.main_print(param_groups.describe(training.optimizer, training.config))
    config = training.config
    norms = [m for m in training.net.modules()  # (frozen ones are kept in eval mode)
             if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.training]
    if norms and (config["virtual_batch_size"] or config["batch_size"]) > config["batch_size"]:
        runtime.main_print(f"preflight: note: the network has BatchNorm ({len(norms)} "
                           f"layers): each of the --batch-size {config['batch_size']} "
                           f"micro-batches normalises with its own statistics, so "
                           f"accumulating to --virtual-batch-size "
                           f"{config['virtual_batch_size']} is close to, not exactly, one "
                           f"batch of {config['virtual_batch_size']}")
    return list(took)


def _interruptible(stop, only, world_size):
    """``--preflight`` alone (``only``) in one process: a stop signal raises
    ``Interrupted`` at once, as nothing of it is kept; else the signal waits for the run's
    first step (``--preflight train``) or the stages' end (torchrun: their collectives)."""
    if only and world_size == 1:
        return stop.interruptible("during the preflight")
    return contextlib.nullcontext()


def check_directories(training):
    """A file made and removed in each directory the run writes to (main process)."""
    name = "the output directories"
    if training.procs.is_main:
        for directory in dict.fromkeys([training.run_log.run_dir, training.saver.dir]):
            with stage(f"{name}: {directory}", training):
                files.probe_writable(directory)
    return name


def train_step(training, loader):
    """One accumulation window of ``engine.steps`` over ``loader``, then the EMA's update;
    the loss and the weights after it must be finite."""
    name = "the training step"
    with stage(name, training):
        with contextlib.closing(engine.steps(training.model, loader, training.optimizer,
                                             training.task, training.loop, training.state,
                                             _NoBar())) as steps:
            step = next(steps, None)
        if step is None:
            raise RunFailed("the training set gave no batch")
        if training.ema is not None:
            training.ema.update(training.task.averaged(training.net), step)
        if training.loop.counters.read()["streak"]:
            raise RunFailed(f"the loss of step {step} is not finite")
        training.saver.check_weights()
    return name


def evaluated(training):
    """``(stage name, model, suffix)`` of each evaluation the run makes."""
    models = [("the evaluation", training.model, "")]
    if training.ema is not None:
        models.append(("the evaluation of the moving average", training.ema.module, "_ema"))
    return models


def evaluate(training, loader, tta, name, model, suffix, seen=None):
    """``model`` evaluated on one validation batch, with the task's figures and pictures
    from it; on the whole set where the task refuses one batch (``TooFewImages``: any other
    error is the stage's). The figures are checked as a validation checks them
    (``engine.check_figures``); ``seen`` gathers the results, the best figure being in
    the network's or the moving average's (checked at the last of them)."""
    task, names = training.task, training.datasets[0].classes
    seen = [] if seen is None else seen
    with stage(name, training):
        if suffix:
            training.ema.sync_buffers()
        try:
            with task.evaluating_on(training.config["batch_size"]) as fewer:
                if fewer:  # (an FID on one batch's images: the path, not the figure)
                    runtime.main_print(f"preflight: {name}: {fewer}")
                result = engine.evaluate(model, itertools.islice(loader, 1), training.loop,
                                         task, tta=tta)
        except TooFewImages as e:  # more than one batch's images (a GAN's --fid-samples)
            runtime.main_print(f"preflight: {name}: one batch is too few ({e}): on the "
                               f"whole validation set")
            result = engine.evaluate(model, loader, training.loop, task, tta=tta)
        seen.append(result)
        engine.check_figures(task, *seen, best=bool(suffix) or training.ema is None)
        task.extra_figures(result, names, suffix)
        if training.run_log.enabled:  # drawn on process 0 only, as validate does
            for _ in task.images(result, names, f"preflight{suffix}"):
                pass
    return name


def check_checkpoint(training):
    """The run's Saver writes a checkpoint into a temporary directory; it is read back with
    ``checkpoint.load_checkpoint`` and compared with the state it was written from."""
    name = "the checkpoint"
    saver = training.saver
    with stage(name, training), tempfile.TemporaryDirectory(prefix="preflight-") as tmp:
        saver.dir = tmp
        expected = checkpoint.to_cpu(saving.training_state(
            saver.net, saver.optimizer, saver.scaler, training.state.state_dict(),
            [saving.rng_state()] * training.procs.world_size, saver.config, saver.ema,
            saver.data, saver.averaged))
        saver.save(saving.Kind.STOP)
        saver.wait()
        if training.procs.is_main:
            read = checkpoint.load_checkpoint(os.path.join(tmp, "last.pt"))
            if training.procs.world_size > 1:  # every process's RNG: gathered, not ours
                expected = {k: v for k, v in expected.items() if k != "rng_per_rank"}
            found = verify_resume.first_difference(expected, {k: read.get(k)
                                                              for k in expected})
            if found is not None:
                where, detail = found
                raise PreflightFailed(f"preflight: {name} read back differs at "
                                f"{'/'.join(map(str, where))} ({detail})")
    return name

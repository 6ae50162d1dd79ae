"""Train an image classifier.

    python train.py                                    # CIFAR-10, the default recipe
    python train.py --dataset synthetic --epochs 2     # no download, seconds on a CPU
    python train.py --config configs/cifar10_simple.yaml --amp bf16
    python train.py --resume auto --run-dir runs/exp1  # continue where it stopped
    torchrun --nproc_per_node 4 train.py ...           # DistributedDataParallel

Read ``train``, ``fit`` and ``build_training`` top to bottom: config, run directory,
processes, data, network, optimizer, resume; then the epoch loop (``run_epochs``) and the
step loop (``run_epoch``), where logging, checkpoints and stopping are decided in plain
sight. Everything else is one hop away:

    the training step (forward, backward, optimizer step)    engine.steps
    validation                                               engine.evaluate
    a flag: its definition, default and checks               config.py
    checkpoint writes                                        checkpoint.Saver
    the resume point, and restoring it                       train / restore below
    every metric's name, the epoch record and its line       metrics.py
    TensorBoard, metrics.jsonl, config.yaml, summary.txt     runlog.RunLog
    MLflow (--mlflow)                                        tracking.py
    processes, devices, AMP dtype, seeds, signals            runtime.py
    torchrun's restarts: joining a round, the job's lock     elastic.py
    datasets, the seeded sampler, per-sample loaders         data.py
    data held and augmented on the device                    device_data.py
    the LR range test (--find-lr)                            lr_finder.run
"""

import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads: exit quietly with 130
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import contextlib
import dataclasses
import enum
import functools
import os
import shlex

import torch
import torch.distributed as dist

import checkpoint
import data
import device_data
import engine
import layers
import lr_finder
import metrics
import ops
import plots
import presets
import profiling
import recipes
import runlog
import runtime
import tracking
from checkpoint import Kind
from config import check_config, merge_resumed_config, parse_config, with_defaults
from losses import build_criterion
from networks import build_network
from ops import Interrupted, RunFailed, UserError

EXIT_USER_ERROR, EXIT_FAILED = 2, 1  # a signal exits with 128 + its number (130, 143, 129)


# ---------------------------------------------------------------------------- main

def main(argv=None):
    """Trains with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        run failed (non-finite loss or weights, a disk that refused a write), and
        128 + the signal's number when stopped by SIGINT/SIGTERM/SIGHUP after saving.
    """
    stop = runtime.StopRequest()
    runtime.quiet_writer_threads()
    try:
        return train(sys.argv[1:] if argv is None else argv, stop)
    except UserError as e:
        runtime.say(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except RunFailed as e:
        runtime.say(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    except Interrupted as e:  # a signal before training began: nothing to save
        runtime.say(f"{signal.Signals(e.signum).name}: stopped {e.what}; no step was "
                    f"taken, so nothing was saved and nothing half-written is left",
                    file=sys.stderr)
        requeued = getattr(e, "requeue", False) and runtime.process_rank() == 0 \
            and runtime.slurm_requeue()  # --requeue-signal (SIGUSR1) under SLURM
        if requeued:
            runtime.say(requeued)
        return 128 + e.signum
    except OSError as e:  # a file system that failed mid-run: full, gone, read-only
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        runtime.say(f"error: {e.strerror or e}{where}", file=sys.stderr)
        return EXIT_FAILED
    except (MemoryError, RuntimeError) as e:
        if data.worker_death(e) is not None:  # a worker killed (the OOM killer?): one line
            runtime.say(f"error: {data.worker_death(e)}", file=sys.stderr)
            return EXIT_FAILED
        if ops.memory_error(e) is not None:  # out of memory outside a step (set-up, a save)
            runtime.say(f"error: {out_of_memory_message(ops.memory_error(e))}",
                        file=sys.stderr)
            return EXIT_FAILED
        if not runtime.lost_peer(e):  # a collective whose peer process died (gloo, NCCL)
            raise
        runtime.say(f"error: process {runtime.process_rank()} lost another process of the "
                    f"run ({runtime.first_sentence(e)}); the checkpoints are intact: "
                    f"continue with --resume auto", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(argv, stop):
    """The run: config, its directory (locked), then ``fit``; returns the exit code."""
    config, explicit = parse_config(argv)
    check_config(config)
    lr_finder.check_config(config)  # --find-lr with --resume
    resume_path, saved = resume_file(config)  # --resume PATH: read before anything is written
    run_dir = choose_run_dir(config, explicit, resume_path, saved)
    with runlog.RunDirectory(run_dir, is_main=runtime.process_rank() == 0) as directory:
        if config["resume"] == "auto":
            resume_path, saved = checkpoint.find_latest(run_dir, warn=runtime.main_print)
        if saved is not None:  # flags added since the checkpoint was written: their defaults
            saved["config"] = with_defaults(saved["config"])
            config = merge_resumed_config(saved["config"], config, explicit)
        config = {**config, "run_dir": run_dir}
        check_config(config)
        if "network" not in explicit and presets.is_photo(config) and saved is None:
            runtime.main_print(f"network: {config['network']}, built for "
                               f"{config['image_size']} px photos (an ImageNet stem); "
                               f"--network to choose another, --pretrained torchvision to "
                               f"start from ImageNet's weights")
        return fit(config, argv, resume_path, saved, directory, stop)


@dataclasses.dataclass
class Training:
    """What ``fit`` built, handed to the few functions that act on the whole run."""

    config: dict
    procs: runtime.Processes
    net: torch.nn.Module          # the plain network (saved in checkpoints)
    model: torch.nn.Module        # what is called: maybe DDP / DataParallel / compiled
    optimizer: torch.optim.Optimizer
    ema: recipes.EMA              # the moving average of the weights, or None
    loop: engine.LoopSettings
    state: engine.TrainState
    meter: engine.LossMeter
    saver: checkpoint.Saver
    run_log: runlog.RunLog
    val_loader: torch.utils.data.DataLoader
    datasets: tuple               # (train, val)
    flops_per_sample: int         # forward + backward, for the TFLOP/s figure
    peak_tflops: float            # the datasheet peak of the run's GPUs (MFU), or None
    profiler: object = None       # a profiling.Profile while --profile-steps runs, or None


def fit(config, argv, resume_path, saved, directory, stop):
    """Builds everything, resumes, trains (``run_epochs``) and says how it ended."""
    log = runtime.main_print
    procs = runtime.setup_processes(config, stop.pending)
    runtime.set_memory_options(config, procs.device)  # before the first allocation
    if procs.world_size > 1:
        runtime.check_same_resume_point(saved, procs)
    runtime.seed_everything(config["seed"], procs.rank, config["deterministic"], procs.device)
    directory.record(config, argv, resuming=saved is not None)
    if resume_path:
        log(f"resuming from {resume_path} (epoch {saved['epoch']}, step {saved['step']})")
    elif config["resume"] == "auto":
        log(f"no valid checkpoint in {directory.path}: starting fresh")
    training, train_loader, criterion = build_training(config, procs, directory.path, saved,
                                                       resume_path, stop.pending)
    if config["find_lr"]:  # the LR range test instead of training: no checkpoint
        return lr_finder.run(training, train_loader, criterion, stop)
    log(f"training {config['network']} on {config['dataset']} ({len(training.datasets[0])} "
        f"samples, {procs.world_size} process(es), {procs.device}) into {directory.path}")
    try:
        with profiling.window(training, train_loader) as training.profiler:  # --profile-steps
            ended, final = run_epochs(training, train_loader, criterion, stop)
    except ops.OutOfMemory as e:  # one line: where, the batch, what to try
        training.run_log.failed()
        snapshot = runtime.dump_memory_snapshot(directory.path, procs.device) \
            if config["memory_snapshot"] else None
        raise RunFailed(out_of_memory_message(e, config, training, snapshot)) from None
    except Exception:  # main prints the error line; --mlflow's run is marked FAILED
        training.run_log.failed()
        raise
    finally:  # also when the run fails
        data.shutdown_loader(train_loader)
        data.shutdown_loader(training.val_loader)
        try:
            training.saver.wait()  # the checkpoint being written in the background
        finally:
            training.run_log.flush()  # keep what was logged
    if ended is Ended.SIGNAL:
        training.run_log.close(config, None)
        if procs.world_size > 1:  # no process exits (and makes torchrun kill the rest)
            dist.barrier()        # before rank 0 has written the checkpoint
        launcher = "python train.py" if procs.world_size == 1 else \
            "torchrun <same options> train.py"
        log(f"{signal.Signals(stop.signum).name}: saved {training.saver.last_saved}. Resume "
            f"with:\n  {launcher} --resume auto --run-dir {shlex.quote(directory.path)}")
        if procs.is_main and stop.signum == signal.Signals[f"SIG{config['requeue_signal']}"]:
            requeued = runtime.slurm_requeue()  # under SLURM: the job goes back in its queue
            if requeued:
                log(requeued)
        return stop.exit_code
    if ended is Ended.EARLY_STOP:
        log(early_stop_line(training))
    training.run_log.close(config, final)
    log(f"done: {directory.path}")
    return 0


def build_training(config, procs, run_dir, saved=None, resume_path=None, stop=None):
    """Data, network, optimizer, the loop's settings and the run's writers, then the
    resume (``restore``) when ``saved`` is a checkpoint. ``stop`` (``StopRequest.pending``)
    interrupts what takes long before the first step (a decoded cache's build).

    Returns:
        ``(training, train_loader, criterion)``: a ``Training``, the training batches
        and the loss.
    """
    log = runtime.main_print
    train_set, val_set = runtime.main_process_first(
        procs, f"reading {config['dataset']} (downloading it if needed)", data.build_datasets,
        config, stop=stop, should_stop=stop)
    sampler = data.EpochBatchSampler(len(train_set), config["batch_size"], config["seed"],
                                     rank=procs.rank, world_size=procs.world_size)
    train_loader, val_loader = build_loaders(config, procs, train_set, val_set, sampler, stop)
    net, model = build_model(config, train_set, procs.device, procs.world_size, log,
                             resuming=saved is not None)
    criterion = build_criterion(config)
    optimizer = build_optimizer(net, config, procs.device)
    ema = recipes.build_ema(config, net)  # --ema-decay: None when off
    prefetch = config["prefetch"]
    if prefetch and isinstance(train_loader, device_data.DeviceLoader):
        log("note: --prefetch does nothing on the device path: its batches are made on the "
            "device, where a thread in front would only move their kernels into the step's "
            "timing")
        prefetch = 0
    loop = build_loop(config, procs, train_set, sampler, prefetch)
    flops = ops.train_flops_per_sample(  # before the restore: it must not touch the RNG
        net, (train_set.in_channels, train_set.image_size, train_set.image_size), procs.device)
    if presets.is_photo(config) and not config["network"].startswith("torchvision/"):
        size = config["image_size"]
        log(f"note: {config['network']} keeps the full resolution of its {size} px input: "
            f"{flops / 3e9:.1f} GFLOPs a forward pass per sample; torchvision/resnet18, "
            f"built for such images (a 4x stem), costs about {3.6 * (size / 224) ** 2:.1f}: "
            f"pass --network torchvision/resnet18")

    identity = {"train": data.set_identity(train_set)}  # recorded: a resume sees other data
    state = engine.TrainState()
    if saved is not None:  # weights, EMA, optimizer, scaler, position, RNG of the saved step
        restore(saved, resume_path, net, ema, optimizer, loop.scaler, state, config, procs)
        check_same_data(saved, resume_path, identity)
        check_same_threads(saved, resume_path, procs.device)
        if unfrozen_at_resume(config, state):  # wrapped again: DDP must see them
            model = wrap_model(net, config, procs.device, procs.world_size)
    engine.set_lr(optimizer, loop.lr_factor(state.step))
    tracker = tracking.open_tracker(config, run_dir, saved, procs.is_main)  # --mlflow
    run_log = runlog.RunLog(run_dir, state.step, state.epoch, procs.is_main, tracker)
    run_log.summary(net, train_set, procs.device)
    if state.step == 0:
        run_log.first_batch(train_set, sampler)
    saver = checkpoint.Saver(run_dir, config, net, optimizer, loop.scaler, state, procs,
                             last_saved=resume_path, ema=ema, data=identity)
    saver.mlflow_run_id = tracking.run_id(tracker, saved)  # a resume continues that run
    training = Training(config, procs, net, model, optimizer, ema, loop, state,
                        engine.LossMeter(loop.counters, procs.world_size), saver, run_log,
                        val_loader, (train_set, val_set), flops,
                        peak_tflops(procs.device, loop.amp_dtype, gpu_count(config, procs)))
    return training, train_loader, criterion


class Ended(enum.Enum):
    """How ``run_epochs`` ended."""

    ALL_EPOCHS = "all epochs"
    MAX_STEPS = "--max-steps"
    SIGNAL = "a signal"
    EARLY_STOP = "--early-stop-patience"


def run_epochs(training, train_loader, criterion, stop):
    """The epoch loop: unfreezing, each epoch's steps (``run_epoch``), its end, stopping.

    Returns:
        ``(ended, final)``: an ``Ended`` value and the last validation figures.
    """
    config, state, sampler = training.config, training.state, train_loader.batch_sampler
    final, ended = {}, Ended.ALL_EPOCHS
    for epoch in range(state.epoch, config["epochs"]):
        if early_stop_due(config, state):  # a resumed run that had stopped early
            return Ended.EARLY_STOP, final
        if stop.agreed(training.procs):  # a signal between steps (set-up, validation)
            save(training, Kind.STOP)
            return Ended.SIGNAL, final
        if (epoch, state.epoch_samples) == unfreeze_point(config):
            names = unfreeze(training)
            runtime.main_print(f"epoch {epoch + 1}: unfroze {len(names)} parameter tensors")
        ended = run_epoch(training, train_loader, criterion, epoch, stop)
        if state.epoch_samples >= sampler.size:  # the epoch is complete
            final = finish_epoch(training, epoch)
            if early_stop_due(config, state):  # the same on every process: their figures are
                ended = Ended.EARLY_STOP       # all-reduced
        if ended is not Ended.ALL_EPOCHS:
            break
    if ended is Ended.MAX_STEPS and state.epoch_samples:  # stopped inside an epoch
        final = metrics.final_figures(validate(training))
        save(training, Kind.STOP)
        runtime.main_print(f"--max-steps {config['max_steps']} reached at step {state.step}: "
                           f"val_acc {final['val_acc']:.4f}")
    return ended, final


def run_epoch(training, train_loader, criterion, epoch, stop):
    """The step loop of one epoch, from where the run stands in it: after each optimizer
    step, the EMA, then whether to stop, log and checkpoint, decided here.

    Returns:
        ``Ended.ALL_EPOCHS`` when the epoch ran to its end, else why it stopped.
    """
    config, state, sampler = training.config, training.state, train_loader.batch_sampler
    ended = Ended.ALL_EPOCHS
    sampler.set_epoch(epoch, state.epoch_samples)
    training.loop.timer.reset()
    training.meter.restart(state.step)
    with training.run_log.progress(epoch, config["epochs"], len(sampler)) as bar, \
            contextlib.closing(engine.steps(training.model, train_loader, training.optimizer,
                                            criterion, training.loop, state, bar)) as steps:
        for step in steps:
            if training.profiler is not None:  # --profile-steps: its schedule moves on
                training.profiler.step()
            if training.ema is not None:
                training.ema.update(training.net, step)  # the average, after every step
            training.saver.poll()  # a checkpoint write that failed in the background
            if stop.agreed(training.procs):
                ended = Ended.SIGNAL
            elif config["max_steps"] and step >= config["max_steps"]:
                ended = Ended.MAX_STEPS
            if step % config["log_every"] == 0 or ended is not Ended.ALL_EPOCHS:
                log_train(training, bar)
            elif training.procs.world_size == 1 and bar.due():
                show(training, bar)  # at most twice a second (no collectives: one process)
            epoch_done = state.epoch_samples >= sampler.size  # finish_epoch saves then
            if ended is Ended.SIGNAL:
                save(training, Kind.STOP)
            elif config["ckpt_every_steps"] and step % config["ckpt_every_steps"] == 0 \
                    and not epoch_done:
                save(training, Kind.STEP)
            if ended is not Ended.ALL_EPOCHS:
                break
        if training.meter.pending(state):  # every epoch ends its loss curve, however short
            log_train(training, bar)
    return ended


# ----------------------------------------------------------- logging, saving, epochs

def read_losses(training):
    """Moves the loss counters into the run state (one sync); after --max-nonfinite bad
    losses in a row, stops the run.

    Returns:
        How many of the latest losses in a row were not finite (0: the last was fine).
    """
    streak, worst = training.meter.collect(training.state)
    if worst >= training.config["max_nonfinite"]:
        raise RunFailed(
            f"the loss was not finite for {worst} steps in a row (at step "
            f"{training.state.step}); lower --lr, add --grad-clip, or try --amp bf16. The last "
            f"good checkpoint is {training.saver.last_saved or 'none'}")
    return streak


def show(training, bar, log_step=False):
    """Loss, samples/s and compute efficiency since the last log, on the progress bar."""
    read_losses(training)
    data_t, compute_t, _ = training.loop.timer.totals()
    bar.show(training.meter.mean(), training.meter.rate(),
             engine.efficiency(data_t, compute_t), log_step)


def log_train(training, bar):
    """The training loss and learning rate since the last log, to TensorBoard and the bar."""
    show(training, bar, log_step=True)
    meter = training.meter
    skips = training.state.scaler_skips if training.loop.scaler.is_enabled() else None
    clipped = meter.grad_clipped if training.config["grad_clip"] > 0 else None
    training.run_log.scalars(metrics.train_scalars(
        meter.mean(), training.optimizer.param_groups[0]["lr"], skips, meter.grad_norm(),
        clipped), training.state.step)
    training.meter.restart(training.state.step)


def save(training, kind, best=False):
    """Checkpoints the state after the last optimizer step, unless its loss was not finite."""
    if read_losses(training):
        training.saver.check_weights()  # non-finite weights stop the run even so
        runtime.main_print(f"not saving at step {training.state.step}: the last loss was "
                           f"not finite")
        return
    training.saver.save(kind, best)  # checks the weights first


def validate(training):
    """Evaluates on the validation set (with --ema-decay, the moving average too) and logs
    the figures (``metrics.validation_figures``); returns them."""
    classes, tta = training.datasets[0].num_classes, use_tta(training.config)
    result = engine.evaluate(training.model, training.val_loader, training.loop, classes,
                             tta=tta)
    ema = None
    if training.ema is not None:
        training.ema.sync_buffers()  # BatchNorm statistics differ between DDP processes
        ema = engine.evaluate(training.ema.module, training.val_loader, training.loop,
                              classes, tta=tta)
    figures = metrics.validation_figures(result, ema)
    step, names = training.state.step, training.datasets[0].classes
    training.run_log.scalars(metrics.validation_scalars(figures), step)
    for suffix, tag, evaluated in (("", metrics.CONFUSION, result),
                                   ("_ema", metrics.CONFUSION_EMA, ema)):
        if evaluated is None:
            continue
        figures["val_class_acc" + suffix] = metrics.class_accuracy(evaluated["confusion"], names)
        if training.run_log.enabled:  # drawn on process 0 only
            title = f"val_acc{suffix} {evaluated['acc']:.4f} at step {step}"
            training.run_log.image(tag, plots.confusion_image(evaluated["confusion"], names,
                                                              title), step)
    return figures


def use_tta(config):
    """--tta flip, except where a mirror image is another class (digits)."""
    return config["tta"] == "flip" and data.mirror_keeps_class(config["dataset"])


def finish_epoch(training, epoch):
    """Validates (when due), logs the epoch, saves last.pt (and best.pt)."""
    config, state = training.config, training.state
    times = training.loop.timer.totals()
    unreadable = sum(dataset.unreadable_count() for dataset in training.datasets)  # skipped
    loss_sum, loss_count, unreadable = ops.sum_over_processes(
        [state.loss_sum, state.loss_count, unreadable], training.loop.device,
        training.procs.world_size)
    state.epoch += 1
    grad_norm = state.grad_norm_sum / state.grad_norm_count if state.grad_norm_count else None
    record = metrics.epoch_record(
        state.epoch, state.step, loss_sum, loss_count, training.optimizer.param_groups[0]["lr"],
        times, state.epoch_samples, training.flops_per_sample, training.peak_tflops,
        unreadable, grad_norm, state.grad_clipped if config["grad_clip"] > 0 else None)
    best = False
    if state.epoch % config["eval_every"] == 0 or state.epoch == config["epochs"]:
        record.update(validate(training))
        value = metrics.best_metric(record)
        best = value > state.best_val_acc
        if best:
            state.best_val_acc, state.best_epoch = value, state.epoch
        count_early_stop(config, state, value)
    state.epoch_samples, state.loss_sum, state.loss_count = 0, 0.0, 0
    state.grad_norm_sum, state.grad_norm_count, state.grad_clipped = 0.0, 0, 0
    training.run_log.epoch(record)
    save(training, Kind.EPOCH, best)
    runtime.main_print(metrics.epoch_line(record, config))
    return metrics.final_figures(record)


def count_early_stop(config, state, value):
    """--early-stop-*: a validation whose figure (the one best.pt follows) is not above the
    best so far by more than --early-stop-min-delta counts towards the patience. Both
    numbers live in the run state, so a resumed run stops where the whole run would."""
    if value > state.early_stop_best + config["early_stop_min_delta"]:
        state.early_stop_best, state.early_stop_waited = value, 0
    else:
        state.early_stop_waited += 1


def early_stop_due(config, state):
    """Whether --early-stop-patience validations went by without improvement."""
    patience = config["early_stop_patience"]
    return patience > 0 and state.early_stop_waited >= patience


def early_stop_line(training):
    """The line an early-stopped run ends with: why, and its best epoch and checkpoint."""
    config, state = training.config, training.state
    name = "val_acc_ema" if training.ema is not None else "val_acc"
    best = os.path.join(config["run_dir"], "checkpoints", "best.pt")
    return (f"early stop at epoch {state.epoch}: {name} did not improve by more than "
            f"{config['early_stop_min_delta']:g} in {state.early_stop_waited} validation(s) "
            f"(--early-stop-patience {config['early_stop_patience']}); the best was epoch "
            f"{state.best_epoch} ({name} {state.best_val_acc:.4f}): {best}")


def out_of_memory_message(error, config=None, training=None, snapshot=None):
    """One line for an out-of-memory error: where it happened, the batch, that the
    checkpoints are intact, and what to try (each only where it is not on already).

    Args:
        error: an ``ops.OutOfMemory`` from a step or a validation, or the allocator's
            words (``ops.memory_error``) for one elsewhere (set-up, a checkpoint).
        config, training: the run's, when it got that far.
        snapshot: the path of the --memory-snapshot file written, or None.
    """
    if not isinstance(error, ops.OutOfMemory):
        return (f"out of memory ({error}) before or between training steps; every file "
                f"written before is intact: lower --batch-size, or free memory")
    batch = config["batch_size"]
    effective = config["virtual_batch_size"] or batch
    smaller = max(d for d in range(1, max(batch // 2, 1) + 1) if effective % d == 0)
    tries = []
    if smaller < batch:
        tries.append(f"--batch-size {smaller} --virtual-batch-size {effective} (the same "
                     f"{effective} samples an optimizer step)")
    if not config["grad_checkpointing"] and hasattr(training.net, "set_grad_checkpointing"):
        tries.append("--grad-checkpointing")
    if config["amp"] == "none":
        tries.append("--amp bf16")
    if not config["channels_last"]:
        tries.append("--channels-last")
    saved = training.saver.last_saved
    return (f"{error}; the checkpoints are intact ("
            f"{'the last: ' + saved if saved else 'none was written yet'})"
            f"{'; the allocator history is in ' + snapshot if snapshot else ''}"
            f"{'; try ' + ', '.join(tries) if tries else ''}")


# ------------------------------------------------------------------ config, run dir

def resume_file(config):
    """The checkpoint that ``--resume PATH`` names, loaded: ``(path, state)``, or Nones."""
    if config["resume"] in (None, "auto"):
        return None, None
    state = checkpoint.load_checkpoint(config["resume"])
    if "model" not in state or "config" not in state or "progress" not in state:
        raise UserError(f"{config['resume']!r} is not a training checkpoint of this project "
                        f"(use --pretrained for plain weights)")
    return config["resume"], state


def choose_run_dir(config, explicit, resume_path, saved):
    """``--run-dir``; else, for ``--resume PATH``, the checkpoint's own run directory, but
    only when PATH is that run's newest checkpoint (continuing from an older one would
    rewind the run); else a new ``runs/<time>-<network>-<dataset>``."""
    if config["run_dir"]:
        return config["run_dir"]
    if saved is None:
        return runlog.default_run_dir(config)
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


# --------------------------------------------------------------------- data, network

def build_loaders(config, procs, train_set, val_set, sampler, stop=None):
    """Loaders: training batches from the seeded sampler, this process's validation shard.

    With --data-on-device (auto decides, and says why), both sets live on the device as
    tensors and whole batches are augmented there; otherwise DataLoader workers augment
    each sample. Both paths give the same batches.
    """
    use, why = device_data.device_data_decision(config, train_set, val_set, procs.device)
    if procs.world_size > 1:  # auto may differ between GPUs: one path for every process
        use = ops.sum_over_processes([int(use)], procs.device,
                                     procs.world_size)[0] == procs.world_size
    runtime.main_print(why)
    if use:
        memory_format = torch.channels_last if config["channels_last"] \
            else torch.contiguous_format
        return runtime.main_process_first(  # it builds an image folder's decoded cache
            procs, "holding the data on the device (an image folder: decoding it once)",
            device_data.build_device_loaders, config, train_set, val_set, sampler,
            procs.device, procs.rank, procs.world_size, memory_format,
            log=runtime.main_print, stop=stop, should_stop=stop)
    pin = procs.device.type == "cuda"
    train_loader = data.build_loader(train_set, batch_sampler=sampler,
                                     num_workers=config["num_workers"], pin_memory=pin)
    val_loader = data.build_loader(
        val_set, batch_size=config["batch_size"], num_workers=config["num_workers"],
        pin_memory=pin, sampler=data.shard_indices(len(val_set), procs.rank, procs.world_size))
    return train_loader, val_loader


def build_loop(config, procs, train_set, sampler, prefetch=0):
    """The loop's fixed settings: accumulation, precision, LR schedule, timers, mixing."""
    device = procs.device
    dtype = runtime.amp_dtype(config["amp"], device)
    accum = (config["virtual_batch_size"] or config["batch_size"]) // config["batch_size"]
    steps_per_epoch = -(-len(sampler) // accum)
    total_steps = steps_per_epoch * config["epochs"]
    if config["max_steps"]:
        total_steps = min(total_steps, config["max_steps"])
    return engine.LoopSettings(
        device=device, accum=accum, world_size=procs.world_size,
        amp_dtype=dtype, scaler=torch.amp.GradScaler(device.type,
                                                     enabled=dtype == torch.float16),
        grad_clip=config["grad_clip"], prefetch=prefetch,
        memory_format=torch.channels_last if config["channels_last"]
        else torch.contiguous_format,
        show_progress=procs.is_main,
        lr_factor=functools.partial(ops.lr_factor, total_steps=total_steps,
                                    schedule=config["scheduler"],
                                    warmup_steps=int(config["warmup_epochs"] * steps_per_epoch)),
        timer=engine.StepTimer(device),
        counters=engine.Counters(device, config["grad_clip"]),
        mix=recipes.build_batch_mix(config, train_set.num_classes))


def peak_tflops(device, amp_dtype, devices=1):
    """The datasheet peak in TFLOP/s of the GPUs the run's throughput counts (MFU), or
    None where unknown.

    Args:
        device: this process's device (its name picks the peak).
        amp_dtype: the autocast dtype; None (--amp none) means TF32 tensor cores when
            cuDNN may use them (its default), plain fp32 otherwise.
        devices: GPUs that share the work: the processes (DDP) or --gpus (DataParallel).
    """
    if device.type != "cuda":
        return None
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype) or \
        ("tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
    peak = ops.peak_tflops(torch.cuda.get_device_name(device), precision)
    return None if peak is None else peak * devices


def gpu_count(config, procs):
    """The GPUs one step runs on: the processes under torchrun, --gpus' ids in one."""
    if procs.world_size > 1:
        return procs.world_size
    return len(runtime.gpu_ids(config["gpus"])) if config["gpus"] else 1


def build_model(config, train_set, device, world_size, log, resuming=False):
    """The network: built, pretrained weights, frozen parts, moved and wrapped.

    A resumed run takes its weights from the checkpoint, so it does not read --pretrained
    (the file may be gone by then).

    Returns:
        ``(net, model)``: the plain network (saved in checkpoints) and the module to call
        (wrapped in DDP / DataParallel / torch.compile as asked).
    """
    try:
        net = build_network(config["network"], train_set.num_classes, train_set.in_channels,
                            train_set.image_size)
    except ValueError as e:
        raise UserError(str(e)) from None
    if config["pretrained"] and not resuming:
        load_pretrained(net, config["pretrained"], log, config["pretrained_weights"],
                        config["network"])
    if config["freeze"]:
        frozen = ops.freeze(net, config["freeze"])
        log(f"frozen: {len(frozen)} parameter tensors matching {' '.join(config['freeze'])}")
    if config["grad_checkpointing"]:
        if not hasattr(net, "set_grad_checkpointing"):
            raise UserError(f"--grad-checkpointing: {config['network']} has no "
                            f"set_grad_checkpointing; use simple_cnn, resnet18, resnet9 or mlp")
        net.set_grad_checkpointing(True)
    if config["sync_bn"] and world_size > 1:
        if device.type != "cuda":  # DDP and SyncBatchNorm refuse CPU modules
            raise UserError("--sync-bn needs CUDA devices (one per process); CPU processes "
                            "keep per-process BatchNorm statistics: drop --sync-bn")
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
    if config["deterministic"] and device.type == "cuda":  # no deterministic CUDA backward
        layers.make_pools_deterministic(net)                 # for adaptive pooling
    memory_format = torch.channels_last if config["channels_last"] else torch.preserve_format
    net = net.to(device, memory_format=memory_format)
    return net, wrap_model(net, config, device, world_size)


def wrap_model(net, config, device, world_size):
    """The module to call: ``net`` in DistributedDataParallel (torchrun) or DataParallel
    (--gpus), then torch.compile (--compile), as asked.

    DDP chooses the parameters it all-reduces when it is built, among those that require
    gradients then: after --unfreeze-at it is built again (``unfreeze``), or the unfrozen
    layers would train apart on each process. DataParallel's replicas run in threads that
    re-enter autocast without a dtype (float16 on CUDA): each replica sets it again.
    """
    model = net
    if world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    elif config["gpus"] and len(runtime.gpu_ids(config["gpus"])) > 1:
        replica = engine.Autocast(net, device.type, runtime.amp_dtype(config["amp"], device))
        model = torch.nn.DataParallel(replica, device_ids=runtime.gpu_ids(config["gpus"]))
    if config["compile"]:
        model = torch.compile(model)
    return model


def load_pretrained(net, path, log, which="ema", network=None):
    """Initialises ``net`` from a checkpoint of this project or a plain state_dict, or,
    where ``path`` is ``torchvision[:NAME]`` and no such file exists, from torchvision's
    pretrained weights of ``network`` (``presets.fetch_weights``).

    From a checkpoint with a moving average of the weights, ``which="ema"`` takes the
    average. A classifier head of another size (another number of classes) keeps its
    fresh initialisation and is listed; any other mismatch is a UserError listing the keys.
    """
    tv_weights = presets.torchvision_weights(network, path)  # (a file of that name wins)
    if tv_weights is not None:
        state = presets.fetch_weights(tv_weights)
        path = f"torchvision's {tv_weights}"
    else:
        state = checkpoint.load_checkpoint(path)
    weights = state["model"] if "model" in state else state
    if which == "ema" and "model" in state and "ema" in state:
        weights = state["ema"]
        log(f"pretrained: taking the moving average (ema) of {path}")
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise UserError(f"--pretrained {path!r} holds no weights: expected a checkpoint of "
                        f"this project or a state_dict (names mapped to tensors)")
    weights = checkpoint.unwrap_state_dict(weights)
    own = net.state_dict()
    head = list(dict(net.named_parameters()))[-1].rsplit(".", 1)[0]  # e.g. "fc"
    resized = [k for k in weights if k in own and own[k].shape != weights[k].shape]
    skipped = []
    if resized and all(k.rsplit(".", 1)[0] == head for k in resized):
        skipped = [k for k in own if k.rsplit(".", 1)[0] == head]
        weights = {**weights, **{k: own[k] for k in skipped}}
    checkpoint.check_compatible(net, weights, path)
    net.load_state_dict(weights)
    log(f"pretrained: loaded {len(weights) - len(skipped)} tensors from {path}"
        + (f"; kept the new head ({', '.join(skipped)}): its size differs" if skipped else ""))
    return skipped


# ------------------------------------------------------------------------ optimiser

def build_optimizer(net, config, device):
    """The optimizer over the trainable parameters; each group keeps its ``base_lr``.

    On CUDA, and wherever fp16's GradScaler runs, the fused implementation: with any
    other, ``GradScaler.step`` reads whether the gradients were finite back to the host at
    every step (a device sync); a fused optimizer takes that flag on the device.
    """
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise UserError("every parameter is frozen: nothing to train")
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam,
           "adamw": torch.optim.AdamW}[config["optimizer"]]
    fused = {"fused": True} if device.type == "cuda" or config["amp"] == "fp16" else {}
    optimizer = cls([{"params": params}], lr=config["lr"], **fused)
    set_hyperparameters(optimizer, config)
    return optimizer


def set_hyperparameters(optimizer, config):
    """Puts the config's hyper-parameters into every param group (also after a resume:
    the config may override the checkpoint's). A second group holds the parameters
    unfrozen by --unfreeze-at; its learning rate is scaled by --unfreeze-lr-scale."""
    for i, group in enumerate(optimizer.param_groups):
        group["base_lr"] = config["lr"] * (config["unfreeze_lr_scale"] if i else 1.0)
        group["fused"] = optimizer.defaults["fused"]  # as built here, not as saved
        group["weight_decay"] = config["weight_decay"]
        if config["optimizer"] == "sgd":
            group["momentum"] = config["momentum"]
            group["nesterov"] = config["nesterov"] and config["momentum"] > 0


def unfreeze_point(config):
    """The position ``(epoch index, samples into it)`` at which --unfreeze-at unfreezes,
    or None."""
    return (config["unfreeze_at"] - 1, 0) if config["unfreeze_at"] else None


def unfrozen_at_resume(config, state):
    """Whether --unfreeze-at happened before the point ``state`` resumes from."""
    point = unfreeze_point(config)
    return point is not None and (state.epoch, state.epoch_samples) > point


def unfreeze(training):
    """--unfreeze-at: the frozen parameters join the optimizer, and the model is wrapped
    again (a DDP built before would not synchronise them); returns their names."""
    names = unfreeze_into(training.net, training.optimizer, training.config)
    training.model = wrap_model(training.net, training.config, training.procs.device,
                                training.procs.world_size)
    engine.set_lr(training.optimizer, training.loop.lr_factor(training.state.step))
    return names


def unfreeze_into(net, optimizer, config):
    """Unfreezes the frozen parameters and adds them to the optimizer as a new group."""
    names = ops.unfreeze(net, config["freeze"])
    params = dict(net.named_parameters())
    optimizer.add_param_group({"params": [params[n] for n in names]})
    set_hyperparameters(optimizer, config)
    return names


# ---------------------------------------------------------------------- resume

def check_same_threads(saved, path, device):
    """On the CPU a kernel's reduction order follows the thread count: a run resumed with
    another count than its checkpoint's ends about 1e-3 away from the run that never
    stopped. Says so, with the setting that restores it (torchrun sets one a process)."""
    before, now = saved.get("threads"), torch.get_num_threads()
    if device.type != "cpu" or before is None or before == now:
        return
    runtime.main_print(f"warning: {path!r} was trained with {before} CPU thread(s) per "
                       f"process, this run has {now}: its kernels add up in another order, "
                       f"so it will not end bit for bit as the run that never stopped; "
                       f"OMP_NUM_THREADS={before} restores it", file=sys.stderr)


def check_same_data(saved, path, identity):
    """Says, in one line, when a run resumes onto another training set than the one its
    checkpoint was trained on: the epoch's order and the augmentation then follow the new
    set, so the run is no longer the one that never stopped. It continues."""
    before = saved.get("data", {}).get("train")
    now = identity["train"]
    if before is None or before == now:
        return
    change = f"{before['size']} samples then, {now['size']} now" \
        if before["size"] != now["size"] else f"{now['size']} samples, other files"
    runtime.main_print(f"warning: the training set is not the one {path!r} was trained on "
                       f"({change}): the rest of the run follows the new set, so it will "
                       f"not end as the run that never stopped would have; continuing",
                       file=sys.stderr)


def restore(saved, path, net, ema, optimizer, scaler, state, config, procs):
    """Loads a checkpoint's state into the freshly built objects."""
    weights = checkpoint.unwrap_state_dict(saved["model"])
    checkpoint.check_compatible(net, weights, path)
    net.load_state_dict(weights)
    if ema is not None and "ema" in saved:
        ema.load_state_dict(saved["ema"], path)
    elif ema is not None:  # EMA turned on for a run that had none: start from the weights
        ema.load_state_dict(net.state_dict(), path)
        runtime.main_print(f"note: {path!r} has no moving average; it starts from the "
                           f"restored weights")
    state.load_state_dict(saved["progress"])
    if procs.rank != 0:  # the epoch's partial loss sums are global; count them once
        state.loss_sum, state.loss_count = 0.0, 0
    if unfrozen_at_resume(config, state):
        unfreeze_into(net, optimizer, config)  # it happened before the save
    try:
        optimizer.load_state_dict(saved["optimizer"])
    except (ValueError, KeyError) as e:
        raise UserError(f"the optimizer state in {path!r} does not fit "
                        f"(--optimizer or --freeze changed?): {e}") from None
    set_hyperparameters(optimizer, config)  # the config's, maybe overridden, not the saved
    if saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    rngs = saved.get("rng_per_rank") or [saved["rng"]]
    checkpoint.set_rng_state(rngs[procs.rank] if len(rngs) == procs.world_size else rngs[0])
    before = saved["config"]  # --batch-size is per process: say so when the count changed
    per_step = (before["virtual_batch_size"] or before["batch_size"]) * len(rngs)
    now = (config["virtual_batch_size"] or config["batch_size"]) * procs.world_size
    if per_step != now:
        runtime.main_print(
            f"note: the checkpoint took {per_step} samples per optimizer step ({len(rngs)} "
            f"process(es)), this run takes {now} ({procs.world_size}); to continue the same "
            f"training, set --batch-size (per process) so that they match")


if __name__ == "__main__":
    sys.exit(main())

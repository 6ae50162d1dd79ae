"""Train an image model. What is trained (its data, networks, loss and figures) is the
task's (--task, tasks/); how a run runs is here, the same for every task.

    python train.py                                    # CIFAR-10, the default recipe
    python train.py --dataset synthetic --epochs 2     # no download, seconds on a CPU
    python train.py --config configs/cifar10_simple.yaml --amp bf16
    python train.py --resume auto --run-dir runs/exp1  # continue where it stopped
    torchrun --nproc_per_node 4 train.py ...           # DistributedDataParallel

Read ``train``, ``fit`` and ``build_training`` top to bottom: config, run directory,
processes, data, network, optimizer, resume; then the epoch loop (``run_epochs``) and the
step loop (``run_epoch``), where logging, checkpoints and stopping are decided in plain
sight. Everything else is one hop away:

    what is trained: a batch, its loss, its figures          tasks/ (one file a task)
    the training step (forward, backward, optimizer step)    machinery/engine.py steps
    validation                                               machinery/engine.py evaluate
    the optimizer and its hyper-parameters                   ops.build_optimizer
    a flag: its definition, default and checks               config.py
    checkpoint writes; restoring one                         machinery/saving.py Saver, restore
    the resume point                                         train below
    every metric's name, the epoch record and its line       reporting/metrics.py
    TensorBoard, metrics.jsonl, config.yaml, summary.txt     reporting/runlog.py
    MLflow (--mlflow)                                        reporting/tracking.py
    processes, devices, signals; AMP dtype, FLOPs, seeds     machinery/runtime.py; hardware.py
    torchrun's restarts: joining a round, the job's lock     machinery/elastic.py
    datasets, the seeded sampler, per-sample loaders         pipeline/data.py
    data held and augmented on the device                    pipeline/device_data.py
    the LR range test (--find-lr)                            reporting/lr_finder.py
    a hung step (--hang-timeout); a non-finite one (--replay) machinery/watchdog.py; replay.py
"""

import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads: exit quietly with 130
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import contextlib
import dataclasses
import enum
import functools
import shlex

import torch
import torch.distributed as dist

import layers
import machinery.sweep_trial as sweep_trial  # sweep.py's trials: report, prune
import ops
import replay
import tasks
from config import check_config, merge_resumed_config, parse_config, with_defaults
from machinery import checkpoint, engine, hardware, ledger, meters, runtime, saving, watchdog
from machinery.param_groups import split, unfreeze_into
from machinery.preflight import run as run_preflight
from machinery.verify_resume import run as run_verify_resume
from ops import Interrupted, RunFailed, UserError
from pipeline import data, device_data, presets, recipes, shards
from reporting import lr_finder, metrics, profiling, runlog, tracking

EXIT_USER_ERROR, EXIT_FAILED = 2, 1  # a signal exits with 128 + its number (130, 143, 129)
# and a hung process with watchdog.EXIT_HUNG (3), from the watchdog's thread


# ---------------------------------------------------------------------------- main

def main(argv=None):
    """Trains with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        run failed (non-finite loss or weights, a disk that refused a write), and
        128 + the signal's number when stopped by SIGINT/SIGTERM/SIGHUP after saving.
        A process whose steps stopped (--hang-timeout) exits with 3 from ``watchdog``.
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
    except OSError as e:  # a file system that failed mid-run (full, gone), a worker killed
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        runtime.say(f"error: {data.worker_death(e) or (e.strerror or e)}{where}", file=sys.stderr)
        return EXIT_FAILED
    except Exception as e:  # (a RuntimeError or MemoryError the first four)
        torch_error = isinstance(e, (MemoryError, RuntimeError))
        if torch_error and hardware.cublas_config_error(e) is not None:  # --deterministic
            runtime.say(f"error: {hardware.cublas_config_error(e)}", file=sys.stderr)
            return EXIT_USER_ERROR
        if torch_error and data.worker_death(e) is not None:  # a worker killed (OOM killer?)
            runtime.say(f"error: {data.worker_death(e)}", file=sys.stderr)
            return EXIT_FAILED
        if torch_error and ops.memory_error(e) is not None:  # out of memory outside a step
            runtime.say(f"error: {ops.out_of_memory_message(ops.memory_error(e))}",
                        file=sys.stderr)
            return EXIT_FAILED
        if torch_error and runtime.lost_peer(e):  # a collective whose peer died (gloo, NCCL)
            runtime.say(f"error: process {runtime.process_rank()} lost another process of "
                        f"the run ({ops.first_sentence(e)}); the checkpoints are intact: "
                        f"continue with --resume auto", file=sys.stderr)
            return EXIT_FAILED
        if (line := tasks.user_code_failed(e)) is None:  # the project's bug: its traceback
            raise
        runtime.say(f"error: {line}; the checkpoints written are intact: fix it, then "
                    f"--resume auto continues", file=sys.stderr)  # (after the traceback)
        return EXIT_FAILED
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


def train(argv, stop):
    """The run: config, its directory (locked), then ``fit``; returns the exit code."""
    config, explicit = parse_config(argv)
    if config["replay"]:  # a recorded non-finite step, replayed in a scratch directory
        return replay.run(config, explicit, stop, build_training, ops.unfreeze_point, unfreeze)
    check_config(config)
    lr_finder.check_config(config)  # --find-lr with --resume
    if config["verify_resume"]:  # this command line stopped, resumed and compared
        return run_verify_resume(config, argv, __file__, stop=stop)
    resume_path, saved = saving.resume_file(config["resume"])  # before any write
    run_dir = runlog.choose_run_dir(config, resume_path, saved)
    checkpoint.refuse_newer(run_dir)  # a newer version's checkpoints: one error, not written
    with runlog.RunDirectory(run_dir, is_main=runtime.process_rank() == 0) as directory:
        if config["resume"] == "auto":
            resume_path, saved = checkpoint.find_latest(run_dir, warn=runtime.main_print)
            if saved is not None:  # a file without a key: one line, not a KeyError
                checkpoint.require(saved, resume_path)
        if saved is not None:  # flags added since the checkpoint was written: their defaults
            saved["config"] = with_defaults(saved["config"])
            config = merge_resumed_config(saved["config"], config, explicit)
            saved = tracking.owned(saved, resume_path, run_dir)  # a fork: a new MLflow run
        config = tracking.resolved({**config, "run_dir": run_dir})  # --mlflow's store, absolute
        check_config(config)
        if saved is None:  # a photo folder's network, chosen without --network: say which
            presets.network_notes(config, runtime.main_print, explicit=explicit)
        else:  # another number of processes: the checkpoint's global batch, or one line
            runtime.check_step_size(saved, config)
        return fit(config, argv, resume_path, saved, directory, stop)


@dataclasses.dataclass
class Training:
    """What ``fit`` built, handed to the few functions that act on the whole run."""

    config: dict
    procs: runtime.Processes
    task: object                  # what is trained: its batches, loss and figures (tasks/)
    net: torch.nn.Module          # the plain network (saved in checkpoints)
    model: torch.nn.Module        # what is called: maybe DDP / DataParallel / compiled
    optimizer: torch.optim.Optimizer
    ema: recipes.EMA              # the moving average of the weights, or None
    loop: engine.LoopSettings
    state: engine.TrainState
    meter: meters.LossMeter
    saver: saving.Saver
    run_log: runlog.RunLog
    val_loader: torch.utils.data.DataLoader
    datasets: tuple               # (train, val)
    flops_per_sample: int         # forward + backward, for the TFLOP/s figure
    peak_tflops: float            # the datasheet peak of the run's GPUs (MFU), or None
    profiler: object = None       # a profiling.Profile while --profile-steps runs, or None
    timed_from: int = 0           # the epoch's samples before run_epoch started its timer
    on_device: bool = False       # the batches are made on the device (--data-on-device)
    nonfinite_record: str = None  # the record of the first non-finite loss (replay.py)
    ledger: object = ledger.OFF   # --sample-ledger: each step's samples (machinery/ledger.py)
    watchdog: object = dataclasses.field(  # a watchdog.Watchdog (--hang-timeout); off until fit
        default_factory=lambda: watchdog.Watchdog(0, ""))


def fit(config, argv, resume_path, saved, directory, stop):
    """Builds everything, resumes, trains (``run_epochs``) and says how it ended."""
    log = runtime.main_print
    watchdog.enable_flight_recorder(config)  # before the process group starts
    procs = runtime.setup_processes(config, stop.pending)
    hardware.set_memory_options(config, procs.device)  # before the first allocation
    if procs.world_size > 1:
        runtime.check_same_resume_point(saved, procs)
    hardware.seed_everything(config["seed"], procs.rank, config["deterministic"], procs.device)
    directory.record(config, argv, resuming=saved is not None)
    if resume_path:
        log(f"resuming from {resume_path} (epoch {saved['epoch']}, step {saved['step']})")
    elif config["resume"] == "auto":
        log(f"no valid checkpoint in {directory.path}: starting fresh")
    try:
        training, train_loader = build_training(config, procs, directory.path, saved,
                                                resume_path, stop.pending)
    except (MemoryError, RuntimeError) as e:  # set-up: the snapshot, and what to try
        if ops.memory_error(e) is None:
            raise
        raise RunFailed(hardware.set_up_out_of_memory(e, config, directory.path,
                                                    procs.device)) from None
    try:
        if config["find_lr"]:  # the LR range test instead of training: no checkpoint
            return lr_finder.run(config, procs, training.model, training.optimizer,
                                 training.task, training.loop, training.state,
                                 training.run_log, (train_loader, training.val_loader),
                                 stop)
        if config["preflight"] != "none":  # every stage once, all put back: preflight.py
            run_preflight(training, train_loader, type(training.task).loaders,
                          data.shutdown_loader, tasks.use_tta(config), stop)
            if config["preflight"] == "only":
                return 0
        log(f"training {config['network']} on {config['dataset']} "
            f"({len(training.datasets[0])} samples, {procs.world_size} process(es), "
            f"{procs.device}) into {directory.path}")
        training.ledger = ledger.open_ledger(config, directory.path, procs, training.state,
                                             len(training.datasets[0]),
                                             train_loader.batch_sampler)
        training.watchdog = watchdog.Watchdog(config["hang_timeout"], directory.path,
                                              procs.rank, training.state, procs.world_size > 1)
        profiler = profiling.window(config, procs, training.loop, training.state.step,
                                    train_loader.batch_sampler, training.on_device)
        with training.watchdog, profiler as training.profiler:  # --profile-steps: or None
            ended, final = run_epochs(training, train_loader, stop)
    except ops.OutOfMemory as e:  # one line: where, the batch, what to try
        training.run_log.failed()
        snapshot = hardware.dump_memory_snapshot(directory.path, procs.device) \
            if config["memory_snapshot"] else None
        raise RunFailed(ops.out_of_memory_message(
            e, config, training.net, training.saver.last_saved, snapshot)) from None
    except Exception:  # main prints the error line; --mlflow's run is marked FAILED
        training.run_log.failed()
        raise
    finally:  # also when the run fails
        data.shutdown_loader(train_loader)
        data.shutdown_loader(training.val_loader)
        training.ledger.close()
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
        log(metrics.early_stop_line(config, training.state, training.task,
                                    training.ema is not None))
    training.run_log.close(config, final)
    log(f"done: {directory.path}")
    return sweep_trial.exit_code()  # 0; EXIT_PRUNED where sweep.py's pruner stopped it


def build_training(config, procs, run_dir, saved=None, resume_path=None, stop=None):
    """Data, network, optimizer, the loop's settings and the run's writers, then the
    resume (``restore``) when ``saved`` is a checkpoint. ``stop`` (``StopRequest.pending``)
    interrupts what takes long before the first step (a decoded cache's build).

    Returns:
        ``(training, train_loader)``: a ``Training`` and the training batches.
    """
    log, task_class = runtime.main_print, tasks.of(config)  # looked up once, here
    train_set, val_set = runtime.main_process_first(
        procs, f"reading {config['dataset']} (downloading it if needed)", task_class.datasets,
        config, log, stop=stop, should_stop=stop)
    sampler = data.EpochBatchSampler(len(train_set), config["batch_size"], config["seed"],
                                     rank=procs.rank, world_size=procs.world_size,
                                     order=shards.own_order(train_set))  # streamed shards: theirs
    train_loader, val_loader = task_class.loaders(config, procs, train_set, val_set, sampler,
                                                  stop)
    config = task_class.recorded(config, train_set)  # what rebuilds the networks (test.py)
    task = tasks.built(task_class, config, train_set, val_set)  # a batch, its loss, figures
    net, model = build_model(config, train_set, procs.device, procs.world_size, log, task,
                             resuming=saved is not None)
    optimizer = ops.build_optimizer(net, config, procs.device, task.network_lr, split)  # groups
    ema = recipes.build_ema(config, task.averaged(net))  # --ema-decay: None when off
    prefetch = config["prefetch"]
    if prefetch and isinstance(train_loader, device_data.DeviceLoader):
        log("note: --prefetch does nothing on the device path: its batches are made on the "
            "device, where a thread in front would only move their kernels into the step's "
            "timing")
        prefetch = 0
    dtype = hardware.amp_dtype(config["amp"], procs.device)  # None: full precision
    loop = engine.build_loop(config, procs, sampler, dtype, prefetch)
    flops, peak = hardware.count_flops(task.counted(net), task.example(train_set), config,
                                      procs, loop.amp_dtype)  # the RNG untouched
    presets.network_notes(config, log, flops=flops)  # a CIFAR network on photos: its cost

    identity = {"train": task.set_identity(train_set),  # a resume sees other data
                **device_data.path_record(train_loader, procs.device)}  # (or path: CUDA)
    state = engine.TrainState()  # (its best figure -inf: any first validation's is the best)
    if saved is not None:  # weights, EMA, optimizer, scaler, position, RNG of the saved step
        saving.restore(saved, resume_path, net, ema, optimizer, loop.scaler, state, config, procs,
                task)
        warn = functools.partial(runtime.main_print, file=sys.stderr)
        saving.check_same_data(saved, resume_path, identity, warn)
        device_data.check_same_path(saved, resume_path, identity, warn)  # CUDA
        saving.check_same_threads(saved, resume_path, procs.device, warn)
        if ops.unfrozen_at_resume(config, state):  # wrapped again: DDP must see them
            model = wrap_model(net, config, procs.device, procs.world_size)
            flops, peak = hardware.count_flops(task.counted(net), task.example(train_set),
                                              config, procs, loop.amp_dtype)
    engine.set_lr(optimizer, loop.lr_factor(state.step))
    tracker = tracking.open_tracker(config, run_dir, saved, procs.is_main)  # --mlflow
    run_log = runlog.RunLog(run_dir, state.step, state.epoch, procs.is_main, tracker)
    run_log.summary(net, task.summarised(net, train_set), procs.device)
    if state.step == 0:
        run_log.first_batch(train_set, sampler)
    saver = saving.Saver(run_dir, config, net, optimizer, loop.scaler, state, procs,
                             last_saved=resume_path, ema=ema, data=identity,
                             averaged=task.averaged_name)
    saver.mlflow_run_id = tracking.run_id(tracker, saved)  # a resume continues that run
    training = Training(config, procs, task, net, model, optimizer, ema, loop, state,
                        meters.LossMeter(loop.counters, procs.world_size), saver, run_log,
                        val_loader, (train_set, val_set), flops, peak,
                        on_device=isinstance(train_loader, device_data.DeviceLoader))
    return training, train_loader


class Ended(enum.Enum):
    """How ``run_epochs`` ended."""

    ALL_EPOCHS = "all epochs"
    MAX_STEPS = "--max-steps"
    SIGNAL = "a signal"
    EARLY_STOP = "--early-stop-patience"


def run_epochs(training, train_loader, stop):
    """The epoch loop: unfreezing, each epoch's steps (``run_epoch``), its end, stopping.

    Returns:
        ``(ended, final)``: an ``Ended`` value and the last validation figures.
    """
    config, state, sampler = training.config, training.state, train_loader.batch_sampler
    # Resumed at its --max-steps: no step more, at most the final validation a signal cut.
    at_limit = bool(config["max_steps"]) and state.step >= config["max_steps"]
    final, ended = {}, Ended.MAX_STEPS if at_limit else Ended.ALL_EPOCHS
    for epoch in range(state.epoch, state.epoch if at_limit else config["epochs"]):
        if state.early_stop_due(config["early_stop_patience"]):  # a resumed run that had
            return Ended.EARLY_STOP, final                       # stopped early
        if sweep_trial.pruned(training.procs, state.step, state.epoch_samples):  # sweep.py's
            break  # pruner stopped the trial at this epoch's validation (see sweep_trial)
        if stop.agreed(training.procs):  # a signal between steps (set-up, validation)
            save(training, saving.Kind.STOP)
            return Ended.SIGNAL, final
        if (epoch, state.epoch_samples) == ops.unfreeze_point(config):
            names = unfreeze(training)
            runtime.main_print(f"epoch {epoch + 1}: unfroze {len(names)} parameter tensors")
        ended = run_epoch(training, train_loader, epoch, stop)
        if state.epoch_samples >= sampler.size:  # the epoch is complete
            try:
                final = finish_epoch(training, stop)
            except Interrupted:  # in its validation: the epoch's training is saved
                return Ended.SIGNAL, final
            if state.early_stop_due(config["early_stop_patience"]):  # the same on every
                ended = Ended.EARLY_STOP  # process: their figures are all-reduced
        if ended is not Ended.ALL_EPOCHS:
            break
    if ended is Ended.MAX_STEPS and state.epoch_samples:  # stopped inside an epoch: saved,
        record = {**summary(training, state.epoch + state.epoch_samples / sampler.size),
                  "final": True}  # then its final validation (a record too), as at an
        if not at_limit:  # (a resumed run at its limit took no step: nothing new to save)
            save(training, saving.Kind.STOP)  # epoch's end: a signal ends that validation,
            training.saver.wait()             # a kill there loses no step
        try:
            with stop.interruptible("during the final validation", training.procs.world_size):
                record.update(validate(training))
        except Interrupted:  # the steps are saved
            return Ended.SIGNAL, final
        training.run_log.epoch(record)
        final = metrics.final_figures(training.task, record)
        best = metrics.best_key(training.task)
        runtime.main_print(f"--max-steps {config['max_steps']} reached at step {state.step}"
                           + (f": {best} {final[best]:.4f}" if best in final else ""))
    return ended, final


def run_epoch(training, train_loader, epoch, stop):
    """The step loop of one epoch, from where the run stands in it: after each optimizer
    step, the EMA, then whether to stop, log and checkpoint, decided here.

    Returns:
        ``Ended.ALL_EPOCHS`` when the epoch ran to its end, else why it stopped.
    """
    config, state, sampler = training.config, training.state, train_loader.batch_sampler
    ended = Ended.ALL_EPOCHS
    sampler.set_epoch(epoch, state.epoch_samples)
    training.loop.timer.reset()  # a resumed epoch: timed from here, for the samples from here
    training.timed_from = state.epoch_samples
    training.meter.restart(state.step)
    training.watchdog.resume()  # timed from here (once a step finished): --hang-timeout
    with training.run_log.progress(epoch, config["epochs"], len(sampler)) as bar, \
            contextlib.closing(engine.steps(training.model, train_loader, training.optimizer,
                                            training.task, training.loop, state, bar)) as steps:
        for step in steps:
            training.watchdog.step()  # one time.monotonic(), no sync
            if training.profiler is not None:  # --profile-steps: its schedule moves on
                with training.watchdog.paused():  # (its trace's export is not a hang)
                    training.profiler.step()
            if training.ema is not None:
                training.ema.update(training.task.averaged(training.net), step)  # after each
            training.ledger.step(state)  # --sample-ledger: the step's samples
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
                save(training, saving.Kind.STOP)
            elif config["ckpt_every_steps"] and step % config["ckpt_every_steps"] == 0 \
                    and not epoch_done:
                save(training, saving.Kind.STEP)
            if ended is not Ended.ALL_EPOCHS:
                break
        training.watchdog.pause()  # validation and the epoch's save are not timed
        if training.meter.pending(state):  # every epoch ends its loss curve, however short
            log_train(training, bar)
    return ended


# ----------------------------------------------------------- logging, saving, epochs

def read_losses(training):
    """Moves the loss counters into the run state (one sync); the first non-finite loss or
    gradient norm is recorded for replay (replay.py); after --max-nonfinite bad losses in
    a row, stops the run.

    Returns:
        How many of the latest losses in a row were not finite (0: the last was fine).
    """
    streak, worst = training.meter.collect(training.state)
    if training.meter.nonfinite is not None and training.nonfinite_record is None:  # once
        training.nonfinite_record = replay.record_nonfinite(
            training.meter.nonfinite, training.config, training.state, training.procs,
            training.loop, len(training.datasets[0]), training.saver.last_saved)
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
    training.run_log.scalars({**metrics.train_scalars(
        meter.mean(), training.optimizer.param_groups[0]["lr"], skips, meter.grad_norm(),
        clipped), **metrics.task_scalars(meter.figures())}, training.state.step)
    training.meter.restart(training.state.step)


def save(training, kind, best=False):
    """Checkpoints the state after the last optimizer step, unless its loss was not finite."""
    with training.watchdog.paused():  # a slow disk is not a hang (--hang-timeout)
        if read_losses(training):
            training.saver.check_weights()  # non-finite weights stop the run even so
            runtime.main_print(f"not saving at step {training.state.step}: the last loss "
                               f"was not finite")
            return
        training.saver.save(kind, best)  # checks the weights first


def validate(training):
    """Evaluates on the validation set (with --ema-decay, the moving average too), logs
    the figures and the task's images; returns the figures (metrics.jsonl keys)."""
    task, loop, tta = training.task, training.loop, tasks.use_tta(training.config)
    result = engine.evaluate(training.model, training.val_loader, loop, task, tta=tta)
    ema = None
    if training.ema is not None:
        training.ema.sync_buffers()  # BatchNorm statistics differ between DDP processes
        ema = engine.evaluate(training.ema.module, training.val_loader, loop, task, tta=tta)
    figures = metrics.validation_figures(task, result, ema)
    step, names = training.state.step, training.datasets[0].classes
    training.run_log.scalars(metrics.validation_scalars(figures), step)
    for suffix, evaluated in (("", result), ("_ema", ema)):
        if evaluated is None:
            continue
        figures.update(task.extra_figures(evaluated, names, suffix))
        if training.run_log.enabled:  # drawn on process 0 only
            title = f"val_{task.best}{suffix} {evaluated[task.best]:.4f} at step {step}" \
                if task.best in evaluated else f"step {step}"  # (not measured: the step)
            for tag, image in task.images(evaluated, names, title):
                training.run_log.image(metrics.validation_tag(tag, suffix), image, step)
    return figures


def summary(training, epoch, times=None):
    """The metrics.jsonl record of the epoch's training so far, at ``epoch`` (finished
    epochs, or a fraction: a run stopped inside one), its validation to be added;
    ``times``: the step timer's totals (None: now)."""
    state, loop, world = training.state, training.loop, training.procs.world_size
    times = times or loop.timer.totals()
    unreadable = sum(dataset.unreadable_count() for dataset in training.datasets)  # skipped
    loss_sum, loss_count, unreadable = ops.sum_over_processes(
        [state.loss_sum, state.loss_count, unreadable], loop.device, world)
    grad_norm = state.grad_norm_sum / state.grad_norm_count if state.grad_norm_count else None
    record = metrics.epoch_record(
        epoch, state.step, loss_sum, loss_count, training.optimizer.param_groups[0]["lr"],
        times, state.epoch_samples - training.timed_from, training.flops_per_sample,
        training.peak_tflops, unreadable, grad_norm,
        state.grad_clipped if training.config["grad_clip"] > 0 else None)
    return {**record, **metrics.epoch_figures(state.figures, loop.device, world)}


def finish_epoch(training, stop):
    """Validates (when due), logs the epoch, saves last.pt (and best.pt). A validation
    starts after last.pt holds the epoch's training, and a stop signal ends it at once."""
    config, state = training.config, training.state
    due = (state.epoch + 1) % config["eval_every"] == 0 or state.epoch + 1 == config["epochs"]
    times = training.loop.timer.totals()  # the epoch's steps alone, not the save below
    if due:  # (a long validation, an FID: a signal or a kill there costs no step)
        save(training, saving.Kind.STOP)
        training.saver.wait()  # written, before the validation
    state.epoch += 1
    record, best = summary(training, state.epoch, times), False
    if due:
        with stop.interruptible(f"during the validation of epoch {state.epoch}",
                                training.procs.world_size):  # (DDP: not: its collectives)
            record.update(sweep_trial.reported(training.procs, state.step, validate(training)))
        value = None if training.task.best is None else metrics.best_metric(training.task,
                                                                           record)
        best = state.record_best(value)  # (no figure to follow: best.pt is the last)
        if value is not None:  # --early-stop-*: towards the patience, or not
            state.count_early_stop(value, config["early_stop_min_delta"])
    state.epoch_samples, state.loss_sum, state.loss_count = 0, 0.0, 0
    state.grad_norm_sum, state.grad_norm_count, state.grad_clipped = 0.0, 0, 0
    state.figures = {}
    training.run_log.epoch(record)
    save(training, saving.Kind.EPOCH, best)
    runtime.main_print(metrics.epoch_line(record, config, training.task, training.on_device))
    return metrics.final_figures(training.task, record)


# --------------------------------------------------------------------- data, network

def build_model(config, train_set, device, world_size, log, task, resuming=False):
    """The network: built, pretrained weights, frozen parts, moved and wrapped.

    A resumed run takes its weights from the checkpoint, so it does not read --pretrained
    (the file may be gone by then).

    Returns:
        ``(net, model)``: the plain network (saved in checkpoints) and the module to call
        (wrapped in DDP / DataParallel / torch.compile as asked).
    """
    net = task.build_networks(config, train_set)  # the task's network(s)
    if config["pretrained"] and not resuming:
        presets.load_pretrained(net, config["pretrained"], log, config["pretrained_weights"],
                                config["network"], task.class_heads(net))
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


def wrap_model(net, config, device, world_size, broadcast_buffers=True):
    """The module to call: ``net`` in DistributedDataParallel (torchrun) or DataParallel
    (--gpus), then torch.compile (--compile), as asked.

    DDP chooses the parameters it all-reduces when it is built, among those that require
    gradients then: after --unfreeze-at it is built again (``unfreeze``), or the unfrozen
    layers would train apart on each process. DataParallel's replicas run in threads that
    re-enter autocast without a dtype (float16 on CUDA): each replica sets it again.

    Several networks (an ``nn.ModuleDict``) are wrapped each on its own, their buffers not
    broadcast at each forward: a network with BatchNorm called twice before one backward
    (a discriminator: real, then made images) would have a buffer its backward needs
    changed by a broadcast between the two (pytorch #175024); process 0's are saved.
    """
    if isinstance(net, torch.nn.ModuleDict):  # several networks: each its own DDP
        return torch.nn.ModuleDict({name: wrap_model(module, config, device, world_size,
                                                     broadcast_buffers=False)
                                    for name, module in net.items()})
    model = net
    if world_size > 1:
        model = runtime.distributed(net, device, broadcast_buffers)  # buckets settled
    elif config["gpus"] and len(runtime.gpu_ids(config["gpus"])) > 1:
        replica = engine.Autocast(net, device.type, hardware.amp_dtype(config["amp"], device))
        model = torch.nn.DataParallel(replica, device_ids=runtime.gpu_ids(config["gpus"]))
    if config["compile"]:
        model = torch.compile(model)
    return model


# ------------------------------------------------------------------------ optimiser

def unfreeze(training):
    """--unfreeze-at: the frozen parameters join the optimizer, the model is wrapped
    again (a DDP built before would not synchronise them) and a step's FLOPs are counted
    again; returns their names."""
    names = unfreeze_into(training.net, training.optimizer, training.config)
    training.model = wrap_model(training.net, training.config, training.procs.device,
                                training.procs.world_size)
    training.flops_per_sample, training.peak_tflops = hardware.count_flops(  # their backward too
        training.net, training.task.example(training.datasets[0]), training.config,
        training.procs, training.loop.amp_dtype)
    engine.set_lr(training.optimizer, training.loop.lr_factor(training.state.step))
    return names


if __name__ == "__main__":
    sys.exit(main())

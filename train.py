"""Train an image classifier.

    python train.py                                    # CIFAR-10, the default recipe
    python train.py --dataset synthetic --epochs 2     # no download, seconds on a CPU
    python train.py --config configs/cifar10_simple.yaml --amp bf16
    python train.py --resume auto --run-dir runs/exp1  # continue where it stopped
    torchrun --nproc_per_node 4 train.py ...           # DistributedDataParallel

Read ``main`` top to bottom: config, processes and device, data, network, loss,
optimizer, resume, the epoch loop, the final save. Each stage is a short function
below it. Everything the run makes goes into one run directory (see README).
"""

import os
import shlex
import signal
import sys
import time

import torch
import torch.distributed as dist

import checkpoint
import data
import engine
import ops
import runlog
import runtime
from config import check_config, merge_resumed_config, parse_config
from losses import build_criterion
from networks import build_network
from ops import UserError

EXIT_USER_ERROR, EXIT_FAILED, EXIT_SIGINT, EXIT_SIGTERM = 2, 1, 130, 143


# ---------------------------------------------------------------------------- main

def main(argv=None):
    """Trains with the given command-line arguments.

    Returns:
        The exit code: 0 when done, 2 for a user error (one ``error:`` line), 1 when the
        loss stayed non-finite, 130/143 when stopped by SIGINT/SIGTERM after saving.
    """
    stop = runtime.StopRequest()
    try:
        return train(sys.argv[1:] if argv is None else argv, stop)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except NonFiniteLoss as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_FAILED
    finally:
        stop.restore()
        if dist.is_initialized():
            dist.destroy_process_group()


class NonFiniteLoss(Exception):
    """The loss stayed NaN or infinite for --max-nonfinite optimizer steps in a row."""


def train(argv, stop):
    """The whole run, stage by stage; returns the exit code (see ``main``)."""
    # 1. Config: defaults < YAML < command line; a resumed run takes its checkpoint's.
    config, explicit = parse_config(argv)
    check_config(config)
    resume_path, state = find_resume(config)
    if state is not None:
        state["path"] = resume_path
        config = merge_resumed_config(state["config"], config, explicit)
        check_config(config)

    # 2. Processes, device, seeds, run directory.
    rank, world_size, device = runtime.setup_processes(config)
    is_main = rank == 0
    if world_size > 1:
        runtime.check_same_resume_point(state, world_size, device)

    def log(message):
        if is_main:
            print(message, flush=True)

    runtime.seed_everything(config["seed"], rank, config["deterministic"], device)
    run_dir = runlog.prepare_run_dir(config, state is not None, is_main, argv)
    if resume_path:
        log(f"resuming from {resume_path} (epoch {state['epoch']}, step {state['step']})")
    elif config["resume"] == "auto":
        log(f"no valid checkpoint in {run_dir}: starting fresh")

    # 3. Data: the first process downloads, the others wait and read.
    if is_main:
        train_set, val_set = data.build_datasets(config)
    if world_size > 1:
        dist.barrier()
    if not is_main:
        train_set, val_set = data.build_datasets(config)
    accum = (config["virtual_batch_size"] or config["batch_size"]) // config["batch_size"]
    sampler = data.EpochBatchSampler(len(train_set), config["batch_size"], config["seed"],
                                     rank=rank, world_size=world_size)
    pin = device.type == "cuda"
    train_loader = data.build_loader(train_set, batch_sampler=sampler,
                                     num_workers=config["num_workers"], pin_memory=pin)
    val_loader = data.build_loader(
        val_set, batch_size=config["batch_size"], num_workers=config["num_workers"],
        pin_memory=pin, sampler=data.shard_indices(len(val_set), rank, world_size))

    # 4. Network, loss, optimizer.
    net, model = build_model(config, train_set, device, world_size, log, state is not None)
    if is_main:
        runlog.write_summary(net, train_set, run_dir, device, log)
    criterion = build_criterion(config)
    optimizer = build_optimizer(net, config)
    dtype = runtime.amp_dtype(config, device)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)

    windows_per_epoch = -(-len(sampler) // accum)
    total_steps = config["max_steps"] or windows_per_epoch * config["epochs"]
    total_steps = min(total_steps, windows_per_epoch * config["epochs"])
    warmup = int(config["warmup_epochs"] * windows_per_epoch)

    def lr_factor(step):
        return ops.lr_factor(step, total_steps, config["scheduler"], warmup)

    # 5. Resume: weights, optimizer, scaler, position and RNG as of the saved step.
    progress = {"epoch": 0, "step": 0, "epoch_samples": 0, "loss_sum": 0.0,
                "loss_count": 0, "best_val_acc": -1.0, "scaler_skips": 0}
    if state is not None:
        restore(state, net, optimizer, scaler, progress, config, rank, world_size, log)
    engine.set_lr(optimizer, lr_factor(progress["step"]))

    # 6. The epoch loop.
    memory_format = torch.channels_last if config["channels_last"] else torch.contiguous_format
    run = engine.RunSettings(
        device=device, epochs=config["epochs"], accum=accum, world_size=world_size,
        amp_dtype=dtype, scaler=scaler, grad_clip=config["grad_clip"],
        memory_format=memory_format, prefetch=config["prefetch"], show_progress=is_main,
        lr_factor=lr_factor, timer=engine.StepTimer(device), counters=engine.Counters(device))
    run.flops_per_sample = ops.train_flops_per_sample(
        net, (train_set.in_channels, train_set.image_size, train_set.image_size), device)
    if device.type == "cuda":
        run.peak_tflops = ops.peak_tflops(torch.cuda.get_device_name(device), dtype is not None)
    run_log = runlog.RunLog(run_dir, progress["step"], progress["epoch"], is_main)
    saver = Saver(run_dir, config, net, optimizer, scaler, progress, is_main, world_size)
    saver.last_saved = resume_path
    if progress["step"] == 0 and is_main:
        runlog.log_first_batch(run_log, train_set, sampler)
    log(f"training {config['network']} on {config['dataset']} ({len(train_set)} samples, "
        f"{world_size} process(es), {device}) into {run_dir}")

    window = {"loss_sum": 0.0, "loss_count": 0, "time": time.perf_counter(), "shown": 0.0}

    def read_counters():
        values = run.counters.read()
        if world_size > 1:  # the loss may be non-finite on some processes only: every
            # process must take the same decision (skip a save, stop), or they fall out of step
            streaks = torch.tensor([values["worst_streak"], values["streak"]], device=device)
            dist.all_reduce(streaks, op=dist.ReduceOp.MAX)
            values["worst_streak"], values["streak"] = (int(s) for s in streaks)
        for key in ("loss_sum", "loss_count"):
            progress[key] += values[key]
            window[key] += values[key]
        progress["scaler_skips"] += values["scaler_skips"]
        if values["worst_streak"] >= config["max_nonfinite"]:
            raise NonFiniteLoss(
                f"the loss was not finite for {values['worst_streak']} steps in a row (at "
                f"step {progress['step']}); lower --lr, add --grad-clip, or try --amp bf16. "
                f"The last good checkpoint is {saver.last_saved or 'none'}")
        return values

    def save(kind, best=False):
        if read_counters()["streak"]:
            log(f"not saving at step {progress['step']}: the last loss was not finite")
            return
        saver.save(kind, best)

    def show(bar):  # loss, samples/s and efficiency since the last log, on the bar
        read_counters()
        mean = window["loss_sum"] / max(window["loss_count"], 1)
        data_t, compute_t, _ = run.timer.totals()
        now = time.perf_counter()
        rate = window["loss_count"] * world_size / max(now - window["time"], 1e-9)
        bar.set_postfix(loss=f"{mean:.4f}", samples_s=f"{rate:.0f}",
                        eff=f"{engine.efficiency(data_t, compute_t):.2f}")
        window["shown"] = now
        return mean

    def log_window(bar, step):
        mean = show(bar)
        scalars = {"train/loss": mean, "train/lr": optimizer.param_groups[0]["lr"]}
        if scaler.is_enabled():
            scalars["train/scaler_skips"] = progress["scaler_skips"]
        run_log.scalars(scalars, step)
        window.update(loss_sum=0.0, loss_count=0, time=time.perf_counter())

    def after_step(bar):  # called by the engine after every optimizer step
        step = progress["step"]
        stopping = stop_now()
        at_max = bool(config["max_steps"]) and step >= config["max_steps"]
        if step % config["log_every"] == 0 or stopping or at_max:
            log_window(bar, step)
        elif world_size == 1 and time.perf_counter() - window["shown"] > 0.5:
            show(bar)  # at most two syncs a second (no collectives: one process only)
        epoch_done = progress["epoch_samples"] >= len(train_set)  # finish_epoch saves then
        if stopping or (config["ckpt_every_steps"] and step % config["ckpt_every_steps"] == 0
                        and not epoch_done):
            save("stop" if stopping else "step")
        return stopping or at_max

    def stop_now():
        wanted = stop.signum is not None
        if world_size > 1:  # every process stops at the same step
            flag = torch.tensor([int(wanted)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            wanted = bool(flag.item())
            if wanted and stop.signum is None:
                stop.signum = signal.SIGTERM
        return wanted

    final, status = {}, "done"
    try:
        for epoch in range(progress["epoch"], config["epochs"]):
            if stop_now():  # a signal that came between steps (setup, validation)
                save("stop")
                break
            if config["unfreeze_at"] and epoch + 1 == config["unfreeze_at"] \
                    and progress["epoch_samples"] == 0:
                names = unfreeze_into(net, optimizer, config)
                engine.set_lr(optimizer, lr_factor(progress["step"]))
                log(f"epoch {epoch + 1}: unfroze {len(names)} parameter tensors")
            run.epoch = epoch
            sampler.set_epoch(epoch, progress["epoch_samples"])
            run.timer.reset()
            window["time"] = time.perf_counter()
            status = engine.train_one_epoch(model, train_loader, optimizer, criterion, run,
                                            progress, after_step)
            if progress["epoch_samples"] >= len(train_set):  # the epoch is complete
                read_counters()
                final = finish_epoch(epoch, model, val_loader, run, config, progress,
                                     run_log, save, world_size, train_set.num_classes, log,
                                     optimizer.param_groups[0]["lr"])
            if status == "stopped":
                break
        if status == "stopped" and stop.signum is None and progress["epoch_samples"]:
            result = engine.evaluate(model, val_loader, run, train_set.num_classes)
            final = {"val_loss": result["loss"], "val_acc": result["acc"]}
            run_log.scalars({"val/loss": result["loss"], "val/acc": result["acc"]},
                           progress["step"])
            save("stop")  # --max-steps reached inside an epoch
            log(f"--max-steps {config['max_steps']} reached at step {progress['step']}: "
                f"val_acc {result['acc']:.4f}")
    finally:
        run_log.flush()  # keep what was logged, also when the run fails
        saver.wait()  # the checkpoint being written in the background
        data.shutdown_loader(train_loader)
        data.shutdown_loader(val_loader)
    if stop.signum is not None:
        run_log.close(config, None)
        if world_size > 1:  # no process exits (and makes torchrun kill the rest) before
            dist.barrier()  # rank 0 has written the checkpoint
        name = signal.Signals(stop.signum).name
        launcher = "python train.py" if world_size == 1 else "torchrun <same options> train.py"
        log(f"{name}: saved {saver.last_saved}. Resume with:\n  {launcher} --resume auto "
            f"--run-dir {shlex.quote(run_dir)}")
        return EXIT_SIGINT if stop.signum == signal.SIGINT else EXIT_SIGTERM
    run_log.close(config, final, progress["step"])
    log(f"done: {run_dir}")
    return 0


# -------------------------------------------------------------------------- network

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
        load_pretrained(net, config["pretrained"], log)
    if config["freeze"]:
        frozen = ops.freeze(net, config["freeze"])
        log(f"frozen: {len(frozen)} parameter tensors matching {' '.join(config['freeze'])}")
    if config["grad_checkpointing"]:
        if not hasattr(net, "set_grad_checkpointing"):
            raise UserError(f"--grad-checkpointing: {config['network']} has no "
                            f"set_grad_checkpointing; use simple_cnn, resnet18 or mlp")
        net.set_grad_checkpointing(True)
    if config["sync_bn"] and world_size > 1:
        if device.type != "cuda":  # DDP and SyncBatchNorm refuse CPU modules
            raise UserError("--sync-bn needs CUDA devices (one per process); CPU processes "
                            "keep per-process BatchNorm statistics: drop --sync-bn")
        net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
    memory_format = torch.channels_last if config["channels_last"] else torch.preserve_format
    net = net.to(device, memory_format=memory_format)
    model = net
    if world_size > 1:
        ids = [device.index] if device.type == "cuda" else None
        model = torch.nn.parallel.DistributedDataParallel(net, device_ids=ids)
    elif config["gpus"] and len(runtime.gpu_ids(config["gpus"])) > 1:
        model = torch.nn.DataParallel(net, device_ids=runtime.gpu_ids(config["gpus"]))
    if config["compile"]:
        model = torch.compile(model)
    return net, model


def load_pretrained(net, path, log):
    """Initialises ``net`` from a checkpoint of this project or a plain state_dict.

    A classifier head of another size (another number of classes) keeps its fresh
    initialisation and is listed; any other mismatch is a UserError listing the keys.
    """
    state = checkpoint.load_checkpoint(path)
    weights = checkpoint.unwrap_state_dict(state["model"] if "model" in state else state)
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

def build_optimizer(net, config):
    """The optimizer over the trainable parameters; each group keeps its ``base_lr``."""
    params = [p for p in net.parameters() if p.requires_grad]
    if not params:
        raise UserError("every parameter is frozen: nothing to train")
    group = {"params": params, "base_lr": config["lr"]}
    wd, lr = config["weight_decay"], config["lr"]
    if config["optimizer"] == "sgd":
        nesterov = config["nesterov"] and config["momentum"] > 0
        return torch.optim.SGD([group], lr=lr, momentum=config["momentum"],
                               nesterov=nesterov, weight_decay=wd)
    cls = torch.optim.Adam if config["optimizer"] == "adam" else torch.optim.AdamW
    return cls([group], lr=lr, weight_decay=wd)


def unfreeze_into(net, optimizer, config):
    """Unfreezes the frozen parameters and adds them to the optimizer as a new group."""
    names = ops.unfreeze(net, config["freeze"])
    params = dict(net.named_parameters())
    base_lr = config["lr"] * config["unfreeze_lr_scale"]
    optimizer.add_param_group({"params": [params[n] for n in names], "base_lr": base_lr,
                               "lr": base_lr})
    return names


def finish_epoch(epoch, model, val_loader, run, config, progress, run_log, save,
                 world_size, num_classes, log, lr):
    """Validates (when due), logs the epoch, saves last.pt (and best.pt)."""
    data_t, compute_t, wall = run.timer.totals()
    sums = torch.tensor([progress["loss_sum"], progress["loss_count"]], dtype=torch.float64,
                        device=run.device)
    if world_size > 1:
        dist.all_reduce(sums)
    progress["epoch"] += 1
    samples = progress["epoch_samples"]
    record = {"epoch": progress["epoch"], "step": progress["step"],
              "train_loss": float(sums[0] / max(sums[1], 1)),
              "lr": lr, "compute_efficiency": engine.efficiency(data_t, compute_t),
              "data_time": data_t, "compute_time": compute_t, "epoch_time": wall,
              "samples_per_sec": samples / max(wall, 1e-9)}
    record["tflops"] = run.flops_per_sample * record["samples_per_sec"] / 1e12
    if run.peak_tflops:
        record["mfu"] = record["tflops"] / run.peak_tflops
    is_last = progress["epoch"] == config["epochs"]
    best = False
    if progress["epoch"] % config["eval_every"] == 0 or is_last:
        result = engine.evaluate(model, val_loader, run, num_classes)
        record.update(val_loss=result["loss"], val_acc=result["acc"])
        best = result["acc"] > progress["best_val_acc"]
        if best:
            progress["best_val_acc"] = result["acc"]
    progress.update(epoch_samples=0, loss_sum=0.0, loss_count=0)
    step = progress["step"]
    run_log.scalars({"perf/compute_efficiency": record["compute_efficiency"],
                    "perf/samples_per_sec": record["samples_per_sec"],
                    "perf/tflops": record["tflops"]}, step)
    if "mfu" in record:
        run_log.scalars({"perf/mfu": record["mfu"]}, step)
    if "val_acc" in record:
        run_log.scalars({"val/loss": record["val_loss"], "val/acc": record["val_acc"]}, step)
    run_log.epoch(record)
    save("epoch", best)
    val = f"  val_loss {record['val_loss']:.4f}  val_acc {record['val_acc']:.4f}" \
        if "val_acc" in record else ""
    log(f"epoch {progress['epoch']}/{config['epochs']}  step {step}  train_loss "
        f"{record['train_loss']:.4f}{val}  {record['samples_per_sec']:.0f} samples/s  "
        f"efficiency {record['compute_efficiency']:.2f} (data {data_t:.1f}s, compute "
        f"{compute_t:.1f}s)")
    if "mfu" in record:
        log(f"  {record['tflops']:.1f} TFLOP/s, model FLOPs utilisation {record['mfu']:.1%}")
    if record["compute_efficiency"] < 0.7:
        log(f"  the loop waited for data {1 - record['compute_efficiency']:.0%} of the time: "
            f"try more --num-workers (now {config['num_workers']}) or --prefetch 2")
    return {k: record[k] for k in ("train_loss", "val_loss", "val_acc") if k in record}


# ----------------------------------------------------------------------- checkpoints

class Saver:
    """Writes checkpoints: last.pt, best.pt and rotating epoch-/step- files."""

    def __init__(self, run_dir, config, net, optimizer, scaler, progress, is_main,
                 world_size):
        self.dir = os.path.join(run_dir, "checkpoints")
        self.config, self.net, self.optimizer, self.scaler = config, net, optimizer, scaler
        self.progress, self.is_main, self.world_size = progress, is_main, world_size
        self.last_saved = None
        self.writer = checkpoint.BackgroundWriter()
        if is_main:  # temporary files of a save that was killed half-way
            for name in os.listdir(self.dir):
                if name.startswith(".tmp-"):
                    os.unlink(os.path.join(self.dir, name))

    def save(self, kind, best=False):
        """Saves the state as of the last optimizer step (all processes call this)."""
        progress = {k: v for k, v in self.progress.items()}
        rngs = [checkpoint.rng_state()]
        if self.world_size > 1:
            sums = torch.tensor([progress["loss_sum"], progress["loss_count"]],
                                dtype=torch.float64)
            sums = sums.to(next(self.net.parameters()).device)
            dist.all_reduce(sums)
            progress.update(loss_sum=float(sums[0]), loss_count=int(sums[1]))
            rngs = [None] * self.world_size
            dist.all_gather_object(rngs, checkpoint.rng_state())
        if not self.is_main:
            return
        state = {
            "model": checkpoint.unwrap_state_dict(self.net.state_dict()),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": {"step": progress["step"]},  # the LR is a function of the step
            "epoch": progress["epoch"],
            "step": progress["step"],
            "progress": progress,
            "rng": rngs[0],
            "rng_per_rank": rngs,
            "config": {k: v for k, v in self.config.items() if k not in ("resume",)},
        }
        path = os.path.join(self.dir, "last.pt")
        also = []
        if best:
            also.append(os.path.join(self.dir, "best.pt"))
        if self.config["keep_last"] > 0 and kind in ("epoch", "step"):
            name = f"epoch-{progress['epoch']:04d}.pt" if kind == "epoch" \
                else f"step-{progress['step']:08d}.pt"
            also.append(os.path.join(self.dir, name))
        # Training goes on while a thread writes a private CPU copy of the state.
        self.writer.submit(checkpoint.to_cpu(state), path, also,
                           keep_last=self.config["keep_last"])
        self.last_saved = path

    def wait(self):
        """Waits for the checkpoint being written (re-raising a failed write's error)."""
        if self.is_main:
            try:
                self.writer.wait()
            except OSError as e:
                raise checkpoint.CheckpointError(
                    f"writing a checkpoint into {self.dir!r} failed ({e}); the files "
                    f"there are the last complete ones") from None


def find_resume(config):
    """The checkpoint to resume from: ``(path, state)`` or ``(None, None)``."""
    if not config["resume"]:
        return None, None
    if config["resume"] == "auto":
        warn = print if int(os.environ.get("RANK", "0")) == 0 else (lambda m: None)
        return checkpoint.find_latest(config["run_dir"], warn=warn)
    state = checkpoint.load_checkpoint(config["resume"])
    if "model" not in state or "config" not in state or "progress" not in state:
        raise UserError(f"{config['resume']!r} is not a training checkpoint of this project "
                        f"(use --pretrained for plain weights)")
    return config["resume"], state


def restore(state, net, optimizer, scaler, progress, config, rank, world_size, log):
    """Loads the checkpoint's state into the freshly built objects."""
    weights = checkpoint.unwrap_state_dict(state["model"])
    checkpoint.check_compatible(net, weights, state["path"])
    net.load_state_dict(weights)
    progress.update(state["progress"])
    if rank != 0:  # the epoch's partial loss sums are global; count them once
        progress.update(loss_sum=0.0, loss_count=0)
    if config["unfreeze_at"] and progress["epoch"] >= config["unfreeze_at"] - 1 and (
            progress["epoch"] > config["unfreeze_at"] - 1 or progress["epoch_samples"]):
        unfreeze_into(net, optimizer, config)
    try:
        optimizer.load_state_dict(state["optimizer"])
    except (ValueError, KeyError) as e:
        raise UserError(f"the optimizer state in {state['path']!r} does not fit "
                        f"(--optimizer or --freeze changed?): {e}") from None
    # Hyper-parameters come from the (possibly overridden) config, not the saved groups.
    for i, group in enumerate(optimizer.param_groups):
        group["base_lr"] = config["lr"] * (config["unfreeze_lr_scale"] if i else 1.0)
        group["weight_decay"] = config["weight_decay"]
        if config["optimizer"] == "sgd":
            group["momentum"] = config["momentum"]
            group["nesterov"] = config["nesterov"] and config["momentum"] > 0
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rngs = state.get("rng_per_rank") or [state["rng"]]
    checkpoint.set_rng_state(rngs[rank] if len(rngs) == world_size else rngs[0])
    saved = state["config"]  # --batch-size is per process: say so when the count changed
    before = (saved.get("virtual_batch_size") or saved.get("batch_size", 0)) * len(rngs)
    now = (config["virtual_batch_size"] or config["batch_size"]) * world_size
    if before and before != now:
        log(f"note: the checkpoint took {before} samples per optimizer step ({len(rngs)} "
            f"process(es)), this run takes {now} ({world_size}); to continue the same "
            f"training, set --batch-size (per process) so that they match")


if __name__ == "__main__":
    sys.exit(main())

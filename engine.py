"""The per-epoch loops: ``train_one_epoch`` and ``evaluate``, and their timing.

Compute efficiency = compute_time / (compute_time + data_time). On the CPU both are
measured with a wall clock: data_time is the wait for the next batch (copy to the device
included), compute_time is forward, backward and optimizer step. On CUDA the work is
asynchronous, so compute_time is read from CUDA events recorded around each step's work
(no device sync per step; the events are read when logging) and data_time is the rest of
the wall time: the time the GPU was not computing.
"""

import contextlib
import dataclasses
import math
import threading
import time

import torch
import torch.distributed as dist
from prefetch_generator import BackgroundGenerator
from tqdm import tqdm

from ops import keep_frozen_norms_eval


class StepTimer:
    """Accumulates data and compute time without a device sync per step.

    Args:
        device: the training device; CUDA devices are timed with events.
    """

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.reset()

    def reset(self):
        self.data = self.compute = 0.0
        self.wall_start = time.perf_counter()
        self._pending = []  # CUDA event pairs not yet read

    def start_data(self):
        self._t = time.perf_counter()

    def start_compute(self):
        now = time.perf_counter()
        self.data += now - self._t
        self._t = now
        if self.cuda:
            self._begin = torch.cuda.Event(enable_timing=True)
            self._begin.record()

    def end_compute(self):
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._pending.append((self._begin, end))
        else:
            self.compute += time.perf_counter() - self._t

    def totals(self):
        """``(data_time, compute_time, wall_time)`` in seconds since the last reset."""
        wall = time.perf_counter() - self.wall_start
        if self.cuda:
            if self._pending:
                self._pending[-1][1].synchronize()
                wall = time.perf_counter() - self.wall_start
            self.compute += sum(b.elapsed_time(e) for b, e in self._pending) / 1000.0
            self._pending = []
            return max(wall - self.compute, 0.0), self.compute, wall
        return self.data, self.compute, wall


def efficiency(data_time, compute_time):
    total = data_time + compute_time
    return compute_time / total if total > 0 else 0.0


class _Prefetcher:
    """Iterates ``loader`` through a prefetch_generator.BackgroundGenerator (a thread),
    or directly when ``depth`` is 0, and can be stopped early without loading more."""

    def __init__(self, loader, depth):
        self._stop = threading.Event()
        self._bg = None
        if depth > 0:
            self._bg = BackgroundGenerator(self._until_stopped(loader), max_prefetch=depth)
            self._it = self._bg
        else:
            self._it = iter(loader)

    def _until_stopped(self, loader):
        it = iter(loader)
        while not self._stop.is_set():
            try:
                item = next(it)
            except StopIteration:
                return
            yield item

    def __iter__(self):
        return self._it

    def close(self):
        """Stops the background thread: it takes no further batch from the loader."""
        self._stop.set()
        if self._bg is not None:
            while self._bg.is_alive():
                with contextlib.suppress(Exception):
                    self._bg.queue.get(timeout=0.05)
            self._bg.join()


def set_lr(optimizer, factor):
    """Sets each param group's lr to its ``base_lr`` times ``factor``."""
    for group in optimizer.param_groups:
        group["lr"] = group["base_lr"] * factor


@dataclasses.dataclass
class RunSettings:
    """What the loops need to know about the run, beyond the model and the data."""

    device: torch.device
    epochs: int = 1
    epoch: int = 0                      # 0-based index of the epoch being trained
    accum: int = 1                      # micro-batches per optimizer step
    world_size: int = 1
    amp_dtype: torch.dtype = None       # None: full precision
    scaler: torch.amp.GradScaler = None
    grad_clip: float = 0.0
    memory_format: torch.memory_format = torch.contiguous_format
    prefetch: int = 0                   # BackgroundGenerator queue depth, 0 = off
    show_progress: bool = True
    lr_factor: object = lambda step: 1.0
    timer: StepTimer = None
    counters: "Counters" = None
    flops_per_sample: int = 0           # forward + backward, from ops.train_flops_per_sample
    peak_tflops: float = None           # the GPU's datasheet peak, when known

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()  # cheaper than a disabled autocast, every step
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


class Counters:
    """Running sums kept on the device and read (one sync) only when logging or saving.

    Args:
        device: where the sums live.
    """

    def __init__(self, device):
        self.device = device
        self.streak = torch.zeros((), device=device, dtype=torch.long)
        self.reset()

    def reset(self):
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.loss_count = 0
        self.worst = torch.zeros((), device=self.device, dtype=torch.long)
        self.skips = torch.zeros((), device=self.device)

    def add_loss(self, loss, count):
        """Adds a batch's mean loss for ``count`` samples; tracks non-finite streaks."""
        loss = loss.detach()
        finite = torch.isfinite(loss)
        self.loss_sum += torch.where(finite, loss.double() * count, 0.0)
        self.loss_count += count
        self.streak = torch.where(finite, 0, self.streak + 1)
        self.worst = torch.maximum(self.worst, self.streak)

    def read(self):
        """Returns the sums since the last read as numbers, and starts new ones.

        Returns:
            A dict with ``loss_sum``, ``loss_count``, ``worst_streak`` (longest run of
            non-finite losses), ``streak`` (the current one) and ``scaler_skips``.
        """
        values = {"loss_sum": float(self.loss_sum), "loss_count": self.loss_count,
                  "worst_streak": int(self.worst), "streak": int(self.streak),
                  "scaler_skips": int(self.skips)}
        self.reset()
        return values


def train_one_epoch(model, loader, optimizer, criterion, run, progress, after_step):
    """Trains from the sampler's position in the epoch to its end, or until told to stop.

    Each optimizer step takes ``run.accum`` micro-batches; every micro-batch's loss is
    weighted by its share of the window's samples (the last window of an epoch may be
    short), so the accumulated gradient is that of one batch of all of them. Under DDP,
    the micro-batches before the last skip the gradient all-reduce (``no_sync``).

    Args:
        model: the (possibly wrapped) network.
        loader: a DataLoader whose batch_sampler is an EpochBatchSampler already set to
            this epoch and position.
        optimizer: the optimizer; its param groups carry ``base_lr``.
        criterion: the loss, mean over the batch.
        run: the RunSettings.
        progress: the run's position, a dict saved in checkpoints; ``step`` (optimizer
            steps) and ``epoch_samples`` (samples of this epoch consumed, all processes)
            advance here.
        after_step: called with the tqdm bar after every optimizer step (logging,
            checkpoints, stop requests); returning True ends the epoch early.

    Returns:
        ``"done"`` at the end of the epoch, ``"stopped"`` when ``after_step`` said so.
    """
    device, accum, world, timer = run.device, run.accum, run.world_size, run.timer
    plan = loader.batch_sampler.plan()  # (global, local) sample counts of each batch
    model.train()
    keep_frozen_norms_eval(model)
    bar = tqdm(total=len(plan), desc=f"epoch {run.epoch + 1}/{run.epochs}", unit="batch",
               disable=not run.show_progress, dynamic_ncols=True, leave=False)
    batches = _Prefetcher(loader, run.prefetch)
    status = "done"
    try:
        timer.start_data()
        for k, (x, y) in enumerate(batches):
            global_n, local_n = plan[k]
            first = k - k % accum
            window_n = sum(g for g, _ in plan[first:first + accum])
            last_in_window = k + 1 == min(first + accum, len(plan))
            x = x.to(device, non_blocking=True, memory_format=run.memory_format)
            y = y.to(device, non_blocking=True)
            timer.start_compute()
            no_sync = world > 1 and not last_in_window
            with model.no_sync() if no_sync else contextlib.nullcontext():
                with run.autocast():
                    loss = criterion(model(x), y)
                # DDP averages gradients over processes: scale so that the window's sum is
                # the mean over all of its samples, however they were split.
                weight = local_n * world / window_n
                run.scaler.scale(loss * weight if weight != 1.0 else loss).backward()
            run.counters.add_loss(loss, local_n)
            if last_in_window:
                _optimizer_step(model, optimizer, run)
                progress["step"] += 1
                set_lr(optimizer, run.lr_factor(progress["step"]))
            timer.end_compute()
            progress["epoch_samples"] += global_n
            bar.update(1)
            if last_in_window and after_step(bar):
                status = "stopped"
                break
            timer.start_data()
    finally:
        batches.close()
        bar.close()
    return status


def _optimizer_step(model, optimizer, run):
    scaler = run.scaler
    if run.grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
    scaler.step(optimizer)
    if scaler.is_enabled():
        found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device")
        if found:
            run.counters.skips += sum(found.values())  # stays on the device
    scaler.update()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def evaluate(model, loader, run, num_classes):
    """Evaluates on ``loader`` (this process's shard), summed over all processes.

    Args:
        model: the network (switched to eval mode here).
        loader: batches of (images, labels).
        run: a ``RunSettings`` (device, autocast, memory format, world size).
        num_classes: number of classes, for the confusion matrix.

    Returns:
        A dict with ``loss`` (mean cross-entropy), ``acc`` (0..1), ``count`` and
        ``confusion`` (a num_classes x num_classes tensor, rows are true classes).
    """
    model.eval()
    device = run.device
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_classes * num_classes, device=device, dtype=torch.long)
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=run.memory_format)
        y = y.to(device, non_blocking=True)
        with run.autocast():
            logits = model(x)
        loss_sum += torch.nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        pred = logits.argmax(dim=1)
        confusion += torch.bincount(y * num_classes + pred, minlength=num_classes ** 2)
    if run.world_size > 1:
        dist.all_reduce(loss_sum)
        dist.all_reduce(confusion)
    confusion = confusion.view(num_classes, num_classes).cpu()
    count = int(confusion.sum())
    return {"loss": float(loss_sum) / max(count, 1),
            "acc": float(confusion.diag().sum()) / max(count, 1),
            "count": count, "confusion": confusion}


def per_class_accuracy(confusion):
    """Accuracy of each true class from a confusion matrix (nan for absent classes)."""
    totals = confusion.sum(dim=1)
    return [float(c) / float(t) if t > 0 else math.nan
            for c, t in zip(confusion.diag(), totals)]

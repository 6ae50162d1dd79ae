"""The training step as a generator (``steps``), ``evaluate``, the run state and timing.

The counters the step adds to and the log window read from them (``Counters``,
``LossMeter``) are meters.py's.

Compute efficiency = compute_time / (compute_time + data_time). On the CPU both are
measured with a wall clock: data_time is the wait for the next batch (copy to the device
included), compute_time is forward, backward and optimizer step. On CUDA the work is
asynchronous, so compute_time is read from CUDA events recorded around each step's work
(no device sync per step; the events are read when logging) and data_time is the rest of
the wall time: the time the GPU was not computing.
"""

import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
import numbers
import threading
import time

import torch
from tqdm import tqdm

import ops
from machinery.meters import Counters
from ops import OutOfMemory, UserError, keep_frozen_norms_eval, memory_error


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
            try:  # only --prefetch needs it (some GPU images lack it)
                from prefetch_generator import BackgroundGenerator
            except ImportError:
                raise UserError(f"--prefetch {depth} needs prefetch_generator: pip install "
                                f"prefetch_generator (or --prefetch 0)") from None
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
class TrainState:
    """Where the run stands; checkpoints hold it under ``progress`` (``state_dict()``)."""

    epoch: int = 0             # finished epochs
    step: int = 0              # optimizer steps taken
    epoch_samples: int = 0     # samples of the current epoch consumed, all processes
    loss_sum: float = 0.0      # the current epoch's finite training losses, summed ...
    loss_count: int = 0        # ... over this many samples
    best: float = -math.inf    # best.pt's figure, higher is better (an FID negated): any
    #                            first validation's is the best (older checkpoints: best_val_acc)
    scaler_skips: int = 0      # fp16 steps the GradScaler skipped (inf/nan gradients)
    grad_norm_sum: float = 0.0  # the current epoch's finite gradient norms, summed ...
    grad_norm_count: int = 0    # ... over this many optimizer steps
    grad_clipped: int = 0       # of which clipped by --grad-clip
    best_epoch: int = 0         # the epoch of best.pt (0: none yet)
    early_stop_best: float = -math.inf  # --early-stop-*: the best figure so far ...
    early_stop_waited: int = 0     # ... and validations since it improved
    figures: dict = dataclasses.field(default_factory=dict)  # the epoch's task figures
    #                                 (a GAN's loss_d, ...): name -> [finite sum, count]

    def record_best(self, value):
        """Whether a validation's ``value`` (higher is better) is the best so far, kept
        as it (with this epoch) when it is; None (no figure): every validation is."""
        if value is not None and not value > self.best:
            return False
        self.best = self.best if value is None else value
        self.best_epoch = self.epoch
        return True

    def count_early_stop(self, value, min_delta):
        """--early-stop-*: a validation whose figure (the one best.pt follows) is not above
        the best so far by more than ``min_delta`` (--early-stop-min-delta) counts towards
        the patience. Both numbers live in the run state, so a resumed run stops where the
        whole run would."""
        if value > self.early_stop_best + min_delta:
            self.early_stop_best, self.early_stop_waited = value, 0
        else:
            self.early_stop_waited += 1

    def early_stop_due(self, patience):
        """Whether ``patience`` (--early-stop-patience; 0: off) validations went by
        without improvement."""
        return patience > 0 and self.early_stop_waited >= patience

    def forget_best(self):
        """best.pt and --early-stop-* start afresh (the figure is not comparable)."""
        self.best = self.early_stop_best = -math.inf
        self.best_epoch = self.early_stop_waited = 0

    def state_dict(self):
        saved = dataclasses.asdict(self)
        if not saved["figures"]:  # a classifier's checkpoint keeps the keys it always had
            del saved["figures"]
        return saved

    def load_state_dict(self, saved):
        if "best_val_acc" in saved:  # a checkpoint of before the rename: the same figure,
            never = saved.get("best_epoch") == 0  # but no best yet: an accuracy's -1 floor
            saved = {"best": -math.inf if never else saved["best_val_acc"], **saved}
            if never:
                saved["early_stop_best"] = -math.inf
        for field in dataclasses.fields(self):
            if field.name in saved:
                setattr(self, field.name, field.type(saved[field.name]))
        self.figures = {name: tuple(value) for name, value in self.figures.items()}


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    """What the loops need to know beyond the model and the data; fixed for the run."""

    device: torch.device
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

    def autocast(self):
        if self.amp_dtype is None:
            return contextlib.nullcontext()  # cheaper than a disabled autocast, every step
        return torch.autocast(self.device.type, dtype=self.amp_dtype)


def build_loop(config, procs, sampler, dtype, prefetch=0):
    """The loop's fixed settings: accumulation, precision, LR schedule, timers.

    Args:
        config: the run's (batch sizes, epochs, --max-steps, schedule, clip, memory format).
        procs: ``runtime.Processes`` (device, world size, the main process).
        sampler: the training ``EpochBatchSampler`` (batches an epoch).
        dtype: the autocast dtype (``hardware.amp_dtype``), None for full precision.
        prefetch: the BackgroundGenerator's depth (0: none).
    """
    device = procs.device
    accum = (config["virtual_batch_size"] or config["batch_size"]) // config["batch_size"]
    steps_per_epoch = -(-len(sampler) // accum)
    total_steps = steps_per_epoch * config["epochs"]
    if config["max_steps"]:
        total_steps = min(total_steps, config["max_steps"])
    return LoopSettings(
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
        timer=StepTimer(device), counters=Counters(device, config["grad_clip"]))


class Autocast(torch.nn.Module):
    """Runs ``module`` under ``torch.autocast(device_type, dtype)`` (nothing when ``dtype``
    is None). DataParallel wraps this: its replicas run in worker threads that re-enter
    autocast with the caller's enabled flag but not its dtype, so without it an
    ``--amp bf16`` run computes its replicas in float16 (CUDA's default), unscaled."""

    def __init__(self, module, device_type, dtype):
        super().__init__()
        self.module, self.device_type, self.dtype = module, device_type, dtype

    def forward(self, *args, **kwargs):
        if self.dtype is None:
            return self.module(*args, **kwargs)
        with torch.autocast(self.device_type, dtype=self.dtype):
            return self.module(*args, **kwargs)


def steps(model, loader, optimizer, task, loop, state, bar):
    """Trains from the sampler's position in the epoch; yields after every optimizer step.

    The caller decides what happens between steps (log, save, stop) and may stop early
    by leaving its ``for`` loop; close the generator (``contextlib.closing``) so that the
    prefetch thread stops at once. Each optimizer step takes ``loop.accum``
    micro-batches; every micro-batch's loss is weighted by its share of the step's
    samples (the last step of an epoch may have fewer), so the accumulated gradient is
    that of one batch of all of them. Under DDP, the micro-batches before the last skip
    the gradient all-reduce (``no_sync``).

    A task with ``phases`` (a GAN: the discriminator's, then the generator's) trains
    each phase's network with its own optimizer in turn, over all of the step's
    micro-batches (``_phase_steps``); one global step per batch all the same.

    Args:
        model: the (possibly wrapped) network; a task with phases: an ``nn.ModuleDict``
            of them, by name, each wrapped on its own.
        loader: a DataLoader whose batch_sampler is an EpochBatchSampler already set to
            this epoch and position.
        optimizer: the optimizer; its param groups carry ``base_lr``. A task with phases:
            an ``ops.Optimizers``, by network name.
        task: what a batch is and its loss (tasks/): ``to_device``, ``prepare``
            (MixUp/CutMix, before the step's clock) and ``loss`` (mean over the batch),
            each given the micro-batch's ``Where`` (``hooks``), or ``phases`` and
            ``phase_loss``.
        loop: the LoopSettings.
        state: the TrainState; ``step`` and ``epoch_samples`` advance here.
        bar: a progress display with ``update(n)`` (one per micro-batch).

    Yields:
        The number of optimizer steps taken so far (``state.step``).
    """
    device, accum, world, timer = loop.device, loop.accum, loop.world_size, loop.timer
    sampler = loader.batch_sampler
    plan = sampler.plan()  # (global, local) sample counts of each batch
    first_batch = sampler.start // (sampler.batch_size * sampler.world_size)  # of the epoch
    starts = [0, *itertools.accumulate(g for g, _ in plan)]  # each batch's first sample
    prepare, loss = hooks(task)  # each called with the micro-batch's ``Where``
    phases = task.phases  # None: one network, one optimizer
    held = []  # with phases: the step's micro-batches, each (x, y, local_n, where)
    if phases is not None:
        networks = _Networks(model)  # their parameters, listed once an epoch
    model.train()
    keep_frozen_norms_eval(model)
    batches = _Prefetcher(loader, loop.prefetch)
    doing, detail = _Doing("loading a batch", sampler.batch_size), None
    try:
        timer.start_data()
        for k, batch in enumerate(batches):
            global_n, local_n = plan[k]
            first = k - k % accum
            accum_n = starts[min(first + accum, len(plan))] - starts[first]
            last_micro_batch = k + 1 == min(first + accum, len(plan))
            where = _where(sampler, plan, starts, state.epoch, first, accum, k,
                           sampler.seed, first_batch + k)
            x, y = task.to_device(batch, device, loop.memory_format)
            x, y = ops.checked_batch(prepare(x, y, where), len(x))  # (MixUp, CutMix)
            timer.start_compute()
            if phases is not None:  # the step's micro-batches, trained phase by phase
                held.append((x, y, local_n, where))
                if last_micro_batch:
                    doing.now("a training phase", local_n)
                    _phase_steps(model, optimizer, task, loop, held, networks)
                    held = []
            else:
                _micro_batch(model, optimizer, loss, loop, x, y, where,
                             local_n * world / accum_n, last_micro_batch,
                             doing.now("the forward pass", local_n))
            if last_micro_batch:
                state.step += 1
                set_lr(optimizer, loop.lr_factor(state.step))
            timer.end_compute()
            state.epoch_samples += global_n
            bar.update(1)
            if last_micro_batch:
                yield state.step
            doing.now("loading a batch")
            timer.start_data()
    except (RuntimeError, MemoryError) as e:
        detail = memory_error(e)
        if detail is None:
            raise
        del e  # the frames of the failed step (and their tensors) go with it
    finally:
        batches.close()
    if detail is not None:  # raised here, outside the handler, so that memory is freed
        raise OutOfMemory(doing.phase, doing.batch_size, detail)


class _Doing:
    """What the step loop is doing (for an out-of-memory message): a phase of the step
    and the micro-batch's size."""

    def __init__(self, phase, batch_size):
        self.phase, self.batch_size = phase, batch_size

    def now(self, phase, batch_size=None):
        self.phase = phase
        self.batch_size = self.batch_size if batch_size is None else batch_size
        return self


def _micro_batch(model, optimizer, loss_of, loop, x, y, where, weight, last, doing):
    """One micro-batch of a one-network task (``where.count`` samples here): forward, the
    loss (``loss_of``: the task's, with ``where``) times ``weight`` (its share of the
    step's samples, times the processes: DDP averages gradients over them, so the sum over
    the accumulation is the mean over all of its samples, however they were split),
    backward (``no_sync`` but for the step's last micro-batch), and the optimizer step
    after the ``last``."""
    no_sync = loop.world_size > 1 and not last
    with model.no_sync() if no_sync else contextlib.nullcontext():
        with loop.autocast():
            loss = ops.checked_loss(loss_of(model, x, y, where))
        doing.now("the backward pass")
        loop.scaler.scale(loss * weight if weight != 1.0 else loss).backward()
    loop.counters.add_loss(loss, where.count)
    if last:
        doing.now("the optimizer step")
        _optimizer_step(model.parameters(), optimizer, loop)


def takes_where(method, plain):
    """Whether a task's hook takes the ``Where`` after its ``plain`` arguments: a parameter
    named ``where``, or one more positional parameter than ``plain`` (``prepare``'s older
    form, ``(x, y, epoch, batch)``, is told apart by its names)."""
    params = [p for p in inspect.signature(method).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in params]
    return "where" in names or (len(params) == plain + 1 and "epoch" not in names)


def hooks(task):
    """``(prepare, loss)``: the task's ``prepare`` and ``loss`` called as ``(x, y, where)``
    and ``(model, x, y, where)``, whichever form the task wrote: a task written before
    the ``Where`` (``prepare(x, y, epoch, batch)``, ``loss(model, x, y)``) keeps working.
    ``loss`` is None for a task of several networks (``phase_loss``)."""
    prepare = task.prepare
    if not takes_where(prepare, 2):
        prepare = functools.partial(_older_prepare, task.prepare)
    if task.phases is not None:
        return prepare, None
    loss = task.loss
    if not takes_where(loss, 3):
        loss = functools.partial(_older_loss, task.loss)
    return prepare, loss


def _older_prepare(prepare, x, y, where):
    """A ``prepare(x, y, epoch, batch)`` of before the ``Where``, called as the loop does."""
    return prepare(x, y, where.epoch, where.batch)


def _older_loss(loss, model, x, y, where):
    """A ``loss(model, x, y)`` of before the ``Where``, called as the loop does."""
    return loss(model, x, y)


def key(*parts):
    """One integer seed from integers (a run's seed, an epoch, a sample's position, a
    stream of one's own): the same on every process, run and resume (Python's ``hash`` of
    a string is salted per process: not that)."""
    k = 0
    for p in parts:
        k = k * 1_000_003 + int(p)
    return k % (2**63 - 1)


@dataclasses.dataclass(frozen=True)
class Where:
    """Where a micro-batch's samples stand in their optimizer step, for draws that must
    not depend on how the step was split (noise, a mask, a timestep, a GAN's latents).
    Every task's ``prepare`` and ``loss`` get one (``tasks.Where``).

    Draw the whole step's ``step_samples`` rows from ``generator(device)`` and keep the
    rows ``mine``: every micro-batch of every process draws the same rows, so 8 + 8
    accumulated, 2 processes of 8 and one batch of 16 draw exactly the same, and a resumed
    run what the whole run drew::

        noise = torch.randn(where.step_samples, *x.shape[1:], generator=where.generator(
            x.device), device=x.device)[where.mine]

    Fields: this process's samples are ``offset`` to ``offset + count`` of the step's
    ``step_samples`` (all processes, all micro-batches); the step starts at sample
    ``first`` of epoch ``epoch``'s order; ``seed`` is the run's --seed and ``batch`` the
    micro-batch's index in the epoch (what ``prepare(x, y, epoch, batch)`` got). ``repeat``
    is set by ``_phase_steps`` (a phase trained several times per step), and ``alone``
    when the micro-batch is its step's only one (what a phase makes may then be kept, with
    its graph, for a later phase of the same step)."""

    epoch: int
    first: int
    offset: int
    count: int
    step_samples: int
    seed: int = 0
    batch: int = 0
    repeat: int = 0
    alone: bool = False

    @property
    def mine(self):
        """This micro-batch's rows of the step's draws: ``slice(offset, offset + count)``."""
        return slice(self.offset, self.offset + self.count)

    def generator(self, device):
        """A new generator on ``device`` seeded from (seed, epoch, the step's first
        sample): the same for every micro-batch and every process of the step. Each call
        starts the stream again; a second stream of one's own: ``torch.Generator(device)
        .manual_seed(key(where.seed, where.epoch, where.first, STREAM))``."""
        return torch.Generator(device=device).manual_seed(key(self.seed, self.epoch,
                                                              self.first))


def _where(sampler, plan, starts, epoch, first, accum, k, seed=0, batch=0):
    """The ``Where`` of micro-batch ``k``, whose step's first micro-batch is ``first``
    (``starts``: each batch's first sample in the plan, and the plan's end): the sampler
    gives each process a contiguous share of every global batch (the last one's split as
    ``tensor_split`` splits it)."""
    global_n, local_n = plan[k]
    step_samples = starts[min(first + accum, len(plan))] - starts[first]
    rank, world = sampler.rank, sampler.world_size
    mine = rank * (global_n // world) + min(rank, global_n % world)
    return Where(epoch=epoch, first=sampler.start + starts[first],
                 offset=starts[k] - starts[first] + mine, count=local_n,
                 step_samples=step_samples, seed=seed, batch=batch)


class _Networks:
    """A task's networks by name (``model``: an ``nn.ModuleDict`` of wrapped networks), bare
    (``plain``) and their parameters (``params``), listed once for a run of steps: which
    tensors are parameters does not change within an epoch (--unfreeze-at switches only
    whether they require gradients)."""

    def __init__(self, model):
        self.plain = {name: bare(m) for name, m in model.items()}
        self.params = {name: list(m.parameters()) for name, m in self.plain.items()}


def _phase_steps(model, optimizer, task, loop, held, networks=None):
    """One optimizer step of each of the task's phases, in order, over the step's held
    micro-batches: each phase accumulates its loss, weighted by sample, over all of them
    (``no_sync`` but for the last), then clips and steps its own optimizer; a phase with
    ``repeats`` does so that many times. Only the phase's network gets gradients: the
    parameters of the networks earlier phases trained do not require them meanwhile (a
    GAN's discriminator, through which the generator's loss flows); a later phase's
    network may run with its graph kept for its own phase (the generator's images, which
    the discriminator's loss takes detached). Each network is called through its own DDP
    wrapper when it trains or keeps a graph, bare otherwise. ``kept`` is a scratch dict
    per micro-batch that the step's phases share (``task.phase_loss``'s last argument).
    One GradScaler scales every phase and is updated once, after the last (PyTorch's AMP
    recipe for several models and optimizers); a repeated phase (--d-steps 2) updates it
    between its steps too, as the GradScaler steps each optimizer once between updates.

    The training loss (``Counters.add_loss``) of a micro-batch is the sum of its phases'
    losses (a repeated phase's: their mean); each phase's own figures
    (``task.phase_loss``'s) and its network's gradient norm (``grad_norm_<network>``) are
    kept as figures. The step's gradient norm (train/grad_norm, --grad-clip's count) is the
    largest of its optimizer steps', and it counts as skipped (train/scaler_skips) where
    any of them was.
    """
    world, scaler = loop.world_size, loop.scaler
    total = sum(n for _, _, n, _ in held) * world  # the step's samples, all processes
    networks = networks or _Networks(model)
    plain, params = networks.plain, networks.params
    totals = [None] * len(held)  # each micro-batch's loss, summed over the phases
    kept = [{} for _ in held]  # what a phase leaves for a later one, per micro-batch
    stepped = set()  # the optimizers the scaler stepped since its last update
    norms, skips = [], []  # each optimizer step's gradient norm and skip
    earlier = set()  # the networks of the phases before this one
    off = set()  # the networks whose parameters do not require gradients now
    for phase in task.phases:
        now_off = earlier - {phase.network}  # gradients through them are not theirs
        for name in now_off ^ off:  # (only the switches that change)
            _requires_grad(params[name], name not in now_off)
        off = now_off
        wrapped = model[phase.network]
        for repeat in range(phase.repeats):
            if phase.network in stepped:  # a repeated phase: the scaler takes one step per
                scaler.update()             # optimizer between updates, made before this
                stepped.clear()             # repeat's backward: its step unscales by its scale
            for i, (x, y, local_n, where) in enumerate(held):
                where = dataclasses.replace(where, repeat=repeat, alone=len(held) == 1)
                no_sync = world > 1 and i + 1 < len(held)
                with wrapped.no_sync() if no_sync else contextlib.nullcontext():
                    with loop.autocast():
                        loss, figures = task.phase_loss(phase.network, model, plain, x, y,
                                                        where, kept[i])
                        ops.checked_loss(loss, "phase_loss")
                    weight = local_n * world / total
                    scaler.scale(loss * weight if weight != 1.0 else loss).backward()
                part = loss.detach().float()
                part = part / phase.repeats if phase.repeats > 1 else part
                totals[i] = part if totals[i] is None else totals[i] + part
                loop.counters.add_figures(figures, local_n)
            norm, skipped = _optimizer_step(params[phase.network],
                                            optimizer[phase.network], loop, update=False,
                                            counted=False)
            stepped.add(phase.network)
            loop.counters.add_figures({f"grad_norm_{phase.network}": norm}, 1)
            norms.append(norm.to(loop.device))
            skips.append(skipped)
        earlier.add(phase.network)
    for name in off:
        _requires_grad(params[name], True)
    scaler.update()
    # One training step, one gradient norm (clipped or not finite where any network's was:
    # its largest) and one skip (any optimizer's), as a one-network step counts them
    loop.counters.add_grad_norm(torch.stack(norms).max())
    if skips[0] is not None:
        loop.counters.skips += torch.stack(skips).any()
    for (_, _, local_n, _), loss in zip(held, totals):
        loop.counters.add_loss(loss, local_n)


def _requires_grad(params, flag):
    """``Module.requires_grad_`` on a network's parameters, listed once per step."""
    for p in params:
        p.requires_grad_(flag)


def train_one_epoch(model, loader, optimizer, task, loop, state):
    """``steps`` run to the end of the epoch, for scripts and tests that want a plain call;
    ``state`` (a ``TrainState``) advances in place."""
    bar = tqdm(total=len(loader.batch_sampler), disable=not loop.show_progress,
               leave=False, dynamic_ncols=True)
    try:
        with contextlib.closing(steps(model, loader, optimizer, task, loop, state,
                                      bar)) as each_step:
            for _ in each_step:
                pass
    finally:
        bar.close()


def bare(module):
    """The network inside its wrappers: torch.compile's, DDP's, DataParallel's."""
    while True:
        if hasattr(module, "_orig_mod"):  # torch.compile
            module = module._orig_mod
        elif isinstance(module, (torch.nn.parallel.DistributedDataParallel,
                                 torch.nn.DataParallel)):
            module = module.module
        else:
            return module


def _optimizer_step(params, optimizer, loop, update=True, counted=True):
    """Clips (--grad-clip) the gradients of ``params``, steps ``optimizer`` through the
    GradScaler, updates the scaler (unless ``update`` is off: the caller does, once for
    several optimizers) and clears the gradients. Returns the gradient norm (0-d, on the
    device, before clipping) and whether the scaler skipped the step (0-d on the device;
    None without fp16); ``counted``: both kept in ``loop.counters`` as the training step's
    (off: the caller keeps one figure for the step's several optimizers)."""
    scaler = loop.scaler
    params = list(params)
    if loop.grad_clip > 0:
        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
        norm = torch.nn.utils.clip_grad_norm_(params, loop.grad_clip)
    else:  # the norm of the scaled gradients, unscaled: the optimizer's path is unchanged
        norm = total_norm([p.grad for p in params if p.grad is not None])
        if scaler.is_enabled():
            norm = norm / scaler._scale  # (get_scale() would read it back: a sync)
    if counted:
        loop.counters.add_grad_norm(norm)
    scaler.step(optimizer)
    skipped = None
    if scaler.is_enabled():
        # No public API tells whether this step was skipped without a sync; the
        # per-device found-inf tensors stay on the device and are summed there.
        found = scaler._per_optimizer_states[id(optimizer)].get("found_inf_per_device")
        if found:
            skipped = sum(found.values()) > 0
            if counted:
                loop.counters.skips += skipped
    if update:
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return norm, skipped


def total_norm(grads):
    """The L2 norm of all ``grads`` together, on their device (no sync), as
    ``clip_grad_norm_`` computes it before clipping."""
    if not grads:
        return torch.zeros(())
    if hasattr(torch.nn.utils, "get_total_norm"):  # torch 2.6 and later
        return torch.nn.utils.get_total_norm(grads)
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))


@torch.no_grad()
def evaluate(model, loader, loop, task, tta=False):
    """Evaluates on ``loader`` (this process's shard), summed over all processes.

    Args:
        model: the network (switched to eval mode here).
        loader: batches the task reads (``task.to_device``).
        loop: the LoopSettings (device, autocast, memory format, world size).
        task: what a batch is, its prediction and its figures (tasks.py):
            ``predict``, ``evaluation`` (the sums, counted on the device).
        tta: ``task.predict``'s test-time augmentation (--tta flip).

    Returns:
        The task's result dict (classification: ``loss``, ``acc``, ``count``,
        ``confusion`` and, with more than 5 classes, ``acc5``).
    """
    model.eval()
    device = loop.device
    evaluation = task.evaluation(device, model)  # a tasks.Evaluation (torchmetrics)
    if not (callable(getattr(evaluation, "update", None)) and
            callable(getattr(evaluation, "compute", None))):  # (a dict has an update)
        raise UserError(f"the task's evaluation returned a {type(evaluation).__name__}, not "
                        f"a tasks.Evaluation (update(outputs, targets, inputs) per batch, "
                        f"compute() the figures)")
    for batch in loader:
        x, y = task.to_device(batch, device, loop.memory_format)
        evaluation.update(_forward_or_out_of_memory(task, model, x, loop, tta), y, x)
    return evaluation.compute()  # reduced over the processes first


def _forward_or_out_of_memory(task, model, x, loop, tta):
    """evaluate's forward pass; running out of memory in it is an ``OutOfMemory``."""
    try:
        with loop.autocast():
            return task.predict(model, x, tta)
    except (RuntimeError, MemoryError) as e:
        detail = memory_error(e)
        if detail is None:
            raise
    raise OutOfMemory("evaluation", len(x), detail)  # outside: the frames are freed


def check_figures(task, *results, best=True):
    """A validation's figures, as the run uses them: each of ``task.figures`` an
    evaluation returned is a number, and (``best``) the task's ``best`` figure is among
    them, in one of ``results`` (the network's evaluation, the moving average's; None:
    not made). A user's task that breaks this fails at its first validation, or at
    --preflight's, in one line (review 6's F3), not in a KeyError or TensorBoard's
    ValueError after an epoch.

    Raises:
        UserError: naming the figure, and the ones the task gave.
    """
    made = [result for result in results if result is not None]
    for result in made:
        if not isinstance(result, dict):
            raise UserError(f"the task's evaluation returned a {type(result).__name__}, not "
                            f"a dict of its figures ({', '.join(task.figures)})")
        for name in task.figures:
            value = result.get(name)
            if name in result and (isinstance(value, bool) or
                                   not isinstance(value, numbers.Real)):
                raise UserError(f"the task's figure {name!r} is {value!r} (a "
                                f"{type(value).__name__}), not a number: its Evaluation's "
                                f"compute() must return numbers (float(...))")
    if not best or task.best is None or not made:
        return
    if task.best not in task.figures:
        raise UserError(f"the task's best figure {task.best!r} is not one of its figures "
                        f"({', '.join(task.figures) or 'none'}): add it to figures")
    if not any(task.best in result for result in made):
        gave = ", ".join(dict.fromkeys(key for result in made for key in result)) or "none"
        raise UserError(f"the task's figures lack {task.best!r} (its best figure; it "
                        f"returned {gave})")

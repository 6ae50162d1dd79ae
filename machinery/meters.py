"""The loop's running figures: ``Counters``, the sums the training step adds to on the
device (losses, non-finite streaks, gradient norms and clips, a task's own figures), read
in one transfer only when logging or saving; ``LossMeter``, the log window's loss, gradient
norm and throughput read from them into the run's epoch sums (engine.TrainState), and where
a window's first non-finite value was (replay.py).
"""

import math
import time

import torch
import torch.distributed as dist

import ops

FOLD_NORMS = 64  # Counters keeps at most this many per-step entries as tensors, then folds


class Counters:
    """Running sums kept on the device and read (one transfer) only when logging or saving.

    Per micro-batch and per optimizer step they only keep what they are given in lists (a
    task's figures: one ``stack``; no kernel else, no sync); every ``FOLD_NORMS`` entries
    a list is folded into sums on the device, a few kernels for all of them, so a long
    --log-every keeps few tensors alive. The sums are float64 sums of float32 (or
    narrower) values times sample counts: exact in any realistic window, so folding them
    together gives the bits one-by-one adding gives.

    Args:
        device: where the sums live.
        clip: --grad-clip (0: off), to count the steps it clipped.
    """

    def __init__(self, device, clip=0.0):
        self.device, self.clip = device, clip
        self.streak = torch.zeros((), device=device, dtype=torch.long)
        self.reset()

    def reset(self):
        self.loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        self.loss_count = torch.zeros((), device=self.device, dtype=torch.float64)
        self.samples = 0
        self.worst = torch.zeros((), device=self.device, dtype=torch.long)
        self.skips = torch.zeros((), device=self.device)
        self.grad_norms = []  # the latest steps' norms, 0-d tensors on the device ...
        self.losses = []      # ... the latest micro-batches' mean losses (0-d) ...
        self.loss_counts = []  # ... and their samples ...
        self.kept_figures = []  # ... and the latest calls' figures: (names, values, count)
        # ... and the earlier ones', folded in: the finite norms' sum, their count, the
        # clipped, the index of the first non-finite norm and of the first non-finite loss
        # (NONE_YET while there is none)
        self.folded = torch.tensor([0.0, 0.0, 0.0, NONE_YET, NONE_YET], device=self.device,
                                   dtype=torch.float64)
        self.steps = self.micro_batches = 0  # since the last read
        # a task's own figures (a GAN's loss_d, ...), kept by the names of each call:
        # (names) -> (finite sums, counts), 1-d tensors in the names' order
        self.figures = {}

    def add_figures(self, figures, count):
        """Keeps a micro-batch's figures (0-d tensors, means over its ``count`` samples; a
        GAN's ``loss_d``, ``d_real``, ...) for their sums, made on the device when folded;
        a non-finite one adds nothing then (its mean is that of the finite ones)."""
        if not figures:
            return
        values = torch.stack(list(figures.values())).detach()  # (a copy: one kernel)
        self.kept_figures.append((tuple(figures), values, count))
        if len(self.kept_figures) >= FOLD_NORMS:
            self._fold()

    def add_loss(self, loss, count):
        """Keeps a batch's mean loss for ``count`` samples (a list append, no kernel).

        A non-finite loss adds nothing to the sums (the mean stays the mean of the
        finite ones) and lengthens the streak of non-finite losses.
        """
        self.losses.append(loss.detach())
        self.loss_counts.append(count)
        self.samples += count
        self.micro_batches += 1
        if len(self.losses) >= FOLD_NORMS:
            self._fold()

    def add_grad_norm(self, norm):
        """Keeps an optimizer step's total gradient norm (before clipping): a list append
        per step, no kernel; every ``FOLD_NORMS`` steps they are summed on the device (a
        few kernels, no sync)."""
        self.grad_norms.append(norm.detach())
        self.steps += 1
        if len(self.grad_norms) >= FOLD_NORMS:
            self._fold()

    def _fold(self):
        """Folds the kept norms, losses and figures into sums on the device: the
        non-finite norms (an fp16 step the GradScaler skipped) left out of the sum and
        count and not counted as clipped, the non-finite losses and figures out of theirs;
        the first non-finite norm's and loss's index kept, and the streaks of non-finite
        losses carried on."""
        parts = []
        if self.grad_norms:
            norms = torch.stack(self.grad_norms).double()
            finite = torch.isfinite(norms)
            clipped = finite & (norms > self.clip) if self.clip > 0 else \
                torch.zeros_like(finite)
            first = self.steps - len(self.grad_norms)  # the index of norms[0]
            parts.append((torch.stack([torch.where(finite, norms, 0.0).sum(),
                                       finite.sum().double(), clipped.sum().double()]),
                          _first_false(finite, first), 3))
            self.grad_norms = []
        if self.losses:
            losses = torch.stack(self.losses).double()  # (any float dtype: exact)
            counts = self._counts(self.loss_counts)
            finite = torch.isfinite(losses)
            self.loss_sum += torch.where(finite, losses * counts, 0.0).sum()
            self.loss_count += (finite * counts).sum()
            self.streak, worst = _streaks(finite, self.streak)
            self.worst = torch.maximum(self.worst, worst)
            first = self.micro_batches - len(self.losses)
            parts.append((None, _first_false(finite, first), 4))
            self.losses, self.loss_counts = [], []
        for sums, bad, at in parts:
            if sums is not None:
                self.folded[:3] += sums
            self.folded[at] = torch.minimum(self.folded[at], bad)
        groups = {}  # the kept figures by their names, in the order first kept
        for names, values, count in self.kept_figures:
            rows, counts = groups.setdefault(names, ([], []))
            rows.append(values)
            counts.append(count)
        for names, (rows, counts) in groups.items():
            values = torch.stack(rows).double()  # (calls, names)
            finite = torch.isfinite(values)
            counts = self._counts(counts)[:, None]
            total, n = self.figures.get(names, (0.0, 0.0))
            self.figures[names] = (total + torch.where(finite, values * counts, 0.0).sum(0),
                                   n + (finite * counts).sum(0))
        self.kept_figures = []

    def _counts(self, counts):
        """Sample counts as a float64 tensor on the device (exact: whole numbers), copied
        from pinned memory on CUDA: a pageable copy may wait for the queued kernels (the
        CUDA review's L3)."""
        return ops.from_host(torch.tensor(counts, dtype=torch.float64), self.device)

    def read(self):
        """Returns the sums since the last read as numbers (one read from the device),
        and starts new ones.

        Returns:
            A dict with ``loss_sum`` and ``loss_count`` (finite losses only),
            ``samples`` (all), ``worst_streak`` (longest run of non-finite losses),
            ``streak`` (the current one), ``scaler_skips``, and the gradient norms:
            ``grad_norm_sum`` over ``grad_norm_count`` steps, ``grad_clipped`` of them
            above the clip (--grad-clip). Where the first non-finite value was (replay.py):
            ``micro_batches`` and ``steps`` since the last read, ``first_nonfinite_loss``
            (a micro-batch's index among them) and ``first_nonfinite_grad_norm`` (an
            optimizer step's), each None when all were finite. ``figures``: the task's own
            figures (``add_figures``), name -> (finite sum, count).
        """
        self._fold()
        groups = list(self.figures.items())
        figures = [torch.as_tensor(v, device=self.device, dtype=torch.float64).reshape(-1)
                   for _, held in groups for v in held]
        (loss_sum, loss_count, worst, streak, skips, grad_sum, grad_count, clipped,
         first_grad, first_loss, *figure_values) = torch.cat([torch.stack([t.double() for t in (
             self.loss_sum, self.loss_count, self.worst, self.streak, self.skips)]),
             self.folded, *figures]).tolist()
        values = {"loss_sum": loss_sum, "loss_count": int(loss_count),
                  "samples": self.samples, "worst_streak": int(worst),
                  "streak": int(streak), "scaler_skips": int(skips),
                  "grad_norm_sum": grad_sum, "grad_norm_count": int(grad_count),
                  "grad_clipped": int(clipped), "micro_batches": self.micro_batches,
                  "steps": self.steps,
                  "first_nonfinite_grad_norm": None if first_grad == NONE_YET
                  else int(first_grad),
                  "first_nonfinite_loss": None if first_loss == NONE_YET else int(first_loss),
                  "figures": _by_name(groups, figure_values)}
        self.reset()
        return values


def _by_name(groups, values):
    """``Counters.read``'s figures, name -> (finite sum, count), sorted by name, from the
    groups' sums and counts read back in one list (``values``: each group's sums, then
    its counts); a name kept in several groups adds them."""
    out, at = {}, 0
    for names, _ in groups:
        k = len(names)
        for name, total, count in zip(names, values[at:at + k], values[at + k:at + 2 * k]):
            before = out.get(name, (0.0, 0.0))
            out[name] = (before[0] + total, before[1] + count)
        at += 2 * k
    return dict(sorted(out.items()))


NONE_YET = 2.0 ** 52  # Counters' "no non-finite value yet" (an index no window reaches)


def _streaks(finite, streak):
    """The streak of non-finite losses after a run of ``finite`` flags (1-d bool) that
    follows a streak of ``streak`` (0-d long), and the longest streak within the run:
    ``streak = 0 if finite else streak + 1`` after each flag, all at once on the device."""
    index = torch.arange(len(finite), device=finite.device)
    last = torch.where(finite, index, -1).cummax(0).values  # the latest finite one so far
    streaks = torch.where(last >= 0, index - last, streak + index + 1)
    return streaks[-1], streaks.max()


def _first_false(flags, offset=0):
    """``offset`` plus the index of the first False in a 1-d bool tensor, or ``NONE_YET``:
    a 0-d float64 tensor on its device (no sync)."""
    index = torch.arange(len(flags), device=flags.device, dtype=torch.float64) + offset
    return torch.where(flags, NONE_YET, index).min()


class LossMeter:
    """The training loss and throughput since the last log, read from the counters.

    ``collect`` moves the device counters into the run's epoch sums (``TrainState``) and
    into this window; ``restart`` begins a new window after a log.

    Args:
        counters: the loop's ``Counters``.
        world_size: number of processes (samples/s counts all of them).
    """

    def __init__(self, counters, world_size=1):
        self.counters, self.world_size = counters, world_size
        self.nonfinite = None  # set by collect
        self.restart()

    def restart(self, step=0):
        """Begins a new window after optimizer step ``step``."""
        self.loss_sum, self.loss_count, self.samples = 0.0, 0, 0
        self.grad_norm_sum, self.grad_norm_count, self.grad_clipped = 0.0, 0, 0
        self.figure_sums = {}  # the task's own figures (a GAN's loss_d, ...): (sum, count)
        self.since, self.step = time.perf_counter(), step

    def collect(self, state):
        """Reads the counters (one sync) into ``state`` and the window.

        Returns:
            ``(streak, worst_streak)`` of non-finite losses, the worst over all
            processes: every process must take the same decision (skip a save, stop).
            ``self.nonfinite`` then says where the first non-finite loss (any process)
            or gradient norm of the window was, or is None.
        """
        values = self.counters.read()
        streaks = (values["streak"], values["worst_streak"])
        first_loss = values["first_nonfinite_loss"]
        if self.world_size > 1:  # the first bad micro-batch of any process rides along
            both = torch.tensor([*streaks, -(first_loss if first_loss is not None else 2**62)],
                                device=self.counters.device)
            dist.all_reduce(both, op=dist.ReduceOp.MAX)
            streaks = (int(both[0]), int(both[1]))
            first_loss = -int(both[2]) if int(both[2]) > -2**62 else None
        self.nonfinite = None  # where the window's first non-finite value was (replay.py)
        if first_loss is not None or values["first_nonfinite_grad_norm"] is not None:
            self.nonfinite = {"micro_batches": values["micro_batches"],
                              "steps": values["steps"], "loss": first_loss,
                              "grad_norm": values["first_nonfinite_grad_norm"]}
        state.loss_sum += values["loss_sum"]
        state.loss_count += values["loss_count"]
        state.scaler_skips += values["scaler_skips"]
        for key in ("grad_norm_sum", "grad_norm_count", "grad_clipped"):
            # the same on every process (the gradients are all-reduced): not summed over them
            setattr(state, key, getattr(state, key) + values[key])
            setattr(self, key, getattr(self, key) + values[key])
        self.loss_sum += values["loss_sum"]
        self.loss_count += values["loss_count"]
        self.samples += values["samples"]
        for name, (total, count) in values["figures"].items():
            for sums in (self.figure_sums, state.figures):
                before = sums.get(name, (0.0, 0))
                sums[name] = (before[0] + total, before[1] + int(count))
        return streaks

    def figures(self):
        """The means of the task's own figures since the window began (this process's),
        by name."""
        return {name: total / count if count else math.nan
                for name, (total, count) in self.figure_sums.items()}

    def pending(self, state):
        """Whether optimizer steps were taken since the window began (the same answer on
        every process, so they all log, and all-reduce, together)."""
        return state.step > self.step

    def mean(self):
        return self.loss_sum / self.loss_count if self.loss_count else math.nan

    def grad_norm(self):
        """The mean total gradient norm (before clipping) of the window's steps."""
        return self.grad_norm_sum / self.grad_norm_count if self.grad_norm_count else math.nan

    def rate(self):
        """Samples per second (all processes) since the window began."""
        return self.samples * self.world_size / max(time.perf_counter() - self.since, 1e-9)

"""The training checkpoint: what a run saves (``training_state``), the ``Saver`` that
writes last.pt, best.pt and the rotating epoch-/step- files (in the background, never a
non-finite state), and what a resume reads back (the networks and optimizers by name, the
moving average, every process's RNG states, the checks of the thread count and the data).
The file format itself (atomic, checksummed, safe to load, rotated) is checkpoint.py's.
"""

import enum
import os
import random
from collections.abc import Mapping

import numpy as np
import torch
import torch.distributed as dist

import ops
from machinery import param_groups
from machinery.checkpoint import (
    FORMAT_VERSION,
    PROJECT_VERSION,
    SINGLE_FORMAT,
    BackgroundWriter,
    check_compatible,
    load_checkpoint,
    require,
    to_cpu,
    unwrap_state_dict,
)
from machinery.runtime import main_print
from ops import RunFailed, UserError


def saved_networks(saved, net):
    """``(module, weights)`` for each network of ``net`` in a training checkpoint: the one
    (``model``), or each of an ``nn.ModuleDict`` by name (``networks``, format 3).

    Raises:
        UserError: the checkpoint holds one network and ``net`` is several, or the other
            way round, or lacks one of ``net``'s by name (one line naming them).
    """
    if isinstance(net, torch.nn.ModuleDict):
        stored = saved.get("networks")
        if not isinstance(stored, Mapping) or set(stored) != set(net.keys()):
            raise UserError(f"the checkpoint holds {sorted(stored) if stored else 'one network'}"
                            f"; this run trains {', '.join(net.keys())} (another --task?)")
        return [(module, unwrap_state_dict(stored[name])) for name, module in net.items()]
    if "model" not in saved:
        raise UserError(f"the checkpoint holds the networks {', '.join(saved['networks'])} "
                        f"(a --task {saved.get('config', {}).get('task', '?')} run); this run "
                        f"trains one network")
    return [(net, unwrap_state_dict(saved["model"]))]


def saved_optimizers(saved):
    """The optimizer state of a training checkpoint: of several networks (``optimizers``,
    format 3, by name) or of one (``optimizer``)."""
    return saved["optimizers" if "networks" in saved else "optimizer"]


def saved_ema(saved, averaged=None):
    """The moving average's weights in a training checkpoint: under the averaged
    network's name ``averaged`` (the task's ``averaged_name``, a GAN's generator) when
    there is one, else the whole model's."""
    return saved["ema"][averaged] if averaged is not None else saved["ema"]


def rng_state():
    """The RNG states of python, numpy, torch CPU and every CUDA device, as plain types
    (and tensors), so that they load with ``weights_only=True``."""
    version, mt, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state = {
        "python": {"version": version, "state": list(mt), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)),
                  "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state):
    """Restores what ``rng_state`` returned."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"]), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"],
                         n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        devices = min(len(state["cuda"]), torch.cuda.device_count())
        torch.cuda.set_rng_state_all(state["cuda"][:devices])


def check_same_threads(saved, path, device, warn=print):
    """On the CPU a kernel's reduction order follows the thread count: a run resumed with
    another count than its checkpoint's ends about 1e-3 away from the run that never
    stopped. Says so, with the setting that restores it (torchrun sets one a process)."""
    before, now = saved.get("threads"), torch.get_num_threads()
    if device.type != "cpu" or before is None or before == now:
        return
    warn(f"warning: {path!r} was trained with {before} CPU thread(s) per process, this "
         f"run has {now}: its kernels add up in another order, so it will not end bit for "
         f"bit as the run that never stopped; OMP_NUM_THREADS={before} restores it")


def check_same_data(saved, path, identity, warn=print):
    """Says, in one line, when a run resumes onto another training set than the one its
    checkpoint was trained on: the epoch's order and the augmentation then follow the new
    set, so the run is no longer the one that never stopped. It continues."""
    before = saved.get("data", {}).get("train")
    now = identity["train"]
    if before is None or before == now:
        return
    change = f"{before['size']} samples then, {now['size']} now" \
        if before["size"] != now["size"] else f"{now['size']} samples, other files"
    warn(f"warning: the training set is not the one {path!r} was trained on ({change}): "
         f"the rest of the run follows the new set, so it will not end as the run that "
         f"never stopped would have; continuing")


# ------------------------------------------------------------ the training checkpoint

class Kind(enum.Enum):
    """Why a checkpoint is saved; EPOCH and STEP saves also write a rotating file."""

    EPOCH = "epoch"  # at the end of an epoch: last.pt (best.pt), epoch-NNNN.pt
    STEP = "step"    # every --ckpt-every-steps: last.pt, step-NNNNNNNN.pt
    STOP = "stop"    # a signal or --max-steps inside an epoch: last.pt


def training_state(net, optimizer, scaler, progress, rngs, config, ema=None, data=None,
                   averaged=None):
    """The checkpoint dict of a training run: what exact resumption needs.

    Args:
        net: the plain network (no DDP/DataParallel/compile wrapper), or several in an
            ``nn.ModuleDict`` (a GAN's), saved by name (``networks``, format 3).
        optimizer: its optimizer (by name: an ``ops.Optimizers``).
        scaler: the GradScaler (enabled or not).
        progress: ``TrainState.state_dict()``, loss sums summed over processes.
        rngs: ``rng_state()`` of every process, by rank.
        config: the resolved config.
        ema: the ``recipes.EMA`` of the weights, or None.
        data: ``{"train": data.set_identity(train_set)}`` (a resume onto another set says
            so), or None.
        averaged: the name of the network the EMA averages (the task's
            ``averaged_name``): its average is saved under ``ema[averaged]``; None: the
            whole model's, as ``ema``.

    Returns:
        A dict of tensors and plain values (``weights_only``-loadable once saved).
    """
    by_name = isinstance(net, torch.nn.ModuleDict)  # several networks (a GAN's): format 3
    state = {
        "format": FORMAT_VERSION if by_name else SINGLE_FORMAT,
        "version": PROJECT_VERSION,
        "threads": torch.get_num_threads(),  # CPU kernels reduce in an order of their own
        **({"networks": {name: unwrap_state_dict(module.state_dict())
                         for name, module in net.items()},
            "optimizers": optimizer.state_dict()} if by_name else
           {"model": unwrap_state_dict(net.state_dict()),
            "optimizer": optimizer.state_dict()}),
        "scaler": scaler.state_dict(),
        "scheduler": {"step": progress["step"]},  # the LR is a function of the step
        "epoch": progress["epoch"],
        "step": progress["step"],
        "progress": progress,
        "rng": rngs[0],
        "rng_per_rank": rngs,
        "config": {k: v for k, v in config.items() if k not in ("resume",)},
    }
    if ema is not None:  # the model's keys; by name, the averaged network's (a generator)
        state["ema"] = ema.state_dict() if averaged is None else {averaged: ema.state_dict()}
    if data is not None:
        state["data"] = data
    return state


class Saver:
    """Writes checkpoints: last.pt, best.pt and rotating epoch-/step- files.

    Every process calls ``save``; the main process writes, in a background thread, from
    a CPU copy. Non-finite weights are never saved: the run stops instead, and names
    the last good checkpoint.

    Args:
        run_dir: the run directory (checkpoints go into its ``checkpoints/``).
        config: the resolved config (saved in every checkpoint).
        net, optimizer, scaler: what is saved.
        ema: the ``recipes.EMA`` (saved under ``ema``), or None.
        state: the run's ``engine.TrainState``.
        procs: ``runtime.Processes``.
        last_saved: the checkpoint resumed from, if any.
        data: what the checkpoint records of the data (``training_state``'s ``data``).
        averaged: the name of the network the EMA averages (``training_state``'s).
    """

    def __init__(self, run_dir, config, net, optimizer, scaler, state, procs, last_saved,
                 ema=None, data=None, averaged=None):
        self.dir = os.path.join(run_dir, "checkpoints")
        self.config, self.net, self.optimizer, self.scaler = config, net, optimizer, scaler
        self.state, self.procs, self.ema, self.data = state, procs, ema, data
        self.averaged = averaged  # the task's averaged_name (training_state)
        self.last_saved = last_saved
        self.mlflow_run_id = None  # --mlflow: kept in every checkpoint (tracking.py)
        self.writer = BackgroundWriter()
        if procs.is_main:  # temporary files of a save that was killed half-way
            for name in os.listdir(self.dir):
                if name.startswith(".tmp-"):
                    os.unlink(os.path.join(self.dir, name))
        for name in ("last.pt", "best.pt"):  # found now, not at the first save
            path = os.path.join(self.dir, name)
            if os.path.isdir(path):
                raise UserError(f"{path!r} is a directory: a checkpoint cannot be written "
                                f"there; move it away")

    def save(self, kind, best=False):
        """Saves the state as of the last optimizer step (all processes call this).

        Args:
            kind: a ``Kind``.
            best: also write best.pt.
        """
        self.poll()
        self.check_weights()
        progress = self.state.state_dict()
        rngs = [rng_state()]
        if self.procs.world_size > 1:  # the epoch's loss sums, over all processes
            loss_sum, loss_count = ops.sum_over_processes(
                [progress["loss_sum"], progress["loss_count"]], self.procs.device,
                self.procs.world_size)
            progress.update(loss_sum=loss_sum, loss_count=int(loss_count))
            if "figures" in progress:  # a GAN's loss_d, ...: (sum, count) each
                names = sorted(progress["figures"])
                flat = ops.sum_over_processes(
                    [v for name in names for v in progress["figures"][name]],
                    self.procs.device, self.procs.world_size)
                progress["figures"] = {name: (flat[2 * i], flat[2 * i + 1])
                                       for i, name in enumerate(names)}
            rngs = [None] * self.procs.world_size
            dist.all_gather_object(rngs, rng_state())
        path = os.path.join(self.dir, "last.pt")
        if not self.procs.is_main:
            self.last_saved = path  # what the main process writes
            return
        state = training_state(self.net, self.optimizer, self.scaler, progress, rngs,
                               self.config, self.ema, self.data, self.averaged)
        if self.mlflow_run_id:  # a resumed run continues this MLflow run
            state["mlflow_run_id"] = self.mlflow_run_id
        also = [os.path.join(self.dir, "best.pt")] if best else []
        if self.config["keep_last"] > 0 and kind is not Kind.STOP:
            name = f"epoch-{progress['epoch']:04d}.pt" if kind is Kind.EPOCH \
                else f"step-{progress['step']:08d}.pt"
            also.append(os.path.join(self.dir, name))
        # Training goes on while a thread writes a private CPU copy of the state.
        self._failing(self.writer.submit, to_cpu(state), path, also,
                      keep_last=self.config["keep_last"])
        self.last_saved = path

    def check_weights(self):
        """Stops the run when a weight or buffer is NaN or infinite: such a state is never
        saved (the loss is computed before the update, so it may still look fine)."""
        tensors = [t for t in self.net.state_dict().values() if t.is_floating_point()]
        if self.ema is not None:
            tensors += [t for t in self.ema.state_dict().values() if t.is_floating_point()]
        if not torch.stack([torch.isfinite(t).all() for t in tensors]).all():
            raise RunFailed(
                f"the weights are not finite at step {self.state.step}; lower --lr or add "
                f"--grad-clip. The last good checkpoint is {self.last_saved or 'none'}")

    def poll(self):
        """Raises now if the last write failed in the background (say, a full disk)."""
        if self.procs.is_main and self.writer.done():
            self.wait()

    def wait(self):
        """Waits for the checkpoint being written (re-raising a failed write's error)."""
        if self.procs.is_main:
            self._failing(self.writer.wait)

    def _failing(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except OSError as e:
            raise RunFailed(f"writing a checkpoint into {self.dir!r} failed ({e}); the "
                            f"files there are the last complete ones") from None


def resume_file(resume):
    """The checkpoint that ``--resume PATH`` names, loaded: ``(path, state)``; Nones for
    ``--resume auto`` (found later, in the run directory) or no --resume."""
    if resume in (None, "auto"):
        return None, None
    state = load_checkpoint(resume)
    if "model" not in state and "networks" not in state:  # a plain state_dict
        raise UserError(f"{resume!r} is not a training checkpoint of this project "
                        f"(use --pretrained for plain weights)")
    require(state, resume)  # one line naming what it lacks
    return resume, state


def restore(saved, path, net, ema, optimizer, scaler, state, config, procs, task):
    """Loads a checkpoint's state into the freshly built objects (a model of several
    networks and its optimizers: by name). ``task``: what the EMA averages
    (``task.averaged``) and under which name (``task.averaged_name``)."""
    for module, weights in saved_networks(saved, net):  # by name, for several
        check_compatible(module, weights, path)
        module.load_state_dict(weights)
    if ema is not None and "ema" in saved:
        ema.load_state_dict(saved_ema(saved, task.averaged_name), path)
    elif ema is not None:  # EMA turned on for a run that had none: start from the weights
        ema.load_state_dict(task.averaged(net).state_dict(), path)
        main_print(f"note: {path!r} has no moving average; it starts from the "
                           f"restored weights")
    state.load_state_dict(saved["progress"])
    changed = [k for k in task.best_depends_on if saved["config"].get(k) != config.get(k)]
    if changed:  # another --fid-features: its FID is no other's
        state.forget_best()
        main_print(f"note: --{changed[0].replace('_', '-')} changed since {path!r}: "
                           f"its {task.best} cannot be compared with the checkpoint's best; "
                           f"best.pt starts afresh")
    if procs.rank != 0:  # the epoch's partial loss sums are global; count them once
        state.loss_sum, state.loss_count = 0.0, 0
    if ops.unfrozen_at_resume(config, state):
        param_groups.unfreeze_into(net, optimizer, config)  # it happened before the save
    param_groups.check_resume(saved_optimizers(saved), optimizer, path)  # the same groups
    try:
        optimizer.load_state_dict(saved_optimizers(saved))
    except (ValueError, KeyError) as e:
        raise UserError(f"the optimizer state in {path!r} does not fit "
                        f"(--optimizer or --freeze changed?): {e}") from None
    ops.set_hyperparameters(optimizer, config)  # the config's, maybe overridden, not the saved
    ops.place_fused_steps(optimizer)  # fused now, maybe not when saved
    if saved.get("scaler"):
        scaler.load_state_dict(saved["scaler"])
    rngs = saved.get("rng_per_rank") or [saved["rng"]]
    set_rng_state(rngs[procs.rank] if len(rngs) == procs.world_size else rngs[0])

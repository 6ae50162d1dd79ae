"""Every figure a run reports, by name: TensorBoard tags, metrics.jsonl keys, the epoch line.

One module spells them, as torchtitan's MetricsProcessor does: train.py hands the raw
figures here (losses, timings, validation results) and gets back dicts keyed by tag or
by metrics.jsonl key, which runlog.py writes. A tag or a key is spelled once, below.

TensorBoard scalars (``scalars`` dicts: tag -> value):

    train/loss, train/lr, train/scaler_skips (fp16)      every --log-every steps
    train/grad_norm, train/grad_clipped (--grad-clip)    (the means/counts since the last)
    train/loss_d, train/loss_g, train/d_real,            a GAN's (--task gan), the same
    train/d_fake, train/gradient_penalty (wgan-gp),      way
    train/grad_norm_discriminator, _generator            (train/grad_norm: each step's
                                                         largest; scaler_skips: steps)
    val/fid, val/kid (val/fid_classifier, ...);          a GAN's, at each validation
    val/samples (image); val_ema/* (EMA generator)
    val/loss, val/acc, val/acc5 (over 5 classes);       at each validation
    val_ema/loss, val_ema/acc, val_ema/acc5 (EMA)
    val/confusion, val_ema/confusion (images)
    z_perf/compute_efficiency, z_perf/samples_per_sec,   at each epoch's end (named to
    z_perf/tflops, z_perf/mfu (known GPUs)                sort after train and val)
    the hparams, their metrics the curves above           when the run finishes
    z_lr_find/loss (smoothed), z_lr_find/lr;             --find-lr (lr_finder.py)
    image z_lr_find/plot

metrics.jsonl: one ``epoch_record`` per finished epoch (docs/design.md lists its keys).
"""

import math
import os

import ops
from machinery import engine

# TensorBoard tags
TRAIN_LOSS, TRAIN_LR, SCALER_SKIPS = "train/loss", "train/lr", "train/scaler_skips"
GRAD_NORM, GRAD_CLIPPED = "train/grad_norm", "train/grad_clipped"
FIRST_BATCH = "z_data/first_batch"  # the first training batch as the network sees it
# --find-lr (x: the sweep's step); after train and val when a real run shares the directory
LR_FIND_LOSS, LR_FIND_LR = "z_lr_find/loss", "z_lr_find/lr"
LR_FIND_PLOT = "z_lr_find/plot"  # the image of lr_find.png
# TensorBoard's Time Series page sorts its groups by name and opens the first two: train
# and val (the loss and accuracy curves) must be those, so the other groups sort last.
PERF_TAGS = {"compute_efficiency": "z_perf/compute_efficiency",
             "samples_per_sec": "z_perf/samples_per_sec", "tflops": "z_perf/tflops",
             "mfu": "z_perf/mfu"}

# The figures a finished run reports with its hyper-parameters (TensorBoard's HPARAMS tab),
# each the last value of its curve (no scalars of their own: those would make a group of
# one-point charts at the top of the Time Series page): the training loss, and the
# validation loss and the figure best.pt follows (the task's), raw and EMA.


def train_scalars(loss, lr, scaler_skips=None, grad_norm=None, grad_clipped=None):
    """The scalars of a log step: the mean training loss since the last log, the learning
    rate, the mean total gradient norm (before clipping) since the last log, and, when on,
    the steps --grad-clip clipped since then and (fp16) the steps the GradScaler skipped so
    far."""
    scalars = {TRAIN_LOSS: loss, TRAIN_LR: lr}
    if grad_norm is not None and grad_norm == grad_norm:  # (nan: no finite norm to show)
        scalars[GRAD_NORM] = grad_norm
    if grad_clipped is not None:
        scalars[GRAD_CLIPPED] = grad_clipped
    if scaler_skips is not None:
        scalars[SCALER_SKIPS] = scaler_skips
    return scalars


def validation_tag(figure, suffix=""):
    """The TensorBoard tag of a validation figure: ``val/<figure>``, or with the suffix
    ``_ema`` (the moving average's) ``val_ema/<figure>``."""
    return f"val{suffix}/{figure}"


def validation_figures(task, result, ema_result=None):
    """The metrics.jsonl figures of a validation: ``val_<figure>`` for each of the task's
    figures in ``result`` (classification: ``val_loss``, ``val_acc``, ``val_acc5`` with
    more than 5 classes) and, with EMA, the same with ``_ema`` (from ``engine.evaluate``'s
    dicts), checked first (``engine.check_figures``: numbers, the best among them)."""
    engine.check_figures(task, result, ema_result)
    figures = {f"val_{f}": result[f] for f in task.figures if f in result}
    if ema_result is not None:
        figures.update({f"val_{f}_ema": ema_result[f] for f in task.figures
                        if f in ema_result})
    return figures


def _tag_of(key):
    """The TensorBoard tag of a metrics.jsonl figure (``val_acc_ema`` -> ``val_ema/acc``)."""
    if key == "train_loss":
        return TRAIN_LOSS
    figure = key[len("val_"):]
    if figure.endswith("_ema"):
        return validation_tag(figure[:-len("_ema")], "_ema")
    return validation_tag(figure)


def validation_scalars(figures):
    """``validation_figures`` as TensorBoard scalars (``val/*``, ``val_ema/*``)."""
    return {_tag_of(key): value for key, value in figures.items()}


def best_key(task, ema=False):
    """The metrics.jsonl key best.pt and --early-stop-* follow: the task's figure, the
    moving average's when there is one (``val_acc_ema``), else the network's."""
    return f"val_{task.best}_ema" if ema else f"val_{task.best}"


LOSS_LIKE = ("loss", "error", "mse", "mae", "rmse", "nll", "fid", "kid", "perplexity")


def lower_is_better(task):
    """Whether a lower ``task.best`` is better: the task's ``lower_is_better``, or where it
    says none (None), from the figure's name: a loss, an error or a distance (``loss``,
    ``val_mse``, ``fid_classifier``) is lower-is-better, any other figure higher."""
    if task.lower_is_better is not None:
        return bool(task.lower_is_better)
    parts = str(task.best).lower().replace("-", "_").split("_")
    return any(part in LOSS_LIKE for part in parts)


def best_metric(task, figures):
    """The value of ``best_key`` in a validation's figures, as a number that is higher
    when better (best.pt and --early-stop-* compare it so): a figure where lower is
    better (a GAN's FID) negated, NaN then never the best."""
    value = figures[best_key(task, f"val_{task.best}_ema" in figures)]
    if lower_is_better(task):
        return -math.inf if value != value else -value
    return value


def epoch_figures(figures, device, world_size=1):
    """The epoch's means of a task's own training figures (``TrainState.figures``: name ->
    (finite sum, count), this process's), over all processes, as metrics.jsonl keys
    ``train_<figure>`` (a GAN's ``train_loss_d``, ...); every process takes part."""
    names = sorted(figures)
    if not names:
        return {}
    flat = ops.sum_over_processes([v for name in names for v in figures[name]], device,
                                  world_size)
    return {f"train_{name}": flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else math.nan
            for i, name in enumerate(names)}


def shown_best(task, value):
    """``best_metric``'s number as the figure it came from (an FID again)."""
    return -value if lower_is_better(task) else value


def task_scalars(figures):
    """A task's own training figures since the last log (a GAN's ``loss_d``, ``loss_g``,
    ``d_real``, ``d_fake``, ``gradient_penalty``, ``grad_norm_<network>``) as
    ``train/<figure>`` scalars; NaN ones (none counted) are left out."""
    return {f"train/{name}": value for name, value in figures.items() if value == value}


def epoch_record(epoch, step, loss_sum, loss_count, lr, times, samples, flops_per_sample,
                 peak_tflops, unreadable=0, grad_norm=None, grad_clipped=None):
    """The metrics.jsonl record of a finished epoch (validation figures are added to it).

    Args:
        epoch, step: finished epochs and optimizer steps so far.
        loss_sum, loss_count: the epoch's finite training losses, summed over samples
            and processes, and their count.
        lr: the learning rate now.
        times: ``(data_time, compute_time, wall_time)`` of the epoch (``StepTimer``).
        samples: samples trained in ``times``, all processes (a resumed epoch: since
            the resume; its earlier samples were timed by the run before). 0 (an epoch
            resumed at its validation): nothing was timed, so no time keys.
        flops_per_sample: forward and backward FLOPs of one sample.
        peak_tflops: the device's datasheet peak, or None where unknown (no ``mfu``).
        unreadable: image files skipped so far (0: no key).
        grad_norm: the epoch's mean total gradient norm before clipping (None: no key).
        grad_clipped: the epoch's steps clipped by --grad-clip (None, when off: no key).

    Returns:
        A dict keyed by metrics.jsonl key.
    """
    data_time, compute_time, wall = times
    record = {"epoch": epoch, "step": step,
              "train_loss": loss_sum / loss_count if loss_count else float("nan"), "lr": lr}
    if samples:  # (none: not a speed of 0, no speed at all; round 6's F11)
        record.update({"compute_efficiency": engine.efficiency(data_time, compute_time),
                       "data_time": data_time, "compute_time": compute_time,
                       "epoch_time": wall, "samples_per_sec": samples / max(wall, 1e-9)})
        record["tflops"] = flops_per_sample * record["samples_per_sec"] / 1e12
        if peak_tflops:
            record["mfu"] = record["tflops"] / peak_tflops
    if grad_norm is not None:
        record["grad_norm"] = grad_norm
    if grad_clipped is not None:
        record["grad_clipped"] = int(grad_clipped)
    if unreadable:
        record["unreadable_images"] = int(unreadable)
    return record


def perf_scalars(record):
    """The ``perf/*`` scalars of an epoch record."""
    return {tag: record[key] for key, tag in PERF_TAGS.items() if key in record}


def final_figures(task, record):
    """The figures of the last epoch that a finished run reports with its hparams: the
    training loss, and the validation loss and the task's best figure, raw and EMA."""
    keys = ["train_loss", "val_loss", "val_loss_ema"]
    if task.best is not None:  # (none: a GAN without FID)
        keys[2:2] = [best_key(task)]
        keys.append(best_key(task, True))
    return {key: record[key] for key in keys if key in record}


def hparam_metrics(final):
    """``final_figures`` as the metrics of TensorBoard's hparams: keyed by the curves
    whose last values the HPARAMS tab shows."""
    return {_tag_of(key): value for key, value in final.items()}


def epoch_line(record, config, task, on_device=False):
    """The line printed when an epoch ends (and hints when the data path is slow).

    Args:
        record: the epoch's ``epoch_record``, with its validation figures.
        config: the run's (``epochs``, ``num_workers``).
        task: the run's task (its best figure is shown).
        on_device: the batches are made on the device (--data-on-device), where workers
            and --prefetch do not apply.
    """
    shown = dict.fromkeys(("val_loss", best_key(task), best_key(task, True)))  # once each
    val = "".join(f"  {key} {record[key]:.4f}" for key in shown if key in record)
    phases = "".join(f"  train_{f} {record[f'train_{f}']:.4f}" for f in  # a GAN's losses
                     task.shown_figures if f"train_{f}" in record)
    speed = (f"{record['samples_per_sec']:.0f} samples/s  efficiency "
             f"{record['compute_efficiency']:.2f} (data {record['data_time']:.1f}s, "
             f"compute {record['compute_time']:.1f}s)" if "samples_per_sec" in record else
             "speed not measured (no step since the resume)")
    lines = [f"epoch {record['epoch']}/{config['epochs']}  step {record['step']}  "
             f"train_loss {record['train_loss']:.4f}{phases}{val}  {speed}"]
    if "mfu" in record:
        lines.append(f"  {record['tflops']:.1f} TFLOP/s, model FLOPs utilisation "
                     f"{record['mfu']:.1%}")
    efficiency = record.get("compute_efficiency", 1.0)  # (not measured: no advice)
    if efficiency < 0.7 and on_device:
        lines.append(f"  the steps' work took {efficiency:.0%} of the time; "
                     f"the rest went to making the batches on the device (and to logging, "
                     f"checkpoints): lighter augmentation (--auto-augment, --random-erase) "
                     f"or a larger --batch-size spreads that cost")
    elif efficiency < 0.7:
        lines.append(f"  the loop waited for data {1 - efficiency:.0%} of "
                     f"the time: try more --num-workers (now {config['num_workers']}) or "
                     f"--prefetch 2")
    if record.get("unreadable_images"):
        lines.append(f"  {record['unreadable_images']} unreadable image(s) skipped so far "
                     f"(named in the warnings above)")
    return "\n".join(lines)


def early_stop_line(config, state, task, ema=False):
    """The line an early-stopped run ends with: why, and its best epoch and checkpoint.

    Args:
        config: the run's (``run_dir``, ``early_stop_*``).
        state: its ``engine.TrainState`` (the patience's count, best.pt's epoch and figure).
        task: its task (the figure best.pt follows).
        ema: the run keeps a moving average (best.pt follows the average's figure).
    """
    name = best_key(task, ema)
    best = os.path.join(config["run_dir"], "checkpoints", "best.pt")
    return (f"early stop at epoch {state.epoch}: {name} did not improve by more than "
            f"{config['early_stop_min_delta']:g} in {state.early_stop_waited} validation(s) "
            f"(--early-stop-patience {config['early_stop_patience']}); the best was epoch "
            f"{state.best_epoch} ({name} {shown_best(task, state.best):.4f}): {best}")

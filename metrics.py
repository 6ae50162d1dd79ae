"""Every figure a run reports, by name: TensorBoard tags, metrics.jsonl keys, the epoch line.

One module spells them, as torchtitan's MetricsProcessor does: train.py hands the raw
figures here (losses, timings, validation results) and gets back dicts keyed by tag or
by metrics.jsonl key, which runlog.py writes. A tag or a key is spelled once, below.

TensorBoard scalars (``scalars`` dicts: tag -> value):

    train/loss, train/lr, train/scaler_skips (fp16)      every --log-every steps
    val/loss, val/acc, val/acc5 (over 5 classes);       at each validation
    val_ema/loss, val_ema/acc, val_ema/acc5 (EMA)
    perf/compute_efficiency, perf/samples_per_sec,       at each epoch's end
    perf/tflops, perf/mfu (known GPUs)
    hparam/<final figure>                                 when the run finishes

metrics.jsonl: one ``epoch_record`` per finished epoch (docs/design.md lists its keys).
"""

import engine

# TensorBoard tags
TRAIN_LOSS, TRAIN_LR, SCALER_SKIPS = "train/loss", "train/lr", "train/scaler_skips"
FIRST_BATCH = "train/first_batch"  # the image grid of the first training batch
VALIDATION_TAGS = {"val_loss": "val/loss", "val_acc": "val/acc", "val_acc5": "val/acc5",
                   "val_loss_ema": "val_ema/loss", "val_acc_ema": "val_ema/acc",
                   "val_acc5_ema": "val_ema/acc5"}
PERF_TAGS = {"compute_efficiency": "perf/compute_efficiency",
             "samples_per_sec": "perf/samples_per_sec", "tflops": "perf/tflops",
             "mfu": "perf/mfu"}
HPARAM_PREFIX = "hparam/"

# The figures a finished run reports with its hyper-parameters (TensorBoard's HPARAMS).
FINAL_KEYS = ("train_loss", "val_loss", "val_acc", "val_loss_ema", "val_acc_ema")


def train_scalars(loss, lr, scaler_skips=None):
    """The scalars of a log step: the mean training loss since the last log, the learning
    rate, and (fp16) the steps the GradScaler skipped so far."""
    scalars = {TRAIN_LOSS: loss, TRAIN_LR: lr}
    if scaler_skips is not None:
        scalars[SCALER_SKIPS] = scaler_skips
    return scalars


def validation_figures(result, ema_result=None):
    """The metrics.jsonl figures of a validation: ``val_loss``, ``val_acc``, ``val_acc5``
    (more than 5 classes) and, with EMA, the same with ``_ema`` (from ``engine.evaluate``'s
    dicts)."""
    figures = {"val_loss": result["loss"], "val_acc": result["acc"]}
    if "acc5" in result:
        figures["val_acc5"] = result["acc5"]
    if ema_result is not None:
        figures.update(val_loss_ema=ema_result["loss"], val_acc_ema=ema_result["acc"])
        if "acc5" in ema_result:
            figures["val_acc5_ema"] = ema_result["acc5"]
    return figures


def validation_scalars(figures):
    """``validation_figures`` as TensorBoard scalars (``val/*``, ``val_ema/*``)."""
    return {VALIDATION_TAGS[key]: value for key, value in figures.items()}


def best_metric(figures):
    """The figure best.pt follows: the EMA's accuracy when there is one, else val_acc."""
    return figures["val_acc_ema" if "val_acc_ema" in figures else "val_acc"]


def epoch_record(epoch, step, loss_sum, loss_count, lr, times, samples, flops_per_sample,
                 peak_tflops, unreadable=0):
    """The metrics.jsonl record of a finished epoch (validation figures are added to it).

    Args:
        epoch, step: finished epochs and optimizer steps so far.
        loss_sum, loss_count: the epoch's finite training losses, summed over samples
            and processes, and their count.
        lr: the learning rate now.
        times: ``(data_time, compute_time, wall_time)`` of the epoch (``StepTimer``).
        samples: samples the epoch trained on, all processes.
        flops_per_sample: forward and backward FLOPs of one sample.
        peak_tflops: the device's datasheet peak, or None where unknown (no ``mfu``).
        unreadable: image files skipped so far (0: no key).

    Returns:
        A dict keyed by metrics.jsonl key.
    """
    data_time, compute_time, wall = times
    record = {"epoch": epoch, "step": step,
              "train_loss": loss_sum / loss_count if loss_count else float("nan"),
              "lr": lr, "compute_efficiency": engine.efficiency(data_time, compute_time),
              "data_time": data_time, "compute_time": compute_time, "epoch_time": wall,
              "samples_per_sec": samples / max(wall, 1e-9)}
    record["tflops"] = flops_per_sample * record["samples_per_sec"] / 1e12
    if peak_tflops:
        record["mfu"] = record["tflops"] / peak_tflops
    if unreadable:
        record["unreadable_images"] = int(unreadable)
    return record


def perf_scalars(record):
    """The ``perf/*`` scalars of an epoch record."""
    return {tag: record[key] for key, tag in PERF_TAGS.items() if key in record}


def final_figures(record):
    """The figures of the last epoch that a finished run reports (``FINAL_KEYS``)."""
    return {key: record[key] for key in FINAL_KEYS if key in record}


def hparam_metrics(final):
    """``final_figures`` as the metrics of TensorBoard's hparams (``hparam/*``)."""
    return {HPARAM_PREFIX + key: value for key, value in final.items()}


def epoch_line(record, config):
    """The line printed when an epoch ends (and hints when the data path is slow)."""
    val = f"  val_loss {record['val_loss']:.4f}  val_acc {record['val_acc']:.4f}" \
        if "val_acc" in record else ""
    if "val_acc_ema" in record:
        val += f"  val_acc_ema {record['val_acc_ema']:.4f}"
    lines = [f"epoch {record['epoch']}/{config['epochs']}  step {record['step']}  "
             f"train_loss {record['train_loss']:.4f}{val}  "
             f"{record['samples_per_sec']:.0f} samples/s  efficiency "
             f"{record['compute_efficiency']:.2f} (data {record['data_time']:.1f}s, "
             f"compute {record['compute_time']:.1f}s)"]
    if "mfu" in record:
        lines.append(f"  {record['tflops']:.1f} TFLOP/s, model FLOPs utilisation "
                     f"{record['mfu']:.1%}")
    if record["compute_efficiency"] < 0.7:
        lines.append(f"  the loop waited for data {1 - record['compute_efficiency']:.0%} of "
                     f"the time: try more --num-workers (now {config['num_workers']}) or "
                     f"--prefetch 2")
    if record.get("unreadable_images"):
        lines.append(f"  {record['unreadable_images']} unreadable image(s) skipped so far "
                     f"(named in the warnings above)")
    return "\n".join(lines)

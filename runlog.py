"""Everything a run writes into its run directory, except checkpoints.

config.yaml and command.txt (how the run was made), summary.txt (torchinfo),
metrics.jsonl (one line per finished epoch), TensorBoard scalars, the first-batch image
grid and the hparams. Only the main process writes.
"""

import datetime
import json
import os
import platform
import shlex
import subprocess

import torch
import yaml

import ops
from config import NOT_SAVED_IN_CONFIG
from ops import UserError


def prepare_run_dir(config, resuming, is_main, argv):
    """Creates the run directory and records how the run was made."""
    if not config["run_dir"]:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = config["network"].replace("/", "-")
        config["run_dir"] = os.path.join("runs", f"{stamp}-{name}-{config['dataset']}")
    run_dir = config["run_dir"]
    ckpt_dir = os.path.join(run_dir, "checkpoints")
    if not resuming and config["resume"] != "auto" and os.path.isdir(ckpt_dir) and any(
            f.endswith(".pt") for f in os.listdir(ckpt_dir)):
        raise UserError(f"{run_dir!r} already holds checkpoints; continue it with --resume "
                        f"auto, or choose another --run-dir")
    if not is_main:
        return run_dir
    os.makedirs(ckpt_dir, exist_ok=True)
    saved = {k: v for k, v in config.items() if k not in NOT_SAVED_IN_CONFIG}
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        yaml.safe_dump(saved, f, sort_keys=False)
    with open(os.path.join(run_dir, "command.txt"), "a") as f:
        f.write(f"{datetime.datetime.now().isoformat(timespec='seconds')}  "
                f"{shlex.join(['python', 'train.py', *argv])}\n"
                f"  git {_git_commit()}  torch {torch.__version__}  {platform.node()}\n")
    return run_dir


def _git_commit():
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=here, capture_output=True, text=True,
                               timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    return (commit + (" (with uncommitted changes)" if dirty else "")) or "unknown"



class RunLog:
    """TensorBoard and metrics.jsonl, written by the main process only."""

    def __init__(self, run_dir, step, epoch, enabled):
        self.enabled = enabled
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.writer = None
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run drops what the stopped one logged after its checkpoint at `step`
        # (everything at `step` itself was logged before the save), so each tag shows one
        # continuous curve and each epoch appears once.
        self.writer = SummaryWriter(run_dir, purge_step=step + 1 if step > 0 else None)
        kept = []
        if os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if line.strip()
                        and json.loads(line).get("epoch", 0) <= epoch]
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            f.writelines(kept)
        os.replace(tmp, self.path)

    def scalars(self, values, step):
        if self.enabled:
            for tag, value in values.items():
                self.writer.add_scalar(tag, value, step)

    def epoch(self, record):
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())

    def flush(self):
        if self.enabled:
            self.writer.flush()

    def close(self, config, final, step=0):
        if not self.enabled:
            return
        if final:
            from torch.utils.tensorboard.summary import hparams

            hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v))
                  for k, v in config.items() if k not in NOT_SAVED_IN_CONFIG}
            metrics = {f"hparam/{k}": v for k, v in final.items()}
            for summary in hparams(hp, metrics):
                self.writer.file_writer.add_summary(summary)
            for tag, value in metrics.items():
                self.writer.add_scalar(tag, value, step)
        self.writer.close()



def write_summary(net, train_set, run_dir, device, log):
    """Prints the torchinfo summary and writes it to summary.txt with parameter counts."""
    import torchinfo

    trainable, frozen = ops.count_parameters(net)
    shape = (1, train_set.in_channels, train_set.image_size, train_set.image_size)
    text = str(torchinfo.summary(net, input_size=shape, device=device, mode="eval",
                                 verbose=0, col_names=("output_size", "num_params",
                                                       "trainable")))
    text += f"\nTrainable parameters: {trainable:,}\nFrozen parameters: {frozen:,}\n"
    with open(os.path.join(run_dir, "summary.txt"), "w") as f:
        f.write(text)
    log(text)



def log_first_batch(runlog, train_set, sampler):
    """An image grid of the first training batch, to check what the network sees."""
    import torchvision

    keys = next(iter(sampler))[:64]
    images = torch.stack([train_set[key][0] for key in keys])
    grid = torchvision.utils.make_grid(images[:, :3], nrow=8, normalize=True)
    runlog.writer.add_image("train/first_batch", grid, 0)

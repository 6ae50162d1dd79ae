"""Processes, devices, precision, seeds and signals: the run's machinery.

Shared by train.py and test.py: torchrun set-up (DistributedDataParallel), the device a
flag names, the autocast dtype a device can do, seeding, and the signals that stop a run
at a step boundary (SIGINT, SIGTERM, SIGHUP).
"""

import os
import random
import signal
import sys
import warnings

import numpy as np
import torch
import torch.distributed as dist

from ops import UserError


def setup_processes(config):
    """Starts torch.distributed when launched by torchrun.

    Returns:
        ``(rank, world_size, device)``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    want_cuda = config["device"] != "cpu" and torch.cuda.is_available()
    if world_size > 1:
        if config["gpus"]:
            raise UserError("--gpus (DataParallel) and torchrun (DDP) do not mix; use one")
        device = torch.device("cuda", local_rank) if want_cuda else torch.device("cpu")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
        return rank, world_size, device
    if config["gpus"]:
        ids = gpu_ids(config["gpus"])
        return 0, 1, torch.device("cuda", ids[0])
    if config["device"] == "auto":
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(config["device"])
    except RuntimeError:
        raise UserError(f"--device {config['device']!r} is not a device; use auto, cpu, "
                        f"cuda or cuda:N") from None
    if device.type == "cuda" and (not torch.cuda.is_available() or
                                  (device.index or 0) >= torch.cuda.device_count()):
        raise UserError(f"--device {config['device']}: no such CUDA device here "
                        f"({torch.cuda.device_count()} visible)")
    return 0, 1, device


def check_same_resume_point(state, world_size, device):
    """Each process read the checkpoint from its own disk: they must have found the same."""
    step = torch.tensor([-1 if state is None else state["step"]], device=device)
    steps = [torch.zeros_like(step) for _ in range(world_size)]
    dist.all_gather(steps, step)
    if len({int(s) for s in steps}) > 1:
        raise UserError(f"the processes found different checkpoints to resume from (step "
                        f"by rank, -1 = none: {[int(s) for s in steps]}); on several "
                        f"machines --run-dir must be on a file system they share")


def gpu_ids(text):
    try:
        ids = [int(i) for i in str(text).split(",") if i.strip() != ""]
    except ValueError:
        raise UserError(f"--gpus takes comma-separated GPU ids like 0,1, not {text!r}") \
            from None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [i for i in ids if not 0 <= i < count]
    if not ids or bad:
        raise UserError(f"--gpus {text}: no GPU {bad or ids} here ({count} visible)")
    return ids


def seed_everything(seed, rank, deterministic, device):
    """Seeds python, numpy and torch; sets the cuDNN and determinism switches."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # DDP broadcasts rank 0's initial weights anyway
    if deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(deterministic)  # both ways: main() may run again
    torch.backends.cudnn.deterministic = deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not deterministic


def amp_dtype(config, device):
    """The autocast dtype, or None; a dtype the device cannot do is a UserError."""
    if config["amp"] == "none":
        return None
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[config["amp"]]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise UserError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no bfloat16; "
                        f"use --amp fp16")
    if not torch.amp.is_autocast_available(device.type):
        raise UserError(f"--amp {config['amp']}: no autocast on {device.type}; use --amp none")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns, then silently runs at full precision
        with torch.autocast(device.type, dtype=dtype):
            works = torch.is_autocast_enabled(device.type)
    if not works:
        raise UserError(f"--amp {config['amp']}: autocast on {device.type} cannot do {dtype} "
                        f"in this torch {torch.__version__}; use --amp none or the other dtype")
    return dtype



class StopRequest:
    """Remembers SIGINT/SIGTERM; the loop stops at the next optimizer step and saves.

    The handler only records the signal: the save happens in the loop, and a second
    Ctrl-C during the save changes nothing (the save finishes, then the run exits).
    """

    def __init__(self):
        self.signum = None
        self._old = {}
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._old[signum] = signal.signal(signum, self._handle)

    def _handle(self, signum, frame):
        if self.signum is None:
            self.signum = signum
            print(f"\n{signal.Signals(signum).name}: stopping after this step and saving "
                  f"a checkpoint (a second signal is ignored)", file=sys.stderr, flush=True)

    def restore(self):
        for signum, handler in self._old.items():
            signal.signal(signum, handler)

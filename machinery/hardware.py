"""What the hardware can do, and how a run uses it: the autocast dtype a device can do
(``amp_dtype``, bf16 where it is native), the peak TFLOP/s a device is measured against and
the FLOPs of a step (``count_flops``: compute efficiency's and MFU's figures), memory (the
allocator's options, what is available, a snapshot when a run runs out of it), and the
seeds and deterministic algorithms of every process. The processes themselves, the devices
a flag names and the signals are runtime.py's.
"""

import os
import random
import sys
import traceback
import warnings

import numpy as np
import torch

import ops
from machinery import files, runtime
from ops import UserError


def peak_tflops(device, amp_dtype, devices=1, matmul_share=0.0):
    """The datasheet peak in TFLOP/s of the GPUs the run's throughput counts (MFU), or
    None where unknown.

    With --amp none, convolutions run in TF32 where cuDNN may use it
    (``torch.backends.cudnn.allow_tf32``, on by default) and matrix products where cuBLAS
    may (``torch.backends.cuda.matmul.allow_tf32``, off by default), each else in plain
    fp32. Where the two differ, the peak is the rate at which the step's FLOPs would run
    if each kind ran at its own peak: ``1 / (share / matmul_peak + (1 - share) /
    conv_peak)``, so an mlp is measured against the fp32 peak and a CNN (nearly all
    convolutions) against TF32's.

    Args:
        device: this process's device (its name picks the peak).
        amp_dtype: the autocast dtype, or None (--amp none).
        devices: GPUs that share the work: the processes (DDP) or --gpus (DataParallel).
        matmul_share: the share of the step's FLOPs that are matrix products, not
            convolutions (``ops.train_flops_per_sample(..., kinds=True)``).
    """
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    precision = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp_dtype)
    if precision is not None:
        peak = ops.peak_tflops(name, precision)
    else:
        conv = ops.peak_tflops(name, "tf32" if torch.backends.cudnn.allow_tf32 else "fp32")
        matmul = ops.peak_tflops(
            name, "tf32" if torch.backends.cuda.matmul.allow_tf32 else "fp32")
        peak = None if conv is None or matmul is None else \
            1 / (matmul_share / matmul + (1 - matmul_share) / conv)
    return None if peak is None else peak * devices


def gpu_count(config, procs):
    """The GPUs one step runs on: the processes under torchrun, --gpus' ids in one."""
    if procs.world_size > 1:
        return procs.world_size
    return len(runtime.gpu_ids(config["gpus"])) if config["gpus"] else 1


def seed_everything(seed, rank, deterministic, device, benchmark=None):
    """Seeds python, numpy and torch; sets the cuDNN and determinism switches
    (``benchmark``: cuDNN's timed choice of algorithms; by default on CUDA unless
    deterministic)."""
    random.seed(seed + rank)
    np.random.seed(seed + rank)
    torch.manual_seed(seed + rank)  # DDP broadcasts rank 0's initial weights anyway
    torch.use_deterministic_algorithms(deterministic)  # both ways: main() may run again
    torch.backends.cudnn.deterministic = deterministic
    if benchmark is None:
        benchmark = device.type == "cuda" and not deterministic
    torch.backends.cudnn.benchmark = benchmark


AMP_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


def cublas_config_error(error):
    """The ``error:`` line's text when ``error`` is cuBLAS refusing --deterministic because
    CUBLAS_WORKSPACE_CONFIG was unset (or set otherwise) at this process's first gemm;
    else None."""
    if not isinstance(error, RuntimeError) or "CUBLAS_WORKSPACE_CONFIG" not in str(error):
        return None
    now = os.environ.get("CUBLAS_WORKSPACE_CONFIG", "(unset)")
    return (f"--deterministic: cuBLAS was set up in this process with "
            f"CUBLAS_WORKSPACE_CONFIG={now} (read once, at the first matrix product), "
            f"where deterministic results need :4096:8 or :16:8; start a new process with "
            f"CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment (or import train before "
            f"any CUDA matrix product), or drop --deterministic")


def amp_dtype(amp, device, remedy=None):
    """The autocast dtype that an --amp value names, or None for ``none``.

    Args:
        amp: ``none``, ``fp16`` or ``bf16``.
        device: where autocast will run.
        remedy: what the error message suggests; by default, another --amp.

    Raises:
        UserError: the device (or this torch) cannot autocast to that dtype: torch would
            warn and silently run at full precision.
    """
    dtype = AMP_DTYPES[amp]
    if dtype is None:
        return None
    if device.type == "cuda" and dtype == torch.bfloat16 and \
            not native_bf16(torch.cuda.get_device_capability(device)):
        raise UserError(f"--amp bf16: {torch.cuda.get_device_name(device)} has no native "
                        f"bfloat16 (it would be emulated, slower than float32); "
                        f"{remedy or 'use --amp fp16'}")
    if not torch.amp.is_autocast_available(device.type):
        raise UserError(f"--amp {amp}: no autocast on {device.type}; "
                        f"{remedy or 'use --amp none'}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns, then silently runs at full precision
        with torch.autocast(device.type, dtype=dtype):
            works = torch.is_autocast_enabled(device.type)
    if not works:
        raise UserError(f"--amp {amp}: autocast on {device.type} cannot do {dtype} in this "
                        f"torch {torch.__version__}; "
                        f"{remedy or 'use --amp none or the other dtype'}")
    return dtype


def native_bf16(capability):
    """Whether a CUDA device of compute ``capability`` (major, minor) computes bfloat16 in
    hardware: Ampere (8.0) and newer. Older GPUs (V100 7.0, T4 7.5) emulate it, which
    ``torch.cuda.is_bf16_supported()`` accepts by default."""
    return tuple(capability) >= (8, 0)


def available_memory():
    """Bytes of memory available to new allocations (Linux's MemAvailable; elsewhere the
    free pages), the measure of what ``--data-on-device auto`` may hold on the CPU."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 0


def set_memory_options(config, device):
    """--gpu-memory-fraction and --memory-snapshot, set before the run's first allocation
    on ``device`` (the fraction on each GPU of --gpus too); without CUDA each is a warning
    and the run goes on."""
    fraction, snapshot = config["gpu_memory_fraction"], config["memory_snapshot"]
    if device.type != "cuda":
        for flag, on in (("--gpu-memory-fraction", fraction), ("--memory-snapshot", snapshot)):
            if on:
                runtime.main_print(f"warning: {flag} is for CUDA devices and this run is on "
                           f"{device}: ignored", file=sys.stderr)
        return
    if fraction:  # the caching allocator refuses beyond it; the CUDA context is not counted
        ids = runtime.gpu_ids(config["gpus"]) if config.get("gpus") else [device]
        for gpu in ids:  # every GPU of --gpus: DataParallel's replicas allocate there too
            torch.cuda.set_per_process_memory_fraction(fraction, gpu)
    if snapshot:  # the allocator's history, for memory_snapshot.pickle on an OOM
        torch.cuda.memory._record_memory_history(max_entries=100_000)


def dump_memory_snapshot(run_dir, device):
    """Writes the CUDA allocator's recorded history (--memory-snapshot) into the run
    directory for https://pytorch.org/memory_viz; returns its path, or None without one."""
    if device.type != "cuda":
        return None
    import pickle


    rank = runtime.process_rank()
    name = "memory_snapshot.pickle" if int(os.environ.get("WORLD_SIZE", "1")) == 1 \
        else f"memory_snapshot-rank{rank}.pickle"
    path = os.path.join(run_dir, name)
    snapshot = torch.cuda.memory._snapshot()
    files.atomic_write(path, lambda f: pickle.dump(snapshot, f), mode="wb")
    return path


def set_up_out_of_memory(error, config, run_dir, device):
    """The ``error:`` line's text for memory that ran out before the first step; writes the
    --memory-snapshot file first. When the sets being put on the device took it
    (--data-on-device), the remedy is the per-sample path, not a smaller batch."""
    snapshot = dump_memory_snapshot(run_dir, device) if config["memory_snapshot"] else None
    on_device = any(frame.name == "build_device_loaders"
                    for frame in traceback.extract_tb(error.__traceback__))
    return (f"out of memory ({ops.memory_error(error)}) "
            f"{'holding the data on ' + str(device) if on_device else 'setting up the run'}, "
            f"before the first step; every file written before is intact"
            f"{'; the allocator history is in ' + snapshot if snapshot else ''}: "
            f"{'use --data-on-device off' if on_device else 'lower --batch-size, or free memory'}")


def count_flops(net, shape, config, procs, amp_dtype):
    """A training step's FLOPs per sample (of the parameters that train now: counted again
    after --unfreeze-at) and the peak the MFU divides by, for their mix of convolutions
    and matrix products (``hardware.peak_tflops``).

    Returns:
        ``(flops_per_sample, peak_tflops)``; the peak is None where unknown.
    """
    flops, matmul = ops.train_flops_per_sample(net, shape, procs.device, kinds=True)
    return flops, peak_tflops(procs.device, amp_dtype, gpu_count(config, procs),
                                      matmul / flops if flops else 0.0)

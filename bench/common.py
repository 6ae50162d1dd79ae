"""What the bench scripts share: the repository on the import path, threads and device."""

import os
import platform
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

from config import parse_config  # noqa: E402


def setup_device(args):
    """Applies ``args.threads`` (0 = torch's default) and ``args.device``.

    Returns:
        ``(device, description)``: the torch.device and a line naming the hardware.
    """
    if getattr(args, "threads", 0):
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
        return device, torch.cuda.get_device_name(device)
    cpu = platform.processor() or platform.machine()
    return device, f"{cpu}, {torch.get_num_threads()} threads, {os.cpu_count()} cores"


def sync(device):
    """Waits for the device's queued work (CUDA); nothing on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_defaults():
    """train.py's built-in defaults as a resolved config dict."""

    config, _ = parse_config([])
    config["run_dir"] = "runs/bench"
    return config

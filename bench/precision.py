"""Training throughput of a network at fp32, bf16 and fp16, contiguous and channels_last,
eager and compiled; and the activation memory saved by activation checkpointing.

    python bench/precision.py --device cuda            # batch 256, 20 timed steps x 3
    python bench/precision.py --device cpu             # batch 16, 3 timed steps x 1
    python bench/precision.py --device cpu --image-size 8 --batch-size 8 --steps 5 --threads 1

On a CPU, fp16 runs on slow reference kernels (about 50x slower than fp32 here), and
inductor compiles C++ for each configuration (minutes); on a busy machine --threads 1
avoids threads waiting for each other.

Each configuration trains a freshly seeded network on random images already on the
device (no data loading), with the engine's step: autocast, GradScaler for fp16,
``engine._optimizer_step``, and train.py's SGD (``ops.build_optimizer``: fused on CUDA
and under fp16, as in a run). samples/s is the mean over the repeats (spread: the
standard deviation), after warmup steps that also absorb torch.compile's compilation. A
configuration the device or this torch cannot run (bf16 on a GPU without native bf16,
which train.py refuses too) prints its reason instead of a number.

Activation memory: bytes of the tensors kept for backward by one forward (autograd's
saved tensors, parameters excluded, plus the block inputs that checkpointing keeps),
counted the same way on every device; on CUDA also the peak memory of forward and
backward above what weights, gradients and optimizer state hold.
This prints figures; it asserts nothing (tests/test_precision.py does).
"""

import argparse
import os
import platform
import statistics
import sys
import time

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from common import setup_device, sync, train_defaults  # noqa: E402  (the repository's path)

import ops  # noqa: E402
from machinery import engine, hardware, meters  # noqa: E402
from networks import build_network  # noqa: E402
from ops import UserError  # noqa: E402

AMP = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
AMP_FLAG = {"fp32": "none", "bf16": "bf16", "fp16": "fp16"}  # train.py's --amp


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Training samples/s by dtype, memory format "
                                "and compile; activation memory with checkpointing.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda")
    p.add_argument("--network", default="resnet18", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=0, help="0: 256 on CUDA, 16 on CPU")
    p.add_argument("--image-size", type=int, default=32, help="side of the random images")
    p.add_argument("--steps", type=int, default=0, help="timed steps per repeat; "
                   "0: 20 on CUDA, 3 on CPU")
    p.add_argument("--warmup", type=int, default=0, help="untimed steps first (compile "
                   "happens here); 0: 5 on CUDA, 2 on CPU")
    p.add_argument("--repeats", type=int, default=0, help="timed blocks; 0: 3 on CUDA, "
                   "1 on CPU")
    p.add_argument("--amp", default="fp32,bf16,fp16", help="comma-separated dtypes")
    p.add_argument("--compile", default="both", choices=["both", "off", "on"],
                   help="eager, compiled, or both")
    p.add_argument("--threads", type=int, default=0, help="CPU threads (0: torch's default)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device.startswith("cuda")
    for name, on_cuda, on_cpu in (("batch_size", 256, 16), ("steps", 20, 3),
                                  ("warmup", 5, 2), ("repeats", 3, 1)):
        if not getattr(args, name):
            setattr(args, name, on_cuda if cuda else on_cpu)
    return args


def amp_problem(device, amp):
    """Why train.py's ``--amp`` cannot run ``amp`` on ``device`` (``hardware.amp_dtype``'s
    check: bf16 on a GPU of compute capability 8.0 or more, autocast that works), or
    None."""
    try:
        hardware.amp_dtype(AMP_FLAG[amp], device, remedy="not measured")
    except UserError as e:
        return str(e)
    return None


def make_loop(device, amp, net):
    """The engine's loop settings and train.py's optimizer (``build_optimizer``: fused on
    CUDA and under fp16, so GradScaler reads no flag back per step) for ``amp``."""
    dtype = AMP[amp]
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    config = {**train_defaults(), "amp": AMP_FLAG[amp], "optimizer": "sgd", "lr": 0.01,
              "momentum": 0.9, "nesterov": False, "weight_decay": 0.0}
    optimizer = ops.build_optimizer(net, config, device)
    loop = engine.LoopSettings(device=device, amp_dtype=dtype, scaler=scaler,
                               counters=meters.Counters(device), show_progress=False)
    return loop, optimizer


def train_steps(model, loop, optimizer, x, y, steps):
    for _ in range(steps):
        with loop.autocast():
            loss = F.cross_entropy(model(x), y)
        loop.scaler.scale(loss).backward()
        engine._optimizer_step(model.parameters(), optimizer, loop)


def build(args, device, channels_last):
    torch.manual_seed(0)
    net = build_network(args.network, 10, 3, args.image_size)
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    return net.to(device, memory_format=memory_format), memory_format


def throughput(args, device, amp, channels_last, compiled):
    """samples/s (mean, std over repeats), or a string saying why it could not run."""
    problem = amp_problem(device, amp)
    if problem:
        return problem
    net, memory_format = build(args, device, channels_last)
    if compiled:
        torch._dynamo.reset()  # each configuration compiles afresh, within the cache limit
    model = torch.compile(net) if compiled else net
    loop, optimizer = make_loop(device, amp, net)
    g = torch.Generator().manual_seed(1)
    side = args.image_size
    x = torch.randn(args.batch_size, 3, side, side, generator=g)
    x = x.to(device, memory_format=memory_format)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    net.train()
    try:
        train_steps(model, loop, optimizer, x, y, args.warmup)
    except Exception as e:  # noqa: BLE001 - report and go on to the next configuration
        return f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0][:80]}"
    rates = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        train_steps(model, loop, optimizer, x, y, args.steps)
        sync(device)
        rates.append(args.batch_size * args.steps / (time.perf_counter() - start))
    return statistics.mean(rates), (statistics.stdev(rates) if len(rates) > 1 else 0.0)


def checkpointing_memory(args, device, checkpointing):
    """``(saved MiB, CUDA peak MiB or None, samples/s)`` for fp32, eager, contiguous."""
    net, _ = build(args, device, channels_last=False)
    net.set_grad_checkpointing(checkpointing)
    net.train()
    loop, optimizer = make_loop(device, "fp32", net)
    g = torch.Generator().manual_seed(1)
    side = args.image_size
    x = torch.randn(args.batch_size, 3, side, side, generator=g).to(device)
    y = torch.randint(0, 10, (args.batch_size,), generator=g).to(device)
    train_steps(net, loop, optimizer, x, y, max(args.warmup, 1))  # optimizer state exists
    saved = ops.saved_tensor_bytes(net, x) / 2**20
    peak = None
    if device.type == "cuda":
        sync(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        F.cross_entropy(net(x), y).backward()
        sync(device)
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
        net.zero_grad(set_to_none=True)
    sync(device)
    start = time.perf_counter()
    train_steps(net, loop, optimizer, x, y, args.steps)
    sync(device)
    rate = args.batch_size * args.steps / (time.perf_counter() - start)
    return saved, peak, rate


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    print(f"# {args.network}, batch {args.batch_size}, {args.image_size}x{args.image_size}, "
          f"{args.warmup} warmup + {args.repeats} x {args.steps} timed steps")
    print(f"# {device} ({name}), torch {torch.__version__}, python {platform.python_version()}")
    print(f"# {' '.join([os.path.basename(sys.executable), *sys.argv])}")
    compile_modes = {"both": [False, True], "off": [False], "on": [True]}[args.compile]
    print()
    print(f"{'amp':<6}{'memory format':<16}{'compile':<9}{'samples/s':>12}  {'spread':>8}")
    for compiled in compile_modes:
        for amp in args.amp.split(","):
            for channels_last in (False, True):
                result = throughput(args, device, amp, channels_last, compiled)
                fmt = "channels_last" if channels_last else "contiguous"
                head = f"{amp:<6}{fmt:<16}{'yes' if compiled else 'no':<9}"
                if isinstance(result, str):
                    print(f"{head}{'n/a':>12}  {result}", flush=True)
                else:
                    print(f"{head}{result[0]:>12.1f}  {result[1]:>8.1f}", flush=True)
    print()
    peak_head = f"{'CUDA peak MiB':>15}" if device.type == "cuda" else ""
    print(f"{'checkpointing':<15}{'saved MiB':>10}{peak_head}{'samples/s':>12}"
          f"   (fp32, contiguous, eager)")
    if not hasattr(build_network(args.network, 10, 3, args.image_size),
                   "set_grad_checkpointing"):
        print(f"{'n/a':<15}{args.network} has no set_grad_checkpointing")
        return
    for checkpointing in (False, True):
        saved, peak, rate = checkpointing_memory(args, device, checkpointing)
        peak_text = f"{peak:>15.1f}" if peak is not None else ""
        print(f"{'on' if checkpointing else 'off':<15}{saved:>10.1f}{peak_text}{rate:>12.1f}",
              flush=True)


if __name__ == "__main__":
    main()

"""Samples/s of the data path alone: the per-sample DataLoader against the device path.

    python bench/data.py                          # CPU: workers 0,1,2 vs the device path
    python bench/data.py --device cuda --workers 0,4,8 --samples 50000

CIFAR-shaped data: ``--samples`` random uint8 32x32 RGB images in a torchvision CIFAR10
object (its ``.data`` array; no files, so its ``__getitem__`` is the real one: a PIL image
per sample), with train.py's training transform: random crop with padding 4 and
horizontal flip drawn from (seed, epoch, index), scaled to floats and normalised.

- per-sample: ``data.build_loader`` over the SeededDataset with an EpochBatchSampler
  (persistent workers), each batch moved to ``--device`` as engine.steps does
  (pinned memory on CUDA);
- device: ``device_data.DeviceLoader`` holding the set as one uint8 tensor on ``--device``,
  gathering, cropping, flipping and normalising whole batches there.

Each configuration runs an untimed warmup epoch, then ``--repeats`` epochs (each a
different epoch number, so different draws) in an order that rotates between repeats;
the figures are medians. No network: this is the most the data path can feed. The first
batch of both paths is compared (the same samples, bit for bit on the CPU). This prints
figures; it asserts nothing.
"""

import argparse
import datetime
import os
import platform
import statistics
import sys
import time

import numpy as np
import torch
from common import setup_device, sync  # (puts the repository on the path)
from torchvision import datasets as tv_datasets

from pipeline import (
    data,  # noqa: E402
    device_data,  # noqa: E402
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N or auto")
    p.add_argument("--samples", type=int, default=10_240, help="images in the set")
    p.add_argument("--batch-size", type=int, default=512, help="samples per batch")
    p.add_argument("--workers", default="0,1,2", help="comma-separated --num-workers "
                   "values for the per-sample path")
    p.add_argument("--repeats", type=int, default=3, help="timed epochs per configuration")
    p.add_argument("--threads", type=int, default=1, help="torch threads of this process "
                   "(0: torch's default); workers use one each")
    p.add_argument("--channels-last", action="store_true", help="batches in channels_last")
    p.add_argument("--seed", type=int, default=0, help="data seed")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.workers = [int(w) for w in args.workers.split(",") if w.strip()]
    return args


def cifar_like(samples, seed):
    """A torchvision CIFAR10 whose ``.data`` is random uint8 images (no files read)."""
    g = np.random.default_rng(seed)
    base = tv_datasets.CIFAR10.__new__(tv_datasets.CIFAR10)
    base.data = g.integers(0, 256, (samples, 32, 32, 3), dtype=np.uint8)
    base.targets = [int(v) for v in g.integers(0, 10, samples)]
    base.transform = base.target_transform = None
    base.classes = [f"class{i}" for i in range(10)]
    train, _ = data._transforms("cifar10", 32, augment=True)
    return data.SeededDataset(base, train, seed, True, base.classes, 3, 32)


class PerSample:
    def __init__(self, dataset, sampler, workers, device, memory_format):
        self.name, self.sampler, self.device = f"per-sample, {workers} workers", sampler, device
        self.memory_format = memory_format
        self.loader = data.build_loader(dataset, batch_sampler=sampler, num_workers=workers,
                                        pin_memory=device.type == "cuda")
        self.times = []

    def batches(self):
        for x, y in self.loader:  # as engine.steps moves them
            yield (x.to(self.device, non_blocking=True, memory_format=self.memory_format),
                   y.to(self.device, non_blocking=True))

    def close(self):
        data.shutdown_loader(self.loader)


class OnDevice:
    def __init__(self, dataset, sampler, device, memory_format):
        self.name, self.sampler = f"device ({device})", sampler
        images, labels = device_data.source_tensors(dataset)
        self.loader = device_data.DeviceLoader(dataset, images, labels, device,
                                        batch_sampler=sampler, memory_format=memory_format)
        self.times = []

    def batches(self):
        return iter(self.loader)

    def close(self):
        pass


def run_epoch(config, epoch, device):
    config.sampler.set_epoch(epoch)
    sync(device)
    start = time.perf_counter()
    count = 0
    for x, _ in config.batches():
        count += len(x)
    sync(device)
    return count, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    device, hardware = setup_device(args)
    memory_format = torch.channels_last if args.channels_last else torch.contiguous_format
    dataset = cifar_like(args.samples, args.seed)

    def sampler():
        return data.EpochBatchSampler(args.samples, args.batch_size, args.seed)

    configs = [PerSample(dataset, sampler(), w, device, memory_format) for w in args.workers]
    configs.append(OnDevice(dataset, sampler(), device, memory_format))
    if device.type == "cuda":  # the device path on the CPU as well: one core's figure
        configs.append(OnDevice(dataset, sampler(), torch.device("cpu"), memory_format))

    print(f"# data path: CIFAR-shaped uint8 32x32, {args.samples} samples, crop (padding 4) "
          f"+ flip + normalise, batch {args.batch_size}, {args.repeats} timed epochs each"
          f"{', channels_last' if args.channels_last else ''}")
    print(f"# {device} ({hardware}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    print(f"# {' '.join(['python', *sys.argv])}", flush=True)

    first = []
    for c in configs:
        c.sampler.set_epoch(0)
        x, y = next(iter(c.batches()))
        first.append((x.cpu(), y.cpu()))
        run_epoch(c, 0, device)  # warmup: starts the workers, fills the caches
    same = all(torch.equal(first[0][0], x) and torch.equal(first[0][1], y) for x, y in first)
    for r in range(args.repeats):
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            count, seconds = run_epoch(c, r + 1, device)
            c.times.append(count / seconds)
    for c in configs:
        c.close()

    base = statistics.median(configs[0].times)
    print()
    print(f"{'path':<28}{'samples/s':>11}{'min':>10}{'max':>10}{'vs first':>10}")
    for c in configs:
        rate = statistics.median(c.times)
        print(f"{c.name:<28}{rate:>11.0f}{min(c.times):>10.0f}{max(c.times):>10.0f}"
              f"{rate / base:>10.2f}")
    note = " (on CUDA the float results may differ in the last bit)" \
        if not same and device.type == "cuda" else ""
    print(f"# first batch identical on every path: {'yes' if same else 'NO'}{note}")
    print(f"# load average after: {' '.join(f'{v:.1f}' for v in os.getloadavg())}")


if __name__ == "__main__":
    main()

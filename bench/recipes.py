"""What each training recipe costs: EMA, MixUp, CutMix, the augmentation policies, erasing.

    python bench/recipes.py                         # simple_cnn, batch 128, 32x32, CPU
    python bench/recipes.py --threads 1 --repeats 9 # steadier on a shared, busy CPU
    python bench/recipes.py --device cuda --network resnet18

Two tables.

Per optimizer step (the main process): a training step of --network on a synthetic
batch of --batch-size 3x32x32 images (forward, cross-entropy with label smoothing 0.1,
backward, SGD with momentum), alone and with one recipe added: the EMA update after the
step (recipes.EMA, decay 0.999 with warmup), MixUp (BatchMix, alpha 0.8) or CutMix
(alpha 1.0) on the batch before the forward (its soft targets then go to the loss).
Each repeat times --steps steps of every variant, in chunks that take turns in a
rotating order, so that changes in the machine's load hit all alike; figures are
medians over repeats. "added" is the variant's median time per step minus the plain
step's of the same repeat (noisy when small), "alone" the recipe timed by itself in a
loop (the EMA update, or the mix with its draw): the better estimate of small costs.

Per sample (the data pipeline, which runs in DataLoader workers): data.py's CIFAR-10
training transform (a 32x32 PIL image: to a tensor, crop with padding 4, flip, to float
and normalise) inside data.SeededDataset (the per-sample seeding included), alone
and with each --auto-augment policy or --random-erase 0.25 / 1.0 inserted where
recipes.policy_transforms says, on one torch thread as in a DataLoader worker. Figures
are microseconds per sample and samples/s of one worker; the cost per step is that
times the batch size, divided among the workers.

This prints figures; it asserts nothing.
"""

import argparse
import datetime
import os
import platform
import statistics
import time

import torch  # noqa: E402
from common import setup_device, sync  # noqa: E402  (puts the repository on the path)
from PIL import Image  # noqa: E402
from torchvision.transforms import v2  # noqa: E402

from networks import build_network  # noqa: E402
from pipeline import (
    data,  # noqa: E402
    recipes,  # noqa: E402
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    p.add_argument("--network", default="simple_cnn", help="a networks.py name")
    p.add_argument("--batch-size", type=int, default=128, help="samples per step")
    p.add_argument("--steps", type=int, default=20, help="timed steps per repeat and variant")
    p.add_argument("--chunk", type=int, default=5, help="steps per turn")
    p.add_argument("--repeats", type=int, default=5, help="repeats (medians over them)")
    p.add_argument("--samples", type=int, default=256, help="samples per repeat and "
                   "pipeline in the per-sample table")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


def per_step_table(args, device):
    classes, n = 10, args.batch_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, 3, 32, 32, generator=g).to(device)
    y = torch.randint(classes, (n,), generator=g).to(device)
    torch.manual_seed(0)
    net = build_network(args.network, classes, 3, 32).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    ema = recipes.EMA(net, 0.999, warmup=True)
    mixup = recipes.BatchMix(0.8, 0.0, 1.0, classes, seed=0)
    cutmix = recipes.BatchMix(0.0, 1.0, 1.0, classes, seed=0)
    counter = [0]

    def step(mix=None, average=False):
        counter[0] += 1
        inputs, targets = (x, y) if mix is None else mix(x, y, 0, counter[0] * n)
        optimizer.zero_grad(set_to_none=True)
        criterion(net(inputs), targets).backward()
        optimizer.step()
        if average:
            ema.update(net, counter[0])

    variants = {"plain step": lambda: step(),
                "+ EMA update": lambda: step(average=True),
                "+ MixUp": lambda: step(mix=mixup),
                "+ CutMix": lambda: step(mix=cutmix)}
    alone = {"+ EMA update": lambda: ema.update(net, 5000),
             "+ MixUp": lambda: mixup(x, y, 0, counter[0] * n),
             "+ CutMix": lambda: cutmix(x, y, 0, counter[0] * n)}
    for fn in variants.values():  # warm up
        for _ in range(3):
            fn()
    names = list(variants)
    times = {name: [] for name in names}
    for r in range(args.repeats):
        spent = dict.fromkeys(names, 0.0)
        for turn in range(-(-args.steps // args.chunk)):
            order = names[(r + turn) % len(names):] + names[:(r + turn) % len(names)]
            for name in order:
                sync(device)
                t0 = time.perf_counter()
                for _ in range(args.chunk):
                    variants[name]()
                sync(device)
                spent[name] += time.perf_counter() - t0
        steps = -(-args.steps // args.chunk) * args.chunk
        for name in names:
            times[name].append(spent[name] / steps)
    alone_ms = {}
    for name, fn in alone.items():
        reps = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                fn()
            sync(device)
            reps.append((time.perf_counter() - t0) / args.steps)
        alone_ms[name] = 1000 * statistics.median(reps)

    base = times["plain step"]
    print(f"\nper optimizer step: {args.network}, batch {n}, 3x32x32, {args.repeats} x "
          f"{args.steps} steps")
    print(f"{'variant':<16}{'ms/step':>9}{'samples/s':>11}{'added ms':>10}{'added %':>9}"
          f"{'alone ms':>10}{'alone %':>9}")
    for name in names:
        med = statistics.median(times[name])
        added = statistics.median(t - b for t, b in zip(times[name], base))
        row = f"{name:<16}{1000 * med:>9.2f}{n / med:>11.0f}"
        if name != "plain step":
            a = alone_ms[name]
            row += (f"{1000 * added:>+10.2f}{100 * added / statistics.median(base):>+9.1f}"
                    f"{a:>10.3f}{100 * a / (1000 * statistics.median(base)):>9.2f}")
        print(row)
    if args.network != "resnet18":  # the recipe's network: what its EMA update costs
        big = build_network("resnet18", classes, 3, 32).to(device)
        big_ema = recipes.EMA(big, 0.999)
        reps = []
        for _ in range(args.repeats):
            sync(device)
            t0 = time.perf_counter()
            for _ in range(args.steps):
                big_ema.update(big, 5000)
            sync(device)
            reps.append((time.perf_counter() - t0) / args.steps)
        count = sum(t.numel() for t in big.state_dict().values())
        print(f"EMA update of resnet18 alone ({count / 1e6:.1f}M values): "
              f"{1000 * statistics.median(reps):.2f} ms")


class PilImages(torch.utils.data.Dataset):
    """Random 32x32 RGB PIL images, as torchvision's CIFAR-10 returns them."""

    def __init__(self, n):
        g = torch.Generator().manual_seed(0)
        arrays = torch.randint(256, (n, 32, 32, 3), dtype=torch.uint8, generator=g).numpy()
        self.images = [Image.fromarray(a) for a in arrays]

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        return self.images[index], 0


def pipeline(policy="none", erase=0.0):
    """data.py's CIFAR-10 training transform with the recipes inserted: the policy before
    the first step that makes floats (uint8 images), erasing after the normalisation."""
    train, _ = data._transforms("cifar10", 32, True)
    before, after = recipes.policy_transforms(policy, 9, erase, "cifar10")
    steps = list(train.transforms)
    at = next(i for i, s in enumerate(steps)
              if type(s).__name__ in ("ToDtype", "Normalize", "Normalise"))
    return v2.Compose(steps[:at] + before + steps[at:] + after)


def per_sample_table(args):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker (torch sets 1 there)
    try:
        _per_sample_table(args)
    finally:
        torch.set_num_threads(threads)


def _per_sample_table(args):
    base = PilImages(args.samples)
    variants = {"crop + flip": pipeline(),
                "+ trivialaugment": pipeline("trivialaugment"),
                "+ randaugment": pipeline("randaugment"),
                "+ autoaugment": pipeline("autoaugment"),
                "+ random_erase .25": pipeline(erase=0.25),
                "+ random_erase 1": pipeline(erase=1.0)}
    sets = {name: data.SeededDataset(base, t, 0, True, ["x"], 3, 32)
            for name, t in variants.items()}
    names = list(sets)
    for ds in sets.values():
        for i in range(min(20, len(ds))):  # warm-up
            ds[(i, 0)]
    times = {name: [] for name in names}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            ds = sets[name]
            t0 = time.perf_counter()
            for i in range(args.samples):
                ds[(i, r)]
            times[name].append((time.perf_counter() - t0) / args.samples)
    ref = times["crop + flip"]
    print(f"\nper sample: CIFAR-10 training transform in SeededDataset, {args.repeats} x "
          f"{args.samples} samples, one process with one thread (a worker's)")
    print(f"{'pipeline':<20}{'us/sample':>10}{'samples/s':>11}{'added us':>10}{'added %':>9}"
          f"{'ms/step of ' + str(args.batch_size):>16}")
    for name in names:
        med = statistics.median(times[name])
        added = statistics.median(t - b for t, b in zip(times[name], ref))
        row = f"{name:<20}{1e6 * med:>10.1f}{1 / med:>11.0f}"
        if name != "crop + flip":
            row += (f"{1e6 * added:>+10.1f}{100 * added / statistics.median(ref):>+9.1f}"
                    f"{1000 * added * args.batch_size:>+16.2f}")
        print(row)


def main(argv=None):
    args = parse_args(argv)
    device, name = setup_device(args)
    print(f"# recipes: {device} ({name}), torch {torch.__version__}, python "
          f"{platform.python_version()}, {datetime.datetime.now():%Y-%m-%d %H:%M}, "
          f"load average {' '.join(f'{v:.1f}' for v in os.getloadavg())}")
    per_step_table(args, device)
    per_sample_table(args)


if __name__ == "__main__":
    main()

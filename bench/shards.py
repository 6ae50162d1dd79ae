"""--dataset shards against webdataset's own plain loop, on the same tars, one thread each.

    python bench/shards.py                        # 2,000 JPEGs of 96x96 in 8 shards, 3 turns
    python bench/shards.py --images 400 --repeats 1

Writes shards of photo-like JPEGs (a smooth random scene plus noise, quality 90, a .cls
label each), then reads every sample of one epoch once, decoding each image with the
image folder's reader (``images.load_image``: RGB, EXIF orientation) in both loops, so
what differs is the reading, not the decoding:

Not in the rates: the set opened at the start (the shards indexed, or, streamed, read once
to count their samples and labels: both splits, here the same shards), printed apart.

* local: ours, random access (``IndexedShards``: wids' index, memory-mapped, in the
  seeded permutation of the epoch) against ``webdataset.WebDataset(files)`` read front to
  back with a shuffle buffer of 1000;
* HTTP: the shards served by ``python -m http.server`` in a process of its own on
  127.0.0.1; ours streamed (``StreamedShards``: the epoch's shard order and shuffle
  buffer of 1000 drawn from (seed, epoch)) against ``webdataset.WebDataset(urls)``
  (webdataset reads http URLs through curl) with a shuffle buffer of 1000.

One thread each (torch.set_num_threads(1), no DataLoader workers), the loops in turn,
--repeats turns; medians of images/s and the ratio ours/webdataset (the target: >= 0.95),
and of images per CPU second (this process, its read-ahead thread, and webdataset's curl
processes; not the server): on a machine others load, wall-clock rates follow the
scheduler more than the code.
Prints figures; asserts nothing.
"""

import argparse
import io
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import common  # noqa: F401 (the repository on the import path)
import numpy as np
import torch
from PIL import Image

from config import with_defaults
from pipeline import data
from pipeline.images import load_image


def cpu_seconds():
    """CPU time of this process and its ended children (webdataset's curl) so far."""
    own, children = (resource.getrusage(w) for w in (resource.RUSAGE_SELF,
                                                      resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def write_shards(folder, images, per_shard, side, seed=0):
    import webdataset

    g = np.random.default_rng(seed)
    shard_count = -(-images // per_shard)
    for s in range(shard_count):
        with webdataset.TarWriter(os.path.join(folder, f"train-{s:03d}.tar")) as tar:
            for i in range(s * per_shard, min((s + 1) * per_shard, images)):
                coarse = g.integers(0, 256, (4, 4, 3), dtype=np.uint8)
                scene = np.asarray(Image.fromarray(coarse).resize((side, side), Image.BILINEAR))
                pixels = np.clip(scene + g.normal(0, 12, scene.shape), 0, 255).astype(np.uint8)
                buffer = io.BytesIO()
                Image.fromarray(pixels).save(buffer, "JPEG", quality=90)
                tar.write({"__key__": f"{i:06d}", "jpg": buffer.getvalue(),
                           "cls": str(i % 10).encode()})
    return shard_count


def ours(spec, buffer):
    """Every sample of epoch 1 in its order, through the set's own reader."""
    config = with_defaults({"dataset": "shards", "data_dir": spec, "val_data_dir": spec,
                            "shuffle_buffer": buffer, "image_size": 32, "num_workers": 0})
    begin = time.perf_counter()
    train, _ = data.build_datasets(config, log=lambda *a, **k: None)
    opened = time.perf_counter() - begin  # the index, or the count of a streamed set
    order = data.shards.own_order(train)
    order = order(config["seed"], 1) if order else torch.randperm(
        len(train), generator=torch.Generator().manual_seed(config["seed"] * 10_007 + 1))
    base = train.base
    base.epoch = 1
    start, cpu = time.perf_counter(), cpu_seconds()
    for index in order.tolist():
        base[index]  # (image, label)
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return len(order) / wall, len(order) / cpu, opened


def plain(spec, buffer):
    """webdataset's own loop: WebDataset(urls), a shuffle buffer, the same decoding."""
    import webdataset

    dataset = webdataset.WebDataset(spec, shardshuffle=False, empty_check=False).shuffle(
        buffer).map(lambda s: (load_image(io.BytesIO(s["jpg"])), int(s["cls"])))
    start, cpu, count = time.perf_counter(), cpu_seconds(), 0
    for _sample in dataset:
        count += 1
    wall, cpu = time.perf_counter() - start, cpu_seconds() - cpu
    return count / wall, count / cpu


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=2000)
    parser.add_argument("--per-shard", type=int, default=250)
    parser.add_argument("--side", type=int, default=96)
    parser.add_argument("--buffer", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        count = write_shards(folder, args.images, args.per_shard, args.side)
        pattern = f"train-{{000..{count - 1:03d}}}.tar"
        port = free_port()
        server = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                                   "127.0.0.1", "--directory", folder],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(1.0)  # (the server's start)
            url = f"http://127.0.0.1:{port}/{pattern}"
            local = os.path.join(folder, pattern)
            print(f"{args.images} JPEGs of {args.side}x{args.side} in {count} shards; one "
                  f"thread; {args.repeats} turns; images/s (medians)")
            for name, spec in (("local", local), ("http", url)):
                got, per_cpu, opened = {"ours": [], "webdataset": []}, {"ours": [],
                                                                         "webdataset": []}, []
                for _ in range(args.repeats):
                    rate, cpu_rate, seconds = ours(spec, args.buffer)
                    got["ours"].append(rate)
                    per_cpu["ours"].append(cpu_rate)
                    opened.append(seconds)
                    rate, cpu_rate = plain(spec, args.buffer)
                    got["webdataset"].append(rate)
                    per_cpu["webdataset"].append(cpu_rate)
                a, b = (statistics.median(got[k]) for k in ("ours", "webdataset"))
                c, d = (statistics.median(per_cpu[k]) for k in ("ours", "webdataset"))
                what = "random access" if name == "local" else "streamed"
                print(f"{name:5s}  ours ({what}) {a:8.1f}   webdataset {b:8.1f}   "
                      f"ratio {a / b:.2f}   turns: ours {[round(x) for x in got['ours']]}, "
                      f"webdataset {[round(x) for x in got['webdataset']]}; ours opened the "
                      f"set (both splits) in {statistics.median(opened):.2f} s first")
                print(f"{name:5s}  per CPU second (the process and its curl): ours {c:8.1f}"
                      f"   webdataset {d:8.1f}   ratio {c / d:.2f}")
        finally:
            server.terminate()
            server.wait()


if __name__ == "__main__":
    main()

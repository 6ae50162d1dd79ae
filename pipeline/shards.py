"""--dataset shards: webdataset tar shards, local or served over http(s).

A shard is a tar whose members are grouped into samples by key (``0001.jpg``,
``0001.cls``): an image (``.jpg``, ``.jpeg``, ``.png`` or ``.webp``) and a label (``.cls``:
the number as text; ``.json``: a number or ``{"label": n}``). ``--data-dir`` is a brace
pattern (``train-{000000..000127}.tar``) of files or http(s) URLs, or a folder of .tar
files; ``--val-data-dir`` the validation shards. Sample ``i`` of the set is the i-th
sample of the shards in that order, so the set is indexed as a folder of the same images
in the same order is, and the ledger (machinery/ledger.py) names samples by that index.

Two ways to read, said in the run's first lines:

- random access (``IndexedShards``): local shards, or URLs copied into ``--shard-cache``
  when first read; each shard is indexed by wids (webdataset's indexed reader) and read
  by index, so the epoch's order is the one of every other set
  (``data.EpochBatchSampler``: a permutation drawn from the seed and the epoch);
- streaming (``StreamedShards``): URLs without ``--shard-cache``, read front to back by
  webdataset's tar iterator; the epoch's order is the shards in an order drawn from
  (seed, epoch) passed through a shuffle buffer whose draws come from (seed, epoch) too
  (``stream_order``). That order is a permutation of the indices, known before a byte is
  read, so the sampler, a mid-epoch resume (the samples seen so far: one number), the
  ledger and a change of the number of processes work on it as on any set. Each process
  (each DataLoader worker) reads the shards that hold its samples in that order and keeps
  at most about a buffer's worth of encoded samples it has read before they are due.

Faults: a shard that cannot be opened or read (a server gone, a cut connection, a
truncated tar) is tried again ``RETRIES`` times with a doubling delay, continuing where it
stopped; then it is skipped, its samples counted as unreadable images are (the next
readable sample stands in for each). When more than a quarter of the shards cannot be
read, the run ends with one ``error:`` line.
"""

import bisect
import collections
import contextlib
import hashlib
import heapq
import http.client
import io
import json
import os
import queue
import sys
import tarfile
import threading
import time
import urllib.request

import torch

from machinery import files
from machinery.runtime import say
from ops import UserError
from pipeline.images import UnreadableImage
from pipeline.sources import EncodedImages, check_labels

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
RETRIES = 6          # tries at a shard that fails, before it is skipped
FIRST_DELAY = 0.5    # s before the second try; doubled at each next one (15.5 s in all)
TIMEOUT = 30         # s a server may stay silent before a read counts as failed
MAX_BAD_SHARDS = 0.25  # of the shards: more that cannot be read ends the run
OPEN_SHARDS = 64     # indexed shards a process keeps open (memory-mapped) at a time


# what a read of a shard may raise: URLError, HTTPError, a cut connection (IncompleteRead),
# a truncated or damaged tar
READ_ERRORS = (OSError, tarfile.TarError, EOFError, ValueError, http.client.HTTPException)


class ShardFault(UnreadableImage):
    """A shard that could not be read, even after ``RETRIES`` tries."""


def expand(spec):
    """The shards that ``spec`` names: a folder's .tar files (sorted), or a brace pattern's
    expansion (``train-{000..009}.tar``), in order."""
    import braceexpand

    if not is_url(spec) and os.path.isdir(spec):
        found = sorted(os.path.join(spec, f) for f in os.listdir(spec) if f.endswith(".tar"))
        if not found:
            raise UserError(f"{spec!r} holds no .tar shards")
        return found
    try:
        return list(braceexpand.braceexpand(spec))
    except Exception as e:  # an unbalanced brace: braceexpand's own error
        raise UserError(f"cannot expand the shard pattern {spec!r} ({e})") from None


def is_url(spec):
    return spec.startswith(("http://", "https://"))


def open_shard(url):
    """A binary stream of a shard: an HTTP response read ahead (``ReadAhead``), or a local
    file."""
    if is_url(url):
        return io.BufferedReader(ReadAhead(urllib.request.urlopen(url, timeout=TIMEOUT)),
                                 buffer_size=2**16)
    return open(url[7:] if url.startswith("file://") else url, "rb")


class ReadAhead(io.RawIOBase):
    """A response read by a thread of its own, up to ``AHEAD`` chunks of ``CHUNK`` bytes in
    front of the reader (as webdataset's curl does in a process of its own): the waits for
    the network overlap the parsing and decoding. An error of the read is raised here."""

    CHUNK, AHEAD = 2**20, 8

    def __init__(self, response):
        self.response, self.chunks = response, queue.Queue(self.AHEAD)
        self.chunk, self.at, self.ended, self.stopped = b"", 0, False, False
        threading.Thread(target=self._fill, daemon=True).start()

    def _fill(self):
        while not self.stopped:
            try:  # what has come (read1), not a whole chunk: the parsing starts at once
                item = self.response.read1(self.CHUNK)
                if not item and getattr(self.response, "length", None):  # cut short
                    item = http.client.IncompleteRead(b"", self.response.length)
            except Exception as e:  # (handed to the reader: it decides)
                item = e
            while not self.stopped:
                with contextlib.suppress(queue.Full):
                    self.chunks.put(item, timeout=0.1)
                    break
            if not isinstance(item, bytes) or not item:
                return

    def readable(self):
        return True

    def readinto(self, buffer):
        if self.at == len(self.chunk):
            if self.ended:
                return 0
            item = self.chunks.get()
            if isinstance(item, Exception):
                raise item
            self.chunk, self.at, self.ended = memoryview(item), 0, not item
        n = min(len(buffer), len(self.chunk) - self.at)
        buffer[:n] = self.chunk[self.at:self.at + n]
        self.at += n
        return n

    def close(self):
        self.stopped = True
        self.response.close()
        super().close()


def tar_samples(stream, url):
    """The samples of a tar stream, webdataset's way (``tar_file_iterator``, then
    ``group_by_keys``): dicts of extension -> bytes with ``__key__``."""
    from webdataset import tariterators

    def members():
        for member in tariterators.tar_file_iterator(stream):
            member["__url__"] = url
            yield member

    return tariterators.group_by_keys(members())


def encoded_image(sample):
    """The image member's bytes of a sample (b"" where it has none: unreadable)."""
    return next((bytes(sample[e]) for e in IMAGE_EXTENSIONS if e in sample), b"")


def label_of(sample, where):
    """The label of a sample: its ``.cls`` (text) or ``.json`` (a number or
    ``{"label": n}``); UserError where it has neither."""
    try:
        if "cls" in sample:
            return int(bytes(sample["cls"]).decode().strip())
        if "json" in sample:
            value = json.loads(bytes(sample["json"]))
            return int(value["label"] if isinstance(value, dict) else value)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise UserError(f"{where}: sample {sample.get('__key__')!r} has a label that is not a "
                        f"number ({type(e).__name__}: {e})") from None
    raise UserError(f"{where}: sample {sample.get('__key__')!r} has no .cls or .json label")


def retried(what, attempt):
    """``attempt()``'s result, tried up to ``RETRIES`` times with a doubling delay between;
    the last error, as ShardFault, when every try failed."""
    delay = FIRST_DELAY
    for n in range(RETRIES):
        try:
            return attempt()
        except READ_ERRORS as e:
            error = e  # URLError, HTTPError, IncompleteRead, a truncated tar, ...
            if isinstance(e, UnreadableImage):
                raise
        if n + 1 < RETRIES:
            time.sleep(delay)
            delay *= 2
    raise ShardFault(f"{what}: {type(error).__name__}: {error} (after {RETRIES} tries)")


def too_many_bad(bad, total, what):
    """Raises UserError when more than ``MAX_BAD_SHARDS`` of ``total`` shards are bad."""
    if bad > MAX_BAD_SHARDS * total:
        raise UserError(f"{bad} of the {total} shards of {what} cannot be read (see the "
                        f"warnings above): more than a quarter of the set is missing")


# ----------------------------------------------------------------------- random access


def cached_copy(url, cache_dir):
    """A local copy of the shard at ``url`` in ``cache_dir`` (made on first read, written
    atomically: a killed download leaves no half shard)."""
    name = hashlib.sha256(url.encode()).hexdigest()[:16] + "-" + os.path.basename(url)
    path = os.path.join(cache_dir, name)
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir, exist_ok=True)

    def download():
        with open_shard(url) as response:
            data = response.read()
        length = getattr(response, "length", None)
        if length:  # a connection cut short
            raise OSError(f"{length} bytes missing")
        return data

    data = retried(url, download)
    files.atomic_write(path, lambda f: f.write(data), mode="wb")
    return path


class IndexedShards(EncodedImages):
    """Shards read by index (wids' ``IndexedTarSamples``: an index of each tar's members,
    the file memory-mapped); each process opens them when it first reads them.

    Args:
        paths: the local shard files, in order.
        sizes: their numbers of samples.
        labels: every sample's label.
        classes: the class names.
        where: the set, in words.
    """

    def __init__(self, paths, sizes, labels, classes, where):
        super().__init__(labels, classes, where)
        self.paths, self.sizes = list(paths), list(sizes)
        self.starts = [0]
        for n in self.sizes:
            self.starts.append(self.starts[-1] + n)
        self._open, self._pid = collections.OrderedDict(), None

    def locate(self, index):
        """``(shard, index within it)`` of a sample."""
        shard = bisect.bisect_right(self.starts, index) - 1
        return shard, index - self.starts[shard]

    def shard(self, shard):
        if self._pid != os.getpid():  # a forked worker: its own files and maps
            self._open, self._pid = collections.OrderedDict(), os.getpid()
        if shard in self._open:
            self._open.move_to_end(shard)
            return self._open[shard]
        if len(self._open) >= OPEN_SHARDS:  # the least recently read one closed
            self._open.popitem(last=False)[1].close()
        self._open[shard] = retried(self.paths[shard], lambda: _indexed(self.paths[shard]))
        return self._open[shard]

    def encoded(self, index):
        shard, inner = self.locate(index)
        sample = self.shard(shard)[inner]
        return encoded_image({k.lstrip(".").lower(): v.getvalue() if hasattr(v, "getvalue")
                              else v for k, v in sample.items()})

    def name(self, index):
        shard, inner = self.locate(index)
        return f"sample {inner} of {self.paths[shard]}"

    def content_name(self):
        return " ".join(f"{os.path.basename(p)}:{n}" for p, n in zip(self.paths, self.sizes))

    def __getstate__(self):  # (mapped files stay behind: a spawned worker opens its own)
        state = dict(self.__dict__)
        state["_open"], state["_pid"] = collections.OrderedDict(), None
        return state


def _indexed(path):
    from wids.wids import IndexedTarSamples

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise tarfile.ReadError("an empty file")
    return IndexedTarSamples(path=path)


def _local_labels(path):
    """The labels of a local shard's samples, in order (its index opened with retries)."""
    tar = retried(path, lambda: _indexed(path))
    found = []
    for i in range(len(tar)):
        sample = {k.lstrip(".").lower(): v.getvalue() for k, v in tar[i].items()
                  if hasattr(v, "getvalue")}
        sample["__key__"] = tar[i]["__key__"]
        found.append(label_of(sample, path))
    tar.close()
    return found


def _survey(names, labels_of, faults, where):
    """``(names, sizes, labels)`` of the shards whose labels ``labels_of(name)`` reads; a
    shard that raises one of ``faults`` is named in a warning and left out (too many: one
    error line, ``too_many_bad``)."""
    kept, sizes, labels, bad = [], [], [], 0
    for name in names:
        try:
            found = labels_of(name)
        except faults as e:
            bad += 1
            say(f"warning: skipping the shard {name}: {e}", file=sys.stderr)
            continue
        kept.append(name)
        sizes.append(len(found))
        labels += found
    too_many_bad(bad, len(names), where)
    return kept, sizes, labels


def _index_local(paths, where):
    """``(paths, sizes, labels)`` of the shards that can be indexed."""
    return _survey(paths, _local_labels, (ShardFault, FileNotFoundError), where)


# ----------------------------------------------------------------------- streaming


def stream_order(sizes, seed, epoch, buffer):
    """The order of an epoch's samples when streamed: the shards in an order drawn from
    (seed, epoch), read front to back through a shuffle buffer of ``buffer`` samples (a
    sample read when the buffer is full takes the place of one drawn from it, which is
    handed out; at the end the rest in a drawn order). A permutation of the indices.

    Returns:
        ``(order, shard_order)``: int64 tensors.
    """
    g = torch.Generator().manual_seed(seed * 10_007 + epoch + 7_919)  # not the sampler's
    shard_order = torch.randperm(len(sizes), generator=g)
    starts = [0]
    for n in sizes:
        starts.append(starts[-1] + n)
    read = [i for s in shard_order.tolist() for i in range(starts[s], starts[s + 1])]
    draws = torch.randint(0, 2**62, (len(read),), generator=g).tolist()
    out, held = [], []
    for index, draw in zip(read, draws):
        if len(held) < buffer:
            held.append(index)
            continue
        j = draw % buffer
        out.append(held[j])
        held[j] = index
    out += [held[j] for j in torch.randperm(len(held), generator=g).tolist()]
    return torch.tensor(out, dtype=torch.long), shard_order


class StreamedShards(IndexedShards):
    """Shards over http(s), read front to back (see the module's docstring).

    ``epoch`` (set by ``data.SeededDataset`` from each key) selects the epoch whose order
    the reads follow; ``shuffle`` False (validation) reads the shards in order.

    Args:
        urls, sizes, labels, classes, where: as ``IndexedShards``'s.
        seed: the run's seed.
        buffer: the shuffle buffer's samples.
        shuffle: whether epochs are shuffled (the training set).
    """

    streamed = True

    def __init__(self, urls, sizes, labels, classes, where, seed, buffer, shuffle):
        super().__init__(urls, sizes, labels, classes, where)
        self.seed, self.buffer, self.shuffle = seed, max(int(buffer), 1), shuffle
        self.epoch = 0
        self.bad_shards = torch.zeros(len(urls), dtype=torch.uint8).share_memory_()
        self._reader, self._orders = None, {}

    def epoch_order(self, seed, epoch):
        """The epoch's order (``data.EpochBatchSampler``'s ``order``)."""
        return self.stream_order(seed, epoch)[0]

    def stream_order(self, seed, epoch):
        """``stream_order`` of this set, the last two epochs' kept (a Python loop over the
        set: the sampler asks for its plan more than once an epoch)."""
        key = (seed, epoch)
        if key not in self._orders:
            if len(self._orders) >= 2:
                self._orders.pop(next(iter(self._orders)))
            self._orders[key] = stream_order(self.sizes, seed, epoch, self.buffer)
        return self._orders[key]

    def encoded(self, index):
        if self.bad_shards[self.locate(index)[0]]:
            raise ShardFault(f"its shard {self.paths[self.locate(index)[0]]} cannot be read")
        reader = self._reader
        if reader is None or reader.pid != os.getpid() or reader.epoch != self.epoch:
            reader = self._reader = _Reader(self, self.epoch)
        data = reader.get(index)
        if data is None:  # not on the way ahead (read before, or out of order): fetched
            data = self.read_one(index)
        return data

    def read_one(self, index):
        """One sample's bytes, read from the front of its shard."""
        shard, inner = self.locate(index)
        for i, data in self.shard_samples(shard, 0):
            if i == inner:
                return data
        raise ShardFault(f"{self.paths[shard]} ended before its sample {inner}")

    def shard_samples(self, shard, first):
        """``(index within the shard, image bytes)`` of a shard's samples from ``first`` on.
        A read that fails is tried again from where it stopped (``retried``); a shard
        that still fails is marked bad and raises ShardFault."""
        url, at = self.paths[shard], first
        while at < self.sizes[shard]:
            def attempt(at=at):
                stream = open_shard(url)
                samples = tar_samples(stream, url)
                for _ in range(at):  # (bytes already had: read past)
                    if next(samples, None) is None:
                        stream.close()
                        raise EOFError(f"{url} holds fewer samples than when it was counted")
                return stream, samples
            try:
                stream, samples = retried(url, attempt)
            except ShardFault:
                self.bad_shards[shard] = 1
                raise
            try:
                for sample in samples:
                    yield at, encoded_image(sample)
                    at += 1
                if at < self.sizes[shard]:
                    raise EOFError(f"{at} of {self.sizes[shard]} samples")
            except READ_ERRORS as e:
                say(f"warning: reading {url} failed at sample {at} ({type(e).__name__}: "
                    f"{e}); trying again from there", file=sys.stderr)
            finally:
                stream.close()

    def __getstate__(self):
        state = super().__getstate__()
        state["_reader"] = None
        return state


class _Reader:
    """One process's front-to-back read of an epoch's shards (see ``StreamedShards``).

    A sample asked for at position ``p`` of the epoch's order is read from the stream;
    the samples read on the way that come later in the order are kept until asked for,
    those that come earlier are dropped (this process never asks for them: its requests
    come in the order). Shards whose samples all come before ``p`` are not opened.
    """

    def __init__(self, shards, epoch):
        self.shards, self.epoch, self.pid = shards, epoch, os.getpid()
        n = len(shards)
        if shards.shuffle:
            order, shard_order = shards.stream_order(shards.seed, epoch)
        else:
            order, shard_order = torch.arange(n), torch.arange(len(shards.sizes))
        self.pos = torch.empty(n, dtype=torch.long)
        self.pos[order] = torch.arange(n)
        owner = torch.repeat_interleave(torch.arange(len(shards.sizes)),
                                        torch.tensor(shards.sizes, dtype=torch.long))
        self.last = torch.full((len(shards.sizes),), -1, dtype=torch.long).scatter_reduce(
            0, owner, self.pos, "amax").tolist()  # each shard's latest position
        self.plan = shard_order.tolist()
        self.read_start = {}  # shard -> its first sample's place in the read order
        at = 0
        for s in self.plan:
            self.read_start[s], at = at, at + shards.sizes[s]
        self.pos = self.pos.tolist()
        self.next_shard, self.samples, self.read_at = 0, None, 0
        self.kept, self.due = {}, []  # index -> bytes; a heap of (position, index)

    def get(self, index):
        """The bytes of sample ``index``, or None where it is not ahead in the stream."""
        p = self.pos[index]
        while self.due and self.due[0][0] < p:
            self.kept.pop(heapq.heappop(self.due)[1], None)
        if index in self.kept:
            return self.kept.pop(index)
        shard, inner = self.shards.locate(index)
        if self.read_start[shard] + inner < self.read_at:
            return None
        while True:
            found = self._next(p)
            if found is None:
                return None
            k, data = found
            if k == index:
                return data
            if self.pos[k] > p:
                self.kept[k] = data
                heapq.heappush(self.due, (self.pos[k], k))

    def _next(self, p):
        while self.samples is None:
            if self.next_shard >= len(self.plan):
                return None
            shard = self.plan[self.next_shard]
            self.next_shard += 1
            if self.last[shard] >= p and not self.shards.bad_shards[shard]:
                self.shard = shard
                self.read_at = self.read_start[shard]
                self.samples = self.shards.shard_samples(shard, 0)
        try:
            inner, data = next(self.samples)
        except (StopIteration, ShardFault):
            self.samples = None
            return self._next(p)
        self.read_at = self.read_start[self.shard] + inner + 1
        return self.shards.starts[self.shard] + inner, data


def _count_streamed(urls, where):
    """``(urls, sizes, labels)`` of the shards over http(s), each read once (streamed) to
    count its samples and read their labels; those that cannot be read are left out."""
    def labels_of(url):
        def attempt():
            with open_shard(url) as stream:
                return [label_of(s, url) for s in tar_samples(stream, url)]
        return retried(url, attempt)

    return _survey(urls, labels_of, (ShardFault,), where)


def open_set(spec, config, shuffle, log, role):
    """The shards ``spec`` names as an IndexedShards or a StreamedShards (see the module's
    docstring), with one line said about how they are read."""
    urls = expand(spec)
    cache = config.get("shard_cache") or ""
    where = f"--{role} {spec}"
    if not urls:
        raise UserError(f"{where} names no shards")
    remote = [u for u in urls if is_url(u)]
    if remote and not cache:
        urls, sizes, labels = _count_streamed(urls, where)
        kind = (f"streamed (the shard order and a shuffle buffer of "
                f"{config.get('shuffle_buffer', 1000)} drawn from the seed and the epoch)"
                if shuffle else "streamed in order")
        make = lambda classes: StreamedShards(  # noqa: E731
            urls, sizes, labels, classes, where, config["seed"],
            config.get("shuffle_buffer", 1000), shuffle)
    else:
        local = []
        for url in urls:  # (a URL that cannot be fetched: left out as an unreadable shard)
            try:
                local.append(cached_copy(url, cache) if is_url(url) else url)
            except ShardFault as e:
                say(f"warning: skipping the shard {url}: {e}", file=sys.stderr)
        too_many_bad(len(urls) - len(local), len(urls), where)
        missing = [p for p in local if not os.path.exists(p)]
        if missing:
            raise UserError(f"{where}: no such shard {missing[0]!r}")
        urls, sizes, labels = _index_local(local, where)
        kind = "random access" + (f" (cached in {cache} on first read)" if remote else "")
        make = lambda classes: IndexedShards(urls, sizes, labels, classes, where)  # noqa: E731
    log(f"data: {where}: {len(urls)} shards, {sum(sizes)} samples, {kind}")
    return make, labels


def own_order(dataset):
    """The ``(seed, epoch) -> order`` of a set of streamed shards (for
    ``data.EpochBatchSampler``), None for any other set."""
    return getattr(getattr(dataset, "base", None), "epoch_order", None)


def splits(config, log):
    """``(train, val)`` of --dataset shards: ``data_dir`` and ``val_data_dir``."""
    if not config.get("val_data_dir"):
        raise UserError("--dataset shards needs --val-data-dir (the validation shards) "
                        "beside --data-dir (the training shards)")
    make_train, train_labels = open_set(config["data_dir"], config, True, log, "data-dir")
    make_val, val_labels = open_set(config["val_data_dir"], config, False, log,
                                    "val-data-dir")
    if not train_labels:
        raise UserError(f"--data-dir {config['data_dir']}: its shards hold no samples")
    classes = [str(i) for i in range(max(max(train_labels + val_labels) + 1, 1))]
    for labels, flag in ((train_labels, "--data-dir"), (val_labels, "--val-data-dir")):
        check_labels(labels, classes, flag)
    return make_train(classes), make_val(classes)


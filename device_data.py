"""The device path: whole sets held as tensors on the training device, batches made there.

``DeviceLoader`` holds a set as one uint8 (synthetic: float32) tensor on the training
device and gathers, crops, flips and normalises each batch there: no worker processes,
no per-sample Python. It draws the same crop offsets and flips (``data.crop_flip_draws``,
a hash of (seed, epoch, index)) and does the same arithmetic (zero padding, indexing,
``data.normalise``) as the per-sample path in data.py, so both give the same samples, bit
for bit on the CPU. ``device_data_decision`` says which path a run takes and why
(``--data-on-device``); ``build_device_loaders`` builds this one.

Image folders reach it through a decoded cache (``decoded_folder``): every image decoded
and resized once into a memory-mapped uint8 array file under ``<data-dir>/.cache``,
keyed by a fingerprint of the files (``folder_fingerprint``) and written atomically.
"""

import contextlib
import glob
import hashlib
import json
import os
import sys
import time
import zlib

import numpy as np
import torch
import torch.utils.data
import torchvision
from torchvision import datasets as tv_datasets
from torchvision.transforms import v2

import data
import files
import runtime
from ops import Interrupted, UserError
from runtime import say

DEVICE_SHARE = 0.25  # --data-on-device auto: the sets may take this share of free memory
CACHE_VERSION = 2    # of the decoded image-folder cache's layout and record


class UnsupportedOnDevice(Exception):
    """Something the device path cannot do for a set; the message says what."""


class DevicePipeline:
    """What the device path applies to a set's batches, read from its transform.

    Attributes:
        front: the decoding steps (``v2.ToImage``, ``v2.Resize``) the source tensors
            already went through (for image folders: the decoded cache applies them).
        padding: the crop's zero padding (0: no crop).
        flip: whether half the samples are flipped horizontally.
        mean, std: the normalisation (None: the images are used as they are).
        random: whether crop and flip apply (the training set with augmentation).
    """

    def __init__(self, dataset):
        transform = dataset.transform
        steps = list(getattr(transform, "transforms", [transform]))
        steps = [s for s in steps if not isinstance(s, v2.Identity)]
        i = 0
        while i < len(steps) and isinstance(steps[i], (v2.ToImage, v2.Resize)):
            i += 1
        self.front = tuple(steps[:i])
        if any(isinstance(s, v2.Resize) for s in self.front) and not isinstance(
                dataset.base, data.SafeImageFolder):
            raise UnsupportedOnDevice("resizes only image folders (through their cache)")
        self.padding, self.flip, self.mean, self.std = 0, False, None, None
        if i < len(steps) and isinstance(steps[i], data.SampleCrop):
            self.padding, i = steps[i].padding, i + 1
        if i < len(steps) and isinstance(steps[i], data.SampleFlip):
            self.flip, i = True, i + 1
        if i < len(steps) and isinstance(steps[i], data.Normalise):
            self.mean, self.std, i = steps[i].mean, steps[i].std, i + 1
        if i < len(steps):
            step = getattr(steps[i], "policy", steps[i])  # recipes wraps float-image policies
            raise UnsupportedOnDevice(f"cannot apply {type(step).__name__} to whole batches "
                                      f"(it does crop, flip and normalisation only)")
        self.random = dataset.random and (self.padding > 0 or self.flip)


def device_pipeline(dataset):
    """The ``DevicePipeline`` of a SeededDataset; raises UnsupportedOnDevice."""
    _source_kind(dataset)
    return DevicePipeline(dataset)


def _source_kind(dataset):
    base = dataset.base
    if isinstance(base, data.SyntheticImages):
        return "synthetic"
    if getattr(base, "transform", None) is not None or \
            getattr(base, "target_transform", None) is not None:
        raise UnsupportedOnDevice(f"cannot apply the transform of {type(base).__name__}")
    if isinstance(base, tv_datasets.CIFAR10):  # and CIFAR100
        return "cifar"
    if isinstance(base, tv_datasets.MNIST):  # and FashionMNIST
        return "mnist"
    if isinstance(base, data.SafeImageFolder):
        return "folder"
    raise UnsupportedOnDevice(f"has no tensor source for {type(base).__name__}")


def source_nbytes(dataset):
    """Bytes a set takes on the device path (uint8 images; float32 for synthetic)."""
    base = dataset.base
    kind = _source_kind(dataset)
    if kind == "synthetic":
        return base.images.numel() * base.images.element_size()
    if kind == "cifar":
        return int(base.data.nbytes)
    if kind == "mnist":
        return base.data.numel()
    return len(base) * 3 * dataset.image_size ** 2


def source_tensors(dataset, cache_dir=None, num_workers=0, log=say, stop=None):
    """A set's images and labels as CPU tensors: ``(images (N, C, H, W), labels (N,))``.

    uint8 images for CIFAR (``.data``), MNIST (``.data``) and image folders (the decoded
    cache, ``decoded_folder``: memory-mapped); float32 for the synthetic set. The values
    are those the per-sample path sees before its crop, flip and normalisation.

    Args:
        dataset: a SeededDataset from ``build_datasets``.
        cache_dir: where image folders' decoded caches live (default:
            ``<folder's parent>/.cache``, i.e. ``<data-dir>/.cache``).
        num_workers: processes that decode images when a cache is built.
        log: prints where the cache is and how big.
        stop: returns a signal's number to stop a cache build at, or None.

    Raises:
        UnsupportedOnDevice: a set of another kind.
    """
    base, kind = dataset.base, _source_kind(dataset)
    if kind == "synthetic":
        return base.images, base.labels.long()
    if kind == "cifar":
        images = torch.from_numpy(np.ascontiguousarray(base.data.transpose(0, 3, 1, 2)))
        return images, torch.as_tensor(base.targets, dtype=torch.long)
    if kind == "mnist":
        return base.data.unsqueeze(1).contiguous(), torch.as_tensor(base.targets).long()
    front = v2.Compose(list(DevicePipeline(dataset).front))
    if cache_dir is None:
        cache_dir = default_cache_dir(os.path.dirname(os.path.normpath(base.root)))
    return decoded_folder(base, front, dataset.image_size, cache_dir, num_workers, log, stop)


def crop_flip_batch(images, top, left, flip, padding):
    """Crops and flips a batch as ``SampleCrop`` and ``SampleFlip`` do each sample.

    Args:
        images: (N, C, H, W), any dtype, contiguous.
        top, left: int64 (N,) offsets into the images padded with zeros by ``padding``.
        flip: int64 (N,), 1 where the sample is flipped horizontally.
        padding: the zero padding on each side.

    Returns:
        (N, C, H, W): one gather from the padded batch (no per-sample Python).
    """
    n, c, h, w = images.shape
    padded = torch.nn.functional.pad(images, [padding] * 4) if padding else images
    rows = top[:, None] + torch.arange(h, device=images.device)                 # (N, H)
    cols = torch.arange(w, device=images.device).expand(n, w)
    cols = left[:, None] + torch.where(flip[:, None].bool(), w - 1 - cols, cols)  # (N, W)
    where = rows[:, :, None] * (w + 2 * padding) + cols[:, None, :]               # (N, H, W)
    where = where.view(n, 1, h * w).expand(n, c, h * w)
    return padded.reshape(n, c, -1).gather(2, where).view(n, c, h, w)


class DeviceLoader:
    """Batches gathered from a set held as one tensor on the device: the DataLoader of the
    device path.

    Iterating yields ``(x, y)`` already on ``device``: ``x`` float32 (N, C, H, W) in
    ``memory_format``, cropped and flipped (training with augmentation) with the draws of
    (seed, epoch, index) and normalised exactly as the per-sample path does; ``y`` int64.
    Each iteration starts afresh from the sampler's ``set_epoch(epoch, start)``, as a
    DataLoader's does: the epoch's indices and draws are computed at once and copied to
    the device in one transfer. No worker processes, no per-sample Python.

    Args:
        dataset: the SeededDataset (its transform says what to apply, its seed the draws).
        images: its images, (N, C, H, W) uint8 (float32 for synthetic), any device.
        labels: (N,) labels.
        device: where the set is held and batches are made.
        batch_sampler: an EpochBatchSampler (training): batches of its keys, this
            process's share of each global batch.
        indices: instead of a sampler, the indices to go through in order (validation:
            this process's shard) in batches of ``batch_size``.
        batch_size: with ``indices``.
        memory_format: of the batches (``torch.channels_last`` or contiguous).

    Raises:
        UnsupportedOnDevice: the set's transform has a step the device path cannot do.
    """

    def __init__(self, dataset, images, labels, device, batch_sampler=None, indices=None,
                 batch_size=None, memory_format=torch.contiguous_format):
        if (batch_sampler is None) == (indices is None):
            raise ValueError("DeviceLoader takes a batch_sampler or indices, not both")
        if len(images) != len(dataset) or len(labels) != len(dataset):
            raise ValueError(f"{len(images)} images and {len(labels)} labels for a set of "
                             f"{len(dataset)}")
        self.dataset = dataset
        self.pipeline = device_pipeline(dataset)
        self.device = torch.device(device)
        self.images = images.to(self.device)  # a CPU tensor (maybe memory-mapped) stays
        self.labels = labels.to(self.device, torch.long)
        self.batch_sampler, self.batch_size = batch_sampler, batch_size
        self.indices = None if indices is None else torch.as_tensor(indices, dtype=torch.long)
        self.memory_format = memory_format
        p = self.pipeline
        self._stats = None
        if p.mean is not None:
            self._stats = tuple(torch.tensor(s, dtype=torch.float32, device=self.device)
                                .view(-1, 1, 1) for s in (p.mean, p.std))

    def __len__(self):
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return -(-len(self.indices) // self.batch_size)

    def nbytes(self):
        """Bytes the set takes where it is held."""
        return self.images.numel() * self.images.element_size()

    def __iter__(self):
        if self.batch_sampler is not None:
            batches = list(self.batch_sampler.index_batches())
            epoch = self.batch_sampler.epoch
        else:
            batches, epoch = list(self.indices.split(self.batch_size)), 0
        if not batches:
            return
        index = torch.cat(batches)
        columns = [index]
        p = self.pipeline
        if p.random:
            zero = torch.zeros_like(index)
            top, left = data.crop_offsets(self.dataset.seed, epoch, index, p.padding) \
                if p.padding else (zero, zero)
            flip = data.flip_draw(self.dataset.seed, epoch, index) if p.flip else zero
            columns += [top, left, flip]
        packed = torch.stack(columns)  # one copy for the whole epoch, from pinned memory:
        if self.device.type == "cuda":  # a copy from pageable memory waits for the GPU
            packed = packed.pin_memory()
        packed = packed.to(self.device, non_blocking=True)
        for part in packed.split([len(b) for b in batches], dim=1):
            yield self._batch(part)

    def _batch(self, part):
        x = self.images.index_select(0, part[0])
        if self.pipeline.random:
            x = crop_flip_batch(x, part[1], part[2], part[3], self.pipeline.padding)
        x = x.contiguous(memory_format=self.memory_format)
        if self._stats is not None:
            x = data.normalise(x, *self._stats)
        return x, self.labels.index_select(0, part[0])


def device_data_decision(config, train_set, val_set, device):
    """Whether a run takes the device path (``--data-on-device``), and one line saying why.

    ``off``: never. ``on``: always, or a UserError when it cannot (a transform or a set it
    cannot do; on CUDA, sets larger than the free memory). ``auto``: on CUDA devices when
    both sets take at most ``DEVICE_SHARE`` (a quarter) of the free device memory and
    every transform is one the device path does; never on other devices.

    Args:
        config: the resolved config (``data_on_device``, ``dataset``, ``num_workers``,
            ``data_dir``).
        train_set, val_set: SeededDatasets from ``build_datasets``.
        device: the training device.

    Returns:
        ``(use, reason)``: a bool and a line to print (``data path: ...``).

    Raises:
        UserError: ``on`` with something the device path cannot do.
    """
    mode, device = config["data_on_device"], torch.device(device)
    workers = config["num_workers"]
    loader = f"data path: per-sample DataLoader, {workers} worker{'s' * (workers != 1)}"
    if mode == "off":
        return False, f"{loader} (--data-on-device off)"
    try:
        for dataset in (train_set, val_set):
            device_pipeline(dataset)
    except UnsupportedOnDevice as e:
        if mode == "on":
            raise UserError(f"--data-on-device on: the device path {e}; use "
                            f"--data-on-device off") from None
        return False, f"{loader} (the device path {e})"
    need = source_nbytes(train_set) + source_nbytes(val_set)
    kind = "float32" if isinstance(train_set.base, data.SyntheticImages) else "uint8"
    what = f"{config['dataset']} as {kind} tensors ({_mib(need)})"
    if isinstance(train_set.base, data.SafeImageFolder):
        cache = config.get("cache_dir") or default_cache_dir(config["data_dir"])
        what += f" decoded once into {cache}"
    how = "each batch gathered, augmented and normalised there, no DataLoader workers"
    if device.type != "cuda":
        if mode == "auto":
            return False, f"{loader} (--data-on-device auto holds data on CUDA devices " \
                          f"only; this run is on {device})"
        return True, f"data path: on {device}: {what} in memory; {how}"
    free, _ = torch.cuda.mem_get_info(device)
    share = need / max(free, 1)
    if mode == "auto" and share > DEVICE_SHARE:
        return False, f"{loader} ({what} would take {share:.0%} of the {_mib(free)} free " \
                      f"on {device}; auto allows {DEVICE_SHARE:.0%})"
    if share > 1:
        raise UserError(f"--data-on-device on: {what} do not fit in the {_mib(free)} free "
                        f"on {device}; use --data-on-device off")
    return True, f"data path: on {device}: {what}, {share:.1%} of its free memory; {how}"


def build_device_loaders(config, train_set, val_set, sampler, device, rank=0, world_size=1,
                         memory_format=torch.contiguous_format, log=say, should_stop=None):
    """The device path's loaders: ``(train_loader, val_loader)``, two DeviceLoader.

    The training loader gathers this process's share of each global batch of
    ``sampler`` (an EpochBatchSampler); the validation loader this process's shard
    (``shard_indices``) in batches of ``config["batch_size"]``. Image folders are read
    through their decoded cache (built here the first time: decoded with
    ``config["num_workers"]`` processes; under DDP let one process build it first).

    Args:
        config: with ``data_dir``, ``batch_size``, ``num_workers`` and optionally
            ``cache_dir`` (default ``<data-dir>/.cache``).
        train_set, val_set: SeededDatasets from ``build_datasets``.
        sampler: the training EpochBatchSampler.
        device: the training device.
        rank, world_size: this process and the number of processes.
        memory_format: of the batches.
        log: prints the cache's place and size.
        should_stop: returns a signal's number to stop a cache build at (``ops.
            Interrupted``), or None.

    Raises:
        UserError: a set or transform the device path cannot do.
    """
    try:
        for dataset in (train_set, val_set):
            device_pipeline(dataset)
    except UnsupportedOnDevice as e:
        raise UserError(f"--data-on-device: the device path {e}") from None
    cache_dir = config.get("cache_dir") or default_cache_dir(config["data_dir"])
    workers = config["num_workers"]
    train_loader = DeviceLoader(train_set, *source_tensors(train_set, cache_dir, workers, log,
                                                           should_stop),
                                device, batch_sampler=sampler, memory_format=memory_format)
    val_loader = DeviceLoader(val_set, *source_tensors(val_set, cache_dir, workers, log,
                                                       should_stop),
                              device, indices=data.shard_indices(len(val_set), rank, world_size),
                              batch_size=config["batch_size"], memory_format=memory_format)
    return train_loader, val_loader


def _mib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# ------------------------------------------------------ the image folders' decoded cache

ORPHAN_AGE = 3600  # s: a temporary cache file of no known writer, untouched this long, goes
_UNWRITABLE = set()  # cache directories this process could not write (warned about once)


def default_cache_dir(data_dir):
    """Where decoded caches live by default: ``<data-dir>/.cache``."""
    return os.path.join(data_dir, ".cache")


def folder_fingerprint(folder, front):
    """A hash of what a decoded cache depends on: every image's relative path, label, size,
    modification and status-change times and inode, the decoding steps (the image size
    among them) and the versions of the decoders (torch, torchvision, PIL).

    The status-change time (ctime) and the inode see a file replaced by another of the
    same size whose modification time was set back to the old one, as ``rsync -a``,
    ``tar x`` and ``cp -p`` do: no program can set a ctime.
    """
    import PIL

    h = hashlib.sha256()
    h.update(json.dumps({"version": CACHE_VERSION, "front": repr(front),
                         "classes": folder.classes, "torch": torch.__version__,
                         "torchvision": torchvision.__version__,
                         "PIL": PIL.__version__}).encode())
    for path, label in folder.samples:
        try:
            st = os.stat(path)
            facts = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        except OSError:
            facts = [-1]
        h.update(json.dumps([os.path.relpath(path, folder.root), label, *facts])
                 .encode() + b"\n")
    return h.hexdigest()


class _Decoded(torch.utils.data.Dataset):
    """A folder's images through the decoding steps (what the cache holds)."""

    def __init__(self, folder, front):
        self.folder, self.front = folder, front

    def __len__(self):
        return len(self.folder)

    def __getitem__(self, index):
        image, label = self.folder[index]  # an unreadable image: the next readable one
        return self.front(image).as_subclass(torch.Tensor), label


def _decoded_batches(folder, front, shape, num_workers, stop):
    """Every image of ``folder`` through ``front``, in order: ``(images, labels)`` numpy
    batches (uint8 (B, *shape[1:]), int64 (B,)), decoded by ``num_workers`` processes.

    Raises:
        ops.Interrupted: ``stop()`` named a signal (checked after every batch).
    """
    loader = torch.utils.data.DataLoader(
        _Decoded(folder, front), batch_size=16, num_workers=num_workers,  # a stop: soon
        worker_init_fn=data.ignore_stop_signals, generator=torch.Generator().manual_seed(0))
    for x, y in loader:
        if stop is not None and stop() is not None:
            raise Interrupted(stop(), f"while decoding {folder.root} into its cache")
        if tuple(x.shape[1:]) != tuple(shape[1:]):
            raise ValueError(f"decoded images of shape {tuple(x.shape[1:])}, expected "
                             f"{tuple(shape[1:])}")
        yield x.numpy(), y.numpy()


def _write_cache(path, shape, batches):
    """Writes the decoded images to the ``.npy`` file ``path`` as they come, atomically.

    Plain writes, not a memory map: a full disk is then an OSError (ENOSPC), where a
    memory-mapped sparse file would get SIGBUS. The temporary file's name holds this
    process's ``runtime.owner_tag()``, so a build killed with SIGKILL leaves a file the
    next one knows is an orphan (``_remove_orphans``).

    Returns:
        ``(labels, crc)``: the labels (int64 numpy) and the CRC-32 of the pixels.
    """
    labels, crc = [], 0

    def write(f):
        nonlocal crc
        np.lib.format.write_array_header_1_0(
            f, {"descr": "|u1", "fortran_order": False, "shape": tuple(shape)})
        for x, y in batches:
            f.write(memoryview(np.ascontiguousarray(x)).cast("B"))
            crc = zlib.crc32(x, crc)
            labels.append(y)

    files.atomic_write(path, write, mode="wb", prefix=f".tmp-{runtime.owner_tag()}~")
    return np.concatenate(labels) if labels else np.empty(0, np.int64), crc


def _remove_orphans(cache_dir):
    """Removes temporary cache files whose writer is gone: of this host and a process that
    no longer runs (``runtime.orphan``), or, unattributed, untouched for ``ORPHAN_AGE``."""
    try:
        names = os.listdir(cache_dir)
    except OSError:
        return
    for name in names:
        if not name.startswith(".tmp-"):
            continue
        path = os.path.join(cache_dir, name)
        with contextlib.suppress(OSError):
            stale = "~" not in name and time.time() - os.stat(path).st_mtime > ORPHAN_AGE
            if runtime.orphan(name) or stale:
                os.remove(path)


def _unreadable_reason(path):
    """Why ``load_image`` refuses a file (read again: the build's workers said it once)."""
    try:
        data.load_image(path)
    except data.UnreadableImage as e:
        return str(e)
    return "unreadable while the cache was built"


def _record_checksum(record):
    """The CRC-32 of a cache record's contents (all but its ``checksum``), canonical JSON."""
    body = {k: v for k, v in record.items() if k != "checksum"}
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


def _pixels_checksum(images, chunk=64 * 2**20):
    """The CRC-32 of a uint8 array's bytes, in chunks (a memory map is read once)."""
    flat, crc = images.reshape(-1), 0
    for start in range(0, flat.size, chunk):
        crc = zlib.crc32(flat[start:start + chunk], crc)
    return crc


def _open_cache(base, fingerprint, shape, folder):
    """The cache ``base``.npy (memory-mapped) and its record, if it can be trusted.

    Returns:
        ``(images, record, problem)``: the array and record, or Nones and, when a cache
        is there but damaged (its record or pixels do not match their checksums, it names
        files the folder lacks, the array is cut short), why (None when there is none).
    """
    try:
        with open(base + ".json", encoding="utf-8") as f:
            record = json.load(f)
    except FileNotFoundError:
        return None, None, None
    except (OSError, ValueError) as e:
        return None, None, f"its record cannot be read ({e})"
    names = {os.path.relpath(p, folder.root) for p, _ in folder.samples}
    checksum = record.get("checksum", {}) if isinstance(record, dict) else {}
    if not isinstance(checksum, dict) or checksum.get("record") != _record_checksum(record):
        return None, None, "its record does not match its checksum"
    if record.get("fingerprint") != fingerprint or record.get("shape") != list(shape) \
            or len(record.get("labels", ())) != shape[0] \
            or not set(record.get("unreadable", {})) <= names:
        return None, None, "its record does not describe this folder"
    try:
        images = np.load(base + ".npy", mmap_mode="c")  # copy-on-write: torch can wrap it
    except (OSError, ValueError) as e:
        return None, None, f"its images cannot be read ({e})"
    if images.shape != shape or images.dtype != np.uint8:
        return None, None, f"its images are {images.dtype} {images.shape}, not uint8 {shape}"
    if _pixels_checksum(images) != checksum.get("pixels"):
        return None, None, "its images do not match their checksum"
    return images, record, None


def decoded_folder(folder, front, image_size, cache_dir, num_workers=0, log=say, stop=None):
    """A data.SafeImageFolder decoded once into a uint8 array file, memory-mapped after.

    The file ``<cache_dir>/decoded-<split>-<size>px-<folder>-<fingerprint>.npy`` holds
    every image after ``front`` (decoded, resized: exactly what the per-sample path
    crops), with a record ``.json`` beside it (fingerprint, shape, labels, unreadable
    files, and the CRC-32 checksums of the pixels and of the record). It is used only
    when its record matches ``folder_fingerprint`` now (an image added, removed, replaced
    or touched, another image size or another torch / torchvision / PIL version builds a
    new one and removes the one it replaces) and both checksums match (a damaged cache is
    a warning, and is rebuilt). Both files are written with ``files.atomic_write``, the
    record last: an interrupted build leaves no cache that a later run trusts, and its
    temporary file is removed by the next build (``_remove_orphans``).

    Unreadable images are replaced by the next readable one and counted, as on the
    per-sample path (``SafeImageFolder``); a reused cache marks them again in
    ``folder.unreadable`` and warns about each. A cache directory that cannot be written
    (read-only, full) gets a warning, and the images are decoded into memory instead.

    Args:
        stop: called between batches; a signal number it returns stops the build
            (``ops.Interrupted``, nothing left behind). None: never.

    Returns:
        ``(images, labels)``: uint8 (N, 3, S, S) and int64 (N,) CPU tensors.
    """
    n = len(folder.samples)
    shape = (n, 3, image_size, image_size)
    split = os.path.basename(os.path.normpath(folder.root))
    place = hashlib.sha256(os.path.abspath(folder.root).encode()).hexdigest()[:8]
    prefix = os.path.join(cache_dir, f"decoded-{split}-{image_size}px-{place}-")
    fingerprint = folder_fingerprint(folder, front)
    base = prefix + fingerprint[:16]
    about = f"{n} images of 3x{image_size}x{image_size}, {_mib(n * 3 * image_size ** 2)}"
    _remove_orphans(cache_dir)
    images, record, problem = _open_cache(base, fingerprint, shape, folder)
    if problem is not None:
        say(f"warning: the decoded cache {base}.npy is damaged ({problem}); rebuilding it",
            file=sys.stderr)
    if images is not None:
        _mark_unreadable(folder, record["unreadable"])
        log(f"decoded cache: {base}.npy ({about}), reused")
        return torch.from_numpy(images), torch.as_tensor(record["labels"], dtype=torch.long)
    start = time.perf_counter()
    try:
        os.makedirs(cache_dir, exist_ok=True)
        labels, crc = _write_cache(base + ".npy", shape,
                                   _decoded_batches(folder, front, shape, num_workers, stop))
    except OSError as e:
        if cache_dir not in _UNWRITABLE:  # once, not once per split
            say(f"warning: cannot write the decoded cache in {cache_dir} "
                f"({e.strerror or e}); decoding the images into memory for this run only",
                file=sys.stderr)
        _UNWRITABLE.add(cache_dir)
        return _decode_into_memory(folder, front, shape, num_workers, stop)
    _write_record(folder, front, fingerprint, shape, labels, crc, base, prefix)
    log(f"decoded cache: {base}.npy ({about}), built in {time.perf_counter() - start:.1f} s")
    return (torch.from_numpy(np.load(base + ".npy", mmap_mode="c")),
            torch.from_numpy(labels))


def _mark_unreadable(folder, unreadable):
    """Flags, and warns about, the images a reused cache found unreadable."""
    where = {os.path.relpath(p, folder.root): i for i, (p, _) in enumerate(folder.samples)}
    for rel, reason in unreadable.items():
        folder.unreadable[where[rel]] = 1
        say(f"warning: skipping unreadable image {os.path.join(folder.root, rel)} "
            f"({reason}; as found when the decoded cache was built); the next "
            f"readable image of the set stands in for it", file=sys.stderr)


def _decode_into_memory(folder, front, shape, num_workers, stop):
    """The images decoded into a numpy array, for a run whose cache cannot be written."""
    images, labels, pos = np.empty(shape, dtype=np.uint8), [], 0
    for x, y in _decoded_batches(folder, front, shape, num_workers, stop):
        images[pos:pos + len(x)] = x
        labels.append(y)
        pos += len(x)
    return torch.from_numpy(images), torch.from_numpy(np.concatenate(labels))


def _write_record(folder, front, fingerprint, shape, labels, crc, base, prefix):
    """Writes the record that makes a built cache trusted (unless the folder changed
    meanwhile), then removes the caches of the folder's older contents."""
    unreadable = {os.path.relpath(p, folder.root): _unreadable_reason(p)
                  for (p, _), bad in zip(folder.samples, folder.unreadable.tolist()) if bad}
    if folder_fingerprint(folder, front) != fingerprint:
        say(f"warning: {folder.root} changed while it was decoded; its cache will be "
            f"rebuilt by the next run", file=sys.stderr)
        return
    record = {"version": CACHE_VERSION, "fingerprint": fingerprint, "shape": list(shape),
              "root": folder.root, "labels": labels.tolist(), "unreadable": unreadable}
    record["checksum"] = {"pixels": crc, "record": _record_checksum(record)}
    try:
        files.atomic_write(base + ".json", lambda f: json.dump(record, f))
    except OSError as e:  # the images are whole: use them, the next run rebuilds
        say(f"warning: cannot write {base}.json ({e.strerror or e}); the decoded "
            f"cache will be rebuilt by the next run", file=sys.stderr)
        return
    for old in glob.glob(glob.escape(prefix) + "*"):  # caches of older contents
        if not old.startswith(base + "."):
            with contextlib.suppress(OSError):
                os.remove(old)

"""The device path: whole sets held as tensors on the training device, batches made there.

``DeviceLoader`` holds a set as one uint8 (synthetic: float32) tensor on the training
device and gathers, crops, flips and normalises each batch there: no worker processes,
no per-sample Python. It draws the same crop offsets and flips
(``sample_transforms.crop_flip_draws``, a hash of (seed, epoch, index)) and does the same
arithmetic (zero padding, indexing, ``sample_transforms.normalise``) as the per-sample
path in data.py, so both give the same samples, bit for bit on the CPU.
``device_data_decision`` says which path a run takes and why (``--data-on-device``);
``build_device_loaders`` builds this one.

Image folders reach it through their decoded cache (decoded_cache.py): every image
decoded and resized once into a memory-mapped uint8 array file under
``<data-dir>/.cache``.
"""

import os

import numpy as np
import torch
from torchvision import datasets as tv_datasets
from torchvision.transforms import v2

from machinery import hardware, runtime
from machinery.runtime import say
from ops import UserError, sum_over_processes
from pipeline import data, decoded_cache, presets, sample_transforms, sources
from pipeline.decoded_cache import mib as _mib

DEVICE_SHARE = 0.25  # --data-on-device auto: the sets may take this share of free memory


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
                dataset.base, (data.SafeImageFolder, sources.EncodedImages)):
            raise UnsupportedOnDevice("resizes only image folders (through their cache)")
        self.padding, self.flip, self.mean, self.std = 0, False, None, None
        self.photo = None  # photos: "train" (random-resized crop) or "eval" (centre crop)
        if i < len(steps) and isinstance(steps[i], sample_transforms.SampleCrop):
            self.padding, i = steps[i].padding, i + 1
        elif i < len(steps) and isinstance(steps[i], (presets.RandomResizedCrop,
                                                      presets.CenterCrop)):
            crop = steps[i]
            self.photo = "train" if isinstance(crop, presets.RandomResizedCrop) else "eval"
            self.size, i = crop.size, i + 1
            self.min_scale = getattr(crop, "min_scale", None)
            self.interpolation = getattr(crop, "interpolation", None)
        if i < len(steps) and isinstance(steps[i], sample_transforms.SampleFlip):
            self.flip, i = True, i + 1
        if i < len(steps) and isinstance(steps[i], sample_transforms.Normalise):
            self.mean, self.std, i = steps[i].mean, steps[i].std, i + 1
        if i < len(steps):
            step = getattr(steps[i], "policy", steps[i])  # recipes wraps float-image policies
            raise UnsupportedOnDevice(f"cannot apply {type(step).__name__} to whole batches "
                                      f"(it does crop, flip and normalisation only)")
        self.random = dataset.random and (self.padding > 0 or self.flip or
                                          self.photo == "train")


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
    if isinstance(base, data.CachedImages):
        return "photos"
    if isinstance(base, sources.EncodedImages) and not getattr(base, "streamed", False) \
            and base.decoder is None:  # hf, indexed shards: decoded into memory
        return "encoded"
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
    if kind == "photos":
        return base.decoded.nbytes
    return len(base) * 3 * dataset.image_size ** 2


def source_tensors(dataset, cache_dir=None, num_workers=0, log=say, stop=None):
    """A set's images and labels as CPU tensors: ``(images (N, C, H, W), labels (N,))``;
    for photos, ``images`` is their ``decoded_cache.Decoded`` (images of many sizes).

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
    if kind == "photos":  # decoded into their cache when the set was built
        return base.decoded, base.decoded.labels
    if kind == "encoded":  # (no files to fingerprint for a cache: decoded for this run)
        decoded = decoded_cache._decode_into_memory(base, decoded_cache.Resized(
            v2.Compose(list(DevicePipeline(dataset).front)), dataset.image_size), num_workers,
            stop)
        return decoded.images, decoded.labels
    front = v2.Compose(list(DevicePipeline(dataset).front))
    if cache_dir is None:
        cache_dir = decoded_cache.default_cache_dir(os.path.dirname(os.path.normpath(
            base.root)))
    decoded = decoded_cache.decoded_folder(
        base, decoded_cache.Resized(front, dataset.image_size), cache_dir, num_workers, log,
        stop, unreadable_reason=data.unreadable_reason)
    return decoded.images, decoded.labels


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


def path_record(loader, device):
    """What a checkpoint records of the data path (``check_same_path``): on
    CUDA, where the device path and the DataLoader round a resize apart by up to a level,
    ``{"path": "device"}`` or ``{"path": "loader"}``; elsewhere, where both give the same
    bits, nothing."""
    if torch.device(device).type != "cuda":
        return {}
    return {"path": "device" if isinstance(loader, DeviceLoader) else "loader"}


PATHS = {"device": "the device data path", "loader": "the per-sample DataLoader"}


def check_same_path(saved, path, identity, warn=print):
    """Says, in one line, when a CUDA run resumes on the other data path than its
    checkpoint's (``identity["path"]``: recorded on CUDA only; ``--data-on-device auto``
    decides by the free memory, which a restart may find otherwise): there the two round a
    resize apart by up to one level, so the batches are not the same bits. It continues."""
    before, now = saved.get("data", {}).get("path"), identity.get("path")
    if before is None or now is None or before == now:
        return
    warn(f"warning: {path!r} was trained on {PATHS[before]}, this run takes {PATHS[now]} "
         f"(--data-on-device auto decides by the free memory): on CUDA their resizes round "
         f"apart by up to one level, so it will not end bit for bit as the run that never "
         f"stopped; --data-on-device {'on' if before == 'device' else 'off'} keeps its path")


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
        if len(images) != len(dataset) or len(labels) != len(dataset):  # (Decoded too)
            raise ValueError(f"{len(images)} images and {len(labels)} labels for a set of "
                             f"{len(dataset)}")
        self.dataset = dataset
        self.pipeline = device_pipeline(dataset)
        self.device = torch.device(device)
        self.shapes = None
        if isinstance(images, decoded_cache.Decoded):  # photos: many sizes, one buffer
            self.shapes = images.shapes  # (on the CPU)
            self._shape_list = images.shapes.numpy()
            self._offset_list = images.offsets.numpy()
            images = images.images
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

    def epoch_batches(self):
        """``(batches, epoch)``: this epoch's index batches from where the sampler stands
        (training), or the shard in order (validation, epoch 0)."""
        if self.batch_sampler is not None:
            return list(self.batch_sampler.index_batches()), self.batch_sampler.epoch
        return list(self.indices.split(self.batch_size)), 0

    def __iter__(self):
        batches, epoch = self.epoch_batches()
        if not batches:
            return
        p = self.pipeline
        if p.photo is not None:
            yield from self._photo_batches(batches, torch.cat(batches), epoch)
            return
        for part in draws_on_device(batches, epoch, self.dataset.seed, p.padding, p.flip,
                                    p.random, self.device):
            yield self._batch(part)

    def _photo_batches(self, batches, index, epoch):
        """Photos: each image cropped (and resized) on its own, on the device, with the
        per-sample path's boxes (``presets.crop_boxes``) and the same resize kernel; the
        epoch's indices and flips reach the device in one copy."""
        p, seed = self.pipeline, self.dataset.seed
        shapes = self.shapes[index]
        flip = sample_transforms.flip_draw(seed, epoch, index) if p.random and p.flip else \
            torch.zeros_like(index)
        boxes = [b.tolist() for b in presets.crop_boxes(
            seed, epoch, index, shapes[:, 1], shapes[:, 2], p.min_scale)] \
            if p.photo == "train" and p.random else None
        where, start = index.tolist(), 0
        for part in columns_on_device([index, flip], batches, self.device):
            crops = []
            for k in range(start, start + part.shape[1]):
                image = self._image(where[k])
                crops.append(presets.resized_crop(image, *(b[k] for b in boxes), p.size,
                                                  p.interpolation) if boxes is not None
                             else presets.center_crop(image, p.size))
            start += part.shape[1]
            x = torch.stack(crops)  # (N, C, size, size) uint8
            if boxes is not None and p.flip:
                x = torch.where(part[1].bool().view(-1, 1, 1, 1), x.flip(-1), x)
            x = x.contiguous(memory_format=self.memory_format)
            if self._stats is not None:
                x = sample_transforms.normalise(x, *self._stats)
            yield x, self.labels.index_select(0, part[0])

    def _image(self, i):
        """Photo ``i`` as a (C, H, W) view of the buffer on the device."""
        c, h, w = (int(v) for v in self._shape_list[i])
        start = int(self._offset_list[i])
        return self.images[start:start + c * h * w].view(c, h, w)

    def _batch(self, part):
        x = self.images.index_select(0, part[0])
        if self.pipeline.random:
            x = crop_flip_batch(x, part[1], part[2], part[3], self.pipeline.padding)
        x = x.contiguous(memory_format=self.memory_format)
        if self._stats is not None:
            x = sample_transforms.normalise(x, *self._stats)
        return x, self.labels.index_select(0, part[0])


def columns_on_device(columns, batches, device):
    """The epoch's columns (1-d int64 tensors, one entry per sample of ``batches``) on
    ``device`` in one copy, from pinned memory on CUDA (a copy from pageable memory waits
    for the GPU): a ``(len(columns), len(batch))`` tensor per batch."""
    packed = torch.stack(columns)
    if device.type == "cuda":
        packed = packed.pin_memory()
    packed = packed.to(device, non_blocking=True)
    return packed.split([len(b) for b in batches], dim=1)


def draws_on_device(batches, epoch, seed, padding, flip, random, device):
    """Each batch's indices and their crop and flip draws on ``device``, the epoch's in one
    copy (``columns_on_device``): rows index, top, left, flip, the offsets zero without
    ``padding`` and the flips zero without ``flip``; the index row alone when not
    ``random``. Both device paths' (this one's and segmentation_data.py's)."""
    index = torch.cat(batches)
    columns = [index]
    if random:
        zero = torch.zeros_like(index)
        top, left = sample_transforms.crop_offsets(
            seed, epoch, index, padding) if padding else (zero, zero)
        columns += [top, left, sample_transforms.flip_draw(seed, epoch, index) if flip else zero]
    return columns_on_device(columns, batches, device)


def device_data_decision(config, train_set, val_set, device):
    """Whether a run takes the device path (``--data-on-device``), and one line saying why.

    ``off``: never. ``on``: always, or a UserError when it cannot (a transform or a set it
    cannot do; on CUDA, sets larger than the free memory). ``auto``: when both sets take
    at most ``DEVICE_SHARE`` (a quarter) of the free memory of the device (under
    --gpu-memory-fraction, of what its cap leaves; on the CPU: of the memory available)
    and every transform is one the device path does (on the CPU too: one process
    gathering whole batches from memory beats workers that send each sample through a
    pipe: bench/data.py; photos come out even, bench/photos.py).

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
        cache = config.get("cache_dir") or decoded_cache.default_cache_dir(config["data_dir"])
        what += f" decoded once into {cache}"
    return memory_decision(config, device, need, what, loader)


def memory_decision(config, device, need, what, loader):
    """``device_data_decision``'s memory rule, for any set the device path can hold: on
    CUDA its free memory (under --gpu-memory-fraction, what the cap leaves), elsewhere the
    memory available; ``auto`` takes at most ``DEVICE_SHARE`` of it.

    Args:
        config: the run's (``data_on_device``, ``gpu_memory_fraction``).
        device: the training device.
        need: the bytes the sets take there.
        what: the sets, in words, for the line.
        loader: the line's words for the per-sample path.

    Returns:
        ``(use, reason)``.
    """
    mode = config["data_on_device"]
    how = "each batch gathered, augmented and normalised there, no DataLoader workers"
    if device.type != "cuda":
        if mode == "on":
            return True, f"data path: on {device}: {what} in memory; {how}"
        free = hardware.available_memory()
        share = need / max(free, 1)
        if share > DEVICE_SHARE:
            return False, f"{loader} ({what} would take {share:.0%} of the {_mib(free)} " \
                          f"of memory available; auto allows {DEVICE_SHARE:.0%})"
        return True, f"data path: in memory ({device}): {what}, {share:.1%} of the " \
                     f"{_mib(free)} available; {how} (--data-on-device auto)"
    free, where = cuda_free_memory(device, config.get("gpu_memory_fraction"))
    share = need / max(free, 1)
    if mode == "auto" and share > DEVICE_SHARE:
        return False, f"{loader} ({what} would take {share:.0%} of the {_mib(free)} free " \
                      f"{where}; auto allows {DEVICE_SHARE:.0%})"
    if share > 1:
        raise UserError(f"--data-on-device on: {what} do not fit in the {_mib(free)} free "
                        f"{where}; use --data-on-device off")
    return True, f"data path: on {device}: {what}, {share:.1%} of its free memory; {how}"


def cuda_free_memory(device, fraction=None):
    """The memory this process can still take on a CUDA device: the card's free memory,
    or less under --gpu-memory-fraction, whose cap (``fraction`` of the total) counts what
    the process's allocator holds already.

    Returns:
        ``(bytes, where)``: the figure and the words that say whose it is (``on cuda:0``).
    """
    free, total = torch.cuda.mem_get_info(device)
    if fraction:
        cap = int(fraction * total) - torch.cuda.memory_reserved(device)
        if cap < free:
            return max(cap, 0), f"on {device} under --gpu-memory-fraction {fraction:g}"
    return free, f"on {device}"


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
    cache_dir = config.get("cache_dir") or decoded_cache.default_cache_dir(config["data_dir"])
    workers = config["num_workers"]
    with data.requeue_on_stop(config):  # SIGUSR1 in a cache's build still requeues
        train_source = source_tensors(train_set, cache_dir, workers, log, should_stop)
        val_source = source_tensors(val_set, cache_dir, workers, log, should_stop)
    train_loader = DeviceLoader(train_set, *train_source, device, batch_sampler=sampler,
                                memory_format=memory_format)
    val_loader = DeviceLoader(val_set, *val_source, device,
                              indices=data.shard_indices(len(val_set), rank, world_size),
                              batch_size=config["batch_size"], memory_format=memory_format)
    return train_loader, val_loader


def build_loaders(config, procs, train_set, val_set, sampler, stop=None,
                  decide=device_data_decision, device_loaders=build_device_loaders):
    """Loaders: training batches from the seeded sampler, this process's validation shard.

    With --data-on-device (auto decides, and says why), both sets live on the device as
    tensors and whole batches are augmented there; otherwise DataLoader workers augment
    each sample. Both paths give the same batches. ``decide`` and ``device_loaders`` are
    the device path's decision and builder (segmentation_data has its own for masks).
    """
    use, why = decide(config, train_set, val_set, procs.device)
    if procs.world_size > 1:  # auto may differ between GPUs: one path for every process
        use = sum_over_processes([int(use)], procs.device,
                                     procs.world_size)[0] == procs.world_size
    runtime.main_print(why)
    if use:
        memory_format = torch.channels_last if config["channels_last"] \
            else torch.contiguous_format
        return runtime.main_process_first(  # it builds an image folder's decoded cache
            procs, "holding the data on the device (an image folder: decoding it once)",
            device_loaders, config, train_set, val_set, sampler,
            procs.device, procs.rank, procs.world_size, memory_format,
            log=runtime.main_print, stop=stop, should_stop=stop)
    pin = procs.device.type == "cuda"
    train_loader = data.build_loader(train_set, batch_sampler=sampler,
                                     num_workers=config["num_workers"], pin_memory=pin)
    val_loader = data.build_loader(
        val_set, batch_size=config["batch_size"], num_workers=config["num_workers"],
        pin_memory=pin, sampler=data.shard_indices(len(val_set), procs.rank, procs.world_size))
    return train_loader, val_loader

"""Datasets, transforms, the deterministic sampler and the loaders.

Determinism promise (docs/design.md): the order of samples in an epoch depends only on the
seed and the epoch, and a sample's random augmentation only on (seed, epoch, index).
``EpochBatchSampler`` yields keys ``(index, epoch)``. A sample's crop offset and flip are
drawn from a counter-based integer hash of (seed, epoch, index) (``crop_flip_draws``);
any other random transform draws from torch's generator, which ``SeededDataset`` seeds
from the same key. So results do not depend on the batch size, the number of DataLoader
workers, the number of processes, or where a run was resumed.

Two data paths give the same samples, bit for bit on the CPU:

- the per-sample path: ``SeededDataset`` in a DataLoader (``build_loader``), one PIL
  image or tensor at a time, in worker processes;
- the device path: ``DeviceLoader`` holds a whole set as a uint8 (synthetic: float)
  tensor on the training device and gathers, crops, flips and normalises each batch
  there, with the same draws and the same arithmetic (``crop_flip_batch``,
  ``normalise``). ``device_data_decision`` says which path a run takes and why;
  ``build_device_loaders`` builds it. Image folders reach it through a decoded cache
  (``decoded_folder``): every image decoded and resized once into a memory-mapped
  uint8 array file under ``<data-dir>/.cache``.
"""

import contextlib
import functools
import glob
import hashlib
import json
import os
import signal
import socket
import sys
import threading
import time
import warnings

import numpy as np
import torch
import torch.utils.data
import torchvision
from PIL import Image
from torchvision import datasets as tv_datasets
from torchvision import tv_tensors
from torchvision.transforms import v2

import recipes
from ops import UserError

# Per-channel mean and std of the training split, for normalisation.
STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}
TORCHVISION_SETS = {"cifar10": tv_datasets.CIFAR10, "cifar100": tv_datasets.CIFAR100,
                    "mnist": tv_datasets.MNIST, "fashion_mnist": tv_datasets.FashionMNIST}
DATASETS = sorted(TORCHVISION_SETS) + ["imagefolder", "synthetic"]
# The raster formats an ImageFolder image may be in. Left free, PIL.Image.open tries about
# forty formats on any file, EPS among them (which runs Ghostscript on the file).
IMAGE_FORMATS = ("JPEG", "PNG", "BMP", "GIF", "TIFF", "WEBP", "PPM")


def sample_seed(seed, epoch, index):
    """The seed of torch's generator for one sample's random transforms other than crop and
    flip (those use ``crop_flip_draws``): a function of (seed, epoch, index) only."""
    return ((seed * 1_000_003 + epoch) * 1_000_000_007 + index) % (2**63 - 1)


# ------------------------------------------------------------ the counter-based hash
#
# Crop offsets and flips come from a hash of (seed, epoch, index), not from an RNG state:
# the same integer arithmetic on Python ints (one sample, per-sample path) and on int64
# tensors (a whole epoch at once, device path) gives the same draws on any device. Every
# intermediate value stays below 2**49, so int64 tensors never overflow.

_MASK32 = 0xFFFFFFFF
STREAM_TOP, STREAM_LEFT, STREAM_FLIP = 1, 2, 3  # one independent draw per stream


def _mul32(x, c):
    """``x * c mod 2**32`` for ``0 <= x < 2**32``, in 16-bit halves of ``c`` (exact in int64)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def mix32(x):
    """A bijection of 32-bit integers with strong avalanche: ``lowbias32`` from Chris
    Wellons' hash prospector. Works on Python ints and on int64 tensors alike."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def sample_hash(seed, epoch, index, stream):
    """A 32-bit hash of (seed, epoch, index) for one ``stream`` of draws.

    ``index`` may be an int or an int64 tensor of indices (``seed``, ``epoch`` and
    ``stream`` are ints); the result has its type. Distinct indices of one (seed, epoch,
    stream) always give distinct hashes (each step is a bijection).
    """
    return mix32(_stream_key(seed, epoch, stream) ^ (index & _MASK32))


@functools.lru_cache(maxsize=64)
def _stream_key(seed, epoch, stream):
    """The part of ``sample_hash`` shared by an epoch's samples (computed once)."""
    return mix32(mix32(mix32(stream) ^ (seed & _MASK32)) ^ (epoch & _MASK32))


def crop_offsets(seed, epoch, index, padding):
    """``(top, left)``: a sample's crop offsets into its image padded by ``padding`` on each
    side, each in ``[0, 2 * padding]``; ints, or int64 tensors when ``index`` is one."""
    span = 2 * padding + 1
    return (sample_hash(seed, epoch, index, STREAM_TOP) % span,
            sample_hash(seed, epoch, index, STREAM_LEFT) % span)


def flip_draw(seed, epoch, index):
    """1 where a sample is flipped horizontally, else 0 (an int, or an int64 tensor)."""
    return sample_hash(seed, epoch, index, STREAM_FLIP) >> 31


def crop_flip_draws(seed, epoch, index, padding):
    """The crop offset and flip of samples: ``(top, left, flip)``.

    Args:
        seed: the run's seed.
        epoch: the epoch.
        index: a sample's index (int), or an int64 tensor of indices.
        padding: the crop's zero padding on each side; offsets lie in ``[0, 2 * padding]``.

    Returns:
        ``top`` and ``left`` offsets into the padded image and ``flip`` (1: flip
        horizontally, 0: not), ints or int64 tensors like ``index``.
    """
    return (*crop_offsets(seed, epoch, index, padding), flip_draw(seed, epoch, index))


_SAMPLE = threading.local()  # (seed, epoch, index) of the sample being transformed


def current_sample():
    """``(seed, epoch, index)`` of the sample ``SeededDataset`` is transforming now."""
    key = getattr(_SAMPLE, "key", None)
    if key is None:
        raise RuntimeError("SampleCrop and SampleFlip draw from the sample's (seed, epoch, "
                           "index): call the transform through SeededDataset")
    return key


def _like(out, image):
    """``out`` as the same tv_tensors type as ``image`` (torch ops return plain tensors)."""
    return tv_tensors.wrap(out, like=image) if isinstance(image, tv_tensors.TVTensor) else out


class SampleCrop:
    """Random crop with zero padding, as ``v2.RandomCrop(size, padding)``, whose offset is
    ``crop_flip_draws`` of the sample being transformed (not torch's RNG). Takes (C, H, W)
    tensors, uint8 or float; the output has the input's side."""

    def __init__(self, padding):
        self.padding = padding

    def __call__(self, image):
        top, left = crop_offsets(*current_sample(), self.padding)
        h, w = image.shape[-2:]
        padded = torch.nn.functional.pad(image.as_subclass(torch.Tensor), [self.padding] * 4)
        return _like(padded[..., top:top + h, left:left + w], image)

    def __repr__(self):
        return f"SampleCrop(padding={self.padding})"


class SampleFlip:
    """Horizontal flip of half the samples, as ``v2.RandomHorizontalFlip()``, decided by
    ``crop_flip_draws`` of the sample being transformed."""

    def __call__(self, image):
        if not flip_draw(*current_sample()):
            return image
        return _like(image.as_subclass(torch.Tensor).flip(-1), image)

    def __repr__(self):
        return "SampleFlip()"


def normalise(images, mean, std):
    """uint8 images scaled to [0, 1] floats (as ``v2.ToDtype(float32, scale=True)``), then
    ``(x - mean) / std`` per channel (as ``v2.Normalize``); float images only the latter.

    The per-sample path (one (C, H, W) image) and the device path (a (N, C, H, W) batch)
    both call this: elementwise, in the same order, so the results are the same bits.
    ``mean`` and ``std`` are sequences or float32 tensors of shape (C, 1, 1).
    """
    x = images.as_subclass(torch.Tensor)
    mean = torch.as_tensor(mean, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    std = torch.as_tensor(std, dtype=torch.float32, device=x.device).view(-1, 1, 1)
    if x.is_floating_point():
        x = x.to(torch.float32).sub(mean)
    else:
        x = x.to(torch.float32).mul_(1.0 / 255).sub_(mean)
    return x.div_(std)


class Normalise:
    """``normalise`` as a transform (uint8 or float image in, normalised float32 out)."""

    def __init__(self, mean, std):
        self.mean, self.std = tuple(mean), tuple(std)

    def __call__(self, image):
        return normalise(image, self.mean, self.std)

    def __repr__(self):
        return f"Normalise(mean={self.mean}, std={self.std})"


class SeededDataset(torch.utils.data.Dataset):
    """A dataset whose random transform is seeded per sample from (seed, epoch, index).

    Indexed by a key ``(index, epoch)`` (or a plain index, meaning epoch 0). The global
    torch RNG is forked around the transform, so augmentation never disturbs the
    randomness of the model (dropout) in the main process.

    Args:
        base: a map-style dataset returning ``(image, label)``.
        transform: applied to the image.
        seed: the run's seed.
        random: whether ``transform`` is random (training augmentation).
        classes: class names, in label order.
        in_channels: channels of the transformed images.
        image_size: side of the transformed (square) images.
    """

    def __init__(self, base, transform, seed, random, classes, in_channels, image_size):
        self.base = base
        self.transform = transform
        self.seed = seed
        self.random = random
        self.classes = list(classes)
        self.num_classes = len(self.classes)
        self.in_channels = in_channels
        self.image_size = image_size

    def __len__(self):
        return len(self.base)

    def unreadable_count(self):
        """The number of distinct files of the set found unreadable so far by this process
        or its DataLoader workers (0 for sets that read no files)."""
        count = getattr(self.base, "unreadable_count", None)
        return count() if count is not None else 0

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        image, label = self.base[index]
        if not self.random:
            return self.transform(image), label
        # Crop and flip read the key (current_sample); any other random transform draws
        # from torch's CPU generator, seeded for this sample and restored afterwards
        # (torch.random.fork_rng does the same but costs 50x more per sample).
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(sample_seed(self.seed, epoch, index))
        _SAMPLE.key = (self.seed, epoch, index)
        try:
            return self.transform(image), label
        finally:
            _SAMPLE.key = None
            generator.set_state(state)


class SyntheticImages(torch.utils.data.Dataset):
    """Learnable images made in memory: a smooth random template per class plus noise.

    Templates are 4x4 random patterns upsampled to the image size, so they survive the
    default crop-and-flip augmentation and a small CNN learns to tell them apart.

    Args:
        size: number of samples.
        num_classes: number of classes (labels are balanced).
        in_channels: channels of the images.
        image_size: side of the square images.
        seed: seeds templates, labels and noise (the same seed gives the same set).
        split: ``"train"`` or ``"val"``; the two share templates, not samples.
        noise: standard deviation of the per-pixel noise.
    """

    def __init__(self, size, num_classes, in_channels, image_size, seed, split, noise=0.6):
        g = torch.Generator().manual_seed(seed)
        coarse = torch.randn(num_classes, in_channels, 4, 4, generator=g)
        templates = torch.nn.functional.interpolate(coarse, size=(image_size, image_size),
                                                    mode="bilinear", align_corners=False)
        templates = templates / templates.std(dim=(1, 2, 3), keepdim=True)
        g.manual_seed(seed * 2 + (split == "val"))  # splits share templates, not samples
        self.labels = torch.arange(size) % num_classes
        self.labels = self.labels[torch.randperm(size, generator=g)]
        noise = noise * torch.randn(size, in_channels, image_size, image_size, generator=g)
        self.images = templates[self.labels] + noise  # (size, C, H, W), about N(0, 1)
        self.classes = [f"class{i}" for i in range(num_classes)]

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], int(self.labels[index])


class UnreadableImage(OSError):
    """An image file that cannot be decoded: empty, truncated, not an image, too large."""


def _to_rgb(image):
    """An 8-bit RGB copy of a decoded image.

    16-bit (``I;16*``), 32-bit (``I``) and float (``F``) grayscale is scaled to 8 bits by
    its bit depth, not clipped at 255: 16 bits for ``I;16*``; for ``I`` and ``F`` the
    smallest of 8, 16 or 31 (signed 32) bits that holds the largest value, or [0, 1] for
    floats up to 1.
    """
    if image.mode.startswith("I;16") or image.mode in ("I", "F"):
        top = image.getextrema()[1]
        if image.mode.startswith("I;16"):
            full = 2**16 - 1
        elif image.mode == "F" and top <= 1:
            full = 1
        else:
            full = next((2**b - 1 for b in (8, 16, 31) if top < 2**b), top)
        mode = "F" if image.mode == "F" else "I"
        image = image.convert(mode).point(lambda v: v * 255 / full).convert("L")
    return image.convert("RGB")  # palette, LA, RGBA, CMYK... (and always a copy)


def load_image(path):
    """Reads an image file fully into an 8-bit RGB PIL image (ImageFolder's loader).

    Only ``IMAGE_FORMATS`` are tried (never EPS/PostScript or PDF). A decompression bomb
    (more than ``PIL.Image.MAX_IMAGE_PIXELS`` pixels) counts as unreadable. The whole image
    is decoded here, so a truncated file fails here and not later in a transform.

    Args:
        path: the image file.

    Returns:
        The RGB image (see ``_to_rgb`` for 16-bit, 32-bit and float grayscale).

    Raises:
        UnreadableImage: the file cannot be read; the message says why.
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path, formats=IMAGE_FORMATS) as image:
                image.load()
                return _to_rgb(image)
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError, EOFError...
        reason = str(e).splitlines()[0] if str(e) else "no message"
        raise UnreadableImage(f"{type(e).__name__}: {reason}") from e


class SafeImageFolder(tv_datasets.ImageFolder):
    """An ImageFolder on which an unreadable image never stops a run.

    A sample whose file cannot be read (see ``load_image``) is replaced by the next readable
    sample of the set, wrapping around: the replacement depends only on the files, so
    results are the same with any number of workers and after a resume. A ``warning:``
    line naming the file goes to stderr. Unreadable files are flagged in a shared-memory
    tensor that the main process and the DataLoader workers (forked, or spawned: it is
    pickled as shared memory) all see; flagged files are skipped without reading them
    again, so each is reported once.

    Args:
        root: the folder with one sub-folder per class.

    Raises:
        UserError: no image of the set can be read (checked when it is built, from the
            first image on, in the process that builds it).
    """

    def __init__(self, root):
        super().__init__(root, loader=load_image)
        self.unreadable = torch.zeros(len(self.samples), dtype=torch.uint8).share_memory_()
        self[0]  # finds a readable image now, or raises UserError

    def __getitem__(self, index):
        size = len(self.samples)
        for i in (j % size for j in range(index, index + size)):
            if self.unreadable[i]:
                continue
            path, label = self.samples[i]
            try:
                return self.loader(path), label
            except UnreadableImage as e:
                self.unreadable[i] = 1
                print(f"warning: skipping unreadable image {path} ({e}); the next readable "
                      f"image of the set stands in for it", file=sys.stderr, flush=True)
        raise UserError(f"no image in {self.root!r} can be read (see the warnings above)")

    def unreadable_count(self):
        """The number of distinct files of the set found unreadable so far."""
        return int(self.unreadable.sum())


def mirror_keeps_class(name):
    """Whether a mirrored image of dataset ``name`` is still of its class (a mirrored digit
    is another digit): training flips and --tta flip apply only where it is."""
    return name not in recipes.DIGITS


def _transforms(name, image_size, augment, from_pil=True, policy=((), ())):
    """The train (maybe augmented) and eval transforms of a dataset.

    Images are cropped and flipped as uint8 (cheaper), then scaled to [0, 1] floats and
    normalised with the dataset's statistics. Crop and flip draw from (seed, epoch,
    index) (``SampleCrop``, ``SampleFlip``); the device path does the same to whole
    batches (``device_pipeline`` reads these lists: a transform it does not know keeps
    a run on the per-sample path). ``policy`` is ``recipes.policy_transforms``'s pair:
    an AutoAugment-family policy after crop and flip, random erasing after normalising.
    """
    front = [v2.ToImage()] if from_pil else []
    if name == "imagefolder":
        front.append(v2.Resize((image_size, image_size), antialias=True))
    back = [Normalise(*STATS[name])] if name in STATS else []  # every PIL set has STATS
    aug = []
    if augment:
        aug = [SampleCrop(padding=max(image_size // 8, 1))]
        if mirror_keeps_class(name):
            aug.append(SampleFlip())
    if augment:
        aug, back_train = aug + list(policy[0]), back + list(policy[1])
    else:
        back_train = back
    train, evaluation = front + aug + back_train, front + back
    return (v2.Compose(train) if train else v2.Identity(),
            v2.Compose(evaluation) if evaluation else v2.Identity())


def _torchvision_split(name, data_dir, train):
    cls = TORCHVISION_SETS[name]
    try:
        return cls(data_dir, train=train, download=False)
    except RuntimeError:
        pass  # not there yet: download it
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    try:
        return cls(data_dir, train=train, download=True)
    except Exception as e:  # URLError, HTTPError, OSError, checksum errors...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"could not download {name} into {data_dir!r} ({reason}); offline? Put an "
            f"existing copy there and pass --data-dir, or train on --dataset imagefolder "
            f"or --dataset synthetic") from None
    finally:
        socket.setdefaulttimeout(old_timeout)


def _imagefolder_splits(data_dir, image_size, augment, seed, policy):
    train_dir = os.path.join(data_dir, "train")
    val_dir = next((os.path.join(data_dir, s) for s in ("val", "test")
                    if os.path.isdir(os.path.join(data_dir, s))), None)
    if not os.path.isdir(train_dir) or val_dir is None:
        raise UserError(f"--dataset imagefolder needs {data_dir!r} to hold train/ and val/ "
                        f"(or test/) folders with one sub-folder per class")
    try:
        train = SafeImageFolder(train_dir)
        val = SafeImageFolder(val_dir)
    except (FileNotFoundError, RuntimeError) as e:
        raise UserError(f"cannot read image folders in {data_dir!r}: {e}") from None
    if train.classes != val.classes:
        only_train = sorted(set(train.classes) - set(val.classes))
        only_val = sorted(set(val.classes) - set(train.classes))
        raise UserError(f"the class folders of {train_dir!r} and {val_dir!r} differ: only "
                        f"in train: {only_train or 'none'}; only in "
                        f"{os.path.basename(val_dir)}: {only_val or 'none'}")
    if len(train.classes) == 1:
        print(f"warning: {train_dir!r} has a single class folder ({train.classes[0]!r}): "
              f"every label is the same, so there is nothing to learn", file=sys.stderr)
    t_train, t_eval = _transforms("imagefolder", image_size, augment, policy=policy)
    return (SeededDataset(train, t_train, seed, augment, train.classes, 3, image_size),
            SeededDataset(val, t_eval, seed, False, val.classes, 3, image_size))


def build_datasets(config):
    """Builds the training and validation datasets named by the config.

    Args:
        config: a mapping with ``dataset``, ``data_dir``, ``seed``, ``augment`` and, for
            synthetic and imagefolder, ``image_size`` (plus ``synthetic_size`` and
            ``num_classes`` for synthetic).

    Returns:
        ``(train, val)``: two SeededDataset with ``classes``, ``num_classes``,
        ``in_channels`` and ``image_size`` attributes. The training set augments when
        ``config["augment"]``; the validation set never does.

        An image folder reads its images with ``load_image``; unreadable ones are replaced
        and counted (see ``SafeImageFolder``, ``SeededDataset.unreadable_count``). One with a
        single class gets a ``warning:`` line on stderr.

    Raises:
        UserError: unknown dataset, missing directory, download impossible, an image
            folder without a single readable image.
    """
    name, data_dir, seed = config["dataset"], config["data_dir"], config["seed"]
    augment, image_size = config["augment"], config["image_size"]
    policy = recipes.policy_transforms(  # --auto-augment, --random-erase
        config.get("auto_augment", "none"), config.get("randaugment_magnitude", 9),
        config.get("random_erase", 0.0), name)
    if name == "synthetic":
        size, classes, channels = (config["synthetic_size"], config["num_classes"],
                                   config.get("in_channels", 3))
        if size < 1 or classes < 2:
            raise UserError("--synthetic-size must be at least 1 and --num-classes at least 2")
        train = SyntheticImages(size, classes, channels, image_size, seed, "train")
        val = SyntheticImages(max(size // 5, 1), classes, channels, image_size, seed, "val")
        t_train, t_eval = _transforms(name, image_size, augment, from_pil=False,
                                      policy=policy)
        return (SeededDataset(train, t_train, seed, augment, train.classes, channels, image_size),
                SeededDataset(val, t_eval, seed, False, val.classes, channels, image_size))
    if name == "imagefolder":
        if not os.path.isdir(data_dir):
            raise UserError(f"--data-dir {data_dir!r} does not exist")
        return _imagefolder_splits(data_dir, image_size, augment, seed, policy)
    if name not in TORCHVISION_SETS:
        raise UserError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    train, val = (_torchvision_split(name, data_dir, split) for split in (True, False))
    side, channels = (28, 1) if "mnist" in name else (32, 3)
    t_train, t_eval = _transforms(name, side, augment, policy=policy)
    return (SeededDataset(train, t_train, seed, augment, train.classes, channels, side),
            SeededDataset(val, t_eval, seed, False, val.classes, channels, side))


class EpochBatchSampler:
    """Batches of keys ``(index, epoch)`` in an order that depends on (seed, epoch) only.

    The epoch's permutation is cut into global batches of ``batch_size * world_size``;
    process ``rank`` takes its contiguous share of each. So P processes with batch B see
    together exactly what one process with batch P*B sees. The last global batch keeps
    every remaining sample (none dropped); where it has fewer samples than processes, a
    process with no sample gets one stand-in sample with weight 0 (``plan()`` says so).

    Args:
        size: samples in the dataset.
        batch_size: samples per batch per process.
        seed: the run's seed.
        shuffle: permute each epoch (training) or keep the index order.
        rank: this process's rank.
        world_size: number of processes.
    """

    def __init__(self, size, batch_size, seed, shuffle=True, rank=0, world_size=1):
        self.size, self.batch_size, self.seed, self.shuffle = size, batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch, start=0):
        """Selects the epoch and the number of its samples already seen (to skip them)."""
        self.epoch, self.start = epoch, start

    def _order(self):
        if not self.shuffle:
            return torch.arange(self.size)
        g = torch.Generator().manual_seed(self.seed * 10_007 + self.epoch)
        return torch.randperm(self.size, generator=g)

    def _chunks(self):
        """Global batches of the rest of the epoch: (global indices, local indices)."""
        order = self._order()[self.start:]
        if len(order) == 0:  # resumed after the epoch's last step: nothing left (split of
            return           # an empty tensor would give one empty batch)
        step = self.batch_size * self.world_size
        for chunk in order.split(step):
            if len(chunk) == step:
                local = chunk[self.rank * self.batch_size:(self.rank + 1) * self.batch_size]
            else:
                local = chunk.tensor_split(self.world_size)[self.rank]
            yield chunk, local

    def plan(self):
        """``(global_count, local_count)`` of each remaining batch, in order."""
        return [(len(chunk), len(local)) for chunk, local in self._chunks()]

    def __len__(self):
        return -(-(self.size - self.start) // (self.batch_size * self.world_size))

    def index_batches(self):
        """This process's remaining batches of the epoch as int64 tensors of indices (the
        keys of ``__iter__`` without the epoch, which is ``self.epoch``)."""
        for chunk, local in self._chunks():
            yield local if len(local) else chunk[-1:]  # stand-in: weighted 0, keeps
            #                                             collectives in step

    def __iter__(self):
        for local in self.index_batches():
            yield [(i, self.epoch) for i in local.tolist()]


def _ignore_stop_signals(worker_id):
    # Ctrl-C and schedulers signal the whole process group. Workers ignore it and are shut
    # down by the main process after it has saved, so the save never sees a dead worker.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_IGN)


def build_loader(dataset, batch_sampler=None, batch_size=None, num_workers=0,
                 pin_memory=False, sampler=None):
    """A DataLoader that keeps every sample and never draws from the global RNG.

    Args:
        dataset: the dataset.
        batch_sampler: an EpochBatchSampler (training), or None.
        batch_size: batch size when no batch_sampler is given (evaluation).
        num_workers: worker processes (persistent; they ignore SIGINT/SIGTERM/SIGHUP).
        pin_memory: page-locked host memory for faster copies to CUDA.
        sampler: an index sampler for evaluation (e.g. one shard of the set).

    Returns:
        The torch.utils.data.DataLoader.
    """
    kwargs = dict(batch_size=batch_size, shuffle=False, drop_last=False, sampler=sampler)
    if batch_sampler is not None:
        kwargs = dict(batch_sampler=batch_sampler)
    return torch.utils.data.DataLoader(
        dataset, num_workers=num_workers, pin_memory=pin_memory,
        persistent_workers=num_workers > 0, worker_init_fn=_ignore_stop_signals,
        generator=torch.Generator().manual_seed(0),  # iter() must not draw from torch's RNG
        **kwargs)


def shard_indices(size, rank, world_size):
    """The contiguous share of ``range(size)`` evaluated by ``rank``: no padding, no repeat."""
    return list(range(rank * size // world_size, (rank + 1) * size // world_size))


def shutdown_loader(loader):
    """Stops a loader's persistent workers now (not at interpreter exit, where workers that
    ignore SIGTERM would be waited for)."""
    # DataLoader has no public way to stop persistent workers before it is garbage
    # collected; its iterator's _shutdown_workers is what its own __del__ calls.
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


# ------------------------------------------------------------------ the device path
#
# A whole set held as one tensor on the training device; each batch gathered by index,
# cropped, flipped and normalised there (``DeviceLoader``). The same draws
# (``crop_flip_draws``) and the same arithmetic (zero padding, indexing, ``normalise``)
# as the per-sample path, so both give the same samples, bit for bit on the CPU.

DEVICE_SHARE = 0.25  # --data-on-device auto: the sets may take this share of free memory
CACHE_VERSION = 1    # of the decoded image-folder cache's layout


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
                dataset.base, SafeImageFolder):
            raise UnsupportedOnDevice("resizes only image folders (through their cache)")
        self.padding, self.flip, self.mean, self.std = 0, False, None, None
        if i < len(steps) and isinstance(steps[i], SampleCrop):
            self.padding, i = steps[i].padding, i + 1
        if i < len(steps) and isinstance(steps[i], SampleFlip):
            self.flip, i = True, i + 1
        if i < len(steps) and isinstance(steps[i], Normalise):
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
    if isinstance(base, SyntheticImages):
        return "synthetic"
    if getattr(base, "transform", None) is not None or \
            getattr(base, "target_transform", None) is not None:
        raise UnsupportedOnDevice(f"cannot apply the transform of {type(base).__name__}")
    if isinstance(base, tv_datasets.CIFAR10):  # and CIFAR100
        return "cifar"
    if isinstance(base, tv_datasets.MNIST):  # and FashionMNIST
        return "mnist"
    if isinstance(base, SafeImageFolder):
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


def source_tensors(dataset, cache_dir=None, num_workers=0, log=print):
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
    return decoded_folder(base, front, dataset.image_size, cache_dir, num_workers, log)


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
            top, left = crop_offsets(self.dataset.seed, epoch, index, p.padding) \
                if p.padding else (zero, zero)
            flip = flip_draw(self.dataset.seed, epoch, index) if p.flip else zero
            columns += [top, left, flip]
        packed = torch.stack(columns).to(self.device)  # one copy for the whole epoch
        for part in packed.split([len(b) for b in batches], dim=1):
            yield self._batch(part)

    def _batch(self, part):
        x = self.images.index_select(0, part[0])
        if self.pipeline.random:
            x = crop_flip_batch(x, part[1], part[2], part[3], self.pipeline.padding)
        x = x.contiguous(memory_format=self.memory_format)
        if self._stats is not None:
            x = normalise(x, *self._stats)
        return x, self.labels.index_select(0, part[0])


def device_data_decision(config, train_set, val_set, device):
    """Whether a run takes the device path (``--data-on-device``), and one line saying why.

    ``off``: never. ``on``: always, or a UserError when it cannot (a transform or a set it
    cannot do; on CUDA, sets larger than the free memory). ``auto``: on CUDA devices when
    both sets take at most ``DEVICE_SHARE`` (a quarter) of the free device memory and
    every transform is one the device path does; never on other devices. A config
    without ``data_on_device`` means ``off``.

    Args:
        config: with ``data_on_device`` (auto, on, off; missing = off), ``dataset``,
            ``num_workers``.
        train_set, val_set: SeededDatasets from ``build_datasets``.
        device: the training device.

    Returns:
        ``(use, reason)``: a bool and a line to print (``data path: ...``).

    Raises:
        UserError: ``on`` with something the device path cannot do.
    """
    mode, device = config.get("data_on_device", "off"), torch.device(device)
    workers = config.get("num_workers", 0)
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
    kind = "float32" if isinstance(train_set.base, SyntheticImages) else "uint8"
    what = f"{config['dataset']} as {kind} tensors ({_mib(need)})"
    if isinstance(train_set.base, SafeImageFolder):
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
                         memory_format=torch.contiguous_format, log=print):
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

    Raises:
        UserError: a set or transform the device path cannot do.
    """
    try:
        for dataset in (train_set, val_set):
            device_pipeline(dataset)
    except UnsupportedOnDevice as e:
        raise UserError(f"--data-on-device: the device path {e}") from None
    cache_dir = config.get("cache_dir") or default_cache_dir(config["data_dir"])
    workers = config.get("num_workers", 0)
    train_loader = DeviceLoader(train_set, *source_tensors(train_set, cache_dir, workers, log),
                                device, batch_sampler=sampler, memory_format=memory_format)
    val_loader = DeviceLoader(val_set, *source_tensors(val_set, cache_dir, workers, log),
                              device, indices=shard_indices(len(val_set), rank, world_size),
                              batch_size=config["batch_size"], memory_format=memory_format)
    return train_loader, val_loader


def _mib(nbytes):
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


# ------------------------------------------------------ the image folders' decoded cache

def default_cache_dir(data_dir):
    """Where decoded caches live by default: ``<data-dir>/.cache``."""
    return os.path.join(data_dir, ".cache")


def folder_fingerprint(folder, front):
    """A hash of what a decoded cache depends on: every image's relative path, label,
    size and modification time, the decoding steps (the image size among them) and the
    versions of the decoders (torch, torchvision, PIL)."""
    import PIL

    h = hashlib.sha256()
    h.update(json.dumps({"version": CACHE_VERSION, "front": repr(front),
                         "classes": folder.classes, "torch": torch.__version__,
                         "torchvision": torchvision.__version__,
                         "PIL": PIL.__version__}).encode())
    for path, label in folder.samples:
        try:
            st = os.stat(path)
            size, mtime = st.st_size, st.st_mtime_ns
        except OSError:
            size = mtime = -1
        h.update(json.dumps([os.path.relpath(path, folder.root), label, size, mtime])
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


def _decode_into(out, folder, front, num_workers):
    """Decodes every image of ``folder`` into ``out`` (N, 3, S, S); returns the labels."""
    loader = torch.utils.data.DataLoader(
        _Decoded(folder, front), batch_size=64, num_workers=num_workers,
        worker_init_fn=_ignore_stop_signals, generator=torch.Generator().manual_seed(0))
    labels = np.empty(len(folder), dtype=np.int64)
    pos = 0
    for x, y in loader:
        if tuple(x.shape[1:]) != tuple(out.shape[1:]):
            raise ValueError(f"decoded images of shape {tuple(x.shape[1:])}, expected "
                             f"{tuple(out.shape[1:])}")
        out[pos:pos + len(x)] = x.numpy()
        labels[pos:pos + len(x)] = y.numpy()
        pos += len(x)
    return labels


def _unreadable_reason(path):
    """Why ``load_image`` refuses a file (read again: the build's workers said it once)."""
    try:
        load_image(path)
    except UnreadableImage as e:
        return str(e)
    return "unreadable while the cache was built"


def _open_cache(base, fingerprint, shape):
    """The cache ``base``.npy (memory-mapped) and its record, or None if not trusted."""
    try:
        with open(base + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        if not isinstance(meta, dict) or meta.get("fingerprint") != fingerprint \
                or meta.get("shape") != list(shape) or len(meta.get("labels", ())) != shape[0] \
                or not isinstance(meta.get("unreadable", {}), dict):
            return None
        images = np.load(base + ".npy", mmap_mode="c")  # copy-on-write: torch can wrap it
    except (OSError, ValueError):
        return None
    if images.shape != shape or images.dtype != np.uint8:
        return None
    return images, meta


def decoded_folder(folder, front, image_size, cache_dir, num_workers=0, log=print):
    """A SafeImageFolder decoded once into a uint8 array file, memory-mapped after.

    The file ``<cache_dir>/decoded-<split>-<size>px-<folder>-<fingerprint>.npy`` holds
    every image after ``front`` (decoded, resized: exactly what the per-sample path
    crops), with a record ``.json`` beside it (fingerprint, shape, labels, unreadable
    files). It is used only when its record matches ``folder_fingerprint`` now: an image
    added, removed, replaced or touched, another image size or another torch /
    torchvision / PIL version builds a new one (and removes the one it replaces). Both
    files are written with ``checkpoint.atomic_write``, the record last: a build that
    was interrupted leaves no cache that a later run trusts (at worst a ``.tmp-*`` file).

    Unreadable images are replaced by the next readable one and counted, as on the
    per-sample path (``SafeImageFolder``); a reused cache marks them again in
    ``folder.unreadable`` and warns about each. A cache directory that cannot be written
    (read-only, full) gets a warning, and the images are decoded into memory instead.

    Returns:
        ``(images, labels)``: uint8 (N, 3, S, S) and int64 (N,) CPU tensors.
    """
    from checkpoint import atomic_write  # checkpoint does not import data

    n = len(folder.samples)
    shape = (n, 3, image_size, image_size)
    split = os.path.basename(os.path.normpath(folder.root))
    place = hashlib.sha256(os.path.abspath(folder.root).encode()).hexdigest()[:8]
    prefix = os.path.join(cache_dir, f"decoded-{split}-{image_size}px-{place}-")
    fingerprint = folder_fingerprint(folder, front)
    base = prefix + fingerprint[:16]
    about = f"{n} images of 3x{image_size}x{image_size}, {_mib(n * 3 * image_size ** 2)}"
    opened = _open_cache(base, fingerprint, shape)
    if opened is not None:
        images, meta = opened
        where = {os.path.relpath(p, folder.root): i for i, (p, _) in enumerate(folder.samples)}
        for rel, reason in meta.get("unreadable", {}).items():
            folder.unreadable[where[rel]] = 1
            print(f"warning: skipping unreadable image {os.path.join(folder.root, rel)} "
                  f"({reason}; as found when the decoded cache was built); the next "
                  f"readable image of the set stands in for it", file=sys.stderr, flush=True)
        log(f"decoded cache: {base}.npy ({about}), reused")
        return torch.from_numpy(images), torch.as_tensor(meta["labels"], dtype=torch.long)
    start = time.perf_counter()
    labels = None
    try:
        os.makedirs(cache_dir, exist_ok=True)

        def write(tmp):
            nonlocal labels
            out = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.uint8, shape=shape)
            labels = _decode_into(out, folder, front, num_workers)
            out.flush()
            del out

        atomic_write(base + ".npy", write, mode=None)
    except OSError as e:
        print(f"warning: cannot write the decoded cache in {cache_dir} "
              f"({e.strerror or e}); decoding {folder.root} into memory for this run only",
              file=sys.stderr, flush=True)
        images = np.empty(shape, dtype=np.uint8)
        labels = _decode_into(images, folder, front, num_workers)
        return torch.from_numpy(images), torch.from_numpy(labels)
    unreadable = {os.path.relpath(p, folder.root): _unreadable_reason(p)
                  for (p, _), bad in zip(folder.samples, folder.unreadable.tolist()) if bad}
    if folder_fingerprint(folder, front) != fingerprint:
        print(f"warning: {folder.root} changed while it was decoded; its cache will be "
              f"rebuilt by the next run", file=sys.stderr, flush=True)
    else:
        record = {"fingerprint": fingerprint, "shape": list(shape), "root": folder.root,
                  "labels": labels.tolist(), "unreadable": unreadable}
        try:
            atomic_write(base + ".json", lambda f: json.dump(record, f))
        except OSError as e:  # the images are whole: use them, the next run rebuilds
            print(f"warning: cannot write {base}.json ({e.strerror or e}); the decoded "
                  f"cache will be rebuilt by the next run", file=sys.stderr, flush=True)
        else:
            for old in glob.glob(glob.escape(prefix) + "*"):  # caches of older contents
                if not old.startswith(base + "."):
                    with contextlib.suppress(OSError):
                        os.remove(old)
    log(f"decoded cache: {base}.npy ({about}), built in {time.perf_counter() - start:.1f} s")
    return (torch.from_numpy(np.load(base + ".npy", mmap_mode="c")),
            torch.from_numpy(labels))

"""Per-sample transforms drawn from (seed, epoch, index): the counter-based hash, the crop
and flip it draws, the (seed, epoch, index) of the sample being transformed, and the
normalisation with each dataset's statistics.

data.py (the per-sample path), device_data.py (whole batches on the device), presets.py
(photos) and segmentation_data.py (images with their masks) all draw from here, so every
path gives a sample the same crop and flip, bit for bit, whatever the worker count or
the resume.
"""

import functools
import threading

import torch
from torchvision import tv_tensors

# Per-channel mean and std of the training split, for normalisation.
STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "imagefolder": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),  # ImageNet's
}
PHOTO_SIDE = 64  # image folders at this --image-size and above are photos (presets.py)
# Sets of image files of any size, treated alike: a folder, a Hugging Face dataset, shards
FOLDERS = ("imagefolder", "hf", "shards")
STATS.update({name: STATS["imagefolder"] for name in FOLDERS})


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


class seeded:
    """``with seeded(seed, epoch, index):`` the sample being transformed in this thread,
    for ``current_sample`` (SampleCrop, SampleFlip, segmentation's joint draws) to read;
    what was set before comes back on exit. Used by data.py's ``SeededDataset``,
    segmentation_data.py's ``SegmentationSet`` and its device path's photos. A class
    (lower case, as a context manager reads), not ``contextlib.contextmanager``: it runs
    once per sample."""

    __slots__ = ("key", "previous")

    def __init__(self, seed, epoch, index):
        self.key = (seed, epoch, index)

    def __enter__(self):
        self.previous = getattr(_SAMPLE, "key", None)
        _SAMPLE.key = self.key

    def __exit__(self, *exc):
        _SAMPLE.key = self.previous


def current_sample():
    """``(seed, epoch, index)`` of the sample being transformed now (``seeded``)."""
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

"""The joint transforms of an image and its target mask (segmentation; next, image-to-image
pairs): every step moves the image and its mask together, the mask by nearest neighbour
(never interpolated), padded with ``IGNORE`` where the image is padded with 0. Each random
draw is a hash of (seed, epoch, index) (``sample_transforms.sample_hash``), like the
classifier's crop and flip, so a sample is the same with any number of workers or
processes and after a resume. ``pair_transforms`` picks them for a size (segmentation_data's
docstring: the small sizes' pad-crop and flip, torchvision's reference geometry for photos).
"""

import torch
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from pipeline import sample_transforms

IGNORE = 255                 # the mask value of pixels no class counts at
BASE_PER_CROP = 520 / 480    # the reference's base size for its crop
RESIZE_RANGE = (0.5, 2.0)    # the reference's random resize of the short side, x base
EVAL_ASPECT = 4 / 3          # evaluation: the long side at most this x base (the canvas)
# Streams of sample_transforms.sample_hash (data.py uses 1-3, presets.py 100-139).
STREAM_SIZE, STREAM_TOP, STREAM_LEFT = 200, 201, 202


def base_size(crop):
    """The photo base size of a crop: ``round(crop * 520 / 480)`` (520 for 480)."""
    return round(crop * BASE_PER_CROP)


def eval_canvas(crop):
    """The side of the square evaluation images are padded to at photo sizes."""
    return round(base_size(crop) * EVAL_ASPECT)


def resized_size(height, width, size, max_size=None):
    """``(height, width)`` with the short side at ``size`` and the long one in proportion,
    truncated (torchvision's ``Resize(size, max_size=max_size)``: where the long side
    would pass ``max_size`` it is ``max_size``), no side below 1 px."""
    short, long = sorted((height, width))
    new_short, new_long = size, int(size * long / short)
    if max_size is not None and new_long > max_size:
        new_short, new_long = max(int(max_size * new_short / new_long), 1), max_size
    return (new_short, new_long) if height <= width else (new_long, new_short)


def fitting_canvas(sizes, size, max_size):
    """The ``(height, width)`` evaluation canvas of a set whose images are ``sizes``
    (``(h, w)`` each) once their short side is at ``size`` (the long side at most
    ``max_size``): the largest of their resized sides, so that a set of one size is not
    padded at all and square images get a square of ``size``; None: no size known."""
    shapes = [resized_size(h, w, size, max_size) for h, w in sizes if h > 0 and w > 0]
    if not shapes:
        return None
    return max(h for h, _ in shapes), max(w for _, w in shapes)


def _resize_pair(image, mask, size, max_size=None):
    """Image (bilinear, antialiased) and mask (nearest: the reference's and tv_tensors.Mask's
    interpolation) with the short side at ``size`` (``resized_size``); as it is when it is
    that size already."""
    shape = list(resized_size(*image.shape[-2:], size, max_size))
    if shape == list(image.shape[-2:]):
        return image, mask
    image = TF.resize(image, shape, interpolation=v2.InterpolationMode.BILINEAR,
                      antialias=True)
    mask = TF.resize(mask[None], shape, interpolation=v2.InterpolationMode.NEAREST)[0]
    return image, mask


def _pad_pair(image, mask, pads):
    """Pads (left, right, top, bottom): the image with 0, the mask with ``IGNORE``."""
    if not any(pads):
        return image, mask
    image = torch.nn.functional.pad(image, pads)
    mask = torch.nn.functional.pad(mask, pads, value=IGNORE)
    return image, mask


class PadCrop:
    """Small sizes: the classifier's crop (``sample_transforms.SampleCrop``: zero padding,
    offsets from ``sample_transforms.crop_offsets``) of the image and the same crop of the
    mask, padded with 255."""

    def __init__(self, padding):
        self.padding = padding

    def __call__(self, image, mask):
        top, left = sample_transforms.crop_offsets(*sample_transforms.current_sample(),
                                                   self.padding)
        h, w = image.shape[-2:]
        image, mask = _pad_pair(image, mask, [self.padding] * 4)
        return (image[..., top:top + h, left:left + w], mask[top:top + h, left:left + w])

    def __repr__(self):
        return f"PadCrop(padding={self.padding})"


class Flip:
    """Flips image and mask horizontally for half the samples (``sample_transforms.flip_draw``)."""

    def __call__(self, image, mask):
        if not sample_transforms.flip_draw(*sample_transforms.current_sample()):
            return image, mask
        return image.flip(-1), mask.flip(-1)

    def __repr__(self):
        return "Flip()"


class RandomResize:
    """Photo training: the short side resized to a size drawn uniformly from
    ``[low, high]`` (stream ``STREAM_SIZE``), as the reference's ``RandomResize``."""

    def __init__(self, low, high):
        self.low, self.high = low, high

    def __call__(self, image, mask):
        seed, epoch, index = sample_transforms.current_sample()
        size = self.low + sample_transforms.sample_hash(seed, epoch, index, STREAM_SIZE) % (
            self.high - self.low + 1)
        return _resize_pair(image, mask, size)

    def __repr__(self):
        return f"RandomResize(low={self.low}, high={self.high})"


class RandomCrop:
    """Photo training: a ``size`` x ``size`` crop at offsets drawn from (seed, epoch,
    index); an image smaller than that is padded right and bottom first (0, and 255 in
    the mask), as the reference's ``RandomCrop``."""

    def __init__(self, size):
        self.size = size

    def __call__(self, image, mask):
        seed, epoch, index = sample_transforms.current_sample()
        h, w = image.shape[-2:]
        image, mask = _pad_pair(image, mask, [0, max(self.size - w, 0), 0,
                                              max(self.size - h, 0)])
        h, w = image.shape[-2:]
        top = sample_transforms.sample_hash(seed, epoch, index, STREAM_TOP) % (h - self.size + 1)
        left = sample_transforms.sample_hash(seed, epoch, index, STREAM_LEFT) % (w - self.size + 1)
        return (image[..., top:top + self.size, left:left + self.size],
                mask[top:top + self.size, left:left + self.size])

    def __repr__(self):
        return f"RandomCrop(size={self.size})"


class EvalResize:
    """Photo evaluation: the short side at ``base`` (the long side at most ``max_size``),
    padded right and bottom to the ``canvas`` (``(height, width)``; 0, and 255 in the
    mask), so that a batch stacks."""

    def __init__(self, base, canvas, max_size=None):
        self.base, self.canvas = base, tuple(canvas)
        self.max_size = max(self.canvas) if max_size is None else max_size

    def __call__(self, image, mask):
        image, mask = _resize_pair(image, mask, self.base, self.max_size)
        h, w = image.shape[-2:]
        return _pad_pair(image, mask, [0, self.canvas[1] - w, 0, self.canvas[0] - h])

    def __repr__(self):
        return f"EvalResize(base={self.base}, canvas={self.canvas})"


class CentreCrop:
    """Photo training without augmentation: the short side at ``size``, then the centre
    ``size`` x ``size`` (an image of that size is taken as it is)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, image, mask):
        image, mask = _resize_pair(image, mask, self.size)
        h, w = image.shape[-2:]
        top, left = (h - self.size) // 2, (w - self.size) // 2
        return (image[..., top:top + self.size, left:left + self.size],
                mask[top:top + self.size, left:left + self.size])

    def __repr__(self):
        return f"CentreCrop(size={self.size})"


class PairCompose:
    """Joint steps on ``(image, mask)``, then the image normalised
    (``sample_transforms.normalise``; ``mean`` None: kept as it is) and the mask as int64.

    Attributes:
        transforms: the joint steps, in order.
        mean, std: the normalisation, or None.
    """

    def __init__(self, transforms, mean=None, std=None):
        self.transforms, self.mean, self.std = list(transforms), mean, std

    def __call__(self, image, mask):
        image, mask = image.as_subclass(torch.Tensor), mask.as_subclass(torch.Tensor)
        for step in self.transforms:
            image, mask = step(image, mask)
        if self.mean is not None:
            image = sample_transforms.normalise(image, self.mean, self.std)
        return image.contiguous(), mask.to(torch.long)

    def __repr__(self):
        return f"PairCompose({self.transforms}, mean={self.mean}, std={self.std})"


def pair_transforms(image_size, augment, stats=None, sizes=None):
    """The training and evaluation ``PairCompose`` of a set.

    Args:
        image_size: ``--image-size``: the side of the samples (photo sizes: the crop).
        augment: whether training augments (small: pad-crop and flip; photos: random
            resize, flip and crop, evaluation at the reference's base size; without,
            photos train at ``image_size`` (the short side there, the centre square) and
            are evaluated at that scale too).
        stats: ``(mean, std)`` of the uint8 images, or None (float images as they are).
        sizes: photo sizes: the ``(h, w)`` of the evaluated set's images, which the
            evaluation canvas fits (``fitting_canvas``); None: the square
            ``eval_canvas`` (the long side at most ``EVAL_ASPECT`` x its short side).

    Returns:
        ``(train, evaluation)``.
    """
    mean, std = stats if stats is not None else (None, None)
    if image_size < sample_transforms.PHOTO_SIDE:
        train = [PadCrop(max(image_size // 8, 1)), Flip()] if augment else []
        return PairCompose(train, mean, std), PairCompose([], mean, std)
    short = base_size(image_size) if augment else image_size
    longest = round(short * EVAL_ASPECT)
    canvas = fitting_canvas(sizes or (), short, longest) or (longest, longest)
    evaluation = [EvalResize(short, canvas, longest)]
    train = [RandomResize(int(RESIZE_RANGE[0] * short), int(RESIZE_RANGE[1] * short)),
             Flip(), RandomCrop(image_size)] if augment else [CentreCrop(image_size)]
    return PairCompose(train, mean, std), PairCompose(evaluation, mean, std)

"""Semantic segmentation data: sets of ``(image, mask)`` whose mask follows its image.

Three sets (``build_datasets``): ``synthetic`` (coloured shapes on noise, made in memory
from the seed), ``maskfolder`` (``DIR/{train,val}/images/NAME.jpg|png`` with
``DIR/{train,val}/masks/NAME.png``) and ``voc`` (torchvision's VOCSegmentation layout, 2012,
downloaded when missing). A sample is a normalised float32 (C, H, W) image and an int64
(H, W) mask of class indices, ``IGNORE`` (255) where no class counts.

Geometry: every step moves the image and its mask together, the mask by nearest neighbour
(never interpolated), padded with ``IGNORE`` where the image is padded with 0. Each random
draw is a hash of (seed, epoch, index) (``sample_transforms.sample_hash``), like the
classifier's crop and flip, so a sample is the same with any number of workers or
processes and after a resume.

* Small sizes (``--image-size`` below ``sample_transforms.PHOTO_SIDE``, the synthetic set): the
  classifier's crop with ``image_size // 8`` padding and flip (``sample_transforms.crop_offsets``,
  ``sample_transforms.flip_draw``); files are resized to a square once, when decoded.
* Photo sizes: torchvision's segmentation reference (references/segmentation/presets.py):
  training resizes the short side to a random size in ``[0.5, 2] x base``, flips half the
  samples, then crops ``--image-size`` (padding right and bottom where the image is
  smaller); evaluation resizes the short side to ``base`` (the long side at most
  ``EVAL_ASPECT x base``) and pads right and bottom to the canvas that fits the
  validation set (``pair_transforms.fitting_canvas``: the largest resized height and
  width; square images get a square of ``base``, a set of one size no padding), so
  that evaluation batches stack; the padding is ignored by the figures. ``base`` is
  ``round(image_size * 520 / 480)``: the reference's 520 for a crop of 480. Without
  augmentation (``--no-augment``) training takes ``--image-size`` as given (the short
  side there, the centre square: a set of that size as it is) and evaluation the same
  scale (the short side at ``--image-size``, the canvas fitting the set).

Files are decoded once (image and mask together, as one 4-channel uint8 image) into the
decoded cache (decoded_cache.py) and read from its memory map after.
"""

import contextlib
import hashlib
import json
import os
import socket
import sys

import numpy as np
import torch
import torch.utils.data
from PIL import Image, ImageOps
from torchvision import datasets as tv_datasets
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from machinery.runtime import say
from ops import UserError
from pipeline import data, decoded_cache, device_data, images, sample_transforms
from pipeline.pair_transforms import (  # noqa: F401 (the transforms were this module's)
    IGNORE,
    Flip,
    PadCrop,
    RandomResize,
    eval_canvas,
    pair_transforms,
    resized_size,
)

DATASETS = ("maskfolder", "synthetic", "voc")
VOC_CLASSES = ("background", "aeroplane", "bicycle", "bird", "boat", "bottle", "bus", "car",
               "cat", "chair", "cow", "diningtable", "dog", "horse", "motorbike", "person",
               "pottedplant", "sheep", "sofa", "train", "tvmonitor")
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")
MASK_MODES = ("P", "L", "1", "I;16", "I;16L", "I;16B", "I")  # palette or grayscale indices


def check_config(config):
    """Refuses, in one line each, what would move an image and not its mask.

    Args:
        config: the resolved config (``auto_augment``, ``random_erase``, ``dataset``).

    Raises:
        UserError: an augmentation policy (it moves pixels, e.g. a rotation, without the
            mask), random erasing (it would erase image pixels under a mask that still
            names their class), or a dataset without masks.
    """
    if config.get("auto_augment", "none") != "none":
        raise UserError(f"--auto-augment {config['auto_augment']} would rotate, shear or "
                        f"translate the image and not its mask: not for --task segmentation")
    if config.get("random_erase", 0.0):
        raise UserError("--random-erase would erase image pixels and keep their class in the "
                        "mask: not for --task segmentation")
    if config["dataset"] not in DATASETS:
        raise UserError(f"--dataset {config['dataset']} has no masks: --task segmentation "
                        f"takes one of {', '.join(DATASETS)}")


class SegmentationSet(data.SeededDataset):
    """A ``data.SeededDataset`` of ``(image, mask)``: the key ``(index, epoch)``, the
    attributes (``classes``, ``num_classes``, ``in_channels``, ``image_size``,
    ``unreadable_count()``) and the seeding are the classifier's; ``transform`` is a
    ``PairCompose``, applied to the image and its mask together.

    Args:
        base: a map-style dataset returning ``(image, mask)``: a (C, H, W) tensor (uint8,
            or float for the synthetic set) and a (H, W) uint8 mask.
        transform: a ``PairCompose``.
        seed, random, classes, in_channels, image_size: as ``data.SeededDataset``'s.
    """

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        image, mask = self.base[index]
        if not self.random:
            return self.transform(image, mask)
        # The draws read the key; nothing here draws from torch's generator, which is
        # still seeded per sample as the classifier's (a user's extra step may).
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(sample_transforms.sample_seed(self.seed, epoch, index))
        try:
            with sample_transforms.seeded(self.seed, epoch, index):
                return self.transform(image, mask)
        finally:
            generator.set_state(state)


# ------------------------------------------------------------------ the synthetic set

SHAPES = ("rectangle", "disc", "diamond", "ring", "triangle")  # class c >= 1: SHAPES[c-1 % 5]


def shape_mask(kind, dy, dx, r):
    """Where a shape of radius ``r`` (per image, (N, 1, 1)) covers the offsets
    ``dy``, ``dx`` from its centre (the synthetic masks' shapes, and detection's)."""
    if kind == "rectangle":
        return (dy.abs() <= r * 0.6) & (dx.abs() <= r)
    if kind == "disc":
        return dy * dy + dx * dx <= r * r
    if kind == "diamond":
        return dy.abs() + dx.abs() <= r
    if kind == "ring":
        d2 = dy * dy + dx * dx
        return (d2 <= r * r) & (d2 >= (r * 0.5) ** 2)
    return (dy <= r * 0.7) & (dy >= -r) & (dx.abs() * 2 <= dy + r)  # triangle


class SyntheticMasks(torch.utils.data.Dataset):
    """Learnable segmentation samples made in memory: noise with 1 to 3 shapes on it.

    Class 0 is the background; each class ``c >= 1`` has its own colour (a random unit
    vector per class, from the seed) and its own shape (``SHAPES[(c - 1) % 5]``), so a
    small network tells classes apart by colour and by shape. Later shapes cover earlier
    ones; the mask is the class of the top shape at each pixel.

    Args:
        size: number of samples.
        num_classes: classes, the background among them (at least 2).
        in_channels: channels of the images.
        image_size: side of the square images.
        seed: seeds colours, shapes and noise (the same seed gives the same set).
        split: ``"train"`` or ``"val"``; the two share colours, not samples.
        noise: standard deviation of the per-pixel noise.
    """

    def __init__(self, size, num_classes, in_channels, image_size, seed, split, noise=0.5):
        g = torch.Generator().manual_seed(seed)
        colours = torch.randn(num_classes, in_channels, generator=g)
        colours = 1.5 * colours / colours.norm(dim=1, keepdim=True).clamp(min=1e-6)
        colours[0] = 0  # the background: noise only
        g.manual_seed(seed * 2 + 1 + (split == "val"))  # splits share colours, not samples
        s = image_size
        masks = torch.zeros(size, s, s, dtype=torch.long)
        ys = torch.arange(s, dtype=torch.float32).view(1, s, 1)
        xs = torch.arange(s, dtype=torch.float32).view(1, 1, s)
        count = torch.randint(1, 4, (size,), generator=g)
        for slot in range(3):
            cls = torch.randint(1, num_classes, (size,), generator=g)
            cy, cx = (torch.rand(2, size, 1, 1, generator=g) * 0.8 + 0.1) * s
            r = (torch.rand(size, 1, 1, generator=g) * 0.2 + 0.15) * s
            for c in range(1, num_classes):
                kind = SHAPES[(c - 1) % len(SHAPES)]
                drawn = (cls == c) & (count > slot)
                where = shape_mask(kind, ys - cy, xs - cx, r) & drawn.view(-1, 1, 1)
                masks[where] = c
        self.masks = masks.to(torch.uint8)
        self.images = colours[masks].permute(0, 3, 1, 2).contiguous()  # (N, C, H, W)
        self.images += noise * torch.randn(self.images.shape, generator=g)
        self.classes = ["background"] + [f"{SHAPES[(c - 1) % len(SHAPES)]}{c}"
                                         for c in range(1, num_classes)]

    def __len__(self):
        return len(self.masks)

    def __getitem__(self, index):
        return self.images[index], self.masks[index]


# ------------------------------------------------------------------ files: pairs and decoding

def _oriented_size(image):
    """``(width, height)`` of an opened PIL image once its EXIF orientation is applied."""
    w, h = image.size
    try:
        turned = image.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # 90 or 270 degrees
    except Exception:  # a broken EXIF block: load_image fails on it, or keeps the size
        turned = False
    return (h, w) if turned else (w, h)


def load_mask(path):
    """A mask file as a (H, W) uint8 tensor of class indices (palette indices of a
    palette PNG, the values of a grayscale one), its EXIF orientation applied.

    Raises:
        images.UnreadableImage: the file cannot be read, is not a palette or grayscale
            image, or holds a value above 255.
    """
    try:
        with Image.open(path, formats=images.IMAGE_FORMATS) as mask:
            mask.load()
            mode = mask.mode
            if mask.format != "PNG":  # a JPEG's values are not the indices it was saved with
                raise ValueError(f"a {mask.format} file, not a PNG")
            if mode not in MASK_MODES:
                raise ValueError(f"a {mode} image, not palette or grayscale class indices")
            values = np.asarray(ImageOps.exif_transpose(mask))
    except Exception as e:
        reason = str(e).splitlines()[0] if str(e) else "no message"
        raise images.UnreadableImage(f"{type(e).__name__}: {reason}") from e
    if values.size and int(values.max()) > IGNORE:
        raise images.UnreadableImage(f"it holds the value {int(values.max())}; class indices "
                                   f"are 0..254 and 255 is ignored")
    return torch.from_numpy(np.array(values, dtype=np.uint8))  # (a writable copy)


class MaskPairs(torch.utils.data.Dataset):
    """Image files and their mask files, read as ``(image, mask)`` pairs: what the decoded
    cache decodes (it takes this for an image folder: ``root``, ``samples``,
    ``classes``, ``unreadable``).

    A pair whose image or mask cannot be read is replaced by the next readable pair,
    with one warning naming the file (as ``data.SafeImageFolder`` does), and counted.
    Where none is readable, a 1 x 1 placeholder pair: ``_decode`` then raises UserError.

    Args:
        root: the folder of the images (the cache's names and relative paths).
        pairs: ``(image path, mask path)`` in order.
        classes: the class names (known so far).
    """

    def __init__(self, root, pairs, classes):
        self.root, self.pairs, self.classes = root, list(pairs), list(classes)
        self.samples = [(image, 0) for image, _ in self.pairs]
        self.unreadable = torch.zeros(len(self.pairs), dtype=torch.uint8).share_memory_()

    def __len__(self):
        return len(self.pairs)

    def mask_facts(self):
        """A hash of the mask files' paths, sizes, times and inodes: with the images'
        (the cache's own fingerprint), what a decoded pair depends on."""
        h = hashlib.sha256()
        for _, path in self.pairs:
            try:
                st = os.stat(path)
                facts = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
            except OSError:
                facts = [-1]
            h.update(json.dumps([os.path.relpath(path, self.root), *facts]).encode())
        return h.hexdigest()

    def read(self, index):
        """Pair ``index`` as ``(image (3, H, W) uint8, mask (H, W) uint8)``, or the next
        readable pair's."""
        size = len(self.pairs)
        for i in (j % size for j in range(index, index + size)):
            if self.unreadable[i]:
                continue
            image_path, mask_path = self.pairs[i]
            path = image_path
            try:
                image = TF.pil_to_tensor(images.load_image(image_path))
                path = mask_path
                mask = load_mask(mask_path)
                if tuple(mask.shape) != tuple(image.shape[-2:]):
                    raise images.UnreadableImage(
                        f"the mask is {mask.shape[1]}x{mask.shape[0]}, its image "
                        f"{image.shape[2]}x{image.shape[1]}")
                return image, mask
            except images.UnreadableImage as e:
                self.unreadable[i] = 1
                say(f"warning: skipping unreadable pair {path} ({e}); the next readable "
                    f"pair of the set stands in for it", file=sys.stderr)
        # None readable: a placeholder, not an exception, which in a decoding worker would
        # come back with the DataLoader's traceback (_decode says it in one line).
        return (torch.zeros(3, 1, 1, dtype=torch.uint8),
                torch.full((1, 1), IGNORE, dtype=torch.uint8))

    def unreadable_count(self):
        return int(self.unreadable.sum())


class PairDecoder:
    """Decodes a pair into the cache as one (4, H, W) uint8 image: RGB, then the mask.
    Its "label" is the largest class index of the mask (-1: none), from which the number
    of classes is read.

    Args:
        side: small sizes: the square side both are resized to (the image bilinear,
            antialiased; the mask nearest); None (photos): the pair as it is.
        split: the split's name (part of the cache's name: VOC's splits share a folder).
        masks: the MaskPairs' ``mask_facts()``.
    """

    def __init__(self, side, split, masks):
        self.side, self.masks = side, masks
        self.shape = (4, side, side) if side else None
        self.name = f"seg-{split}-{side}px" if side else f"seg-{split}-full"
        self.split = split

    def describe(self):
        return f"PairDecoder(side={self.side}, split={self.split}, masks={self.masks})"

    def __call__(self, pairs, index):
        image, mask = pairs.read(index)
        if self.side:
            image = TF.resize(image, [self.side, self.side], antialias=True,
                              interpolation=v2.InterpolationMode.BILINEAR)
            mask = TF.resize(mask[None], [self.side, self.side],
                             interpolation=v2.InterpolationMode.NEAREST)[0]
        classes = mask[mask != IGNORE]
        top = int(classes.max()) if classes.numel() else -1
        return torch.cat([image, mask[None]]), top


class CachedPairs(torch.utils.data.Dataset):
    """A split's pairs from its decoded cache: ``(image (3, H, W), mask (H, W))`` uint8
    views of the memory map.

    Attributes:
        pairs: the MaskPairs; decoded: its ``decoded_cache.Decoded``; largest: the largest
            class index of its masks (-1: none).
    """

    def __init__(self, pairs, decoded):
        self.pairs, self.decoded = pairs, decoded
        self.root = pairs.root
        self.largest = int(decoded.labels.max()) if len(decoded) else -1

    def __len__(self):
        return len(self.decoded)

    def __getitem__(self, index):
        both = self.decoded.image(index)
        return both[:3], both[3]

    def unreadable_count(self):
        return self.pairs.unreadable_count()


def _maskfolder_pairs(data_dir, split):
    """The ``(image, mask)`` paths of ``DIR/<split>/images`` and ``DIR/<split>/masks``,
    in the order of the image names.

    Raises:
        UserError: a folder missing, no image, an image without its mask, two images
            of one name (``a.jpg`` and ``a.png``: one mask for both).
    """
    images_dir = os.path.join(data_dir, split, "images")
    masks_dir = os.path.join(data_dir, split, "masks")
    for folder in (images_dir, masks_dir):
        if not os.path.isdir(folder):
            raise UserError(f"--dataset maskfolder needs {folder!r}: DIR/train and DIR/val "
                            f"each hold images/NAME.jpg|png and masks/NAME.png")
    names = sorted(n for n in os.listdir(images_dir) if n.lower().endswith(IMAGE_SUFFIXES)
                   and os.path.isfile(os.path.join(images_dir, n)))
    if not names:
        raise UserError(f"{images_dir!r} holds no .jpg or .png image")
    masks = {os.path.splitext(n)[0]: n for n in os.listdir(masks_dir)
             if n.lower().endswith(".png")}
    pairs, seen = [], {}
    for name in names:
        stem = os.path.splitext(name)[0]
        if stem in seen:
            raise UserError(f"{os.path.join(images_dir, seen[stem])} and {name} would share "
                            f"the mask {os.path.join(masks_dir, stem + '.png')}; rename one")
        seen[stem] = name
        if stem not in masks:
            raise UserError(f"the image {os.path.join(images_dir, name)} has no mask: "
                            f"expected {os.path.join(masks_dir, stem + '.png')}")
        pairs.append((os.path.join(images_dir, name), os.path.join(masks_dir, masks[stem])))
    alone = sorted(set(masks) - set(seen))
    if alone:
        say(f"warning: {len(alone)} mask(s) in {masks_dir} have no image and are not used "
            f"(e.g. {masks[alone[0]]})", file=sys.stderr)
    return pairs


def _check_pairs(pairs):
    """Reads each pair's headers (not the pixels): a mask that is not palette or grayscale,
    or whose size is not its image's, is a UserError naming it. Unreadable files are left
    to the decoding (skipped there with a warning)."""
    for image_path, mask_path in pairs:
        try:
            with Image.open(image_path, formats=images.IMAGE_FORMATS) as image:
                size = _oriented_size(image)
            with Image.open(mask_path, formats=images.IMAGE_FORMATS) as mask:
                kind, mode, mask_size = mask.format, mask.mode, _oriented_size(mask)
        except Exception:
            continue
        if kind != "PNG":
            raise UserError(f"the mask {mask_path} is a {kind} file: masks are PNGs (lossless) "
                            f"of class indices")
        if mode not in MASK_MODES:
            raise UserError(f"the mask {mask_path} is a {mode} image: masks are palette or "
                            f"grayscale PNGs of class indices (255 = ignore)")
        if mask_size != size:
            raise UserError(f"the mask {mask_path} is {mask_size[0]}x{mask_size[1]} but its "
                            f"image {image_path} is {size[0]}x{size[1]}")


def _read_class_names(path):
    """The class names of ``classes.txt`` (one a line, blank lines skipped), or None."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            names = [line.strip() for line in f if line.strip()]
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"cannot read {path} ({e})") from None
    if len(names) < 2:
        raise UserError(f"{path} names {len(names)} class(es); a segmentation set needs at "
                        f"least 2 (the background is one)")
    return names


def _voc_split(data_dir, image_set):
    """torchvision's VOCSegmentation 2012 ``image_set`` under ``data_dir``, downloaded
    (about 2 GB) when it is not there."""
    try:
        return tv_datasets.VOCSegmentation(data_dir, year="2012", image_set=image_set)
    except RuntimeError:
        pass  # not there yet: download it
    old_timeout = socket.getdefaulttimeout()
    socket.setdefaulttimeout(60)
    try:
        return tv_datasets.VOCSegmentation(data_dir, year="2012", image_set=image_set,
                                           download=True)
    except Exception as e:  # URLError, HTTPError, OSError, checksum errors...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(
            f"could not download voc (PASCAL VOC 2012) into {data_dir!r} ({reason}); "
            f"offline? Put an existing VOCdevkit/VOC2012 there and pass --data-dir, or "
            f"train on --dataset maskfolder or --dataset synthetic") from None
    finally:
        socket.setdefaulttimeout(old_timeout)


def _decode(pairs, split, config, log, stop):
    """A split's pairs decoded once into the decoded cache: a ``CachedPairs``."""
    side = config["image_size"] if config["image_size"] < sample_transforms.PHOTO_SIDE else None
    decoder = PairDecoder(side, split, pairs.mask_facts())
    cache_dir = config.get("cache_dir") or decoded_cache.default_cache_dir(config["data_dir"])
    masks = dict(pairs.pairs)

    def reason(path):
        for p, load in ((path, images.load_image), (masks[path], load_mask)):
            try:
                load(p)
            except images.UnreadableImage as e:
                return f"{p}: {e}"
        return "its mask and image differ in size"

    decoded = decoded_cache.decoded_folder(pairs, decoder, cache_dir, config["num_workers"],
                                           log, stop, reason)
    if pairs.unreadable_count() == len(pairs):
        raise UserError(f"no image and mask pair in {pairs.root!r} can be read (see the "
                        f"warnings above)")
    return CachedPairs(pairs, decoded)


def _file_sets(config, log, stop):
    """``(train, val, class names)`` of maskfolder or voc, decoded."""
    name, data_dir = config["dataset"], config["data_dir"]
    if not os.path.isdir(data_dir) and name == "maskfolder":
        raise UserError(f"--data-dir {data_dir!r} does not exist")
    if name == "voc":
        splits = {s: _voc_split(data_dir, s) for s in ("train", "val")}
        pairs = {s: MaskPairs(os.path.dirname(v.images[0]) if v.images else data_dir,
                              zip(v.images, v.masks), VOC_CLASSES) for s, v in splits.items()}
        names = list(VOC_CLASSES)
    else:
        names = _read_class_names(os.path.join(data_dir, "classes.txt"))
        pairs = {}
        for split in ("train", "val"):
            listed = _maskfolder_pairs(data_dir, split)
            _check_pairs(listed)
            pairs[split] = MaskPairs(os.path.dirname(listed[0][0]), listed, names or [])
    cached = {s: _decode(p, s, config, log, stop) for s, p in pairs.items()}
    largest = max(c.largest for c in cached.values())
    if names is None:
        names = [f"class{i}" for i in range(max(largest + 1, 2))]
        if config["num_classes"] != len(names):  # (round 5's F11: said, not silent)
            log(f"note: {data_dir} has no classes.txt: {len(names)} classes (class0.."
                f"class{len(names) - 1}), from the largest index in its masks; "
                f"--num-classes {config['num_classes']} counts the synthetic set's classes "
                f"only (name yours in {os.path.join(data_dir, 'classes.txt')}, one a line)")
    elif largest >= len(names):
        where = next(c for c in cached.values() if c.largest == largest)
        k = int(torch.nonzero(where.decoded.labels == largest)[0])
        source = "VOC's 21 classes" if name == "voc" else \
            os.path.join(data_dir, "classes.txt")
        raise UserError(f"the mask {where.pairs.pairs[k][1]} holds class {largest}, but "
                        f"{source} names {len(names)} (0..{len(names) - 1}; 255 = ignore)")
    return cached["train"], cached["val"], names


def build_datasets(config, log=say, stop=None):
    """The training and validation sets of a segmentation run.

    Args:
        config: a resolved config: ``dataset`` (``synthetic``, ``maskfolder``, ``voc``),
            ``data_dir``, ``seed``, ``augment``, ``image_size``, ``synthetic_size``,
            ``num_classes`` (synthetic), ``num_workers`` (decoding), ``auto_augment`` and
            ``random_erase`` (refused: ``check_config``); ``cache_dir`` and
            ``in_channels`` (synthetic), not flags, are optional.
        log: prints where a decoded cache is and how big.
        stop: returns a signal's number to stop a cache build at (``ops.Interrupted``).

    Returns:
        ``(train, val)``: two ``SegmentationSet`` of ``(image, mask)``: the image float32
        (C, H, W) normalised (files: ImageNet's statistics; synthetic: as made), the mask
        int64 (H, W), 255 = ignore. ``classes``: the synthetic set's ``background`` and
        shapes, VOC's 21 names, ``classes.txt``'s lines or ``class0``... up to the
        largest index in the masks.

    Raises:
        UserError: see ``check_config``; a missing folder, mask or download; a mask of
            another size or kind than its image; a class index beyond ``classes.txt``.
    """
    check_config(config)
    seed, augment, side = config["seed"], config["augment"], config["image_size"]
    if config["dataset"] == "synthetic":
        size, classes = config["synthetic_size"], config["num_classes"]
        channels = config.get("in_channels", 3)
        if size < 1 or classes < 2:
            raise UserError("--synthetic-size must be at least 1 and --num-classes at least 2")
        train = SyntheticMasks(size, classes, channels, side, seed, "train")
        val = SyntheticMasks(max(size // 5, 1), classes, channels, side, seed, "val")
        t_train, t_eval = pair_transforms(side, augment, sizes=[(side, side)])
        names = train.classes
    else:
        train, val, names = _file_sets(config, log, stop)
        channels = 3
        shapes = val.decoded.shapes  # (photos: each image's; the evaluation canvas fits them)
        sizes = None if shapes is None else [(h, w) for _, h, w in shapes.tolist()]
        t_train, t_eval = pair_transforms(side, augment, sample_transforms.STATS["imagefolder"],
                                          sizes)
    return (SegmentationSet(train, t_train, seed, augment, names, channels, side),
            SegmentationSet(val, t_eval, seed, False, names, channels, side))


def set_identity(dataset):
    """What a checkpoint records of a segmentation training set (as ``data.set_identity``
    for classifiers): ``{"size": N, "fingerprint": hex}`` of its files' relative paths,
    or of the synthetic set's recipe and masks."""
    base, h = dataset.base, hashlib.sha256()
    if isinstance(base, CachedPairs):
        for image, mask in base.pairs.pairs:
            h.update(os.fsencode(os.path.relpath(image, base.root)) + b"\0" +  # any name:
                     os.fsencode(os.path.relpath(mask, base.root)) + b"\n")  # bytes, as read
    else:
        h.update(f"segmentation synthetic {dataset.seed} {dataset.image_size} "
                 f"{dataset.in_channels} {dataset.num_classes}".encode())
        h.update(base.masks.numpy().tobytes())
    return {"size": len(dataset), "fingerprint": h.hexdigest()}


# ------------------------------------------------------------------ the device path

class DeviceLoader(device_data.DeviceLoader):
    """The device path of a segmentation set (device_data.py's, for ``(image, mask)``; one
    of its kind, so that ``isinstance`` checks for the device path hold, with its own
    ``__init__``):
    the set held as tensors on ``device``, each batch made there with the per-sample
    path's draws and arithmetic, so both paths give the same batches, bit for bit on the
    CPU.

    Small sizes: one gather per batch (``device_data.crop_flip_batch``) for the images,
    and the same gather for the masks, padded with 255 (the gather of ``255 - mask``
    padded with 0, turned back: the very offsets and flips of the images). Photo sizes:
    each sample through the set's own joint steps on the device (images of many sizes),
    the batch then normalised at once (``sample_transforms.normalise``, elementwise: the
    same bits).

    Iterating yields ``(x, y)`` on ``device``: ``x`` float32 (N, C, H, W) in
    ``memory_format``, ``y`` int64 (N, H, W).

    Args:
        dataset: a ``SegmentationSet`` from ``build_datasets``.
        device: where the set is held and batches are made.
        batch_sampler: an EpochBatchSampler (training), or
        indices: the indices to go through in order (validation), in batches of
            ``batch_size``.
        memory_format: of the batches.
    """

    def __init__(self, dataset, device, batch_sampler=None, indices=None, batch_size=None,
                 memory_format=torch.contiguous_format):
        if (batch_sampler is None) == (indices is None):
            raise ValueError("DeviceLoader takes a batch_sampler or indices, not both")
        self.dataset, self.device = dataset, torch.device(device)
        self.batch_sampler, self.batch_size = batch_sampler, batch_size
        self.indices = None if indices is None else torch.as_tensor(indices, dtype=torch.long)
        self.memory_format = memory_format
        transform, base = dataset.transform, dataset.base
        self.steps = transform.transforms
        self.stats = None if transform.mean is None else tuple(
            torch.tensor(s, dtype=torch.float32, device=self.device).view(-1, 1, 1)
            for s in (transform.mean, transform.std))
        self.padding = next((s.padding for s in self.steps if isinstance(s, PadCrop)), 0)
        self.flip = any(isinstance(s, Flip) for s in self.steps)
        self.photo = dataset.image_size >= sample_transforms.PHOTO_SIDE
        self.shapes = None
        if isinstance(base, SyntheticMasks):
            self.images, self.masks = base.images, base.masks
        elif base.decoded.shapes is None:  # small: (N, 4, S, S)
            both = base.decoded.images
            self.images, self.masks = both[:, :3], both[:, 3]
        else:  # photos: many sizes in one flat buffer
            self.images, self.shapes = base.decoded.images, base.decoded.shapes.tolist()
            self.offsets = base.decoded.offsets.tolist()
        self.images = self.images.to(self.device)
        self.masks = None if self.shapes else self.masks.to(self.device)

    def __len__(self):
        if self.batch_sampler is not None:
            return len(self.batch_sampler)
        return -(-len(self.indices) // self.batch_size)

    def nbytes(self):
        """Bytes the set takes where it is held."""
        held = self.images.numel() * self.images.element_size()
        return held + (0 if self.masks is None else self.masks.numel())

    def __iter__(self):
        batches, epoch = self.epoch_batches()  # (device_data.DeviceLoader's)
        if not batches:
            return
        random = self.dataset.random
        parts = batches if self.photo else device_data.draws_on_device(
            batches, epoch, self.dataset.seed, self.padding, self.flip, random, self.device)
        for part in parts:
            x, y = self._photos(part, epoch, random) if self.photo else self._gather(part)
            x = x.contiguous(memory_format=self.memory_format)
            if self.stats is not None:
                x = sample_transforms.normalise(x, *self.stats)
            yield x, y.to(torch.long)

    def _gather(self, part):
        x, y = self.images.index_select(0, part[0]), self.masks.index_select(0, part[0])
        if not self.dataset.random or not (self.padding or self.flip):
            return x, y
        top, left, flip = part[1], part[2], part[3]
        x = device_data.crop_flip_batch(x, top, left, flip, self.padding)
        y = IGNORE - device_data.crop_flip_batch(IGNORE - y[:, None], top, left, flip,
                                                 self.padding)[:, 0]
        return x, y

    def _photos(self, index, epoch, random):
        images, masks = [], []
        for i in index.tolist():
            if self.shapes is None:  # one size, stacked (the synthetic set at photo sizes)
                image, mask = self.images[i], self.masks[i]
            else:  # a photo of its own size in the flat buffer: image and mask together
                c, h, w = self.shapes[i]
                both = self.images[self.offsets[i]:self.offsets[i] + c * h * w].view(c, h, w)
                image, mask = both[:3], both[3]
            with sample_transforms.seeded(self.dataset.seed, epoch, i) if random else \
                    contextlib.nullcontext():
                for step in self.steps:
                    image, mask = step(image, mask)
            images.append(image)
            masks.append(mask)
        return torch.stack(images), torch.stack(masks)


def device_nbytes(dataset):
    """Bytes a segmentation set takes on the device path (images and masks)."""
    base = dataset.base
    if isinstance(base, SyntheticMasks):
        return base.images.numel() * base.images.element_size() + base.masks.numel()
    return base.decoded.nbytes


def device_decision(config, train_set, val_set, device):
    """Whether a segmentation run takes the device path (``--data-on-device``), and one
    line saying why: ``device_data.device_data_decision``'s rules (``auto``: when both
    sets take at most ``device_data.DEVICE_SHARE`` of the free memory) for these sets.

    Returns:
        ``(use, reason)``.

    Raises:
        UserError: ``on`` and the sets do not fit in the free memory of a CUDA device.
    """
    mode, device = config["data_on_device"], torch.device(device)
    workers = config["num_workers"]
    loader = f"data path: per-sample DataLoader, {workers} worker{'s' * (workers != 1)}"
    if mode == "off":
        return False, f"{loader} (--data-on-device off)"
    need = device_nbytes(train_set) + device_nbytes(val_set)
    what = f"{config['dataset']} images and masks ({decoded_cache.mib(need)})"
    return device_data.memory_decision(config, device, need, what, loader)


def build_device_loaders(config, train_set, val_set, sampler, device, rank=0, world_size=1,
                         memory_format=torch.contiguous_format, log=None, should_stop=None):
    """The device path's loaders of a segmentation run (as ``device_data.
    build_device_loaders``, whose arguments it takes; ``log`` and ``should_stop`` are
    unused: ``build_datasets`` decoded the files): ``(train_loader, val_loader)``, two
    ``DeviceLoader``; the validation loader goes through this process's shard
    (``data.shard_indices``) in batches of ``config["batch_size"]``."""
    train_loader = DeviceLoader(train_set, device, batch_sampler=sampler,
                                memory_format=memory_format)
    val_loader = DeviceLoader(val_set, device, indices=data.shard_indices(
        len(val_set), rank, world_size), batch_size=config["batch_size"],
        memory_format=memory_format)
    return train_loader, val_loader

"""Image-to-image data: sets of ``(input, target)`` images of one size, paired (pix2pix).

Two sets (``build_datasets``): ``synthetic`` (made in memory from the seed: the outlines of
segmentation's synthetic shapes, each drawn in its class's colour, as the input; the same
shapes filled as the target) and ``pairfolder`` (``DIR/{train,val}/{a,b}/NAME.png``: the
input in ``a``, its target in ``b``, paired by file name). A sample is two float32
``(C, S, S)`` images in [-1, 1] (the generator's tanh range), ``S`` = ``--image-size``:
files are resized to that square when read (bilinear, antialiased).

Geometry: the joint transforms are segmentation's (pair_transforms.py), reused: input and
target are stacked on channels and move as one image (bilinear, the same draws), the mask
slot carrying nothing. Training with augmentation takes the paper's jitter: both resized
to ``round(S * 286 / 256)``, a random ``S`` crop, a flip for half the samples, each draw
a hash of (seed, epoch, index) as every data path's, so a sample is the same with any
number of workers or processes and after a resume. Evaluation takes the pairs as they
are. The loaders are DataLoader workers (``data.build_loader``): no device path.
"""

import hashlib
import os

import torch
import torch.nn.functional as F
from PIL import Image
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from ops import UserError
from pipeline import data, images, sample_transforms, segmentation_data
from pipeline.pair_transforms import Flip, PairCompose, RandomCrop, RandomResize

DATASETS = ("pairfolder", "synthetic")
SUFFIXES = (".png", ".jpg", ".jpeg")
JITTER = 286 / 256  # the paper's: resized to 286, cropped to 256
MEAN, STD = 0.5, 0.5  # [0, 1] -> [-1, 1]


class PairSet(data.SeededDataset):
    """A ``data.SeededDataset`` of ``(input, target)``: the key ``(index, epoch)`` and the
    seeding are the classifier's; ``transform`` is a ``PairCompose`` over the two stacked
    on channels (``in_channels`` then ``out_channels``).

    Args:
        base: a map-style dataset returning ``(input, target)`` uint8 ``(C, S, S)`` tensors.
        transform: a ``PairCompose`` (``pair_transforms_for``).
        seed, random, in_channels, image_size: as ``data.SeededDataset``'s.
        out_channels: channels of the targets.
    """

    def __init__(self, base, transform, seed, random, in_channels, out_channels, image_size):
        super().__init__(base, transform, seed, random, [], in_channels, image_size)
        self.out_channels = out_channels

    def _transformed(self, index):
        a, b = self.base[index]
        both, nothing = torch.cat([a, b]), torch.zeros(b.shape[-2:], dtype=torch.uint8)
        both, _ = self.transform(both, nothing)
        return both[:self.in_channels], both[self.in_channels:]

    def __getitems__(self, keys):
        """A batch's pairs (the DataLoader asks for them together): where nothing is drawn
        and nothing moves (no augmentation: only the normalisation, elementwise) and the
        pairs are held in memory (``base.inputs``, ``base.targets``: the synthetic set), the
        whole batch is normalised at once, the same bits as pair by pair; else pair by
        pair."""
        if self.random or self.transform.transforms or not hasattr(self.base, "targets"):
            return [self[key] for key in keys]
        index = torch.tensor([key[0] if isinstance(key, tuple) else key for key in keys],
                             dtype=torch.long)
        both = torch.cat([self.base.inputs[index], self.base.targets[index]], 1)
        both, _ = self.transform(both, torch.zeros(0, dtype=torch.uint8))
        return list(zip(both[:, :self.in_channels], both[:, self.in_channels:]))

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        if not self.random:
            return self._transformed(index)
        generator = torch.default_generator  # seeded per sample, as the classifier's
        state = generator.get_state()
        generator.manual_seed(sample_transforms.sample_seed(self.seed, epoch, index))
        try:
            with sample_transforms.seeded(self.seed, epoch, index):
                return self._transformed(index)
        finally:
            generator.set_state(state)


def pair_transforms_for(image_size, augment, channels):
    """The training and evaluation ``PairCompose`` of ``channels`` stacked channels: the
    paper's jitter (resize to ``JITTER`` x the side, crop, flip) when ``augment``, else
    none; both bring uint8 to [-1, 1]."""
    stats = ((MEAN,) * channels, (STD,) * channels)
    train = []
    if augment:
        jittered = round(image_size * JITTER)
        train = [RandomResize(jittered, jittered), RandomCrop(image_size), Flip()]
    return PairCompose(train, *stats), PairCompose([], *stats)


# ------------------------------------------------------------------ the synthetic set

class SyntheticPairs(torch.utils.data.Dataset):
    """Outlines in, filled shapes out: segmentation's synthetic shapes
    (``segmentation_data.SyntheticMasks``, 1 to 3 per image) with a colour per class (from
    the seed; the background black). The input holds each shape's outline (its pixels
    with a 4-neighbour of another class) in its colour, the target the shapes filled.

    Args:
        size, num_classes, image_size, seed, split: as ``SyntheticMasks``' (the splits
            share colours, not samples).
    """

    def __init__(self, size, num_classes, image_size, seed, split):
        masks = segmentation_data.SyntheticMasks(size, num_classes, 1, image_size, seed,
                                                 split).masks.long()  # (N, S, S)
        g = torch.Generator().manual_seed(seed + 7)
        colours = torch.randint(64, 256, (num_classes, 3), generator=g, dtype=torch.uint8)
        colours[0] = 0
        padded = F.pad(masks[:, None].float(), (1, 1, 1, 1), mode="replicate")[:, 0].long()
        edge = torch.zeros_like(masks, dtype=torch.bool)
        for dy, dx in ((0, 1), (2, 1), (1, 0), (1, 2)):
            edge |= padded[:, dy:dy + image_size, dx:dx + image_size] != masks
        self.targets = colours[masks].permute(0, 3, 1, 2).contiguous()  # (N, 3, S, S) uint8
        self.inputs = self.targets * edge[:, None]
        self.recipe = f"pairs synthetic {seed} {image_size} {num_classes} {split}"

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.inputs[index], self.targets[index]


# ------------------------------------------------------------------------ the folders

class UnreadablePair(UserError):
    """A pair's file that cannot be read: one line naming it, from a DataLoader worker too.

    A worker's exception is raised again in the loading process as its type built from
    "Caught NAME in DataLoader worker process N.", the worker's traceback and its last line
    (``torch._utils.ExceptionWrapper.reraise``): this type keeps only its own message."""

    def __init__(self, message):
        text = str(message)
        if text.startswith(f"Caught {type(self).__name__} in DataLoader worker"):
            text = text.rstrip().rpartition(f"{type(self).__name__}: ")[2] or text
        super().__init__(text)


class FolderPairs(torch.utils.data.Dataset):
    """The pairs of one split of a pairfolder: ``(input, target)`` uint8 ``(3, S, S)``,
    each file read (``images.load_image``: RGB) and resized to ``S`` x ``S`` when asked.

    Args:
        root: the split's folder (``DIR/train``).
        pairs: ``[(input path, target path)]``.
        image_size: ``S``.
    """

    def __init__(self, root, pairs, image_size):
        self.root, self.pairs, self.image_size = root, pairs, image_size

    def __len__(self):
        return len(self.pairs)

    def _read(self, path):
        try:
            image = images.load_image(path)
        except images.UnreadableImage as e:
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise UnreadablePair(f"cannot read {path} ({reason})") from None
        tensor = TF.pil_to_tensor(image)  # (3, H, W) uint8
        side = self.image_size
        if tensor.shape[-2:] != (side, side):
            tensor = TF.resize(tensor, [side, side], antialias=True,
                               interpolation=v2.InterpolationMode.BILINEAR)
        return tensor

    def __getitem__(self, index):
        a, b = self.pairs[index]
        return self._read(a), self._read(b)


def _listed(folder):
    """``{stem: file name}`` of the images in ``folder``.

    Raises:
        UserError: two images of one name (``x.jpg`` and ``x.png``).
    """
    found = {}
    for name in sorted(os.listdir(folder)):
        if not name.lower().endswith(SUFFIXES) or not os.path.isfile(
                os.path.join(folder, name)):
            continue
        stem = os.path.splitext(name)[0]
        if stem in found:
            raise UserError(f"{os.path.join(folder, found[stem])} and {name} have one name: "
                            f"a pair is found by its name; rename one")
        found[stem] = name
    return found


def folder_pairs(data_dir, split):
    """The ``(input, target)`` paths of ``DIR/<split>/a`` and ``DIR/<split>/b``, by name.

    Raises:
        UserError: a folder missing, no image, a file without its pair (named), an
            unreadable file, a pair of two sizes (named).
    """
    folders = [os.path.join(data_dir, split, side) for side in ("a", "b")]
    for folder in folders:
        if not os.path.isdir(folder):
            raise UserError(f"--dataset pairfolder needs {folder!r}: DIR/train and DIR/val "
                            f"each hold a/NAME.png (the inputs) and b/NAME.png (their "
                            f"targets)")
    inputs, targets = (_listed(f) for f in folders)
    if not inputs:
        raise UserError(f"{folders[0]!r} holds no .png or .jpg image")
    for mine, theirs, (here, there), what in ((inputs, targets, folders, "input"),
                                              (targets, inputs, folders[::-1], "target")):
        alone = sorted(set(mine) - set(theirs))
        if alone:
            other = "target" if what == "input" else "input"
            raise UserError(f"the {what} {os.path.join(here, mine[alone[0]])} has no {other}: "
                            f"expected {os.path.join(there, alone[0])}.png (or .jpg) "
                            f"({len(alone)} unpaired in {here})")
    pairs = [(os.path.join(folders[0], inputs[s]), os.path.join(folders[1], targets[s]))
             for s in sorted(inputs)]
    for a, b in pairs:
        (wa, ha), (wb, hb) = _size(a), _size(b)
        if (wa, ha) != (wb, hb):
            raise UserError(f"the target {b} is {wb}x{hb} but its input {a} is {wa}x{ha}: "
                            f"a pair is two images of one size")
    return pairs


def _size(path):
    """``(width, height)`` of an image file from its header (its EXIF orientation
    applied), or a UserError naming it."""
    try:
        with Image.open(path, formats=images.IMAGE_FORMATS) as image:
            w, h = image.size
            if image.getexif().get(0x0112, 1) in (5, 6, 7, 8):  # turned 90 or 270 degrees
                w, h = h, w
            return w, h
    except Exception as e:  # PIL raises OSError, ValueError, SyntaxError...
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"cannot read {path} ({reason})") from None


# ------------------------------------------------------------------------ the sets

def build_datasets(config, log=None, stop=None):
    """The training and validation sets of an image-to-image run.

    Args:
        config: ``dataset`` (``synthetic``, ``pairfolder``), ``data_dir``, ``seed``,
            ``augment``, ``image_size``, ``synthetic_size`` and ``num_classes``
            (synthetic).
        log, stop: unused (the pairs are read as they are asked for).

    Returns:
        ``(train, val)``: two ``PairSet`` with ``in_channels``, ``out_channels`` and
        ``image_size``; the training set augments when ``config["augment"]``.

    Raises:
        UserError: an unknown dataset; see ``folder_pairs``.
    """
    name, seed, side = config["dataset"], config["seed"], config["image_size"]
    augment = config["augment"]
    if name == "synthetic":
        size, classes = config["synthetic_size"], config["num_classes"]
        if size < 1 or classes < 2:
            raise UserError("--synthetic-size must be at least 1 and --num-classes at least 2")
        train = SyntheticPairs(size, classes, side, seed, "train")
        val = SyntheticPairs(max(size // 5, 1), classes, side, seed, "val")
    elif name == "pairfolder":
        data_dir = config["data_dir"]
        if not os.path.isdir(data_dir):
            raise UserError(f"--data-dir {data_dir!r} does not exist")
        train, val = (FolderPairs(os.path.join(data_dir, split), folder_pairs(data_dir, split),
                                  side) for split in ("train", "val"))
    else:
        raise UserError(f"--dataset {name} holds no pairs: one of {', '.join(DATASETS)}")
    t_train, t_eval = pair_transforms_for(side, augment, 6)
    return (PairSet(train, t_train, seed, augment, 3, 3, side),
            PairSet(val, t_eval, seed, False, 3, 3, side))


def set_identity(dataset):
    """What a checkpoint records of a training set of pairs: ``{"size", "fingerprint"}``
    of its files' relative paths (bytes: any name), or of the synthetic set's recipe."""
    base, h = dataset.base, hashlib.sha256()
    if isinstance(base, FolderPairs):
        for a, b in base.pairs:
            h.update(os.fsencode(os.path.relpath(a, base.root)) + b"\0" +
                     os.fsencode(os.path.relpath(b, base.root)) + b"\n")
    else:
        h.update(base.recipe.encode())
    return {"size": len(dataset), "fingerprint": h.hexdigest()}

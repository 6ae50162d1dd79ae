"""What the data sources kept where users keep them (hf_data.py: Hugging Face datasets;
shards.py: webdataset tars) have in common: their flags, and ``EncodedImages``, a set of
encoded images read as an image folder's files are.

An image of such a set is its file's bytes (a PNG, a JPEG, ...) decoded by the same
``images.load_image`` that reads an ImageFolder's files, so the same images give the same
tensors, bit for bit, and go through the same transforms (data.py) from there. An image
that cannot be decoded is replaced by the next readable one of the set and counted, as in
``data.SafeImageFolder``.
"""

import hashlib
import io
import sys

import torch
import torch.utils.data

from machinery.runtime import say
from ops import UserError
from pipeline import presets
from pipeline.images import UnreadableImage, load_image


def add_flags(g):
    """The flags of --dataset hf and --dataset shards (config.py's data group)."""
    g.add_argument("--train-split", default="train",
                   help="--dataset hf: the split to train on")
    g.add_argument("--val-split", default="",
                   help="--dataset hf: the split to validate on (default: validation, "
                   "else test)")
    g.add_argument("--image-column", default="",
                   help="--dataset hf: the column of the images (default: the one whose "
                   "feature is an Image)")
    g.add_argument("--label-column", default="",
                   help="--dataset hf: the column of the labels (default: the one whose "
                   "feature is a ClassLabel)")
    g.add_argument("--val-data-dir", default="",
                   help="--dataset shards: the validation shards (a brace pattern of "
                   "files or http(s) URLs, or a folder of .tar files)")
    g.add_argument("--shard-cache", default="",
                   help="--dataset shards over http(s): a folder where the shards are "
                   "kept when first read, for random access (default: streamed)")
    g.add_argument("--shuffle-buffer", type=int, default=1000,
                   help="--dataset shards, streamed: the shuffle buffer's samples (the "
                   "shard order and the buffer's draws come from the seed and the epoch)")


class EncodedImages(torch.utils.data.Dataset):
    """Encoded images and their labels: ``(RGB PIL image, label)`` by index.

    A subclass gives ``encoded(index)`` (the image file's bytes; it may raise
    ``UnreadableImage``, e.g. a shard that cannot be read) and ``name(index)`` (the
    sample, in words). Unreadable samples are flagged in a shared-memory tensor that the
    DataLoader workers see too, and replaced by the next readable one (``read``).

    Args:
        labels: the label of each sample (int).
        classes: the class names, in label order.
        where: the set, in words (for messages).
    """

    decoder = None  # photos: presets.ShortSide (``as_photos``)

    def __init__(self, labels, classes, where):
        self.targets = [int(x) for x in labels]
        self.classes = list(classes)
        self.where = where
        self.unreadable = torch.zeros(len(self.targets), dtype=torch.uint8).share_memory_()
        self.source_sizes = torch.zeros(len(self.targets), 2, dtype=torch.int32)

    def __len__(self):
        return len(self.targets)

    def encoded(self, index):
        raise NotImplementedError

    def name(self, index):
        return f"sample {index} of {self.where}"

    def __getitem__(self, index):
        if self.decoder is not None:  # a photo: (3, h, w) uint8 at its stored short side
            return self.decoder(self, index)
        return self.read(index, load_image)

    def read(self, index, loader):
        """Sample ``index`` decoded by ``loader`` (a file -> image function, given the bytes
        as a file object), or, where it is unreadable, the next readable one."""
        size = len(self)
        for i in (j % size for j in range(index, index + size)):
            if self.unreadable[i]:
                continue
            try:
                image = loader(io.BytesIO(self.encoded(i)))
            except UnreadableImage as e:
                self.unreadable[i] = 1
                say(f"warning: skipping unreadable image {self.name(i)} ({e}); the next "
                    f"readable image of the set stands in for it", file=sys.stderr)
                continue
            return image, self.targets[i]
        raise UserError(f"no image of {self.where} can be read (see the warnings above)")

    def unreadable_count(self):
        """The number of distinct samples of the set found unreadable so far."""
        return int(self.unreadable.sum())

    def identity(self):
        """Bytes that tell this set from another (``data.set_identity``): its kind, what
        names its contents, and the labels."""
        h = hashlib.sha256(type(self).__name__.encode())
        h.update(self.content_name().encode())
        h.update(torch.as_tensor(self.targets, dtype=torch.long).numpy().tobytes())
        return h.digest()

    def content_name(self):
        return self.where


def as_photos(config, sets, policy):
    """At --image-size 64 and above, ``sets`` (EncodedImages) become photos as an image
    folder's do (presets.py): each image decoded to its stored short side by the decoded
    cache's own decoder (``presets.ShortSide``), here per sample, then the random-resized
    or centre crop. Returns their ``(train, eval)`` transforms then, else None.

    Args:
        config: the run's (``image_size``, ``crop_pct``, the preset's flags).
        sets: the EncodedImages (their ``decoder`` set).
        policy: ``recipes.policy_transforms``'s pair.
    """
    if config["image_size"] < presets.PHOTO_SIDE:
        return None
    decoder = presets.ShortSide(presets.stored_side(config["image_size"], config["crop_pct"]),
                                presets.preset(config)["interpolation"])
    for images in sets:
        images.decoder = decoder
    return presets.transforms(config, policy)


def check_labels(labels, classes, where):
    """Raises UserError unless every label is one of ``classes``' indices."""
    bad = [x for x in labels if not 0 <= int(x) < len(classes)]
    if bad:
        raise UserError(f"{where}: label {bad[0]} is not one of the {len(classes)} classes "
                        f"(0-{len(classes) - 1})")

"""Object detection data: images with a variable number of boxes each.

Two sets (``build_datasets``): ``synthetic`` (coloured shapes on noise, each with its tight
box, made in memory from the seed; some images hold none) and ``coco``, in either layout:

* COCO's own: ``DIR/annotations/instances_{train,val}2017.json`` with the images in
  ``DIR/{train,val}2017/``;
* what labelling tools export (CVAT, Label Studio, Roboflow): ``DIR/{train,val}/`` each
  holding its images and one COCO-format ``.json`` (``valid/`` is read as ``val/``).

A json is checked when read; what is wrong is one ``UserError`` line naming the file and
the annotation: a missing file or image, a json that is not COCO (no ``images``,
``annotations`` or ``categories``) or nested too deeply to read, an id that is not an
integer or a string (a list, an object, ``true``), an annotation of an image or category
that does not exist, a ``file_name`` that leaves its split's image folder (an absolute
path, ``..``), a box of negative width or height, a box outside its image (by more than
``OUTSIDE_TOLERANCE`` px: COCO's own boxes cross their image's edge by a rounding). Boxes
of zero width or height are dropped, with their count in one warning. Images are read as
stored, without their EXIF orientation (as torchvision's COCO reference reads them): a
json's boxes and sizes are the stored pixels'. A split without a readable image is one
``UserError`` line when it is built. Category ids are mapped to contiguous labels ``1..C`` in the
order of their ids (0 is the detectors' background) and back (``category_ids``: test.py's
predictions are written in the file's own ids). Crowd boxes (``iscrowd: 1``) are left out
of training, as COCO's reference does, and kept for evaluation, where COCO's evaluation
ignores what matches them. Images without boxes are kept.

A sample is ``(image, target)``: the image float32 (3, S, S) in [0, 1] (the detectors
normalise it themselves), S = ``--image-size``, and the target a dict of tensors padded to
the set's most boxes per image (``max_boxes``), so that the DataLoader's default collation
stacks a batch: ``boxes`` (K, 4) XYXY in the image's pixels, ``labels`` (K,) (-1 where
padded), ``crowd`` (K,), ``count`` (the boxes there), ``index`` (the sample's index),
``scale`` (sx, sy: the image's size over its file's) and ``size`` (the file's h, w).

Training (``--augment``): torchvision.transforms.v2 on the image and its
``tv_tensors.BoundingBoxes``: horizontal flip, scale jitter (``v2.ScaleJitter``: the image
fitted into S x S, times a factor drawn from ``SCALE_RANGE``), a random S x S crop (padded
where the image is smaller), the boxes clipped to it and those it emptied removed
(``v2.SanitizeBoundingBoxes``). Their random draws come from torch's generator, which
``SeededDataset`` seeds from (seed, epoch, index) for each sample
(``sample_transforms.sample_seed``), so a sample is the same with any number of workers or
processes and after a resume. Evaluation (and training without augmentation): the long
side resized to S, the image padded right and bottom to S x S; evaluation keeps the boxes
of the file (``scale`` maps predictions back to them), so that the figures are those of
the file's own coordinates.

The device path is not offered: the boxes and the scale jitter are per-sample work
(``device_decision`` says so in one line).
"""

import hashlib
import json
import math
import os
import sys

import torch
import torch.utils.data
from torchvision import tv_tensors
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from machinery.runtime import say
from ops import UserError
from pipeline import data, images, sample_transforms
from pipeline.segmentation_data import shape_mask

DATASETS = ("coco", "synthetic")
SCALE_RANGE = (0.5, 1.5)  # training's scale jitter, times the image fitted into S x S
OUTSIDE_TOLERANCE = 1.0   # px a box may cross its image's edge (clipped): COCO's rounding
SPLIT_NAMES = {"train": ("train",), "val": ("val", "valid")}


# ------------------------------------------------------------------ the synthetic set

SHAPES = ("rectangle", "disc", "diamond", "triangle", "ring")


class SyntheticBoxes(torch.utils.data.Dataset):
    """Learnable detection samples made in memory: noise with 0 to 3 shapes on it, each
    class its own colour and shape (``SHAPES[(c - 1) % 5]``), each shape's box the tight
    box of its pixels (a later shape may cover part of an earlier one; its box stays).

    Args:
        size: number of images.
        num_classes: object classes (labels 1..C; 0 is the detectors' background).
        image_size: side of the square uint8 images.
        seed: the same seed gives the same set.
        split: ``"train"`` or ``"val"``: they share colours, not images.
    """

    def __init__(self, size, num_classes, image_size, seed, split):
        g = torch.Generator().manual_seed(seed)
        colours = torch.rand(num_classes + 1, 3, generator=g) * 0.8 + 0.2
        g.manual_seed(seed * 2 + 1 + (split == "val"))
        s = image_size
        pictures = 0.3 + 0.1 * torch.randn(size, 3, s, s, generator=g)
        ys = torch.arange(s, dtype=torch.float32).view(s, 1)
        xs = torch.arange(s, dtype=torch.float32).view(1, s)
        count = torch.randint(0, 4, (size,), generator=g)  # 0: an image without boxes
        self.targets = []
        for i in range(size):
            boxes, labels = [], []
            for _ in range(int(count[i])):
                c = int(torch.randint(1, num_classes + 1, (), generator=g))
                cy, cx = ((torch.rand(2, generator=g) * 0.7 + 0.15) * s).tolist()
                r = float(torch.rand((), generator=g) * 0.15 + 0.12) * s
                where = shape_mask(SHAPES[(c - 1) % len(SHAPES)], ys - cy, xs - cx, r)
                if not bool(where.any()):
                    continue
                pictures[i][:, where] = colours[c].view(3, 1)
                rows, cols = where.any(1).nonzero()[:, 0], where.any(0).nonzero()[:, 0]
                boxes.append([float(cols[0]), float(rows[0]), float(cols[-1] + 1),
                              float(rows[-1] + 1)])
                labels.append(c)
            self.targets.append({"boxes": torch.tensor(boxes, dtype=torch.float32).view(-1, 4),
                                 "labels": torch.tensor(labels, dtype=torch.long),
                                 "crowd": torch.zeros(len(labels), dtype=torch.bool)})
        self.images = (pictures.clamp(0, 1) * 255).round().to(torch.uint8)
        self.classes = [f"{SHAPES[(c - 1) % len(SHAPES)]}{c}" for c in range(1, num_classes + 1)]
        self.category_ids = list(range(1, num_classes + 1))
        self.image_ids = list(range(size))

    def __len__(self):
        return len(self.targets)

    def __getitem__(self, index):
        return self.images[index], self.targets[index]


# ------------------------------------------------------------------ COCO files

def _fail(path, what):
    raise UserError(f"{path}: {what}")


def _number(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isfinite(value)


def _an_id(value):
    """Whether ``value`` can be a COCO id: an integer (not ``true``/``false``) or a
    string."""
    return isinstance(value, (int, str)) and not isinstance(value, bool)


def _inside(image_dir, file_name):
    """``image_dir``/``file_name`` as joined (what a checkpoint's fingerprint hashes), or
    None where the name leaves the folder (absolute, or more ``..`` than folders)."""
    if os.path.isabs(file_name) or os.path.splitdrive(file_name)[0]:
        return None
    path = os.path.join(image_dir, file_name)
    root, where = os.path.normpath(image_dir), os.path.normpath(path)
    return path if os.path.commonpath([root, where]) == root and where != root else None


def _own_categories(json_path, doc):
    """A COCO json's ``[(id, name)]``, each id an integer, no id twice."""
    own = []
    for cat in doc["categories"]:
        if not isinstance(cat, dict) or not isinstance(cat.get("id"), int) or \
                isinstance(cat.get("id"), bool):
            _fail(json_path, f"a category without an integer id: {str(cat)[:100]}")
        own.append((cat["id"], str(cat.get("name", cat["id"]))))
    if len({i for i, _ in own}) != len(own):
        _fail(json_path, "two categories share an id")
    return own


def _image_entries(json_path, doc, image_dir):
    """A COCO json's images by id, each with empty lists for its boxes."""
    by_id = {}
    for image in doc["images"]:
        if not isinstance(image, dict) or not _an_id(image.get("id")) or \
                not isinstance(image.get("file_name"), str) or \
                not all(_number(image.get(k)) and image[k] > 0 for k in ("width", "height")):
            _fail(json_path, f"an image entry without id (an integer or a string), file_name, "
                             f"width and height: "
                             f"{str(image)[:120]}")
        if image["id"] in by_id:
            _fail(json_path, f"two images have the id {image['id']!r}")
        path = _inside(image_dir, image["file_name"])
        if path is None:
            _fail(json_path, f"image {image['id']!r}: its file_name {image['file_name']!r} "
                             f"is not inside its image folder {image_dir}: refused")
        by_id[image["id"]] = {"path": path, "id": image["id"], "height": image["height"],
                              "width": image["width"], "boxes": [], "categories": [],
                              "crowd": []}
    return by_id


def read_coco(json_path, image_dir, categories=None):
    """One split's COCO json, checked: ``(images, categories)``.

    Args:
        json_path: the json file.
        image_dir: where its ``file_name``s are.
        categories: the training split's ``[(id, name)]`` (the validation split's must be
            among them); None: this file's, sorted by id.

    Returns:
        ``images``: ``[{"path", "id", "height", "width", "boxes" (K, 4) XYXY,
        "categories" (K,) the file's ids, "crowd" (K,)}]`` in the file's order;
        ``categories``: ``[(id, name)]``.

    Raises:
        UserError: one line naming the file (and the annotation) for anything wrong.
    """
    if not os.path.isfile(json_path):
        _fail(json_path, "no such file")
    try:
        with open(json_path, "rb") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        _fail(json_path, f"not a JSON file ({str(e).splitlines()[0][:200]})")
    except RecursionError:
        _fail(json_path, "nested too deeply to be read (not a COCO annotation file)")
    if not isinstance(doc, dict) or not all(
            isinstance(doc.get(k), list) for k in ("images", "annotations", "categories")):
        have = ", ".join(sorted(doc)[:8]) if isinstance(doc, dict) else type(doc).__name__
        _fail(json_path, f"not a COCO annotation file: it needs the lists images, "
                         f"annotations and categories (it has {have or 'nothing'})")
    own = _own_categories(json_path, doc)
    if categories is None:
        categories = sorted(own)
        if not categories:
            _fail(json_path, "no categories")
    known = {i for i, _ in categories}
    by_id = _image_entries(json_path, doc, image_dir)
    empty = 0
    for ann in doc["annotations"]:
        name = f"annotation {ann.get('id', '?')}" if isinstance(ann, dict) else "annotation"
        if not isinstance(ann, dict):
            _fail(json_path, f"{name} is not an object")
        for key in ("image_id", "category_id"):
            if not _an_id(ann.get(key)):
                _fail(json_path, f"{name}: its {key} {str(ann.get(key))[:60]} is not an "
                                 f"integer or a string")
        entry = by_id.get(ann["image_id"])
        if entry is None:
            _fail(json_path, f"{name} is of image_id {ann.get('image_id')!r}, which no image "
                             f"has")
        if ann.get("category_id") not in known:
            _fail(json_path, f"{name} is of category_id {ann.get('category_id')!r}, which "
                             f"is not a category" + (" of the training split"
                                                     if len(categories) != len(own) or
                                                     categories != sorted(own) else ""))
        box = ann.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and all(_number(v) for v in box)):
            _fail(json_path, f"{name}: bbox {str(box)[:60]} is not [x, y, width, height]")
        x, y, w, h = (float(v) for v in box)
        if w < 0 or h < 0:
            _fail(json_path, f"{name}: bbox [{x:g}, {y:g}, {w:g}, {h:g}] has a negative "
                             f"width or height")
        if w == 0 or h == 0:
            empty += 1
            continue
        t = OUTSIDE_TOLERANCE
        if x < -t or y < -t or x + w > entry["width"] + t or y + h > entry["height"] + t:
            _fail(json_path, f"{name}: bbox [{x:g}, {y:g}, {w:g}, {h:g}] lies outside its "
                             f"image {entry['path']} ({entry['width']:g}x"
                             f"{entry['height']:g})")
        x1, y1 = max(x, 0.0), max(y, 0.0)
        x2, y2 = min(x + w, entry["width"]), min(y + h, entry["height"])
        entry["boxes"].append([x1, y1, x2, y2])
        entry["categories"].append(ann["category_id"])
        entry["crowd"].append(bool(ann.get("iscrowd", 0)))
    if empty:
        say(f"warning: {json_path}: {empty} box{'es' * (empty != 1)} of zero width or "
            f"height dropped", file=sys.stderr)
    found = list(by_id.values())
    missing = next((e["path"] for e in found if not os.path.isfile(e["path"])), None)
    if missing is not None:
        _fail(json_path, f"its image {missing} does not exist")
    for e in found:
        e["boxes"] = torch.tensor(e["boxes"], dtype=torch.float32).view(-1, 4)
        e["categories"] = torch.tensor(e["categories"], dtype=torch.long)
        e["crowd"] = torch.tensor(e["crowd"], dtype=torch.bool)
    return found, categories


def coco_layout(data_dir):
    """``{"train": (json, image dir), "val": (json, image dir)}`` of ``data_dir``: COCO's
    own layout or a labelling tool's export (module docstring).

    Raises:
        UserError: neither layout, or a split folder without exactly one json.
    """
    if not os.path.isdir(data_dir):
        raise UserError(f"--data-dir {data_dir!r} does not exist")
    own = {s: (os.path.join(data_dir, "annotations", f"instances_{s}2017.json"),
               os.path.join(data_dir, f"{s}2017")) for s in ("train", "val")}
    if os.path.isdir(os.path.join(data_dir, "annotations")):
        return own
    found = {}
    for split, names in SPLIT_NAMES.items():
        folder = next((os.path.join(data_dir, n) for n in names
                       if os.path.isdir(os.path.join(data_dir, n))), None)
        if folder is None:
            raise UserError(f"--data-dir {data_dir!r} holds neither COCO's layout "
                            f"(annotations/instances_{{train,val}}2017.json) nor a "
                            f"labelling tool's ({'/, '.join(names)}/ with its images and "
                            f"one COCO .json)")
        jsons = sorted(n for n in os.listdir(folder) if n.lower().endswith(".json"))
        if len(jsons) != 1:
            raise UserError(f"{folder}: {len(jsons)} .json files; a split folder holds its "
                            f"images and one COCO-format .json")
        found[split] = (os.path.join(folder, jsons[0]), folder)
    return found


class CocoImages(torch.utils.data.Dataset):
    """One split of a COCO-format folder: ``(uint8 image (3, H, W), target)``, the target
    as ``SyntheticBoxes``'s (``labels`` 1..C from ``categories``' order).

    An image that cannot be read is replaced by the next readable one, with one warning
    naming the file (as ``data.SafeImageFolder`` does), and counted. Images are read as
    stored (no EXIF orientation: the json's boxes are the stored pixels').

    Raises:
        UserError: no image of the split can be read (checked when it is built, from the
            first image on).
    """

    def __init__(self, entries, categories):
        self.entries = entries
        self.classes = [name for _, name in categories]
        self.category_ids = [i for i, _ in categories]
        self.image_ids = [e["id"] for e in entries]
        label = {cid: k + 1 for k, cid in enumerate(self.category_ids)}
        self.targets = [{"boxes": e["boxes"],
                         "labels": torch.tensor([label[int(c)] for c in e["categories"]],
                                                dtype=torch.long),
                         "crowd": e["crowd"]} for e in entries]
        self.unreadable = torch.zeros(len(entries), dtype=torch.uint8).share_memory_()
        self.warned = torch.zeros(len(entries), dtype=torch.uint8).share_memory_()
        if entries:
            self[0]  # finds a readable image now, or raises UserError

    def __len__(self):
        return len(self.entries)

    def unreadable_count(self):
        return int(self.unreadable.sum())

    def __getitem__(self, index):
        size = len(self.entries)
        for i in (j % size for j in range(index, index + size)):
            if self.unreadable[i]:
                continue
            entry = self.entries[i]
            try:
                image = TF.pil_to_tensor(images.load_image(entry["path"], oriented=False))
            except images.UnreadableImage as e:
                self.unreadable[i] = 1
                say(f"warning: skipping unreadable image {entry['path']} ({e}); the next "
                    f"readable image of the set stands in for it", file=sys.stderr)
                continue
            target = self.targets[i]
            h, w = image.shape[-2:]
            if h != w and (h, w) == (entry["width"], entry["height"]) and not self.warned[i]:
                self.warned[i] = 1
                say(f"warning: {entry['path']} is {w}x{h} as stored, its json says "
                    f"{entry['width']:g}x{entry['height']:g}: if its boxes were drawn on "
                    f"the image turned by its EXIF orientation, they miss their objects "
                    f"(images are read as stored)", file=sys.stderr)
            if (h, w) != (entry["height"], entry["width"]):  # boxes are the json's pixels
                sx, sy = w / entry["width"], h / entry["height"]
                target = dict(target, boxes=target["boxes"] * torch.tensor([sx, sy, sx, sy]))
            return image, target
        folder = os.path.dirname(self.entries[0]["path"]) if size else "the split"
        raise UserError(f"no image in {folder!r} can be read (see the warnings above)")


# ------------------------------------------------------------------ transforms

def fitted(h, w, side):
    """``[height, width]`` of an ``h`` x ``w`` image with its long side at ``side`` (as
    ``TF.resize(image, None, max_size=side)`` gives), each side at least 1 px."""
    new_short = max(1, int(side * min(h, w) / max(h, w)))
    return [side, new_short] if w <= h else [new_short, side]


class _ScaleJitter(v2.ScaleJitter):
    """``v2.ScaleJitter`` (the same draw), each side of its result at least 1 px (an image
    of extreme aspect ratio, 2000 x 10, would have a side of 0)."""

    def make_params(self, flat_inputs):
        height, width = super().make_params(flat_inputs)["size"]
        return dict(size=(max(height, 1), max(width, 1)))


class BoxTransform:
    """An image and its boxes to a square ``side`` x ``side`` sample (module docstring).

    Args:
        side: ``--image-size``.
        train: training (crowd boxes left out, the boxes moved with the image) or
            evaluation (the file's boxes kept, ``scale`` given).
        augment: training's flip, scale jitter and crop (v2); off: the evaluation's resize.
        max_boxes: the set's most boxes per image (what a target is padded to).
    """

    def __init__(self, side, train, augment, max_boxes):
        self.side, self.train, self.augment = side, train, augment
        self.max_boxes = max(max_boxes, 1)
        self.jitter = v2.Compose([
            v2.RandomHorizontalFlip(0.5),
            _ScaleJitter((side, side), scale_range=SCALE_RANGE),
            v2.RandomCrop(side, pad_if_needed=True),
            v2.ClampBoundingBoxes(),
            v2.SanitizeBoundingBoxes(min_size=1.0),
        ])

    def resize(self, image):
        """The long side at ``side``, padded right and bottom: ``(image, (sx, sy))``."""
        h, w = image.shape[-2:]
        if (h, w) != (self.side, self.side):
            image = TF.resize(image, fitted(h, w, self.side), antialias=True)
        nh, nw = image.shape[-2:]
        image = TF.pad(image, [0, 0, self.side - nw, self.side - nh])
        return image, (nw / w, nh / h)

    def __call__(self, image, target, index):
        h, w = image.shape[-2:]
        boxes, labels, crowd = target["boxes"], target["labels"], target["crowd"]
        if self.train:
            keep = ~crowd
            boxes, labels = boxes[keep], labels[keep]
            crowd = torch.zeros(len(labels), dtype=torch.bool)
            picture = tv_tensors.Image(image)
            held = tv_tensors.BoundingBoxes(boxes, format="XYXY", canvas_size=(h, w))
            if self.augment:
                picture, out = self.jitter(picture, {"boxes": held, "labels": labels})
                boxes, labels = out["boxes"], out["labels"]
                crowd = torch.zeros(len(labels), dtype=torch.bool)
                scale = (1.0, 1.0)
            else:
                picture, held = self.resize_both(picture, held)
                boxes, scale = held, (1.0, 1.0)
            image = picture
        else:
            image, scale = self.resize(image)
        image = TF.to_dtype(image.as_subclass(torch.Tensor), torch.float32, scale=True)
        return image.contiguous(), pack(boxes, labels, crowd, self.max_boxes, index, scale,
                                        (h, w))

    def resize_both(self, picture, held):
        """Training without augmentation: image and boxes as evaluation resizes them."""
        h, w = picture.shape[-2:]
        if (h, w) != (self.side, self.side):
            size = fitted(h, w, self.side)
            picture, held = TF.resize(picture, size, antialias=True), TF.resize(held, size)
        nh, nw = picture.shape[-2:]
        pads = [0, 0, self.side - nw, self.side - nh]
        return TF.pad(picture, pads), TF.pad(held, pads)

    def __repr__(self):
        return (f"BoxTransform(side={self.side}, train={self.train}, augment={self.augment},"
                f" scale_range={SCALE_RANGE})")


def pack(boxes, labels, crowd, k, index, scale, size):
    """A target as tensors of fixed shapes (the module docstring's), ``k`` rows."""
    n = len(labels)
    if n > k:
        raise ValueError(f"{n} boxes in an image, more than the set's {k}")
    packed_boxes = torch.zeros(k, 4, dtype=torch.float32)
    packed_boxes[:n] = torch.as_tensor(boxes, dtype=torch.float32).view(-1, 4)
    packed_labels = torch.full((k,), -1, dtype=torch.long)
    packed_labels[:n] = labels
    packed_crowd = torch.zeros(k, dtype=torch.bool)
    packed_crowd[:n] = crowd
    return {"boxes": packed_boxes, "labels": packed_labels, "crowd": packed_crowd,
            "count": torch.tensor(n), "index": torch.tensor(index),
            "scale": torch.tensor(scale, dtype=torch.float32),
            "size": torch.tensor(size, dtype=torch.long)}


class DetectionSet(data.SeededDataset):
    """A ``data.SeededDataset`` of ``(image, target)``: the key ``(index, epoch)`` and the
    seeding of torch's generator per sample (v2's draws) are the classifier's; besides
    its attributes, ``category_ids`` (label k is the file's category ``category_ids[k -
    1]``), ``image_ids`` (the file's image ids, by index) and ``max_boxes``."""

    def __init__(self, base, transform, seed, random, classes, image_size):
        super().__init__(base, transform, seed, random, classes, 3, image_size)
        self.category_ids = list(base.category_ids)
        self.image_ids = list(base.image_ids)
        self.max_boxes = transform.max_boxes

    def __getitem__(self, key):
        index, epoch = key if isinstance(key, tuple) else (key, 0)
        image, target = self.base[index]
        if not self.random:
            return self.transform(image, target, index)
        generator = torch.default_generator
        state = generator.get_state()
        generator.manual_seed(sample_transforms.sample_seed(self.seed, epoch, index))
        try:
            with sample_transforms.seeded(self.seed, epoch, index):
                return self.transform(image, target, index)
        finally:
            generator.set_state(state)


def check_config(config):
    """Refuses, in one line each, what would move an image and not its boxes."""
    if config.get("auto_augment", "none") != "none":
        raise UserError(f"--auto-augment {config['auto_augment']} would rotate, shear or "
                        f"translate the image and not its boxes: not for --task detection")
    if config.get("random_erase", 0.0):
        raise UserError("--random-erase would erase objects and keep their boxes: not for "
                        "--task detection")
    if config["dataset"] not in DATASETS:
        raise UserError(f"--dataset {config['dataset']} has no boxes: --task detection "
                        f"takes one of {', '.join(DATASETS)}")


def build_datasets(config, log=say, stop=None):
    """The training and validation sets of a detection run: two ``DetectionSet``.

    Args:
        config: ``dataset`` (``synthetic``, ``coco``), ``data_dir``, ``seed``,
            ``augment``, ``image_size``, ``synthetic_size`` and ``num_classes``
            (synthetic).
        log, stop: as the other sets' (unused: nothing is cached).

    Raises:
        UserError: see ``check_config``, ``coco_layout`` and ``read_coco``.
    """
    check_config(config)
    seed, augment, side = config["seed"], config["augment"], config["image_size"]
    if config["dataset"] == "synthetic":
        size, classes = config["synthetic_size"], config["num_classes"]
        if size < 1 or classes < 1:
            raise UserError("--synthetic-size and --num-classes must be at least 1")
        train = SyntheticBoxes(size, classes, side, seed, "train")
        val = SyntheticBoxes(max(size // 5, 1), classes, side, seed, "val")
    else:
        layout = coco_layout(config["data_dir"])
        entries, categories = read_coco(*layout["train"])
        train = CocoImages(entries, categories)
        val_entries, _ = read_coco(*layout["val"], categories=categories)
        val = CocoImages(val_entries, categories)
    most = max((len(t["labels"]) for s in (train, val) for t in s.targets), default=1)
    return (DetectionSet(train, BoxTransform(side, True, augment, most), seed, augment,
                         train.classes, side),
            DetectionSet(val, BoxTransform(side, False, False, most), seed, False,
                         train.classes, side))


def set_identity(dataset):
    """What a checkpoint records of a detection training set: ``{"size", "fingerprint"}``
    of its image paths and boxes (files), or of the synthetic set's recipe and boxes."""
    base, h = dataset.base, hashlib.sha256()
    if isinstance(base, CocoImages):
        for entry in base.entries:
            h.update(os.fsencode(entry["path"]) + b"\n")
    else:
        h.update(f"detection synthetic {dataset.seed} {dataset.image_size} "
                 f"{dataset.num_classes}".encode())
    for target in base.targets:
        h.update(target["boxes"].numpy().tobytes() + target["labels"].numpy().tobytes())
    return {"size": len(dataset), "fingerprint": h.hexdigest()}


def device_decision(config, train_set, val_set, device):
    """Detection's batches are made by DataLoader workers: ``(False, the line why)``."""
    workers = config["num_workers"]
    return False, (f"data path: per-sample DataLoader, {workers} worker"
                   f"{'s' * (workers != 1)} (detection: each image's boxes and scale "
                   f"jitter are per-sample work; no device path)")

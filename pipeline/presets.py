"""The geometry of photos, in one place: what training, evaluation, the device path, test.py
and export do with an image folder at ``--image-size 64`` and above, and what a
pretrained torchvision network expects (as torchvision's reference presets).

Each photo is decoded once (at reduced size where it is a JPEG much larger than needed:
PIL's draft mode) into the decoded cache with its short side at ``stored_side``:
``image_size / --crop-pct`` (256 for 224), aspect kept (``ShortSide``). From there:

* training: a random-resized crop (its area a fraction in ``[--crop-min-scale, 1]`` of
  the stored image's, its aspect ratio log-uniform in [3/4, 4/3], ten tries then the
  centre, as ``v2.RandomResizedCrop``) resized to ``image_size``, then a flip;
* evaluation: the centre ``image_size`` crop of the stored image (torchvision's
  ``Resize(256)`` + ``CenterCrop(224)``).

The crop's draws come from a hash of (seed, epoch, index)
(``sample_transforms.sample_hash``), like the small images' crop and flip, and the boxes
are computed with the same float64 tensor arithmetic (+, *, /, sqrt, round: exact in
IEEE) on every path: the DataLoader workers, the device path, any worker count, after a
resume, give the same crops. Below 64 px an
image folder keeps the small-image geometry (resize to a square, pad-and-crop).
"""

import hashlib
import math
import os

import torch
import torch.hub
from torchvision.transforms import v2
from torchvision.transforms.v2 import functional as TF

from machinery import checkpoint
from networks import is_segmentation
from ops import UserError
from pipeline import images, sample_transforms, timm_hub

PHOTO_SIDE = sample_transforms.PHOTO_SIDE  # image folders at this --image-size and above
RATIO = (3 / 4, 4 / 3)  # the random-resized crop's aspect ratios, as torchvision's
ATTEMPTS = 10          # tries at a crop that fits, as torchvision's; then the centre
STREAM = 100           # attempt a's draws: streams STREAM + 4a (area) ... + 3 (left)
_RATIOS = 4096         # the aspect ratio is one of these many log-uniform values


def is_photo(config):
    """Whether a run's image folder takes the photo geometry (64 px and above)."""
    return config["dataset"] in sample_transforms.FOLDERS and config["image_size"] >= PHOTO_SIDE


def network_notes(config, log, explicit=None, flops=None):
    """The lines a photo run gets about its network: which one it got without --network
    (``explicit``: the flags given, of a fresh run), or that a CIFAR network keeps the full
    resolution of its photos (``flops``: a forward pass per sample)."""
    if not is_photo(config):
        return
    if explicit is not None and "network" not in explicit:
        log(f"network: {config['network']}, built for {config['image_size']} px photos (an "
            f"ImageNet stem); --network to choose another, --pretrained torchvision to "
            f"start from ImageNet's weights")
    if flops is not None and not config["network"].startswith(("torchvision/", "timm/")):
        size = config["image_size"]
        log(f"note: {config['network']} keeps the full resolution of its {size} px input: "
            f"{flops / 3e9:.1f} GFLOPs a forward pass per sample; torchvision/resnet18, "
            f"built for such images (a 4x stem), costs about {3.6 * (size / 224) ** 2:.1f}: "
            f"pass --network torchvision/resnet18")


def stored_side(image_size, crop_pct):
    """The short side a photo is kept at: ``floor(image_size / crop_pct)`` (as timm)."""
    return max(image_size, math.floor(image_size / crop_pct + 1e-6))


_LOG_RATIOS = None


def _ratio_table():
    """The log-uniform aspect ratios (float64), computed once in Python: the same values
    on every device, with no exp or log (whose last bit varies between libraries)."""
    global _LOG_RATIOS
    if _LOG_RATIOS is None:
        low, high = math.log(RATIO[0]), math.log(RATIO[1])
        _LOG_RATIOS = torch.tensor([math.exp(low + (k + 0.5) / _RATIOS * (high - low))
                                    for k in range(_RATIOS)], dtype=torch.float64)
    return _LOG_RATIOS


def crop_boxes(seed, epoch, index, heights, widths, min_scale):
    """The random-resized crop of samples: ``(top, left, height, width)``, int64 tensors.

    Args:
        seed, epoch: the run's seed and the epoch.
        index: int64 tensor of sample indices.
        heights, widths: int64 tensors, the stored images' sizes.
        min_scale: the smallest area fraction (``--crop-min-scale``).
    """
    index = torch.as_tensor(index, dtype=torch.long).reshape(-1)
    H = torch.as_tensor(heights, dtype=torch.long).reshape(-1)
    W = torch.as_tensor(widths, dtype=torch.long).reshape(-1)
    area = (H * W).to(torch.float64)
    ratios = _ratio_table()
    top, left, h, w = (torch.full_like(index, -1) for _ in range(4))
    for attempt in reversed(range(ATTEMPTS)):  # the first attempt that fits wins
        draw = [sample_transforms.sample_hash(seed, epoch, index, STREAM + 4 * attempt + k)
                for k in range(4)]
        scale = min_scale + (1.0 - min_scale) * (draw[0].to(torch.float64) / 2.0**32)
        ratio = ratios[draw[1] % _RATIOS]
        target = area * scale
        cw = torch.round(torch.sqrt(target * ratio)).to(torch.long)
        ch = torch.round(torch.sqrt(target / ratio)).to(torch.long)
        fits = (cw > 0) & (cw <= W) & (ch > 0) & (ch <= H)
        ct = draw[2] % (H - ch + 1).clamp(min=1)
        cl = draw[3] % (W - cw + 1).clamp(min=1)
        top, left = torch.where(fits, ct, top), torch.where(fits, cl, left)
        h, w = torch.where(fits, ch, h), torch.where(fits, cw, w)
    # None fits (a very long image): the centre, at the nearest ratio allowed.
    Hf, Wf = H.to(torch.float64), W.to(torch.float64)
    in_ratio = Wf / Hf
    fw = torch.where(in_ratio > RATIO[1], torch.round(Hf * RATIO[1]).to(torch.long), W)
    fh = torch.where(in_ratio < RATIO[0], torch.round(Wf / RATIO[0]).to(torch.long), H)
    none = h < 0
    h, w = torch.where(none, fh, h), torch.where(none, fw, w)
    top = torch.where(none, (H - h) // 2, top)
    left = torch.where(none, (W - w) // 2, left)
    return top, left, h, w


def crop_box(seed, epoch, index, height, width, min_scale):
    """``crop_boxes`` of one sample, in Python numbers: the same float64 operations (IEEE
    +, *, /, sqrt and round to even give the same bits as the tensor ones), without the
    cost of a hundred one-element tensor operations per sample."""
    global _RATIO_LIST
    if _RATIO_LIST is None:
        _RATIO_LIST = _ratio_table().tolist()
    ratios, area = _RATIO_LIST, float(height * width)
    for attempt in range(ATTEMPTS):
        draw = [sample_transforms.sample_hash(seed, epoch, index, STREAM + 4 * attempt + k)
                for k in range(4)]
        scale = min_scale + (1.0 - min_scale) * (draw[0] / 2.0**32)
        ratio = ratios[draw[1] % _RATIOS]
        target = area * scale
        cw, ch = round(math.sqrt(target * ratio)), round(math.sqrt(target / ratio))
        if 0 < cw <= width and 0 < ch <= height:
            return (draw[2] % max(height - ch + 1, 1), draw[3] % max(width - cw + 1, 1),
                    ch, cw)
    in_ratio = width / height
    w = round(height * RATIO[1]) if in_ratio > RATIO[1] else width
    h = round(width / RATIO[0]) if in_ratio < RATIO[0] else height
    return (height - h) // 2, (width - w) // 2, h, w


_RATIO_LIST = None


def resized_crop(image, top, left, height, width, size, interpolation):
    """A (C, H, W) uint8 crop resized to ``size`` x ``size``, antialiased: what both paths
    call on each image (the same kernel: the same bits on the CPU)."""
    return TF.resized_crop(image, int(top), int(left), int(height), int(width),
                           [size, size], interpolation=interpolation, antialias=True)


def center_crop(image, size):
    """The centre ``size`` x ``size`` crop of a (C, H, W) image (torchvision's offsets)."""
    return TF.center_crop(image, [size, size])


class RandomResizedCrop:
    """The photo training crop of the sample being transformed
    (``sample_transforms.current_sample``: its draws are ``crop_boxes``'), on a (C, H, W)
    uint8 tensor."""

    def __init__(self, size, min_scale, interpolation):
        self.size, self.min_scale, self.interpolation = size, min_scale, interpolation

    def __call__(self, image):
        seed, epoch, index = sample_transforms.current_sample()
        h, w = image.shape[-2:]
        box = crop_box(seed, epoch, index, int(h), int(w), self.min_scale)
        return resized_crop(image.as_subclass(torch.Tensor), *box, self.size,
                            self.interpolation)

    def __repr__(self):
        return (f"RandomResizedCrop(size={self.size}, min_scale={self.min_scale}, "
                f"interpolation={self.interpolation.value})")


class CenterCrop:
    """The photo evaluation crop (of the stored image: its short side resized already)."""

    def __init__(self, size):
        self.size = size

    def __call__(self, image):
        return center_crop(image.as_subclass(torch.Tensor), self.size)

    def __repr__(self):
        return f"CenterCrop(size={self.size})"


class ShortSide:
    """A decoded-cache decoder for photos: each image read at reduced size where it is a
    JPEG much larger than needed (``images.load_image``'s ``short_side``), turned as its
    EXIF orientation says, its short side resized to ``side``: a (3, h, w) uint8."""

    shape = None  # many sizes

    def __init__(self, side, interpolation):
        self.side, self.interpolation = side, interpolation
        self.name = f"short{side}-{interpolation.value}"

    def describe(self):
        return f"ShortSide(side={self.side}, interpolation={self.interpolation.value}, draft)"

    def __call__(self, folder, index):
        loader = _PhotoLoader(self.side, self.interpolation)
        image, label = folder.read(index, loader)
        return TF.pil_to_tensor(image), label


class _PhotoLoader:
    """``images.load_image`` with a short side (picklable, for decoding workers)."""

    def __init__(self, side, interpolation):
        self.side, self.interpolation = side, interpolation

    def __call__(self, path):
        return images.load_image(path, short_side=self.side, interpolation=self.interpolation)


# ---------------------------------------------------------- pretrained torchvision weights

def torchvision_weights(network, pretrained):
    """The torchvision weights that ``--pretrained torchvision[:NAME]`` names for
    ``--network torchvision/<name>``, or None when ``pretrained`` names no such thing (a
    file of that name that exists wins: it is a path). ``torchvision:backbone`` names the
    ImageNet weights of a segmentation network's backbone (``backbone_weights``).

    Raises:
        ops.UserError: another network, or a NAME the architecture has not.
    """
    if not (pretrained == "torchvision" or str(pretrained).startswith("torchvision:")) \
            or os.path.exists(pretrained):
        return None
    if not str(network).startswith("torchvision/"):
        raise UserError(f"--pretrained {pretrained} takes torchvision's own weights: it "
                        f"needs --network torchvision/<name>, not {network}")
    import torchvision

    name = network.split("/", 1)[1]
    try:
        enum = torchvision.models.get_model_weights(name)
    except (ValueError, KeyError):
        raise UserError(f"torchvision has no pretrained weights for {name}") from None
    which = pretrained.split(":", 1)[1] if ":" in pretrained else "DEFAULT"
    if which == "backbone":
        return backbone_weights(name)
    if which == "DEFAULT":
        return enum.DEFAULT
    try:
        return enum[which]
    except KeyError:
        extra = ", backbone" if name in torchvision.models.list_models(
            module=torchvision.models.segmentation) else ""
        raise UserError(f"--pretrained {pretrained}: {name} has no weights {which!r}; it has "
                        f"{', '.join(w.name for w in enum)} (or DEFAULT{extra})") from None


def backbone_weights(name):
    """The ImageNet weights torchvision's segmentation builder ``name`` puts in its
    backbone by default (its ``weights_backbone``: ``ResNet50_Weights.IMAGENET1K_V1``,
    ``MobileNet_V3_Large_Weights.IMAGENET1K_V1``), what its reference trains from.

    Raises:
        ops.UserError: ``name`` has no separate backbone weights (a classifier).
    """
    import inspect

    import torchvision

    try:
        builder = torchvision.models.get_model_builder(name)
    except ValueError:
        builder = None
    param = inspect.signature(builder).parameters.get("weights_backbone") if builder else None
    if param is None or param.default is None:
        raise UserError(f"--pretrained torchvision:backbone: {name} has no separate backbone "
                        f"weights; use --pretrained torchvision")
    return param.default


def fetch_weights(weights):
    """torchvision's state_dict of ``weights``: read from TORCH_HOME's hub/checkpoints
    where it is, else downloaded there once and hash-checked (torch.hub, as torchvision
    does; a progress bar in a terminal). Loaded with ``weights_only=True`` (torchvision's
    ``get_state_dict`` unpickles anything: a copy planted there whose SHA-256 matches
    the 8 hex digits of its name would run code).

    Raises:
        ops.UserError: offline (or any download failure) with no copy there: one line
            naming the file expected; a copy there that does not load.
    """
    import sys
    import urllib.error
    import urllib.parse

    filename = os.path.basename(urllib.parse.urlparse(weights.url).path)
    path = os.path.join(torch.hub.get_dir(), "checkpoints", filename)
    had_copy = os.path.exists(path)
    if had_copy:  # torch.hub checks the hash of a download only, not of a copy it finds
        check_weights_hash(path, weights)
    try:
        return torch.hub.load_state_dict_from_url(weights.url, progress=sys.stderr.isatty(),
                                                  check_hash=True, weights_only=True)
    except (urllib.error.URLError, OSError, TimeoutError) as e:
        reason = getattr(e, "reason", None) or e.strerror or e
        raise UserError(f"--pretrained torchvision: cannot download {weights} from "
                        f"{weights.url} ({reason}); offline? Put the file at {path} "
                        f"(TORCH_HOME), or pass --pretrained PATH") from None
    except Exception as e:  # a hash that does not match, a copy that does not load
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        where = f"the copy at {path} does not load" if had_copy else \
            f"the download of {weights.url} failed its check"
        raise UserError(f"--pretrained torchvision: {where} ({first[:200]}); delete it and "
                        f"try again, or pass --pretrained PATH") from None


def check_weights_hash(path, weights):
    """Checks a copy of torchvision's weights against the hash its name carries: the
    first hex digits of its SHA-256 after the last ``-`` (``resnet18-f37072fd.pth``), the
    check torch.hub does at download (``torch.hub.HASH_REGEX``), done when it is loaded.

    Raises:
        ops.UserError: the file's hash differs (damaged on disk, cut short, replaced): one
            line naming it and saying to delete it (it is then downloaded again).
    """
    from ops import UserError

    match = torch.hub.HASH_REGEX.search(os.path.basename(path))
    if match is None or not match.group(1):
        return  # (torchvision's names all carry one)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    if not digest.hexdigest().startswith(match.group(1)):
        raise UserError(f"--pretrained torchvision: the copy of {weights} at {path} is "
                        f"damaged (its SHA-256 starts {digest.hexdigest()[:len(match[1])]}, "
                        f"its name says {match[1]}); delete it and it is downloaded again, "
                        f"or pass --pretrained PATH")


def preset(config):
    """What the photos of a run get: ``{"mean", "std", "interpolation", "crop", "resize"}``
    from a timm network's data configuration (``timm_hub.preset``), from the pretrained
    torchvision weights' own transforms where ``--pretrained torchvision`` is used, else
    ImageNet's statistics (sample_transforms.STATS) and bilinear."""
    if timm_hub.is_timm(config.get("network")):  # the model's own data configuration
        return timm_hub.preset(config)
    weights = torchvision_weights(config["network"], config["pretrained"]) \
        if config.get("pretrained") else None
    if weights is None:
        mean, std = sample_transforms.STATS["imagefolder"]
        return {"mean": tuple(mean), "std": tuple(std),
                "interpolation": v2.InterpolationMode.BILINEAR, "crop": None, "resize": None}
    t = weights.transforms()
    return {"mean": tuple(t.mean), "std": tuple(t.std), "interpolation": t.interpolation,
            "crop": t.crop_size[0], "resize": t.resize_size[0]}


def transforms(config, policy=((), ())):
    """The photo training and evaluation transforms of a run (of cached uint8 images)."""
    p, size = preset(config), config["image_size"]
    normalise = sample_transforms.Normalise(p["mean"], p["std"])
    train = [RandomResizedCrop(size, config["crop_min_scale"], p["interpolation"]),
             sample_transforms.SampleFlip(), *policy[0], normalise, *policy[1]]
    if not config["augment"]:
        train = [CenterCrop(size), normalise]
    return v2.Compose(train), v2.Compose([CenterCrop(size), normalise])


# ------------------------------------------- torchvision weights for segmentation networks

HEADS = ("classifier.", "aux_classifier.")  # torchvision's segmentation heads


def fit_segmentation_weights(net, weights, state):
    """A torchvision state_dict of a segmentation network or of its backbone's
    classifier, made to fit ``net`` (torchvision's segmentation network, built by
    ``networks.build_network``).

    * The network's own weights (COCO with VOC's 21 classes): the heads' layers whose
      shape differs (another ``--num-classes``: the last convolution of ``classifier`` and
      of ``aux_classifier``; LR-ASPP's ``low_classifier`` and ``high_classifier``) keep
      their fresh initialisation; everything else is loaded.
    * ImageNet weights of its backbone (``torchvision:backbone``): the classifier's names
      are mapped into ``backbone.`` (ResNet's ``conv1...layer4``, MobileNetV3's
      ``features.N`` as ``backbone.N``), its ImageNet classifier dropped; both heads
      start fresh.

    Args:
        net: the segmentation network.
        weights: the torchvision weights enum value the state is of.
        state: its state_dict.

    Returns:
        ``(state, kept, line)``: a state_dict with every key of ``net`` in its shape, the
        keys of ``net`` kept at their fresh values, and one line saying what was loaded.

    Raises:
        ops.UserError: the state fits neither way (a name or shape the head does not
            explain), listing the first keys concerned.
    """
    own = net.state_dict()
    categories = len(weights.meta.get("categories") or ()) or "?"
    if any(k.startswith("backbone.") for k in state):  # the segmentation network's own
        kept = [k for k in own if k in state and state[k].shape != own[k].shape]
        modules = sorted({k.rsplit(".", 1)[0] for k in kept})  # (their weight and bias)
        what = f"torchvision's {weights} ({categories} classes)"
        line = f"pretrained: loaded {what}" + (
            f"; new heads for {_classes(net)} classes, fresh: {', '.join(modules)}"
            if modules else "")
        bad = [k for k in kept if not k.startswith(HEADS)]
    else:  # its backbone's classifier: the names mapped into backbone.
        mapped = {}
        for key, value in state.items():
            for name in (f"backbone.{key}", f"backbone.{key.removeprefix('features.')}"):
                if name in own and own[name].shape == value.shape:
                    mapped[name] = value
                    break
        state = mapped
        kept = [k for k in own if k not in state]
        line = (f"pretrained: loaded the backbone from torchvision's {weights} (ImageNet, "
                f"{len(state)} tensors); the heads start fresh")
        bad = [k for k in kept if not k.startswith(HEADS)]
    missing = [k for k in own if k not in state and k not in kept]
    missing += [k for k in state if k not in own]  # (an auxiliary head this net has not)
    if bad or missing:
        keys = bad + missing
        raise UserError(f"--pretrained torchvision: {weights} does not fit this network: "
                        f"{len(keys)} tensors differ or are missing ({', '.join(keys[:4])}"
                        f"{', ...' if len(keys) > 4 else ''})")
    return {**state, **{k: own[k] for k in kept}}, kept, line


def _classes(net):
    """The classes of a torchvision segmentation network (its main head's outputs)."""
    return [m for m in net.classifier.modules() if isinstance(m, torch.nn.Conv2d)][-1] \
        .out_channels


def load_segmentation_weights(net, weights):
    """Loads torchvision's ``weights`` (``torchvision_weights``' answer) into ``net``, a
    torchvision segmentation network: fetched (``fetch_weights``: TORCH_HOME, or
    downloaded once), fitted (``fit_segmentation_weights``: a new head for another
    number of classes; an ImageNet backbone mapped), loaded.

    Returns:
        The line to log: what was loaded and which heads start fresh.
    """
    state, _, line = fit_segmentation_weights(net, weights, fetch_weights(weights))
    net.load_state_dict(state)
    return line


def load_pretrained(net, path, log, which="ema", network=None, heads=None):
    """Initialises ``net`` from a checkpoint of this project or a plain state_dict, or,
    where ``path`` is ``torchvision[:NAME]`` and no such file exists, from torchvision's
    pretrained weights of ``network`` (``presets.fetch_weights``).

    From a checkpoint with a moving average of the weights, ``which="ema"`` takes the
    average. The class-dependent modules (``heads``: module names, the task's
    ``class_heads(net)``; None: the module of the last parameter, a classifier's head)
    whose shapes differ (another number of classes) keep their fresh initialisation and
    are listed; any other mismatch is a UserError listing the keys. BatchNorm's
    ``num_batches_tracked`` where ``net`` has a ``FrozenBatchNorm2d`` (a detector's
    backbone) is dropped. A torchvision segmentation network takes its weights through
    ``load_segmentation_weights`` (new heads for another number of classes).

    Returns:
        The names of the tensors that kept their fresh initialisation.
    """
    tv_weights = torchvision_weights(network, path)  # (a file of that name wins)
    if tv_weights is not None and is_segmentation(network):  # two heads, maybe a backbone
        log(load_segmentation_weights(net, tv_weights))
        return []
    if tv_weights is not None:
        state = fetch_weights(tv_weights)
        path = f"torchvision's {tv_weights}"
    elif timm_hub.is_request(path) or str(path).endswith(".safetensors"):
        state, path = timm_hub.pretrained_state(network, path)  # no code runs
    else:
        state = checkpoint.load_checkpoint(path)
    if "networks" in state:  # a GAN's (format 3): a generator and a discriminator
        raise UserError(f"--pretrained {path!r} holds a GAN's networks "
                        f"({', '.join(state['networks'])}), not one network's weights")
    weights = state["model"] if "model" in state else state
    if which == "ema" and "model" in state and "ema" in state:
        weights = state["ema"]
        log(f"pretrained: taking the moving average (ema) of {path}")
    if not isinstance(weights, dict) or not weights or not all(
            isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in weights.items()):
        raise UserError(f"--pretrained {path!r} holds no weights: expected a checkpoint of "
                        f"this project or a state_dict (names mapped to tensors)")
    weights = checkpoint.unwrap_state_dict(weights)
    if timm_hub.is_timm(network):  # its own filter: another image size, other channels
        weights = timm_hub.fit(weights, net)
    own = net.state_dict()
    weights = {k: v for k, v in weights.items()  # (a frozen BatchNorm counts nothing)
               if k in own or not k.endswith(".num_batches_tracked")
               or k.rsplit(".", 1)[0] + ".running_mean" not in own}
    heads = last_module(net) if heads is None else heads
    resized = [k for k in weights if k in own and own[k].shape != weights[k].shape]
    skipped = []
    if resized and all(any(k == h or k.startswith(h + ".") for h in heads) for k in resized):
        modules = {k.rsplit(".", 1)[0] for k in resized}  # (their weight and bias)
        skipped = [k for k in own if k.rsplit(".", 1)[0] in modules]
        weights = {**weights, **{k: own[k] for k in skipped}}
    checkpoint.check_compatible(net, weights, path)
    net.load_state_dict(weights)
    listed = ", ".join(skipped[:4]) + (f" and {len(skipped) - 4} more" if len(skipped) > 4
                                       else "")
    log(f"pretrained: loaded {len(weights) - len(skipped)} tensors from {path}"
        + (f"; kept the new head ({listed}): its size differs" if skipped else ""))
    return skipped


def last_module(net):
    """``(name,)`` of the module holding ``net``'s last parameter (a classifier's head,
    ``fc``), or ``()``: ``load_pretrained``'s class-dependent module by default."""
    names = [name for name, _ in net.named_parameters()]
    return (names[-1].rsplit(".", 1)[0],) if names else ()

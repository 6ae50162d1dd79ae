"""Semantic segmentation: per-pixel logits, per-pixel cross-entropy that ignores mask value
255, and its figures and pictures: one confusion matrix counted on the device, mIoU, pixel
accuracy and per-class IoU from it, masks coloured for TensorBoard; test.py's mIoU report.

Its data are segmentation_data.py's (image, mask) sets; its networks networks.py's unet and
torchvision's segmentation networks.

The confusion matrix is a ``(C, C)`` int64 tensor on the device (rows: true classes,
columns: predicted ones) that ``update_confusion`` adds a batch into with ``index_add_``:
no host read per batch (``torch.bincount`` would read its size back on CUDA). Under DDP
the matrices of the processes are summed (``dist.all_reduce``) before ``figures``.

mIoU is the mean of the IoUs of the classes present, a class being present when it
appears in the targets or in the predictions (its union is not empty), as torchmetrics'
``MulticlassJaccardIndex(average="macro")`` counts it. torchvision's segmentation reference
averages over every class instead, and its mean is NaN as soon as one class is absent from
both: on a validation set that holds every class the two agree.
"""

import math

import torch
import torch.nn.functional as F

import networks
from ops import UserError
from pipeline import device_data, segmentation_data
from tasks import IGNORE_INDEX, Evaluation, Task, new_confusion, update_confusion


def class_iou(confusion):
    """Each class's intersection over union: ``TP / (TP + FP + FN)``.

    Args:
        confusion: a ``(C, C)`` matrix of counts (rows true, columns predicted).

    Returns:
        A ``(C,)`` float64 tensor on the matrix's device; NaN for a class absent from
        both the targets and the predictions.
    """
    confusion = confusion.to(torch.float64)
    tp = confusion.diag()
    union = confusion.sum(0) + confusion.sum(1) - tp
    return tp / union  # 0 / 0 = nan: absent


def figures(confusion, classes=None):
    """The figures of a validation, read back to the host once.

    Args:
        confusion: the ``(C, C)`` matrix of the whole validation (all processes).
        classes: the class names (None: ``"0"``, ``"1"``, ...).

    Returns:
        ``{"miou", "pixel_acc", "class_iou", "pixels"}``: mIoU over the classes present
        (NaN when no pixel was counted), pixel accuracy (correct over counted pixels), each
        class's IoU by name (None for an absent class: a JSON null), the pixels counted.
    """
    iou = class_iou(confusion).cpu()
    counts = confusion.cpu()
    pixels = int(counts.sum())
    present = ~torch.isnan(iou)
    miou = float(iou[present].mean()) if bool(present.any()) else math.nan
    names = [str(c) for c in (classes if classes is not None else range(len(iou)))]
    if len(names) != len(iou):
        raise ValueError(f"{len(names)} class names for a {len(iou)}-class confusion matrix")
    return {"miou": miou,
            "pixel_acc": float(counts.diag().sum()) / pixels if pixels else math.nan,
            "class_iou": {name: None if math.isnan(v) else v
                          for name, v in zip(names, iou.tolist())},
            "pixels": pixels}


# ------------------------------------------------------------------ masks in pictures

IGNORE_COLOUR = (255, 255, 255)  # white: no class colour is (the VOC map tops at 224)


def palette(num_classes):
    """The colour of each class: PASCAL VOC's colour map (class 0 black, 1 dark red, 2
    green...; VOC's own 21 for up to 21 classes), whose bit pattern goes on giving
    distinct colours for any number of classes below 2**24, none of them white.

    Returns:
        A ``(num_classes, 3)`` uint8 tensor.
    """
    colours = []
    for c in range(num_classes):
        r = g = b = 0
        for shift in range(8):  # three bits of the class at a time, into r, g, b
            r |= ((c >> (3 * shift)) & 1) << (7 - shift)
            g |= ((c >> (3 * shift + 1)) & 1) << (7 - shift)
            b |= ((c >> (3 * shift + 2)) & 1) << (7 - shift)
        colours.append((r, g, b))
    return torch.tensor(colours, dtype=torch.uint8).reshape(num_classes, 3)


def colour_masks(masks, num_classes):
    """``(N, H, W)`` class masks as ``(N, 3, H, W)`` uint8 pictures (``palette``); the
    ignored pixels (255), as any value that is not a class, white."""
    masks = masks.long().cpu()
    table = torch.cat([palette(num_classes), torch.tensor([IGNORE_COLOUR], dtype=torch.uint8)])
    index = torch.where((masks >= 0) & (masks < num_classes), masks, num_classes)
    return table[index].permute(0, 3, 1, 2)  # (N, 3, H, W)


def mask_grid(images, targets, preds, num_classes, mean=None, std=None, padding=2):
    """A picture of a few images, each with its true and its predicted mask: one row per
    image (image, truth, prediction), for TensorBoard (``torchvision.utils.make_grid``).

    Args:
        images: ``(N, 3, H, W)`` uint8 images, or float ones normalised with ``mean`` and
            ``std`` (per channel; None: taken as in [0, 1]). One channel is shown grey.
        targets: ``(N, H, W)`` true classes (the ignored pixels, 255, white).
        preds: ``(N, C, H, W)`` logits or ``(N, H, W)`` predicted classes.
        num_classes: classes (the palette's size).
        mean, std: the normalisation the float images carry, undone here.
        padding: pixels between the tiles (grey).

    Returns:
        A ``(3, H', W')`` uint8 tensor on the CPU.
    """
    from torchvision.utils import make_grid

    images = images.detach().cpu()
    if preds.dim() == targets.dim() + 1:
        preds = preds.argmax(dim=1)
    if images.dtype != torch.uint8:
        images = images.float()
        if mean is not None:
            shape = (1, -1, 1, 1)
            images = images * torch.tensor(std).view(shape) + torch.tensor(mean).view(shape)
        images = (images.clamp(0, 1) * 255).round().to(torch.uint8)
    if images.shape[1] == 1:
        images = images.expand(-1, 3, -1, -1)
    rows = torch.stack([images, colour_masks(targets, num_classes),
                        colour_masks(preds.detach(), num_classes)], dim=1)
    return make_grid(rows.flatten(0, 1), nrow=3, padding=padding, pad_value=128)


# --------------------------------------------------------------------- the task

class Segmentation(Task):
    """Semantic segmentation: per-pixel logits (N, classes, H, W), per-pixel cross-entropy
    that ignores mask value 255, mIoU, pixel accuracy and per-class IoU from one confusion
    matrix counted on the device (py).

    torchvision's segmentation networks return ``{"out", "aux"}``: the auxiliary head's
    loss counts ``aux_weight`` (0.5, as torchvision's segmentation reference weighs it);
    evaluation reads ``out`` alone.

    Args:
        num_classes: the classes of the set.
        classes: their names (None: the numbers).
        label_smoothing: --label-smoothing, per pixel.
        aux_weight: the auxiliary loss's weight.
        stats: the images' normalisation ``(mean, std)``, undone in the pictures (None:
            the images are shown as they are, clamped to [0, 1]).
    """

    name = "segmentation"
    datasets_named = segmentation_data.DATASETS
    figures = ("loss", "miou", "pixel_acc")
    best = "miou"
    examples = 4  # validation images shown with their true and predicted masks

    default_network = "unet"

    @classmethod
    def check_config(cls, config):
        """A segmentation network, and nothing that moves an image and not its mask."""
        if not networks.is_segmentation(config["network"]):
            raise UserError(f"--network {config['network']} is a classifier (one label an "
                            f"image): --task segmentation needs per-pixel logits: unet, or "
                            f"torchvision/<a segmentation network> (deeplabv3_resnet50, ...)")
        mixing = [f for f, on in (("--mixup-alpha", config["mixup_alpha"]),
                                  ("--cutmix-alpha", config["cutmix_alpha"])) if on]
        if mixing:
            raise UserError(f"{' and '.join(mixing)} mix the images of a batch, not their "
                            f"masks: not for --task segmentation")
        segmentation_data.check_config(config)
        device = str(config["device"])
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if config["deterministic"] and cuda and config["network"].startswith("torchvision/"):
            raise UserError(f"--deterministic with --network {config['network']} on CUDA: "
                            f"its bilinear F.interpolate has no deterministic CUDA backward "
                            f"(torch.use_deterministic_algorithms would stop the first step); "
                            f"drop --deterministic, or train --network unet")

    @classmethod
    def datasets(cls, config, log, should_stop=None):
        """SeededDatasets of (image, mask) (segmentation_data.py)."""
        return segmentation_data.build_datasets(config, log, should_stop)

    @classmethod
    def loaders(cls, config, procs, train_set, val_set, sampler, stop=None):
        """As a classifier's, the device path carrying the masks."""
        return device_data.build_loaders(
            config, procs, train_set, val_set, sampler, stop,
            segmentation_data.device_decision, segmentation_data.build_device_loaders)

    set_identity = staticmethod(segmentation_data.set_identity)

    @classmethod
    def build(cls, config, train_set, val_set=None):
        transform = train_set.transform  # its normalisation, undone in the pictures
        return cls(train_set.num_classes, train_set.classes, config["label_smoothing"],
                   stats=(getattr(transform, "mean", None), getattr(transform, "std", None)))

    def __init__(self, num_classes, classes=None, label_smoothing=0.0, aux_weight=0.5,
                 stats=(None, None)):
        self.num_classes = num_classes
        self.classes = list(classes) if classes is not None else \
            [str(i) for i in range(num_classes)]
        self.label_smoothing = float(label_smoothing)
        self.aux_weight = aux_weight
        self.mean, self.std = stats

    def criterion(self, logits, y):
        """Per-pixel cross-entropy (255 ignored), averaged over each image's counted pixels,
        then over the images: a sample's share of the loss does not depend on the others
        in its batch (torchvision's reference averages over the batch's pixels, so the
        images with fewer ignored pixels weigh more), and so accumulation and any number
        of processes give the large batch's gradient, as they do for a classifier."""
        per_pixel = F.cross_entropy(logits, y, ignore_index=IGNORE_INDEX,
                                    label_smoothing=self.label_smoothing, reduction="none")
        counted = (y != IGNORE_INDEX).sum(dim=(-2, -1)).clamp_(min=1)
        return (per_pixel.sum(dim=(-2, -1)) / counted).mean()

    def loss(self, model, x, y):
        out = model(x)
        if not isinstance(out, dict):
            return self.criterion(out, y)
        loss = self.criterion(out["out"], y)
        if "aux" in out:
            loss = loss + self.aux_weight * self.criterion(out["aux"], y)
        return loss

    @staticmethod
    def predict(model, x, tta=False):
        """The logits; with ``tta``, the mean of the image's and of its mirror's logits
        flipped back (each pixel's own)."""
        logits = _out(model(x))
        if tta:
            logits = (logits + _out(model(x.flip(-1))).flip(-1)) / 2
        return logits

    def evaluation(self, device, model=None):
        return SegmentationEvaluation(self.num_classes, device, self.examples)

    @staticmethod
    def extra_figures(result, names, suffix=""):
        """Each class's IoU by name (``val_class_iou``; None: absent from the set)."""
        return {f"val_class_iou{suffix}": dict(zip(names, result["class_iou"].values()))}

    def images(self, result, names, title):
        """A few validation images, each with its true and its predicted mask."""
        images, targets, preds = result["examples"]
        grid = mask_grid(images, targets, preds, self.num_classes, self.mean,
                                     self.std)
        return [("masks", grid.permute(1, 2, 0).numpy())]  # (H, W, 3), as runlog.image takes


    @staticmethod
    def exported(net, config, val_set):
        """The logits of a network that returns a dict (torchvision's)."""
        return (inference_network(net), (val_set.in_channels, val_set.image_size,
                                         val_set.image_size), None, None)

    def report(self, result, key, path):
        """Loss, mIoU, pixel accuracy, each class's IoU (None: a class absent from the set
        and the predictions), the confusion matrix."""
        return {key: path, "loss": result["loss"], "miou": result["miou"],
                "pixel_accuracy": result["pixel_acc"],
                "per_class_iou": dict(zip(self.classes, result["class_iou"].values())),
                "confusion": result["confusion"].tolist(), "count": result["count"]}

    @staticmethod
    def format_report(report, title):
        """Loss, mIoU, pixel accuracy, each class's IoU."""
        lines = [title,
                 f"loss {report['loss']:.4f}  mIoU {report['miou']:.4f}  pixel accuracy "
                 f"{report['pixel_accuracy']:.4f} ({report['count']} pixels)",
                 "per-class IoU:"]
        width = max(len(n) for n in report["per_class_iou"])
        for name, iou in report["per_class_iou"].items():
            lines.append(f"  {name:<{width}}  {'-' if iou is None else f'{iou:.4f}':>6}")
        return "\n".join(lines)


class _Logits(torch.nn.Module):
    """A segmentation network whose dict output (``{"out", "aux"}``) is reduced to its
    logits: what inference and export take."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        return _out(self.net(x))


def inference_network(net):
    """``net`` as inference takes it (export, a measured file): a network that returns a
    dict gives its ``out`` logits; any other is returned as it is."""
    if not type(net).__module__.startswith("torchvision.models.segmentation"):
        return net
    return _Logits(net).eval()


def _out(output):
    """The logits of a network's output: torchvision's segmentation networks return a dict."""
    return output["out"] if isinstance(output, dict) else output


class SegmentationEvaluation(Evaluation):
    """Sums of one segmentation evaluation, counted on the device (no host read per
    batch): the loss over the counted pixels, the confusion matrix, the pixels of no class
    (summed over the processes); the first images of this process, for the picture.

    Args:
        num_classes: the classes (the matrix's side).
        device: where the sums live.
        examples: how many of the first images to keep for the picture.
    """

    def __init__(self, num_classes, device, examples=4):
        super().__init__()
        self.num_classes, self.want = num_classes, examples
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("confusion", new_confusion(num_classes), "sum")
        self.add_state("invalid", torch.zeros((), dtype=torch.long), "sum")
        self.kept = None
        self.to(device)

    def update(self, logits, y, x=None):
        # per pixel, then summed: reduction="sum" on CUDA (nll_loss2d) has no deterministic
        # kernel (--deterministic would stop the first validation; the CUDA review's H2)
        self.loss_sum += F.cross_entropy(logits.float(), y, reduction="none",
                                         ignore_index=IGNORE_INDEX).sum(dtype=torch.float64)
        self.invalid += update_confusion(self.confusion, logits, y)
        if self.kept is None and x is not None:  # the first images: the same every time
            n = self.want
            self.kept = (x[:n].detach().clone(), y[:n].clone(), logits[:n].argmax(dim=1))

    def compute(self):
        """``loss`` (mean per counted pixel), ``miou``, ``pixel_acc``, ``class_iou`` (by
        class number), ``count`` (pixels), ``confusion`` and ``examples``."""
        counted = figures(self.confusion)
        invalid = int(self.invalid)
        if invalid:
            raise UserError(f"{invalid} mask pixels hold a value that is neither a class "
                            f"(0-{self.num_classes - 1}) nor 255 (ignored): --num-classes "
                            f"is too small for these masks")
        pixels = counted["pixels"]
        if not pixels:  # every mask pixel 255: nothing is learnt, nothing measured
            raise UserError("no mask pixel of the validation set is a class: every one is 255 "
                            "(ignored); check how the masks were written (class indices "
                            "0..N-1 per pixel, 255 only where nothing counts)")
        empty = torch.zeros(0)
        return {"loss": float(self.loss_sum) / max(pixels, 1), "miou": counted["miou"],
                "pixel_acc": counted["pixel_acc"], "class_iou": counted["class_iou"],
                "count": pixels, "confusion": self.confusion.cpu(),
                "examples": tuple(t.cpu() for t in self.kept) if self.kept is not None
                else (empty, empty, empty)}


TASK = Segmentation

"""Semantic segmentation's figures and pictures: one confusion matrix counted on the device,
mIoU, pixel accuracy and per-class IoU from it, and masks coloured for TensorBoard.

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

IGNORE_INDEX = 255  # mask pixels that count nowhere (VOC's object borders, padding)


def new_confusion(num_classes, device=None):
    """A ``(num_classes, num_classes)`` int64 zero matrix on ``device``."""
    return torch.zeros(num_classes, num_classes, dtype=torch.long, device=device)


def update_confusion(confusion, pred, target, ignore_index=IGNORE_INDEX):
    """Adds a batch into the confusion matrix, in place, on its device (no host read).

    Args:
        confusion: the ``(C, C)`` int64 matrix (``new_confusion``).
        pred: ``(N, C, H, W)`` logits or ``(N, H, W)`` predicted classes.
        target: ``(N, H, W)`` integer classes (any integer dtype: uint8 masks too);
            ``ignore_index`` pixels are not counted.
        ignore_index: the target value that counts nowhere.

    Returns:
        A 0-d int64 tensor on the device: the pixels whose target is neither a class in
        ``[0, C)`` nor ``ignore_index`` (a mask that does not match the number of
        classes). They are not counted; sum them over the batches and read the sum once,
        after the loop, to say so.
    """
    n = confusion.shape[0]
    if pred.dim() == target.dim() + 1:
        pred = pred.argmax(dim=1)
    if pred.shape != target.shape:
        raise ValueError(f"predictions {tuple(pred.shape)} and targets "
                         f"{tuple(target.shape)} differ in shape")
    # int64: a uint8 mask times C would wrap around at 256
    pred, target = pred.reshape(-1).long(), target.reshape(-1).to(pred.device, torch.long)
    valid = (target >= 0) & (target < n)
    invalid = (~valid & (target != ignore_index)).sum()
    # Ignored and invalid pixels add 0 at index 0: the same kernel and no boolean
    # indexing (whose output size would be read back to the host).
    index = torch.where(valid, target * n + pred, 0)
    confusion.view(-1).index_add_(0, index, valid.to(confusion.dtype))
    return invalid


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

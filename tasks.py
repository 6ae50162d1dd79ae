"""The task seam: what is trained, apart from how a run runs.

A task says what a batch is and how it reaches the device, its loss, its validation
figures and which one picks best.pt, and the images TensorBoard shows. The loop does the
rest for every task: precision, DDP and ``no_sync``, sample-weighted accumulation,
clipping, gradient norms, timing and out-of-memory handling (engine.py), and every log,
save and stop decision (train.py). The anchors: timm's ``timm/task/`` (a task returns the
loss; the loop owns accumulation, precision, EMA and resume), Composer's ``ComposerModel``
(forward, loss, metrics). No Trainer class and no callbacks: a task is asked, it never
calls back.

What a task provides (``Classification`` is the reference; ``build_task`` picks one):

    name                          --task's value, recorded in every checkpoint's config
    figures, best                 its validation figures (metrics.jsonl ``val_<figure>``,
                                  TensorBoard ``val/<figure>``) and the one best.pt and
                                  --early-stop-* follow (higher is better)
    to_device(batch, device, memory_format) -> (inputs, targets)
    prepare(inputs, targets, epoch, batch)  -> (inputs, targets)   before the step's clock
    loss(model, inputs, targets)            -> the mean loss of the micro-batch
    predict(model, inputs, tta)             -> outputs for evaluation (--tta flip)
    evaluation(device)                      -> an accumulator: update / sums / gather /
                                               result (sums are all-reduced; gather
                                               collects what is not a sum)
    extra_figures(result, names, suffix)    -> metrics.jsonl figures beyond the scalars
    images(result, names, title)            -> [(tag, HxWx3 uint8)] for TensorBoard
    example(dataset)                        -> one input sample's shape (FLOPs, summary)

A micro-batch weighs its number of samples (the sampler's plan), for every task.
"""


import torch
import torch.nn.functional as F

import data
import device_data
import losses
import recipes
import seg_metrics
import segmentation_data
from ops import UserError

TASKS = ("classification", "segmentation")
TOP_K = 5  # acc5: counted where there are more classes than this
DENSE_CLASSES = 2048  # up to this many classes a C x C confusion matrix (32 MiB at most);
#                       beyond, each sample's (label, prediction): memory grows with the set
PICTURED_CLASSES = 100  # the confusion image up to this many; beyond, the top confused pairs
TOP_CONFUSED = 20  # pairs (true class, predicted class) listed where there is no picture


def build_task(config, train_set):
    """The task ``config["task"]`` names, for the training set ``train_set``."""
    name = config.get("task", "classification")
    if name == "classification":
        return Classification(train_set.num_classes, train_set.classes,
                              losses.build_criterion(config),
                              recipes.build_batch_mix(config, train_set.num_classes))
    if name == "segmentation":
        transform = train_set.transform  # its normalisation, undone in the pictures
        return Segmentation(train_set.num_classes, train_set.classes,
                            config["label_smoothing"],
                            stats=(getattr(transform, "mean", None),
                                   getattr(transform, "std", None)))
    raise UserError(f"unknown task {name!r}; choose one of: {', '.join(TASKS)}")


def build_datasets(config, log, should_stop=None):
    """The training and validation sets of the task: ``(train, val)``, SeededDatasets of
    (image, label) for classification (data.py), of (image, mask) for segmentation
    (segmentation_data.py). ``should_stop`` returns a stop signal's number (a decoded
    cache's build stops at it)."""
    if _segmenting(config):
        return segmentation_data.build_datasets(config, log, should_stop)
    return data.build_datasets(config, log, should_stop)


def build_loaders(config, procs, train_set, val_set, sampler, stop=None):
    """The training and validation loaders (``device_data.build_loaders``): the device
    path or DataLoader workers, as --data-on-device decides; segmentation's device path
    carries the masks."""
    if _segmenting(config):
        return device_data.build_loaders(
            config, procs, train_set, val_set, sampler, stop,
            segmentation_data.device_decision, segmentation_data.build_device_loaders)
    return device_data.build_loaders(config, procs, train_set, val_set, sampler, stop)


def set_identity(config, dataset):
    """What a checkpoint records of the training set (a resume onto another says so)."""
    return (segmentation_data if _segmenting(config) else data).set_identity(dataset)


def use_tta(config):
    """--tta flip, except where a mirror image is another class (digits)."""
    return config["tta"] == "flip" and data.mirror_keeps_class(config["dataset"])


def _segmenting(config):
    return config.get("task", "classification") == "segmentation"


def check_config(config):
    """Refuses, in one line each, the flags that make no sense for the task."""
    if not _segmenting(config):
        return
    mixing = [f for f, on in (("--mixup-alpha", config["mixup_alpha"]),
                              ("--cutmix-alpha", config["cutmix_alpha"])) if on]
    if mixing:
        raise UserError(f"{' and '.join(mixing)} mix the images of a batch, not their masks: "
                        f"not for --task segmentation")
    segmentation_data.check_config(config)


def to_device(batch, device, memory_format):
    """``(images, targets)`` of a batch on ``device``, without waiting for the copy."""
    x, y = batch
    return (x.to(device, non_blocking=True, memory_format=memory_format),
            y.to(device, non_blocking=True))


class Classification:
    """Image classification: logits (N, classes), cross-entropy, accuracy, top-5.

    Args:
        num_classes: the classes of the set.
        classes: their names, in label order (None: the label numbers).
        criterion: the training loss (``losses.build_criterion``); cross-entropy if None.
        mix: a ``recipes.BatchMix`` (MixUp/CutMix), or None.
    """

    name = "classification"
    figures = ("loss", "acc", "acc5")
    best = "acc"

    def __init__(self, num_classes, classes=None, criterion=None, mix=None):
        self.num_classes = num_classes
        self.classes = list(classes) if classes is not None else \
            [str(i) for i in range(num_classes)]
        self.criterion = criterion if criterion is not None else torch.nn.CrossEntropyLoss()
        self.mix = mix

    to_device = staticmethod(to_device)

    def prepare(self, x, y, epoch, batch):
        """MixUp/CutMix, drawn from (seed, epoch, batch); targets become soft."""
        return (x, y) if self.mix is None else self.mix(x, y, epoch, batch)

    def loss(self, model, x, y):
        return self.criterion(model(x), y)

    @staticmethod
    def predict(model, x, tta=False):
        """The logits; with ``tta``, the mean of the image's and its mirror's."""
        logits = model(x)
        if tta:
            logits = (logits + model(x.flip(-1))) / 2
        return logits

    def evaluation(self, device):
        return ClassificationEvaluation(self.num_classes, device)

    def extra_figures(self, result, names, suffix=""):
        """Each class's accuracy by name (``val_class_acc``); with more classes than a
        picture can show, the most confused pairs (``val_top_confused``: true, predicted,
        count)."""
        figures = {f"val_class_acc{suffix}": class_accuracy(result, names)}
        if self.num_classes > PICTURED_CLASSES or result["confusion"] is None:
            figures[f"val_top_confused{suffix}"] = [
                [names[t], names[p], n] for t, p, n in result["top_confused"]]
        return figures

    def images(self, result, names, title):
        """The confusion matrix, rows normalised (matplotlib; drawn where it is read), up
        to ``PICTURED_CLASSES`` classes: beyond, no person reads it (``extra_figures``
        lists the most confused pairs instead)."""
        if self.num_classes > PICTURED_CLASSES or result["confusion"] is None:
            return []
        import plots

        return [("confusion", plots.confusion_image(result["confusion"], names, title))]

    @staticmethod
    def example(dataset):
        return (dataset.in_channels, dataset.image_size, dataset.image_size)


class ClassificationEvaluation:
    """Sums of one evaluation, counted on the device (no host read per batch).

    Args:
        num_classes: classes of the set (the confusion matrix's side).
        device: where the sums live.
    """

    def __init__(self, num_classes, device):
        self.num_classes = num_classes
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.dense = num_classes <= DENSE_CLASSES
        self.confusion = torch.zeros(num_classes * num_classes if self.dense else 1,
                                     device=device, dtype=torch.long)
        self.pairs = []  # beyond DENSE_CLASSES: each batch's label * C + prediction
        self.in_top = torch.zeros((), device=device, dtype=torch.long)

    def update(self, logits, y, x=None):
        c = self.num_classes
        self.loss_sum += F.cross_entropy(logits.float(), y, reduction="sum")
        pred = logits.argmax(dim=1)  # counted on the device (bincount reads back its size)
        if self.dense:
            self.confusion.index_add_(0, y * c + pred, torch.ones_like(pred))
        else:
            self.pairs.append(y * c + pred)
        if c > TOP_K:
            top = logits.topk(TOP_K, dim=1).indices  # (N, 5)
            self.in_top += (top == y[:, None]).any(dim=1).sum()

    def sums(self):
        """The tensors to sum over processes."""
        return [self.loss_sum, self.confusion, self.in_top]

    def gather(self, world_size):
        """Beyond ``DENSE_CLASSES``: every process's pairs, gathered (they are not sums)."""
        if self.dense:
            return
        import torch.distributed as dist

        mine = torch.cat(self.pairs).cpu() if self.pairs else torch.zeros(0, dtype=torch.long)
        every = [None] * world_size
        dist.all_gather_object(every, mine)
        self.pairs = every

    def result(self):
        """``loss`` (mean cross-entropy), ``acc`` (0..1), ``count``, ``class_total`` and
        ``class_correct`` (per class), and ``confusion`` (rows: true classes; up to
        ``DENSE_CLASSES`` classes, else None) or ``top_confused`` (``TOP_CONFUSED`` pairs
        ``(true, predicted, count)``, most first); with more than ``TOP_K`` classes,
        ``acc5``."""
        c = self.num_classes
        if self.dense:
            confusion = self.confusion.view(c, c).cpu()
            total, correct = confusion.sum(dim=1), confusion.diag()
            wrong = confusion.flatten() * (1 - torch.eye(c, dtype=torch.long).flatten())
            pairs, counts = wrong.nonzero().flatten(), wrong[wrong > 0]
        else:
            confusion = None
            flat = torch.cat([p.cpu() for p in self.pairs]) if self.pairs else \
                torch.zeros(0, dtype=torch.long)
            label, pred = flat // c, flat % c
            total = torch.bincount(label, minlength=c)
            correct = torch.bincount(label[label == pred], minlength=c)
            pairs, counts = flat[label != pred].unique(return_counts=True)
        order = counts.argsort(descending=True, stable=True)[:TOP_CONFUSED]
        count = int(total.sum())
        result = {"loss": float(self.loss_sum) / max(count, 1),
                  "acc": float(correct.sum()) / max(count, 1), "count": count,
                  "confusion": confusion, "class_total": total, "class_correct": correct,
                  "top_confused": [(int(pairs[i]) // c, int(pairs[i]) % c, int(counts[i]))
                                   for i in order]}
        if c > TOP_K:
            result["acc5"] = float(self.in_top) / max(count, 1)
        return result


def class_accuracy(result, classes):
    """Each class's accuracy from an evaluation's per-class counts (``class_total``,
    ``class_correct``), by class name; None for a class with no sample. train.py's
    validations (``val_class_acc``) and test.py's report (``per_class``) both use it."""
    return {name: float(c) / float(t) if t > 0 else None
            for name, c, t in zip(classes, result["class_correct"].tolist(),
                                  result["class_total"].tolist())}


class Segmentation:
    """Semantic segmentation: per-pixel logits (N, classes, H, W), per-pixel cross-entropy
    that ignores mask value 255, mIoU, pixel accuracy and per-class IoU from one confusion
    matrix counted on the device (seg_metrics.py).

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
    figures = ("loss", "miou", "pixel_acc")
    best = "miou"
    examples = 4  # validation images shown with their true and predicted masks

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
        per_pixel = F.cross_entropy(logits, y, ignore_index=seg_metrics.IGNORE_INDEX,
                                    label_smoothing=self.label_smoothing, reduction="none")
        counted = (y != seg_metrics.IGNORE_INDEX).sum(dim=(-2, -1)).clamp_(min=1)
        return (per_pixel.sum(dim=(-2, -1)) / counted).mean()

    to_device = staticmethod(to_device)

    @staticmethod
    def prepare(x, y, epoch, batch):
        return x, y

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

    def evaluation(self, device):
        return SegmentationEvaluation(self.num_classes, device, self.examples)

    @staticmethod
    def extra_figures(result, names, suffix=""):
        """Each class's IoU by name (``val_class_iou``; None: absent from the set)."""
        return {f"val_class_iou{suffix}": dict(zip(names, result["class_iou"].values()))}

    def images(self, result, names, title):
        """A few validation images, each with its true and its predicted mask."""
        images, targets, preds = result["examples"]
        grid = seg_metrics.mask_grid(images, targets, preds, self.num_classes, self.mean,
                                     self.std)
        return [("masks", grid.permute(1, 2, 0).numpy())]  # (H, W, 3), as runlog.image takes

    @staticmethod
    def example(dataset):
        return (dataset.in_channels, dataset.image_size, dataset.image_size)


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


class SegmentationEvaluation:
    """Sums of one segmentation evaluation, counted on the device (no host read per
    batch): the loss over the counted pixels and the confusion matrix.

    Args:
        num_classes: the classes (the matrix's side).
        device: where the sums live.
        examples: how many of the first images to keep for the picture.
    """

    def __init__(self, num_classes, device, examples=4):
        self.num_classes, self.want = num_classes, examples
        self.loss_sum = torch.zeros((), device=device, dtype=torch.float64)
        self.confusion = seg_metrics.new_confusion(num_classes, device)
        self.invalid = torch.zeros((), device=device, dtype=torch.long)
        self.kept = None

    def update(self, logits, y, x=None):
        self.loss_sum += F.cross_entropy(logits.float(), y, reduction="sum",
                                         ignore_index=seg_metrics.IGNORE_INDEX)
        self.invalid += seg_metrics.update_confusion(self.confusion, logits, y)
        if self.kept is None and x is not None:  # the first images: the same every time
            n = self.want
            self.kept = (x[:n].detach().clone(), y[:n].clone(), logits[:n].argmax(dim=1))

    def sums(self):
        return [self.loss_sum, self.confusion, self.invalid]

    def gather(self, world_size):
        """Nothing beyond the sums."""

    def result(self):
        """``loss`` (mean per counted pixel), ``miou``, ``pixel_acc``, ``class_iou`` (by
        class number), ``count`` (pixels), ``confusion`` and ``examples``."""
        figures = seg_metrics.figures(self.confusion)
        invalid = int(self.invalid)
        if invalid:
            raise UserError(f"{invalid} mask pixels hold a value that is neither a class "
                            f"(0-{self.num_classes - 1}) nor 255 (ignored): --num-classes "
                            f"is too small for these masks")
        pixels = figures["pixels"]
        empty = torch.zeros(0)
        return {"loss": float(self.loss_sum) / max(pixels, 1), "miou": figures["miou"],
                "pixel_acc": figures["pixel_acc"], "class_iou": figures["class_iou"],
                "count": pixels, "confusion": self.confusion.cpu(),
                "examples": tuple(t.cpu() for t in self.kept) if self.kept is not None
                else (empty, empty, empty)}

"""Image classification: one label an image, cross-entropy, accuracy and top-5, each
class's accuracy and the confusion matrix counted on the device; test.py's accuracy report.

The reference task: the defaults of ``tasks.Task`` are its own (data.py's datasets, the
device path or DataLoader workers, networks.py's networks).
"""

import torch
import torch.nn.functional as F

import losses
import networks
from ops import UserError
from pipeline import data, recipes
from tasks import Evaluation, Task, joined, new_confusion, update_confusion

TOP_K = 5  # acc5: counted where there are more classes than this
DENSE_CLASSES = 2048  # up to this many classes a C x C confusion matrix (32 MiB at most);
#                       beyond, each sample's (label, prediction): memory grows with the set
PICTURED_CLASSES = 100  # the confusion image up to this many; beyond, the top confused pairs
TOP_CONFUSED = 20  # pairs (true class, predicted class) listed where there is no picture


class Classification(Task):
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

    measured_export = True  # test.py: an ONNX export's accuracy beside the eager one's

    @classmethod
    def check_config(cls, config):
        """A dataset of labelled images, and a network that gives one label an image."""
        if config["dataset"] not in data.DATASETS:
            raise UserError(f"unknown dataset {config['dataset']!r}; choose one of: "
                            f"{', '.join(data.DATASETS)}")
        if networks.is_segmentation(config["network"]):
            raise UserError(f"--network {config['network']} gives per-pixel logits: train "
                            f"it with --task segmentation")

    @classmethod
    def build(cls, config, train_set, val_set=None):
        return cls(train_set.num_classes, train_set.classes, losses.build_criterion(config),
                   recipes.build_batch_mix(config, train_set.num_classes))

    def __init__(self, num_classes, classes=None, criterion=None, mix=None):
        self.num_classes = num_classes
        self.classes = list(classes) if classes is not None else \
            [str(i) for i in range(num_classes)]
        self.criterion = criterion if criterion is not None else torch.nn.CrossEntropyLoss()
        self.mix = mix

    def prepare(self, x, y, where):
        """MixUp/CutMix, drawn from (seed, epoch, the micro-batch's index in the epoch);
        targets become soft."""
        return (x, y) if self.mix is None else self.mix(x, y, where.epoch, where.batch)

    def loss(self, model, x, y, where=None):  # (draws nothing: a subclass's super().loss(
        #                                        model, x, y) of the older form works too)
        return self.criterion(model(x), y)

    @staticmethod
    def predict(model, x, tta=False):
        """The logits; with ``tta``, the mean of the image's and its mirror's."""
        logits = model(x)
        if tta:
            logits = (logits + model(x.flip(-1))) / 2
        return logits

    def evaluation(self, device, model=None):
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
        from reporting import plots

        return [("confusion", plots.confusion_image(result["confusion"], names, title))]


    def report(self, result, key, path):
        """Loss, accuracy (top-5), each class's accuracy (None: a class with no sample) and
        counts, the confusion matrix or, beyond ``PICTURED_CLASSES``, the worst pairs."""
        classes = self.classes
        top5 = {"accuracy_top5": result["acc5"]} if "acc5" in result else {}
        report = {key: path, "loss": result["loss"], "accuracy": result["acc"], **top5,
                  "per_class": class_accuracy(result, classes),
                  "per_class_counts": [result["class_correct"].tolist(),
                                       result["class_total"].tolist()],
                  "count": result["count"]}
        if len(classes) <= PICTURED_CLASSES and result["confusion"] is not None:
            report["confusion"] = result["confusion"].tolist()
        else:  # C x C would be gigabytes of JSON at ImageNet-21k's size: the worst pairs
            report["top_confused"] = [[classes[t], classes[p], n]
                                      for t, p, n in result["top_confused"]]
        return report

    @staticmethod
    def format_report(report, title):
        """The report as text: headline, per-class accuracy, confusion matrix."""
        names = list(report["per_class"])
        hits, totals = report["per_class_counts"]
        correct = sum(hits)
        top5 = f"  top-5 accuracy {report['accuracy_top5']:.4f}" \
            if "accuracy_top5" in report else ""
        lines = [title,
                 f"loss {report['loss']:.4f}  accuracy {report['accuracy']:.4f} "
                 f"({correct}/{report['count']}){top5}", "per-class accuracy:"]
        width = max(len(n) for n in names)
        for i, name in enumerate(names):
            acc = report["per_class"][name]
            text = "-" if acc is None else f"{acc:.4f}"
            lines.append(f"  {name:<{width}}  {text:>6}  ({hits[i]}/{totals[i]})")
        if "confusion" not in report:
            lines.append(f"most confused (true class -> predicted class: samples), of "
                         f"{len(names)} classes:")
            lines += [f"  {t} -> {p}: {n}" for t, p, n in report["top_confused"]]
            return "\n".join(lines)
        confusion = report["confusion"]
        lines.append("confusion matrix (rows: true class, columns: predicted class):")
        cell = max(len(str(max(max(row) for row in confusion))), len(str(len(names) - 1)))
        lines.append(f"  {'':<{width}}  " + " ".join(f"{j:>{cell}}"
                                                     for j in range(len(names))))
        for name, row in zip(names, confusion):
            lines.append(f"  {name:<{width}}  " + " ".join(f"{v:>{cell}}" for v in row))
        return "\n".join(lines)


class ClassificationEvaluation(Evaluation):
    """One evaluation's sums, counted on the device (no host read per batch): the loss,
    the confusion matrix (``tasks.update_confusion``) or, beyond ``DENSE_CLASSES``, each
    sample's ``label * C + prediction`` (gathered, not summed), the top-5 hits.

    Args:
        num_classes: classes of the set (the confusion matrix's side).
        device: where the sums live.
    """

    def __init__(self, num_classes, device):
        super().__init__()
        self.num_classes = num_classes
        self.dense = num_classes <= DENSE_CLASSES
        side = num_classes if self.dense else 1
        self.add_state("loss_sum", torch.zeros((), dtype=torch.float64), "sum")
        self.add_state("confusion", new_confusion(side), "sum")
        self.add_state("pairs", [], "cat")  # beyond DENSE_CLASSES
        self.add_state("in_top", torch.zeros((), dtype=torch.long), "sum")
        self.to(device)

    def update(self, logits, y, x=None):
        c = self.num_classes
        self.loss_sum += F.cross_entropy(logits.float(), y, reduction="sum")
        if self.dense:
            update_confusion(self.confusion, logits, y)
        else:
            self.pairs.append(y * c + logits.argmax(dim=1))
        if c > TOP_K:
            top = logits.topk(TOP_K, dim=1).indices  # (N, 5)
            self.in_top += (top == y[:, None]).any(dim=1).sum()

    def compute(self):
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
            pairs = joined(self.pairs)
            flat = torch.zeros(0, dtype=torch.long) if pairs is None else pairs.cpu().long()
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


TASK = Classification

"""Object detection: torchvision's detectors (``--network torchvision/NAME``: fasterrcnn_*,
retinanet_*, fcos_*, ssd300_vgg16, ssdlite320_mobilenet_v3_large), their own losses, and
COCO's figures: mAP, mAP@50, mAP@75 and each class's AP, with torchmetrics'
``MeanAveragePrecision`` (the pycocotools backend), over every process's images; best.pt
on mAP; a few validation images with their predicted and true boxes in TensorBoard;
test.py's figures, images with boxes, COCO results json and the export's answer.

Its data are detection_data.py's: images of one square size (``--image-size``) and their
boxes padded to a fixed count per image, so a batch stacks; ``to_device`` turns the
padding back into the list of per-image targets the detectors take. A detector returns its
losses in training (``loss``: their sum) and its predictions in evaluation (``predict``).
The detector's own resize (``GeneralizedRCNNTransform``, 800 px by default) is set to
``--image-size``, which the images already are: it only normalises them.

What a split of the step does (accumulation, torchrun): every torchvision detector
normalises its loss over the whole batch (RetinaNet, FCOS and SSD divide by the batch's
matched anchors, Faster R-CNN averages over the anchors and proposals it samples from the
batch, at random), and the detectors built without ``--pretrained`` keep trainable
BatchNorm in their backbones. So k accumulated batches of B are the same recipe as one of
kB, not the same gradient: a micro-batch's loss is weighted by its samples as every
task's, and an image's share of the loss depends on its batch-mates' boxes. With
``--pretrained`` the backbone's BatchNorm is frozen (``FrozenBatchNorm2d``, as torchvision
builds it with weights); the loss's normalisation stays the batch's.
"""

import contextlib
import json
import os

import torch

from machinery import files
from machinery.runtime import say
from ops import UserError
from pipeline import detection_data
from tasks import Evaluation, Task, joined
from tasks._report import TestFlags

EXAMPLES = 4          # validation images shown with their boxes in TensorBoard
SHOWN_SCORE = 0.3     # predicted boxes drawn from this score up ...
SHOWN_BOXES = 10      # ... at most this many an image
EXPORT_DETECTIONS = 100  # rows of an exported detector's output per image
REFUSED_NETWORKS = {"maskrcnn": "instance masks", "keypointrcnn": "keypoints"}


def detector_names():
    """torchvision's detection builders this task trains (not those that need masks or
    keypoints)."""
    import torchvision

    return [n for n in torchvision.models.list_models(module=torchvision.models.detection)
            if not n.startswith(tuple(REFUSED_NETWORKS))]


def frozen_norms(net):
    """Every ``BatchNorm2d`` of ``net``'s backbone as a ``FrozenBatchNorm2d`` (torchvision's
    detectors built with weights have these): the statistics and affine weights fixed, so
    that pretrained weights load as they were saved."""
    from torchvision.ops import FrozenBatchNorm2d

    for module in list(net.backbone.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, torch.nn.BatchNorm2d):
                frozen = FrozenBatchNorm2d(child.num_features, eps=child.eps)
                setattr(module, child_name, frozen)
    return net


def _float32(value):
    """``value`` (a tensor, or lists, tuples and dicts of them) with every floating tensor
    of another dtype in float32; None where there is none."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.is_floating_point() and \
            value.dtype != torch.float32 else None
    if isinstance(value, (list, tuple, dict)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        changed = {k: _float32(v) for k, v in items}
        if all(v is None for v in changed.values()):
            return None
        if isinstance(value, dict):
            return {k: value[k] if v is None else v for k, v in changed.items()}
        return type(value)(value[k] if v is None else v for k, v in changed.items())
    return None


def _head_in_float32(module, args, output):
    """A forward hook: the head's outputs (box deltas, scores) in float32."""
    return _float32(output)


def _anchors_in_float32(module, args):
    """A forward pre-hook of an anchor generator, which makes its anchors in its feature
    maps' dtype: float32 stand-ins of their shapes (no memory: expanded scalars)."""
    image_list, feature_maps = args
    if all(f.dtype == torch.float32 for f in feature_maps):
        return None
    return image_list, [torch.zeros((), device=f.device).expand(f.shape) for f in feature_maps]


BOX_HEADS = ("rpn.head", "roi_heads.box_predictor", "head")  # torchvision's, by builder
ANCHOR_GENERATORS = ("rpn.anchor_generator", "anchor_generator")


def decode_in_float32(net):
    """Boxes decoded in float32 under any autocast (the CUDA review's N-M1): torchvision's
    box coders decode in their deltas' dtype, with the anchors in the feature maps' (under
    ``--amp bf16`` bfloat16's 8 bits round a corner by 1-4 px). The heads' outputs and the
    anchors are made float32 (hooks); without autocast nothing changes."""
    names = dict(net.named_modules())
    for name in BOX_HEADS:
        if name in names:
            names[name].register_forward_hook(_head_in_float32)
    for name in ANCHOR_GENERATORS:
        if name in names:
            names[name].register_forward_pre_hook(_anchors_in_float32)
    return net


def build_detector(name, num_classes, image_size, pretrained=False):
    """torchvision's detector ``name`` for ``num_classes`` object classes (+ background),
    from scratch (its backbone's BatchNorm frozen when ``pretrained`` weights will be
    loaded), its resize set to ``image_size``, its boxes decoded in float32
    (``decode_in_float32``)."""
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    net = builder(weights=None, weights_backbone=None, num_classes=num_classes + 1)
    transform = net.transform
    transform.min_size, transform.max_size = (image_size,), image_size
    if transform.fixed_size is not None:  # SSD's fixed 300 x 300 (320 for SSDlite)
        transform.fixed_size = (image_size, image_size)
    decode_in_float32(net)
    return frozen_norms(net) if pretrained else net


class _Counted(torch.nn.Module):
    """A training step of the detector on images with one box each: what FLOPs are counted
    on (``ops.train_flops_per_sample`` calls it with images alone)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, x):
        side = x.shape[-1]
        box = torch.tensor([[side / 4, side / 4, side * 3 / 4, side * 3 / 4]], device=x.device)
        targets = [{"boxes": box, "labels": torch.ones(1, dtype=torch.long, device=x.device)}
                   for _ in range(len(x))]
        return sum(self.net(x, targets).values())


class Detections(torch.nn.Module):
    """The detector for inference and export: images ``(N, 3, S, S)`` in [0, 1] in,
    ``(N, EXPORT_DETECTIONS, 6)`` out, each row ``x1, y1, x2, y2, score, label``, the
    highest scores first, zero rows after the last detection."""

    def __init__(self, net, rows=EXPORT_DETECTIONS):
        super().__init__()
        self.net, self.rows = net, rows

    def forward(self, x):
        found = []
        for out in self.net(x):
            r = torch.cat([out["boxes"], out["scores"][:, None],
                           out["labels"][:, None].to(out["boxes"].dtype)], 1)[:self.rows]
            found.append(torch.nn.functional.pad(r, (0, 0, 0, self.rows - len(r))))
        return torch.stack(found)


class DetectionFlags(TestFlags):
    """test.py's flag of a detection checkpoint (--samples and --out are ``ImageFlags``')."""

    title = "a detection checkpoint (--task {tasks})"
    files = ("predictions",)

    def add(self, group):
        group.add_argument("--predictions", default=None, metavar="FILE", help="write every "
                           "validation image's predictions to FILE as COCO results json "
                           "(image_id, category_id, bbox [x, y, w, h], score: the data's own "
                           "ids and pixels, what pycocotools' loadRes reads)")

    def check(self, args):
        if args.predictions is not None and not args.predictions.strip():
            raise UserError("--predictions needs a file name")


DETECTION_FLAGS = DetectionFlags()


class Detection(Task):
    """Object detection with torchvision's detectors (module docstring).

    Args:
        classes: the object classes' names (label k is ``classes[k - 1]``).
        category_ids: the dataset's own id of each class, in label order.
        image_ids: the validation set's own image ids, by index.
    """

    name = "detection"
    datasets_named = detection_data.DATASETS
    figures = ("map", "map_50", "map_75")
    best = "map"
    default_network = "torchvision/fasterrcnn_mobilenet_v3_large_320_fpn"

    # ---------------------------------------------------------------- command line

    @classmethod
    def defaults(cls, config, explicit):
        """The reference's recipe where the user set none: SGD 0.02 (for 16 images),
        momentum 0.9, weight decay 1e-4, a linear warm-up; 64 px synthetic images."""
        for key, value in (("optimizer", "sgd"), ("lr", 0.01), ("momentum", 0.9),
                           ("weight_decay", 1e-4), ("batch_size", 8),
                           ("warmup_epochs", 1.0), ("image_size", 320),
                           ("label_smoothing", 0.0)):
            if key not in explicit:
                config[key] = value
        if config["dataset"] == "cifar10" and "dataset" not in explicit:
            config["dataset"] = "synthetic"

    @classmethod
    def check_config(cls, config):
        """One of torchvision's detectors, its data, and nothing that moves an image and
        not its boxes (or mixes two images' boxes)."""
        network = str(config["network"])
        name = network.split("/", 1)[1] if network.startswith("torchvision/") else None
        refused = next((what for prefix, what in REFUSED_NETWORKS.items()
                        if name and name.startswith(prefix)), None)
        if refused:
            raise UserError(f"--network {network} needs {refused} in its targets: --task "
                            f"detection trains box detectors ({', '.join(detector_names())})")
        if name not in detector_names():
            raise UserError(f"--network {network} is no detector: --task detection trains "
                            f"torchvision/<one of {', '.join(detector_names())}>")
        detection_data.check_config(config)
        for on, flag, why in ((config["mixup_alpha"], "--mixup-alpha",
                               "mixes two images and not their boxes"),
                              (config["cutmix_alpha"], "--cutmix-alpha",
                               "mixes two images and not their boxes"),
                              (config["label_smoothing"], "--label-smoothing",
                               "is a classifier's"),
                              (config["tta"] != "none", "--tta", "averages a classifier's "
                               "logits; a detector's boxes are not averaged"),
                              (config["grad_checkpointing"], "--grad-checkpointing",
                               "is for this project's own networks"),
                              (config["pretrained"] == "torchvision:backbone",
                               "--pretrained torchvision:backbone", "maps a classifier's "
                               "ImageNet weights by name, and a detector's backbone has other "
                               "names: use --pretrained torchvision (the COCO detector, its "
                               "class layers fresh for --num-classes) or --pretrained FILE"),
                              (config["data_on_device"] == "on", "--data-on-device on",
                               "has no detection path: each image's boxes and scale jitter "
                               "are per-sample work for DataLoader workers (use off or "
                               "auto)"),
                              (config["compile"], "--compile", "meets a detector's "
                               "data-dependent shapes (NMS, top-k, per-image loops): graph "
                               "breaks and recompiles, minutes for no gain (CUDA review 7's "
                               "N-L4)")):
            if on:
                raise UserError(f"{flag} {why}: not for --task detection")
        if config["image_size"] < 32:
            raise UserError(f"--image-size {config['image_size']}: a detector's strides "
                            f"need at least 32 px")

    # ---------------------------------------------------------------- data, networks

    @classmethod
    def datasets(cls, config, log, should_stop=None):
        return detection_data.build_datasets(config, log, should_stop)

    @classmethod
    def loaders(cls, config, procs, train_set, val_set, sampler, stop=None):
        from pipeline import device_data

        return device_data.build_loaders(config, procs, train_set, val_set, sampler, stop,
                                         detection_data.device_decision)

    set_identity = staticmethod(detection_data.set_identity)

    @classmethod
    def build_networks(cls, config, dataset):
        name = config["network"].split("/", 1)[1]
        return build_detector(name, dataset.num_classes, config["image_size"],
                              bool(config["pretrained"]))

    @classmethod
    def build(cls, config, train_set, val_set=None):
        return cls(train_set.classes, train_set.category_ids,
                   (val_set or train_set).image_ids)

    def __init__(self, classes, category_ids=None, image_ids=None):
        self.classes = list(classes)
        self.category_ids = list(category_ids or range(1, len(self.classes) + 1))
        self.image_ids = image_ids

    @staticmethod
    def example(dataset):
        return (3, dataset.image_size, dataset.image_size)

    def summarised(self, net, dataset):
        return [(None, Detections(net), self.example(dataset))]

    @staticmethod
    def counted(net):
        return _Counted(net)

    @staticmethod
    def class_heads(net):
        """The classification layers, shaped by the number of classes (and Faster R-CNN's
        box regression, one box per class): COCO's weights (91 ids) on another
        ``--num-classes`` load everything else."""
        return ("roi_heads.box_predictor", "head.classification_head")

    # ---------------------------------------------------------------- a step

    @staticmethod
    def to_device(batch, device, memory_format):
        """``(images, targets)`` on ``device``: ``targets`` a dict of per-image lists
        (``boxes``, ``labels``, ``crowd``: each image's own rows, the padding cut off by
        its count, read on the host) and per-batch tensors (``index``, ``scale``)."""
        x, y = batch
        counts = y["count"].tolist()  # (the loader's CPU tensor: no device read)
        x = x.to(device, non_blocking=True, memory_format=memory_format)
        moved = {k: y[k].to(device, non_blocking=True) for k in ("boxes", "labels", "crowd")}
        return x, {**{k: [v[i, :n] for i, n in enumerate(counts)] for k, v in moved.items()},
                   "index": y["index"].to(device, non_blocking=True),
                   "scale": y["scale"].to(device, non_blocking=True)}

    def loss(self, model, x, y, where=None):
        """The sum of the detector's losses (torchvision's own, as its reference sums
        them) on the micro-batch's images and boxes (crowd boxes were left out)."""
        targets = [{"boxes": b, "labels": k} for b, k in zip(y["boxes"], y["labels"])]
        return sum(model(x, targets).values())

    # ---------------------------------------------------------------- a validation

    @staticmethod
    def predict(model, x, tta=False):
        return model(x)

    def evaluation(self, device, model=None):
        return DetectionEvaluation(len(self.classes), device, EXAMPLES)

    def extra_figures(self, result, names, suffix=""):
        """Each class's AP by name (``val_class_ap``; None: no box of it in the set)."""
        return {f"val_class_ap{suffix}": class_ap(result, self.classes)}

    def images(self, result, names, title):
        """A few validation images with their true (green) and predicted (red) boxes."""
        kept = result["examples"].value
        if not kept:
            return []
        from torchvision.utils import make_grid

        pictures = [draw_boxes(image, truth, pred, self.classes) for image, truth, pred in kept]
        grid = make_grid(torch.stack(pictures), nrow=len(pictures), padding=2, pad_value=128)
        return [("boxes", grid.permute(1, 2, 0).numpy())]

    # ---------------------------------------------------------------- test.py

    test_flags = DETECTION_FLAGS
    test_reads = ("samples", "out", "predictions")

    @classmethod
    def tested(cls, config, val_set, request):
        """The task for test.py: the figures training logged (the same evaluation), with
        ``--samples N --out DIR`` the first N validation images with their boxes as PNGs
        (a file there that test.py did not write refused first), and with
        ``--predictions FILE`` every image's predictions as COCO results."""
        task = super().tested(config, val_set, request)
        if request.samples and request.samples > len(val_set):
            raise UserError(f"--samples {request.samples}: the validation set has "
                            f"{len(val_set)} images")
        if request.samples:
            from tasks._generative import refuse_replacing

            refuse_replacing(request.out, [f"{i:06d}.png" for i in range(request.samples)])
        return task

    def outputs(self, net, result, val_set, report):
        request, found = self.request, result["predictions"].value
        if request.samples:
            names = [f"{i:06d}.png" for i in range(request.samples)]
            written = write_samples(found, val_set, self.classes, request.out, names)
            report["samples"] = {"count": len(written), "dir": request.out}
            say(f"wrote {len(written)} images with their boxes to {request.out}")
        if request.predictions:
            count = write_predictions(found, self, request.predictions)
            report["predictions"] = {"file": request.predictions, "count": count}
            say(f"wrote every validation image's predictions to {request.predictions} (COCO "
                f"results: {count} boxes)")

    def exported(self, net, config, val_set):
        """``Detections``, where torch.export takes the detector; else one ``UserError``
        line saying so, before anything is evaluated."""
        side, path = config["image_size"], self.request.export
        if os.path.splitext(path)[1].lower() == ".ts":
            raise UserError("--export .ts: a traced detector keeps the number of boxes of "
                            "the image it was traced on; use .pt2 or .onnx")
        exported = Detections(net).eval()
        check_exportable(exported, side, path, config["network"])
        described = {"input": f"images (N, 3, {side}, {side}) float32 in [0, 1], resized so "
                              f"that the long side is {side}, padded right and bottom",
                     "output": f"(N, {EXPORT_DETECTIONS}, 6): x1, y1, x2, y2, score, label "
                               f"per detection, zero rows after the last",
                     "classes": self.classes, "category_ids": self.category_ids}
        return exported, (3, side, side), described, ("images", "detections")

    def report(self, result, key, path):
        return {key: path, "task": self.name, "map": result["map"],
                "map_50": result["map_50"], "map_75": result["map_75"],
                "map_small": result["map_small"],
                "map_medium": result["map_medium"], "map_large": result["map_large"],
                "mar_100": result["mar_100"], "per_class_ap": class_ap(result, self.classes),
                "count": result["count"]}

    @staticmethod
    def format_report(report, title):
        lines = [title, f"mAP {report['map']:.4f}  mAP@50 {report['map_50']:.4f}  mAP@75 "
                        f"{report['map_75']:.4f}  AR@100 {report['mar_100']:.4f} "
                        f"({report['count']} images)", "per-class AP:"]
        width = max([len(n) for n in report["per_class_ap"]] or [1])
        for name, ap in report["per_class_ap"].items():
            lines.append(f"  {name:<{width}}  {'-' if ap is None else f'{ap:.4f}':>6}")
        return "\n".join(lines)


def class_ap(result, classes):
    """Each class's AP by name, None for a class without a true box in the set."""
    return {name: result["class_ap"].get(k + 1) for k, name in enumerate(classes)}


# ------------------------------------------------------------------ the evaluation

class DetectionEvaluation(Evaluation):
    """One validation of a detector: every image's predictions and true boxes in the
    file's own pixels (predictions divided by the image's ``scale``), each row with its
    image's index, gathered from every process (``"cat"`` states); ``compute`` groups them
    by image and runs torchmetrics' ``MeanAveragePrecision`` (COCO's evaluation, the
    pycocotools backend) once, on the whole set, so the figures do not depend on the
    number of processes or the batch size. The first ``examples`` images of this process
    are kept for the picture. Each state starts with an empty tensor of its own shape and
    dtype, so that a process without a validation image (a set smaller than the number of
    processes) gathers what the others do (torchmetrics would send a 1-D float32 for it:
    gloo aborts, NCCL hangs: the CUDA review's N-L3).
    """

    NAMES = ("pred_boxes", "pred_scores", "pred_labels", "pred_image",
             "true_boxes", "true_labels", "true_crowd", "true_image", "images")
    EMPTY = {"pred_boxes": ((0, 4), torch.float32), "pred_scores": ((0,), torch.float32),
             "pred_labels": ((0,), torch.long), "pred_image": ((0,), torch.long),
             "true_boxes": ((0, 4), torch.float32), "true_labels": ((0,), torch.long),
             "true_crowd": ((0,), torch.bool), "true_image": ((0,), torch.long),
             "images": ((0,), torch.long)}

    def __init__(self, num_classes, device, examples=EXAMPLES):
        super().__init__()
        self.num_classes, self.want, self.kept = num_classes, examples, []
        for name in self.NAMES:
            self.add_state(name, [], "cat")
            shape, dtype = self.EMPTY[name]
            getattr(self, name).append(torch.zeros(shape, dtype=dtype))
        self.to(device)

    def update(self, out, y, x=None):
        scale = y["scale"].float()  # (N, 2): sx, sy
        index = y["index"]
        preds = [torch.cat([o["boxes"].float() / scale[i].repeat(2), o["scores"].float()[:, None],
                            o["labels"].float()[:, None]], 1) for i, o in enumerate(out)]
        own = [len(p) for p in preds]
        pred = torch.cat(preds) if preds else torch.zeros(0, 6, device=index.device)
        self.pred_boxes.append(pred[:, :4])
        self.pred_scores.append(pred[:, 4])
        self.pred_labels.append(pred[:, 5].long())
        self.pred_image.append(index.repeat_interleave(torch.tensor(own, device=index.device)))
        self.true_boxes.append(torch.cat(y["boxes"]).float())
        self.true_labels.append(torch.cat(y["labels"]))
        self.true_crowd.append(torch.cat(y["crowd"]))
        counts = torch.tensor([len(b) for b in y["boxes"]], device=index.device)
        self.true_image.append(index.repeat_interleave(counts))
        self.images.append(index)
        if x is not None and len(self.kept) < self.want:
            for i in range(min(self.want - len(self.kept), len(x))):
                s = scale[i].repeat(2)
                self.kept.append((x[i].detach().cpu(),
                                  (y["boxes"][i] * s).cpu(), y["labels"][i].cpu(),
                                  {k: v.detach().cpu() for k, v in out[i].items()}))

    def compute(self):
        """``map``, ``map_50``, ``map_75`` (-1 where the set has no true box, as COCO
        says), ``map_small/medium/large``, ``mar_100``, ``class_ap`` (label -> AP),
        ``count`` (images) and ``examples``."""
        from torchmetrics.detection import MeanAveragePrecision

        got = {name: joined(getattr(self, name)) for name in self.NAMES}
        got = {k: v.cpu() if v is not None else None for k, v in got.items()}
        images = got["images"]
        order = sorted(set(images.tolist())) if images is not None else []
        metric = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", class_metrics=True,
                                      backend="pycocotools", sync_on_compute=False)
        metric.warn_on_many_detections = False  # (COCO counts the best 100 an image)
        preds = _by_image(order, got["pred_image"], boxes=got["pred_boxes"],
                          scores=got["pred_scores"], labels=got["pred_labels"])
        targets = _by_image(order, got["true_image"], boxes=got["true_boxes"],
                            labels=got["true_labels"], iscrowd=got["true_crowd"])
        if order:
            with contextlib.redirect_stdout(None):
                metric.update(preds, targets)
                figures = metric.compute()
        else:
            figures = {}

        def number(key):
            value = figures.get(key)
            return -1.0 if value is None else float(value)

        present = figures.get("classes", torch.zeros(0)).reshape(-1).tolist()
        per_class = figures.get("map_per_class", torch.zeros(0)).reshape(-1).tolist()
        class_aps = {int(c): (None if v < 0 else float(v)) for c, v in zip(present, per_class)}
        return {"map": number("map"), "map_50": number("map_50"), "map_75": number("map_75"),
                "map_small": number("map_small"), "map_medium": number("map_medium"),
                "map_large": number("map_large"), "mar_100": number("mar_100"),
                "class_ap": class_aps, "count": len(order),
                "examples": Held([(image, (boxes, labels), pred)
                                  for image, boxes, labels, pred in self.kept]),
                "predictions": Held((order, preds))}


class Held:
    """What ``compute`` returns as it is (torchmetrics squeezes every tensor of one
    element it finds in lists, tuples and dicts: a single box's label would be 0-d)."""

    def __init__(self, value):
        self.value = value


def _by_image(order, image_of, **columns):
    """``[{column: its rows of image i}]`` for each image index of ``order`` (sorted),
    in one stable sort of the rows by image."""
    if not order:
        return []
    image_of = torch.zeros(0, dtype=torch.long) if image_of is None else image_of.long()
    slot = torch.searchsorted(torch.tensor(order, dtype=torch.long), image_of)
    rows = torch.argsort(slot, stable=True)
    counts = torch.bincount(slot, minlength=len(order)).tolist()
    out = [{} for _ in order]
    for name, values in columns.items():
        if values is None:
            values = torch.zeros((0, 4) if name == "boxes" else (0,))
        for entry, part in zip(out, values[rows].split(counts)):
            entry[name] = part.long() if name in ("labels", "iscrowd") else part
    return out


def draw_boxes(image, truth, pred, classes):
    """``image`` (3, H, W) in [0, 1] as uint8 with its true boxes (green) and its predicted
    ones of ``SHOWN_SCORE`` and more (red, at most ``SHOWN_BOXES``)."""
    from torchvision.utils import draw_bounding_boxes

    picture = (image.float().clamp(0, 1) * 255).round().to(torch.uint8)
    boxes, labels = truth
    if len(boxes):
        picture = draw_bounding_boxes(picture, boxes.float(), colors="lime",
                                      labels=[classes[int(k) - 1] for k in labels])
    shown = pred["scores"] >= SHOWN_SCORE
    boxes, labels = pred["boxes"][shown][:SHOWN_BOXES], pred["labels"][shown][:SHOWN_BOXES]
    scores = pred["scores"][shown][:SHOWN_BOXES]
    if len(boxes):
        names = [f"{classes[int(k) - 1] if 0 < int(k) <= len(classes) else int(k)} {s:.2f}"
                 for k, s in zip(labels, scores)]
        picture = draw_bounding_boxes(picture, boxes.float(), colors="red", labels=names)
    return picture


# ------------------------------------------------------------------ test.py's parts

def write_samples(found, val_set, classes, out_dir, names):
    """The first validation images (as evaluated) with their true and predicted boxes, as
    PNGs in ``out_dir`` (written atomically). Returns the paths."""
    from tasks._generative import encode_png

    order, preds = found
    position = {index: k for k, index in enumerate(order)}
    written, path = [], out_dir
    try:
        os.makedirs(out_dir, exist_ok=True)
        for i, name in enumerate(names):
            image, target = val_set[i]
            s = target["scale"].repeat(2)
            n = int(target["count"])
            truth = (target["boxes"][:n] * s, target["labels"][:n])
            pred = dict(preds[position[i]])
            pred["boxes"] = pred["boxes"] * s
            png = encode_png(draw_boxes(image, truth, pred, classes))
            path = os.path.join(out_dir, name)
            files.atomic_write(path, lambda f, png=png: f.write(png), "wb")
            written.append(path)
    except OSError as e:
        raise files.output_failed("--out", path, e, written) from None
    return written


def coco_results(found, task):
    """Every prediction as COCO's results format: ``[{"image_id", "category_id", "bbox":
    [x, y, w, h], "score"}]`` in the file's own ids and pixels."""
    order, preds = found
    results = []
    for index, pred in zip(order, preds):
        image_id = task.image_ids[index] if task.image_ids is not None else index
        for box, score, label in zip(pred["boxes"].tolist(), pred["scores"].tolist(),
                                     pred["labels"].tolist()):
            if not 0 < label <= len(task.category_ids):
                continue
            x1, y1, x2, y2 = box
            results.append({"image_id": image_id, "category_id": task.category_ids[label - 1],
                            "bbox": [round(x1, 2), round(y1, 2), round(x2 - x1, 2),
                                     round(y2 - y1, 2)], "score": round(score, 5)})
    return results


def write_predictions(found, task, path):
    """``coco_results`` as json at ``path`` (--predictions), written atomically (a file
    there before stays whole if the write fails: one ``error:`` line). Returns the
    number of boxes."""
    results = coco_results(found, task)
    text = json.dumps(results)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, lambda f: f.write(text))
    except OSError as e:
        raise files.output_failed("--predictions", path, e) from None
    return len(results)


def check_exportable(exported, side, path, network):
    """Whether torch.export takes the detector (``.pt2``; ONNX's exporter goes through
    it): one ``UserError`` line saying why not, before anything is evaluated."""
    suffix = os.path.splitext(path)[1].lower()
    import io
    import logging

    quiet = logging.getLogger("torch")
    level = quiet.level
    try:  # (torch.export logs the graph it failed on: the line below says it)
        quiet.setLevel(logging.CRITICAL)
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            torch.export.export(exported, (torch.rand(2, 3, side, side),), strict=False)
    except Exception as e:  # torch.export's many refusals: said in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--export {suffix}: torch.export does not take {network} (its "
                        f"post-processing keeps as many boxes as each image's scores pass: "
                        f"{first[:160]}); nothing exported (the figures need no export: "
                        f"run without --export)") from None
    finally:
        quiet.setLevel(level)


TASK = Detection

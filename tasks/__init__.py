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
    evaluation(device, model)               -> an accumulator: update / sums / gather /
                                               result (sums are all-reduced; gather
                                               collects what is not a sum)
    extra_figures(result, names, suffix)    -> metrics.jsonl figures beyond the scalars
    images(result, names, title)            -> [(tag, HxWx3 uint8)] for TensorBoard
    example(dataset)                        -> one input sample's shape (FLOPs, summary)
    averaged(net), counted(net)             -> what --ema-decay averages, what a step's
                                               FLOPs are counted on

A task with several networks (``GAN``) declares ``phases`` (``Phase``: the network each
trains, with the optimizer of the same name, and how often per step) and
``phase_loss(network, model, plain, inputs, targets, where, kept)`` instead of ``loss``;
the engine runs them (``engine._phase_steps``), and ``lower_is_better`` when its best
figure is one (an FID).

A micro-batch weighs its number of samples (the sampler's plan), for every task.
"""


import dataclasses

import torch
import torch.nn.functional as F

import dcgan
import losses
from machinery import engine
from ops import UserError
from pipeline import data, device_data, recipes, segmentation_data
from reporting import gan_metrics
from tasks import seg_metrics

TASKS = ("classification", "segmentation", "gan")
TOP_K = 5  # acc5: counted where there are more classes than this
DENSE_CLASSES = 2048  # up to this many classes a C x C confusion matrix (32 MiB at most);
#                       beyond, each sample's (label, prediction): memory grows with the set
PICTURED_CLASSES = 100  # the confusion image up to this many; beyond, the top confused pairs
TOP_CONFUSED = 20  # pairs (true class, predicted class) listed where there is no picture


class Task:
    """The thin base of every task: what a task may leave out, declared with its default.

    The loop reads these attributes; it never probes a task with ``getattr``. A task sets
    ``name``, ``figures`` and ``best`` and provides the methods listed in this module's
    docstring; the attributes below it overrides only where it differs from their default.
    """

    name = None               # --task's value, recorded in every checkpoint's config
    figures = ("loss",)       # validation figures: val_<figure>, val/<figure>
    best = "loss"             # the figure best.pt and --early-stop-* follow ...
    lower_is_better = False   # ... higher is better unless this (a GAN's FID)
    phases = None             # a task of several networks: its ``Phase``s, in order
    averaged_name = None      # ... and the network --ema-decay averages (by name, in the
    #                           checkpoint's ``ema``); None: the whole model, as ``ema``
    network_lr = {}           # a network's own learning-rate flag ({"name": "lr_x"})
    shown_figures = ()        # training figures on the epoch line (train_<figure>)
    criterion = None          # the training loss as a module, if any (--replay watches it)


def build_task(config, train_set, val_set=None):
    """The task ``config["task"]`` names, for the training set ``train_set`` (a GAN
    checks that ``val_set`` has --fid-samples images)."""
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
    if name == "gan":
        if val_set is not None and len(val_set) < config["fid_samples"]:
            raise UserError(f"--fid-samples {config['fid_samples']}: the validation set has "
                            f"{len(val_set)} images; lower --fid-samples")
        return GAN(config, train_set)
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
    if config["task"] == "gan" or config["network"] == "dcgan":
        _check_gan(config)
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

    @staticmethod
    def example(dataset):
        return (dataset.in_channels, dataset.image_size, dataset.image_size)

    @staticmethod
    def averaged(net):
        """The network --ema-decay averages: all of it."""
        return net

    @staticmethod
    def counted(net):
        """What a step's FLOPs are counted on: the network's forward and backward."""
        return net


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


class Segmentation(Task):
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

    def evaluation(self, device, model=None):
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

    example = staticmethod(Classification.example)
    averaged = staticmethod(Classification.averaged)
    counted = staticmethod(Classification.counted)


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


# ---------------------------------------------------------------------------- GANs

GAN_DATASETS = ("mnist", "fashion_mnist", "cifar10", "imagefolder", "synthetic")
NATIVE_SIDE = {"mnist": 28, "fashion_mnist": 28, "cifar10": 32}


# The DCGAN paper's recipe (a classifier's SGD at 0.1 with a cosine would diverge)
GAN_RECIPE = {"optimizer": "adam", "lr": 2e-4, "betas": [0.5, 0.999], "weight_decay": 0.0,
              "scheduler": "none", "warmup_epochs": 0.0, "augment": False}


def gan_defaults(config, explicit):
    """--task gan's own defaults where the user set none: the DCGAN network, the paper's
    recipe (``GAN_RECIPE``: Adam 2e-4 with betas (0.5, 0.999), no weight decay, a constant
    rate), no augmentation (a padded crop would teach the generator black borders), and
    the dataset's own image side (MNIST's 28, CIFAR-10's 32)."""
    if "network" not in explicit:
        config["network"] = "dcgan"
    config.update({k: v for k, v in GAN_RECIPE.items() if k not in explicit})
    if "image_size" not in explicit and config["dataset"] in NATIVE_SIDE:
        config["image_size"] = NATIVE_SIDE[config["dataset"]]


def _check_gan(config):
    """What --task gan takes, and the flags that make no sense for it: one line each."""
    if config["task"] != "gan":
        raise UserError("--network dcgan is a GAN's pair of networks: train it with "
                        "--task gan")
    if config["network"] != "dcgan":
        raise UserError(f"--task gan trains --network dcgan (dcgan.py), not "
                        f"{config['network']}")
    if config["dataset"] not in GAN_DATASETS:
        raise UserError(f"--task gan: --dataset must be one of {', '.join(GAN_DATASETS)} "
                        f"(got {config['dataset']!r})")
    side, native = config["image_size"], NATIVE_SIDE.get(config["dataset"])
    if native is not None and side != native:
        raise UserError(f"--image-size {side}: {config['dataset']}'s images are {native} px "
                        f"(--image-size {native}, or leave it out)")
    if side not in dcgan.IMAGE_SIZES:
        raise UserError(f"--task gan: --image-size must be one of "
                        f"{', '.join(map(str, dcgan.IMAGE_SIZES))} (got {side})")
    refused = [(config["mixup_alpha"] or config["cutmix_alpha"], "--mixup-alpha/--cutmix-alpha",
                "mix images and labels; a GAN has no labels"),
               (config["tta"] != "none", "--tta", "averages a classifier's predictions"),
               (config["freeze"], "--freeze", "is not for a GAN's two networks"),
               (config["pretrained"], "--pretrained", "loads one network's weights"),
               (config["grad_checkpointing"], "--grad-checkpointing",
                "has no DCGAN implementation"),
               (config["find_lr"], "--find-lr", "sweeps one optimizer's learning rate"),
               (config["gpus"] and "," in str(config["gpus"]), "--gpus with several GPUs",
                "(DataParallel) is not for a GAN: use torchrun")]
    for on, flag, why in refused:
        if on:
            raise UserError(f"{flag} {why}: not for --task gan")


@dataclasses.dataclass(frozen=True)
class Phase:
    """One part of a training step (``engine._phase_steps``): the network it trains, whose
    optimizer has the same name, and how many times per step."""

    network: str
    repeats: int = 1


class GAN(Task):
    """A GAN (dcgan.py's generator and discriminator): per step the discriminator's phase
    (``--d-steps`` times, each with new latents on the same real batch), then the
    generator's on the images the discriminator last judged; FID and KID of the
    generator's images from fixed latents at each validation (gan_metrics.py), the lowest
    FID picking best.pt.

    Latents are drawn from (seed, epoch, the step's first sample, phase, repeat) for all
    of a step's samples at once, and each micro-batch of each process takes its own
    slice (``engine.Where``): accumulation and any number of processes draw what one
    large batch draws. Real images are brought to [-1, 1] (the generator's tanh range):
    the dataset's normalisation is undone (the synthetic set, about N(0, 1), is taken as
    it is). Labels are ignored.

    Args:
        config: the run's (``gan_loss``, ``gp_weight``, ``latent_dim``, ``seed``,
            ``fid_samples``, ``fid_features``, ``d_steps``, ``dataset``).
        train_set: the training set (its normalisation).
    """

    name = "gan"
    lower_is_better = True  # best.pt: the lowest FID
    averaged_name = "generator"  # --ema-decay averages the generator
    network_lr = {"discriminator": "lr_d"}  # --lr-d (None: --lr)
    shown_figures = ("loss_d", "loss_g")  # the epoch line's two losses
    grid = 64  # fixed latents shown as a grid in TensorBoard at each validation

    def __init__(self, config, train_set):
        self.kind, self.gp_weight = config["gan_loss"], config["gp_weight"]
        self.latent_dim, self.seed = config["latent_dim"], config["seed"]
        self.fid_samples = config["fid_samples"]
        self.phases = (Phase("discriminator", config["d_steps"]), Phase("generator"))
        self.features = gan_metrics.build_features(config["fid_features"])  # fails early
        suffix = "" if self.features.name == "inception" else f"_{self.features.name}"
        self.figures = (f"fid{suffix}", f"kid{suffix}")
        self.best = f"fid{suffix}"
        self.transform = train_set.transform  # its normalisation, undone for the real images

    def to_device(self, batch, device, memory_format):
        """The real images on ``device`` in [-1, 1] (``gan_metrics.to_generator_range``,
        as test.py takes them), and the labels (unused)."""
        x, y = to_device(batch, device, memory_format)
        return gan_metrics.to_generator_range(x, self.transform), y

    @staticmethod
    def prepare(x, y, epoch, batch):
        return x, y

    def latents(self, network, where, device):
        """This micro-batch's latents for ``network``'s phase: the slice ``where`` names
        of the step's draw, made on the CPU from (seed, epoch, step, phase, repeat)."""
        phase = 0 if network == "discriminator" else 1
        key = (((self.seed * 1_000_003 + where.epoch) * 1_000_003 + where.first) * 7 + phase) \
            * 101 + where.repeat
        g = torch.Generator().manual_seed(key % (2**63 - 1))
        z = torch.randn(where.step_samples, self.latent_dim, generator=g)
        return z[where.offset:where.offset + where.count].to(device, non_blocking=True)

    def phase_loss(self, network, model, plain, x, y, where, kept):
        """The loss of ``network``'s phase for one micro-batch and its figures (detached).

        The discriminator's: ``dcgan.discriminator_loss`` on the real images and the
        generator's images of new latents (detached: nothing reaches the generator). The
        generator's: ``dcgan.generator_loss`` through the bare discriminator (its
        parameters do not require gradients in this phase) on the images the
        discriminator's last repeat judged, as the PyTorch example's loop does: made with
        their graph and kept when the micro-batch is its step's only one (``where.alone``),
        else (accumulation: every micro-batch's graph would be held) made again from the
        kept latents, the same images. ``model`` holds the wrapped networks (DDP),
        ``plain`` the bare ones, ``kept`` this micro-batch's scratch for the step.
        """
        if network == "generator":
            fake = kept.pop("fake", None)
            if fake is None:
                fake = model["generator"](kept.pop("z"))
            return dcgan.generator_loss(plain["discriminator"], fake, self.kind)
        z = self.latents(network, where, x.device)
        last = where.repeat == self.phases[0].repeats - 1
        if last and where.alone:  # the generator's phase back-propagates through these
            fake = kept["fake"] = model["generator"](z)
        else:
            with torch.no_grad():
                fake = plain["generator"](z)
            if last:
                kept["z"] = z
        return dcgan.discriminator_loss(model["discriminator"], x, fake, self.kind,
                                        self.gp_weight)

    @staticmethod
    def averaged(net):
        """The network --ema-decay averages: the generator."""
        return net["generator"]

    def counted(self, net):
        """What a step's FLOPs are counted on (``ops.train_flops_per_sample``)."""
        return dcgan.StepFlops(net["generator"], net["discriminator"], self.phases[0].repeats)

    @staticmethod
    def predict(model, x, tta=False):
        """Evaluation reads the real images; the generator is asked in ``result``."""
        return x

    def evaluation(self, device, model=None):
        return GANEvaluation(self, model)

    @staticmethod
    def extra_figures(result, names, suffix=""):
        """KID's standard deviation over its subsets (``val_kid_std<...>``)."""
        return {f"val_{k}{suffix}": v for k, v in result.items() if k.startswith("kid_std")}

    @staticmethod
    def images(result, names, title):
        """The fixed latents' samples, as a grid."""
        return [("samples", result["grid"])]

    def example(self, dataset):
        return (self.latent_dim,)


class GANEvaluation:
    """One GAN evaluation: the first ``fid_samples`` real validation images, then (in
    ``result``) as many of the generator's images from the fixed latents, their FID and
    KID (gan_metrics.measure) and a grid of the first ``GAN.grid``. Under DDP the real
    images are gathered (the shards are contiguous: in rank order they are the set's
    order), process 0 measures and the others take its figures: every process decides
    alike and the figures are those of the generator process 0 saves.

    Args:
        task: the ``GAN``.
        model: what is evaluated: the run's networks (``nn.ModuleDict``) or the moving
            average of the generator.
    """

    def __init__(self, task, model):
        self.task, self.real, self.have = task, [], 0
        generator = model["generator"] if isinstance(model, torch.nn.ModuleDict) else model
        self.generator = engine.bare(generator)
        self.world, self.rank = 1, 0

    def update(self, real, y, x=None):
        want = self.task.fid_samples - self.have
        if want > 0:
            self.real.append(real[:want].float().cpu())
            self.have += len(self.real[-1])

    def sums(self):
        return []

    def gather(self, world_size):
        """Every process's real images, in rank order."""
        import torch.distributed as dist

        every = [None] * world_size
        dist.all_gather_object(every, torch.cat(self.real) if self.real else torch.zeros(0))
        self.real = [t for t in every if len(t)]
        self.world, self.rank = world_size, dist.get_rank()

    def result(self):
        """``fid``/``kid``/``kid_std`` (``_classifier`` with --fid-features), ``count``
        (images on each side) and ``grid`` (an (H, W, 3) uint8 array)."""
        task = self.task
        real = torch.cat(self.real)[:task.fid_samples] if self.real else torch.zeros(0)
        if len(real) < task.fid_samples:
            raise UserError(f"--fid-samples {task.fid_samples}: the validation set has "
                            f"{len(real)} images; lower --fid-samples")
        result = None
        if self.rank == 0:
            task.features.to(next(self.generator.parameters()).device)
            result = gan_metrics.generator_scores(  # as test.py measures a checkpoint
                self.generator, real, task.features, task.fid_samples, task.seed)
            result["count"] = len(real)
            result["grid"] = dcgan.sample_grid(
                self.generator, dcgan.fixed_latents(task.grid, task.latent_dim, task.seed))
        if self.world > 1:
            import torch.distributed as dist

            shared = [result]
            dist.broadcast_object_list(shared, src=0)
            result = shared[0]
        return result

"""Training recipes: EMA of the weights, MixUp/CutMix, AutoAugment policies, random erasing.

Each keeps the determinism promise of docs/design.md (a run resumed anywhere ends with the
same weights as one that never stopped, with any number of workers):

* ``EMA`` is a function of the weights after each optimizer step and of the step number;
  checkpoints hold its state_dict under ``ema``.
* ``BatchMix`` (MixUp or CutMix) draws from a generator of its own, seeded from (seed,
  epoch, position of the batch in the epoch): never from the global RNG.
* ``policy_transforms`` returns torchvision's per-sample policies and RandomErasing; they
  draw from torch's global generator, which ``data.SeededDataset`` seeds per sample from
  (seed, epoch, index), as it does for the crop and flip.

Where torchvision or torch have the piece and it keeps that promise, it is used; why
``EMA`` and ``BatchMix`` have code of their own is in docs/design.md.
"""

import copy
import math
import random
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.optim.swa_utils import get_ema_multi_avg_fn
from torchvision.transforms import v2

from machinery.checkpoint import check_compatible, unwrap_state_dict
from ops import UserError
from pipeline.sample_transforms import FOLDERS

POLICIES = ("none", "trivialaugment", "randaugment", "autoaugment")
# The digit sets: 28x28, one channel, centred on black; a mirrored digit is another digit,
# so no flips and no --tta flip. The one spelling: data.py (their shape, mirror_keeps_class),
# the policies below and gan_metrics.py (a GAN's channels) read it.
DIGITS = ("mnist", "fashion_mnist")


# --------------------------------------------------------------------------------- EMA

class EMA:
    """An exponential moving average of a network's weights and buffers.

    ``ema_0`` is the network as it is when the EMA is built (after --pretrained); after
    optimizer step ``t`` (1, 2, ...), ``update(net, t)`` sets, for every floating-point
    parameter and buffer (BatchNorm's running mean and variance included)::

        ema_t = d_t * ema_{t-1} + (1 - d_t) * w_t

    with ``d_t = decay``, or with warmup ``d_t = min(decay, (1 + t) / (10 + t))`` (the
    ramp of TensorFlow's ExponentialMovingAverage(num_updates), also timm's): 0.18 at
    step 1, 0.9 at step 80, 0.99 at 890, 0.999 at 8,990, so the early average is not
    stuck at the initial weights. Integer buffers (BatchNorm's ``num_batches_tracked``)
    are copied. The update is a function of the weights and ``t`` only: processes with
    the same weights keep the same average, and a resumed run (the average from the
    checkpoint's ``ema``, ``t`` from its ``step``) continues it exactly.

    The averaging is torch's ``get_ema_multi_avg_fn`` (a foreach lerp); why the loop
    around it is not ``torch.optim.swa_utils.AveragedModel``: docs/design.md.

    Args:
        net: the plain network (no DDP/DataParallel/compile wrapper; a wrapper with the
            same parameters works too). It is deep-copied onto its own device.
        decay: in [0, 1); e.g. 0.999 (the average spans about 1 / (1 - decay) steps).
        warmup: ramp the decay up over the first steps as above.

    Attributes:
        module: the averaged network, in eval mode, without gradients: pass it to
            ``engine.evaluate`` (or export it) like the network itself.
    """

    def __init__(self, net, decay, warmup=True):
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"EMA decay must be in [0, 1), got {decay}")
        self.decay, self.warmup = float(decay), bool(warmup)
        self.module = copy.deepcopy(net).eval().requires_grad_(False)
        for p in self.module.parameters():
            p.grad = None  # deepcopy copies gradients too
        own = self._tensors(self.module)
        self._copied = [i for i, t in enumerate(own)
                        if not (t.is_floating_point() or t.is_complex())]
        groups = {}  # foreach kernels want one device and dtype per list
        for i, t in enumerate(own):
            if t.is_floating_point() or t.is_complex():
                groups.setdefault((t.device, t.dtype), []).append(i)
        self._groups = [([own[i] for i in idx], idx) for idx in groups.values()]
        self._own = own

    @staticmethod
    def _tensors(module):
        return [*module.parameters(), *module.buffers()]

    def decay_at(self, step):
        """The decay ``d_t`` used by the update after optimizer step ``step``."""
        if not self.warmup:
            return self.decay
        return min(self.decay, (1.0 + step) / (10.0 + step))

    @torch.no_grad()
    def update(self, net, step):
        """Moves the average towards ``net`` after optimizer step ``step`` (1, 2, ...).

        Call it once after every optimizer step, with the plain network and
        ``TrainState.step``; every process calls it (it communicates nothing).
        """
        new = self._tensors(net)
        if len(new) != len(self._own):
            raise ValueError(f"EMA.update: the network has {len(new)} parameters and "
                             f"buffers, the average {len(self._own)}")
        average = get_ema_multi_avg_fn(self.decay_at(step))
        for own, idx in self._groups:
            average(own, [new[i].detach() for i in idx], None)
        for i in self._copied:
            self._own[i].copy_(new[i])

    def state_dict(self):
        """The averaged network's state_dict: the network's own keys, tensors only (on the
        training device; ``checkpoint.to_cpu`` copies them). Its step is the checkpoint's."""
        return self.module.state_dict()

    def load_state_dict(self, state_dict, source="the checkpoint"):
        """Loads what ``state_dict`` returned; also an AveragedModel's (``module.*`` keys
        and ``n_averaged``, as torchvision's reference scripts save).

        Raises:
            checkpoint.CheckpointError (a UserError): the keys or shapes do not fit.
        """
        weights = unwrap_state_dict({k: v for k, v in state_dict.items()
                                     if k != "n_averaged"})
        check_compatible(self.module, weights, source)
        self.module.load_state_dict(weights)

    @torch.no_grad()
    def sync_buffers(self, src=0):
        """Makes the average's buffers those of process ``src`` on every process (all call
        it; nothing happens in a single process).

        Under DDP the weights are the same on every process after each step, but the
        BatchNorm statistics are not: DDP broadcasts rank 0's buffers at the start of each
        forward and each process then updates them with its own batch, so each process's
        averaged statistics drift a little apart. Rank 0's are the ones checkpoints hold
        (and what a resumed run starts from), and they depend on rank 0 only; call this
        before evaluating ``module`` so that every process evaluates with them. Not
        needed with --sync-bn, harmless anyway.
        """
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return
        by_dtype = {}
        for b in self.module.buffers():
            by_dtype.setdefault(b.dtype, []).append(b)
        for buffers in by_dtype.values():
            flat = torch.cat([b.reshape(-1) for b in buffers])
            dist.broadcast(flat, src)
            for b, value in zip(buffers, flat.split([b.numel() for b in buffers])):
                b.copy_(value.view_as(b))


def build_ema(config, net):
    """The EMA that ``config`` asks for (``ema_decay``, ``ema_warmup``), or None (decay 0)."""
    if not config["ema_decay"]:
        return None
    return EMA(net, config["ema_decay"], config["ema_warmup"])


# ---------------------------------------------------------------------- MixUp, CutMix

class MixDraw(NamedTuple):
    """What ``BatchMix`` drew for one batch."""

    kind: str           # "none", "mixup" or "cutmix"
    lam: float          # weight of each sample's own image and label (1.0 for "none")
    box: tuple          # CutMix: (x1, y1, x2, y2) pasted from the partner; () otherwise
    perm: torch.Tensor  # sample i is mixed with sample perm[i] (CPU, int64); None: "none"


class BatchMix:
    """MixUp (Zhang et al., 2018) or CutMix (Yun et al., 2019) of a batch, with soft targets.

    Per batch: with probability ``mix_prob`` the batch is mixed, by MixUp or CutMix (when
    both alphas are set, either with probability 1/2), with ``lam ~ Beta(alpha, alpha)``
    and a random pairing ``perm``::

        MixUp:   x_i = lam * x_i + (1 - lam) * x_perm[i]
        CutMix:  x_i = x_i with a box of x_perm[i] pasted in, lam = 1 - box area / image area
        target_i = lam * onehot(y_i) + (1 - lam) * onehot(y_perm[i])

    The box is drawn as torchvision's ``v2.CutMix`` draws it (a centre uniform over the
    image, sides ``sqrt(1 - lam)`` of the image's, clipped at the border). An unmixed
    batch gets one-hot targets, so the loss is always the soft-target cross-entropy.
    Label smoothing stays with the loss: ``nn.CrossEntropyLoss(label_smoothing=e)`` on
    probability targets uses ``(1 - e) * target + e / C``, which is also the mix of the
    smoothed one-hot labels (timm's order), so losses.build_criterion needs no change.

    Determinism: every draw (whether to mix, which, lam, the box, the pairing) comes from
    a generator seeded from (seed, epoch, position), where position is the place of the
    batch in the epoch (``TrainState.epoch_samples`` before the batch: the same on every
    process and after a resume). Nothing depends on the DataLoader workers or on the
    global RNG. Under DDP each process mixes within its own share of the global batch
    (pairs never cross processes), with the same lam, choice and box on every process, so
    P processes of B draw what one process of P*B draws but pair within each share.

    The arithmetic is torchvision's ``v2.MixUp``/``v2.CutMix`` (tests check it against
    theirs); why the draws are not theirs: docs/design.md.

    Args:
        mixup_alpha: MixUp's Beta parameter (0 = no MixUp).
        cutmix_alpha: CutMix's Beta parameter (0 = no CutMix).
        mix_prob: probability that a batch is mixed.
        num_classes: classes of the labels.
        seed: the run's seed.
    """

    def __init__(self, mixup_alpha, cutmix_alpha, mix_prob, num_classes, seed):
        if mixup_alpha < 0 or cutmix_alpha < 0 or not 0.0 <= mix_prob <= 1.0:
            raise ValueError(f"BatchMix: alphas must be >= 0 and mix_prob in [0, 1], got "
                             f"{mixup_alpha}, {cutmix_alpha}, {mix_prob}")
        self.mixup_alpha, self.cutmix_alpha = float(mixup_alpha), float(cutmix_alpha)
        self.mix_prob, self.num_classes, self.seed = float(mix_prob), num_classes, seed

    def draw(self, epoch, position, batch_size, height, width):
        """The random choices for one batch: a ``MixDraw``, a function of (seed, epoch,
        position) and the batch's shape only."""
        # random.Random seeds from a string through SHA-512: the same on every platform
        # and process, whatever PYTHONHASHSEED. It draws the Beta variate, which no torch
        # API draws from a given generator; the permutation comes from a torch.Generator
        # seeded from it.
        rnd = random.Random(f"batchmix/{self.seed}/{epoch}/{position}")
        if not (self.mixup_alpha or self.cutmix_alpha) or rnd.random() >= self.mix_prob:
            return MixDraw("none", 1.0, (), None)
        cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or rnd.random() < 0.5)
        alpha = self.cutmix_alpha if cutmix else self.mixup_alpha
        lam = rnd.betavariate(alpha, alpha)
        box = ()
        if cutmix:  # as torchvision's v2.CutMix.make_params
            cx, cy = rnd.randrange(width), rnd.randrange(height)
            r = 0.5 * math.sqrt(1.0 - lam)
            half_w, half_h = int(r * width), int(r * height)
            box = (max(cx - half_w, 0), max(cy - half_h, 0),
                   min(cx + half_w, width), min(cy + half_h, height))
            lam = 1.0 - (box[2] - box[0]) * (box[3] - box[1]) / (width * height)
        g = torch.Generator().manual_seed(rnd.getrandbits(63))
        perm = torch.randperm(batch_size, generator=g)
        return MixDraw("cutmix" if cutmix else "mixup", lam, box, perm)

    def apply(self, x, y, draw):
        """Mixes the batch as ``draw`` says.

        Args:
            x: images ``(N, C, H, W)``, floating point for MixUp, on any device and in any
                memory format (kept; the input is not changed).
            y: labels ``(N,)`` (int64), or probabilities ``(N, num_classes)``.
            draw: a ``MixDraw`` for this batch size.

        Returns:
            ``(x, targets)``: the mixed images and float32 targets ``(N, num_classes)`` on
            ``y``'s device, each row summing to one.
        """
        targets = y.float() if y.ndim == 2 else F.one_hot(y.long(), self.num_classes).float()
        if draw.kind == "none":
            return x, targets
        perm = draw.perm.pin_memory() if x.is_cuda else draw.perm  # pageable: a sync
        perm = perm.to(x.device, non_blocking=True)
        if draw.kind == "mixup":
            if not x.is_floating_point():
                raise TypeError(f"MixUp needs floating-point images, got {x.dtype}")
            x = torch.lerp(x[perm], x, draw.lam)  # keeps channels_last, unlike index_select
        else:
            x1, y1, x2, y2 = draw.box
            patch = x[..., y1:y2, x1:x2][perm]
            x = x.clone()
            x[..., y1:y2, x1:x2] = patch
        perm = perm.to(targets.device, non_blocking=True)
        return x, torch.lerp(targets[perm], targets, draw.lam)

    def __call__(self, x, y, epoch, position):
        """``apply(x, y, draw(epoch, position, ...))``: the batch mixed, and its targets."""
        return self.apply(x, y, self.draw(epoch, position, x.shape[0], x.shape[-2],
                                          x.shape[-1]))


def build_batch_mix(config, num_classes):
    """The BatchMix that ``config`` asks for (``mixup_alpha``, ``cutmix_alpha``,
    ``mix_prob``, ``seed``), or None when nothing would ever be mixed."""
    mixup, cutmix, prob = config["mixup_alpha"], config["cutmix_alpha"], config["mix_prob"]
    if not (mixup or cutmix) or prob == 0:
        return None
    return BatchMix(mixup, cutmix, prob, num_classes, config["seed"])


# ------------------------------------------------------- policies and random erasing

class _DigitTrivialAugment(v2.TrivialAugmentWide):
    """TrivialAugmentWide with rotations up to 30 degrees (RandAugment's and AutoAugment's
    largest) instead of 135: a digit turned further can be another digit (6 and 9).

    torchvision has no argument for the range; its policies read the class attribute
    ``_AUGMENTATION_SPACE`` (private), overridden here with one entry changed.
    """

    _AUGMENTATION_SPACE = {
        **v2.TrivialAugmentWide._AUGMENTATION_SPACE,
        "Rotate": (lambda num_bins, height, width: torch.linspace(0.0, 30.0, num_bins), True),
    }


class _OnUint8(torch.nn.Module):
    """Runs a uint8 policy on float images of about N(0, 1) (the synthetic set): maps
    [-4, 4] to 0..255, applies the policy, maps back (quantising to steps of 8/255)."""

    def __init__(self, policy):
        super().__init__()
        self.policy = policy

    def forward(self, image):
        q = ((image.clamp(-4.0, 4.0) + 4.0) * (255.0 / 8.0)).round().to(torch.uint8)
        return self.policy(q).float() * (8.0 / 255.0) - 4.0


def policy_transforms(policy, magnitude, erase_p, dataset_name):
    """torchvision's augmentation policy and random erasing for a training transform.

    The policy works on uint8 images: it goes after the crop and flip, before
    ``v2.ToDtype``; RandomErasing goes after ``v2.Normalize`` (it fills with 0, the mean).
    Both draw from torch's global generator, which ``data.SeededDataset`` seeds per sample
    from (seed, epoch, index), so they are deterministic like the crop and flip.

    No torchvision policy flips (checked for torchvision 0.29: TrivialAugmentWide and
    RandAugment use Identity, ShearX/Y, TranslateX/Y, Rotate, Brightness, Color,
    Contrast, Sharpness, Posterize, Solarize, AutoContrast, Equalize; AutoAugment's
    ImageNet, CIFAR-10 and SVHN policies use those and Invert). For digits (mnist,
    fashion_mnist): ``autoaugment`` takes the SVHN policy (learned on digits);
    ``trivialaugment`` rotates by at most 30 degrees instead of 135; ``randaugment``
    rotates by at most 30 anyway. ``autoaugment`` takes the CIFAR-10 policy for cifar10,
    cifar100 and synthetic, ImageNet's for imagefolder. All interpolate bilinearly (as
    torchvision's reference recipes) and fill with black. The synthetic set's float
    images go through the policy as uint8 (``_OnUint8``).

    Args:
        policy: one of ``POLICIES``.
        magnitude: RandAugment's magnitude, 0..30 (of 31 bins; 2 operations per image).
        erase_p: probability of RandomErasing (0 = none).
        dataset_name: the ``--dataset`` name.

    Returns:
        ``(before_to_dtype, after_normalize)``: two lists of v2 transforms (maybe empty).

    Raises:
        UserError: unknown policy, magnitude out of range, erase_p out of [0, 1].
    """
    bilinear = v2.InterpolationMode.BILINEAR
    digits = dataset_name in DIGITS
    if policy == "none":
        before = []
    elif policy == "trivialaugment":
        before = [(_DigitTrivialAugment if digits else v2.TrivialAugmentWide)(
            interpolation=bilinear)]
    elif policy == "randaugment":
        if not 0 <= magnitude <= 30:
            raise UserError(f"--randaugment-magnitude must be in 0..30, got {magnitude}")
        before = [v2.RandAugment(num_ops=2, magnitude=int(magnitude), num_magnitude_bins=31,
                                 interpolation=bilinear)]
    elif policy == "autoaugment":
        kind = (v2.AutoAugmentPolicy.SVHN if digits else
                v2.AutoAugmentPolicy.IMAGENET if dataset_name in FOLDERS else
                v2.AutoAugmentPolicy.CIFAR10)
        before = [v2.AutoAugment(kind, interpolation=bilinear)]
    else:
        raise UserError(f"unknown --auto-augment policy {policy!r}; choose one of: "
                        f"{', '.join(POLICIES)}")
    if before and dataset_name == "synthetic":
        before = [_OnUint8(before[0])]
    if not 0.0 <= erase_p <= 1.0:
        raise UserError(f"--random-erase must be in [0, 1], got {erase_p}")
    after = [v2.RandomErasing(p=erase_p, value=0)] if erase_p > 0 else []
    return before, after

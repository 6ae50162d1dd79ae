"""FID and KID of a generator's images against real images, by torchmetrics; the images
themselves (``generate``: a generator's, in eval mode, in batches; ``to_uint8``).

Two feature extractors, each named in every key it gives so that nobody takes one for the
other:

- ``inception``: the Inception-v3 of the FID paper (Heusel et al., 2017), torch-fidelity's
  port as torchmetrics runs it (``NoTrainInceptionV3``), 2048 pool features. Its weights
  are a file, ``$TORCH_HOME/hub/checkpoints/weights-inception-2015-12-05-6726825d.pth``
  (``inception_weights_path``: torch.hub's cache, where torch-fidelity would download it);
  nothing is downloaded here: without the file, one ``error:`` line names it. Keys
  ``fid``, ``kid``, ``kid_std``: comparable with published figures.
- ``classifier`` (--fid-features CHECKPOINT): the penultimate features (the input of the
  last ``nn.Linear``) of a classifier this project trained, for offline runs and data
  unlike ImageNet. Keys ``fid_classifier``, ``kid_classifier``, ``kid_std_classifier``:
  comparable only between runs measured with the same checkpoint.

The features are computed once per image and given to torchmetrics'
``FrechetInceptionDistance`` and ``KernelInceptionDistance`` (the library does the
statistics: means, covariances, the matrix square root, the polynomial-kernel MMD).
"""

import functools
import math
import os
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import dcgan
from machinery import checkpoint
from ops import UserError
from pipeline import data, recipes, sample_transforms

INCEPTION_FILE = "weights-inception-2015-12-05-6726825d.pth"  # torch-fidelity's URL's name
INCEPTION_URL = ("https://github.com/toshas/torch-fidelity/releases/download/v0.2.0/"
                 + INCEPTION_FILE)
KID_SUBSET_SIZE = 1000  # torchmetrics' default (and the KID paper's); fewer images: all
KID_SUBSETS = 100


def inception_weights_path():
    """Where the Inception weights must be: torch.hub's cache under TORCH_HOME
    (``torch.hub.get_dir()/checkpoints``), where torch-fidelity downloads them to."""
    return os.path.join(torch.hub.get_dir(), "checkpoints", INCEPTION_FILE)


class InceptionFeatures(nn.Module):
    """Inception-v3 pool features (2048) of images in [-1, 1], from the weights file.

    Args:
        path: the weights file (default ``inception_weights_path()``).

    Raises:
        UserError: the file is missing (the line names it and where to get it), holds
            anything but tensors, or torch-fidelity is not installed.
    """

    name = "inception"
    num_features = 2048

    def __init__(self, path=None):
        super().__init__()
        path = path or inception_weights_path()
        if not os.path.isfile(path):
            raise UserError(f"FID needs the Inception weights in {path} (offline: nothing is "
                            f"downloaded); put {INCEPTION_URL} there, or measure with "
                            f"--fid-features CHECKPOINT (a classifier this project trained), or "
                            f"train without FID: --fid-samples 0")
        try:
            # torch-fidelity loads the file with weights_only=False: refuse pickled code
            # before it does
            torch.load(path, map_location="cpu", weights_only=True)
        except Exception:  # torch.load raises several types for a bad or unsafe file
            raise UserError(f"Inception weights {path} cannot be loaded safely (truncated, "
                            f"damaged or holding pickled objects): put {INCEPTION_URL} "
                            f"there") from None
        try:
            from torchmetrics.image.fid import NoTrainInceptionV3
            self.net = NoTrainInceptionV3(name="inception-v3-compat", features_list=["2048"],
                                          feature_extractor_weights_path=path)
        except ModuleNotFoundError as e:
            raise UserError(f"FID with Inception needs torch-fidelity ({e}): "
                            f"pip install -r requirements.txt") from None
        except (RuntimeError, KeyError) as e:
            raise UserError(f"{path} is not torch-fidelity's Inception-v3: "
                            f"{str(e).splitlines()[0][:200]}") from None

    def forward(self, images):
        x = to_uint8(images)  # what the FID Inception takes: uint8, 3 channels
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        return self.net(x).float()  # (N, 2048)


class ClassifierFeatures(nn.Module):
    """The penultimate features of a classifier: the input of its last ``nn.Linear``
    (the last one called in a forward pass), taken by a forward hook.

    Images in [-1, 1] are brought to what the classifier was trained on: mapped to [0, 1]
    and normalised with ``mean`` and ``std`` (sample_transforms.STATS, as data.py does), or left in
    [-1, 1] when there are none (the synthetic set is not normalised); resized
    (bilinear) to its ``image_size``; one channel repeated to its three.

    Args:
        net: the classifier (eval mode is kept).
        image_size: the side it was trained at.
        in_channels: its input channels.
        mean, std: the normalisation of its training data, or None.

    Raises:
        UserError: the network has no ``nn.Linear``.
    """

    name = "classifier"

    def __init__(self, net, image_size, in_channels, mean=None, std=None):
        super().__init__()
        self.net = net.eval().requires_grad_(False)
        self.image_size, self.in_channels = image_size, in_channels
        linears = [m for m in net.modules() if isinstance(m, nn.Linear)]
        if not linears:
            raise UserError(f"--fid-features: {type(net).__name__} has no Linear layer whose "
                            f"input could serve as features")
        for m in linears:
            m.register_forward_hook(self._keep)
        self.register_buffer("mean", None if mean is None else
                             torch.tensor(mean, dtype=torch.float32).view(1, -1, 1, 1))
        self.register_buffer("std", None if std is None else
                             torch.tensor(std, dtype=torch.float32).view(1, -1, 1, 1))
        self._features = None
        with torch.no_grad():
            self.num_features = self(torch.zeros(1, in_channels, image_size, image_size)
                                     ).shape[1]

    def _keep(self, module, inputs, output):
        self._features = inputs[0]  # the last Linear called wins

    def train(self, mode=True):
        """Keeps the classifier in eval mode (BatchNorm's running statistics, no dropout)."""
        super().train(mode)
        self.net.eval()
        return self

    def forward(self, images):
        x = images.float()
        if x.shape[1] != self.in_channels:
            if x.shape[1] != 1:
                raise UserError(f"--fid-features: the classifier takes {self.in_channels} "
                                f"channels, the images have {x.shape[1]}")
            x = x.expand(-1, self.in_channels, -1, -1)
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                              align_corners=False, antialias=True)
        if self.mean is not None:
            x = ((x + 1) / 2 - self.mean) / self.std
        self.net(x)
        return self._features.flatten(1).float()  # (N, features)


def _channels(config):
    if config.get("in_channels"):
        return int(config["in_channels"])
    return 1 if config.get("dataset") in recipes.DIGITS else 3


def classifier_features(path):
    """The ``ClassifierFeatures`` of a classifier checkpoint of this project (train.py's
    best.pt or last.pt): its trained weights (the moving average when it has one), on
    the CPU, in eval mode.

    Args:
        path: the checkpoint (--fid-features).

    Returns:
        A ``ClassifierFeatures``.

    Raises:
        UserError: not a classifier's checkpoint of this project, or unreadable (one line).
    """
    import networks

    try:
        state = checkpoint.load_checkpoint(path)
    except checkpoint.CheckpointError as e:
        raise UserError(f"--fid-features: {e}") from None
    config = state.get("config") if isinstance(state.get("config"), dict) else None
    one = isinstance(state.get("model"), dict)  # one network (format 2), not several
    if config is not None and ("networks" in state or (
            one and networks.is_segmentation(str(config.get("network"))))):  # no classifier
        raise UserError(f"--fid-features needs a classifier's checkpoint; {path!r} was "
                        f"trained with --task {config.get('task', '?')}")
    if config is None or not one:
        raise UserError(f"--fid-features: {path!r} is not a training checkpoint of this "
                        f"project (no model and config)")
    weights = checkpoint.unwrap_state_dict(state["ema"] if isinstance(state.get("ema"), dict)
                                           else state["model"])
    matrices = [v for v in weights.values() if v.dim() == 2]
    if not matrices:
        raise UserError(f"--fid-features: {path!r} holds no Linear layer's weights")
    # the last layer's outputs: config's num_classes is --num-classes' value, which an
    # image folder's own classes override
    num_classes = matrices[-1].shape[0]
    native = data.native_geometry(config.get("dataset"))  # (MNIST: 28, whatever the flag)
    image_size = native[0] if native else int(config.get("image_size") or 32)
    channels = _channels(config)
    try:
        net = networks.build_network(config["network"], num_classes, channels, image_size)
    except (ValueError, KeyError) as e:
        raise UserError(f"--fid-features: {path!r}: {e}") from None
    checkpoint.check_compatible(net, weights, path)
    net.load_state_dict(weights)
    mean, std = sample_transforms.STATS.get(config.get("dataset"), (None, None))
    return ClassifierFeatures(net, image_size, channels, mean, std)


def build_features(fid_features=None):
    """The feature extractor a run asks for: ``classifier_features(fid_features)`` with
    --fid-features, else ``InceptionFeatures()`` (the weights file under TORCH_HOME)."""
    return classifier_features(fid_features) if fid_features else InceptionFeatures()


def to_generator_range(images, transform):
    """Real images as a generator makes them, in [-1, 1]: the dataset's normalisation
    undone to [0, 1] pixels, then mapped to [-1, 1].

    The normalisation is the ``sample_transforms.Normalise`` in the transform that made
    the images (data.py's and presets.py's evaluation transforms: the dataset's STATS, or
    a preset's). A transform without one (the synthetic set, not normalised) leaves the
    images as they are, as ``ClassifierFeatures`` takes them.

    Args:
        images: a batch ``(N, C, H, W)`` as the dataset gives it.
        transform: the dataset's transform (a ``v2.Compose``, or one transform).

    Returns:
        A float32 tensor of the same shape.
    """
    steps = getattr(transform, "transforms", [transform])
    found = [s for s in steps if isinstance(s, sample_transforms.Normalise)]
    x = images.float()
    if not found:
        return x
    mean, std = _statistics(found[-1].mean, found[-1].std, x.device)
    return (x * std + mean) * 2 - 1  # (N, C, H, W): pixels / 255 -> [-1, 1]


@functools.lru_cache(maxsize=8)
def _statistics(mean, std, device):
    """``(mean, std)`` as (1, C, 1, 1) float32 tensors on ``device``, made once: the
    training step calls ``to_generator_range`` for every batch, and a tensor made from a
    list on a GPU is a copy from the host each time."""
    return tuple(torch.tensor(v, dtype=torch.float32, device=device).view(1, -1, 1, 1)
                 for v in (mean, std))


class _Given(nn.Module):
    """Features already computed, handed to torchmetrics as its ``feature`` module."""

    def __init__(self, num_features):
        super().__init__()
        self.num_features = num_features

    def forward(self, features):
        return features


def _take(images, n):
    """The first ``n`` images of a tensor or an iterable of batches (or of (images,
    labels) pairs), as one tensor."""
    if isinstance(images, torch.Tensor):
        return images[:n]
    out, have = [], 0
    for batch in images:
        batch = batch[0] if isinstance(batch, (tuple, list)) else batch
        out.append(batch[:n - have])
        have += len(out[-1])
        if have >= n:
            break
    return torch.cat(out) if out else torch.zeros(0)


@torch.no_grad()
def measure(features, real, fake, seed=0, batch_size=256, extracted=False):
    """FID and KID between two sets of images, computed by torchmetrics on ``features``.

    Args:
        features: an ``InceptionFeatures`` or ``ClassifierFeatures`` (its ``name`` names
            the keys).
        real, fake: images in [-1, 1], ``(N, C, H, W)`` tensors (at least 2 each).
        seed: KID's subset draws (torch's global generator is forked, not advanced).
        batch_size: images per forward pass of the feature extractor.
        extracted: ``real`` and ``fake`` hold the images' features already, ``(N, D)``
            each (``extract``'s: each process extracts its share of a validation's real
            and generated images, process 0 measures them gathered), not images.

    Returns:
        ``{"fid<s>", "kid<s>", "kid_std<s>": float}`` with ``<s>`` empty for Inception and
        ``_<name>`` (``_classifier``) otherwise. KID averages ``KID_SUBSETS`` subsets of
        ``min(KID_SUBSET_SIZE, N)`` images. All NaN when an image's features are not
        finite (a generator that diverged to NaN or infinity).

    Raises:
        UserError: fewer than 2 images on a side.
    """
    from torchmetrics.image.fid import FrechetInceptionDistance
    from torchmetrics.image.kid import KernelInceptionDistance

    if len(real) < 2 or len(fake) < 2:
        raise UserError(f"FID needs at least 2 images on each side, got {len(real)} real and "
                        f"{len(fake)} generated")
    device = next(features.parameters()).device
    # sync_on_compute off: under torchrun one process measures (tasks.GANEvaluation) and
    # torchmetrics would otherwise wait in compute() for the others to gather theirs
    fid = FrechetInceptionDistance(feature=_Given(features.num_features),
                                   sync_on_compute=False).to(device)
    subset = min(KID_SUBSET_SIZE, len(real), len(fake))
    with warnings.catch_warnings():  # "will save all extracted features": that is KID
        warnings.filterwarnings("ignore", message=".*save all extracted features")
        kid = KernelInceptionDistance(feature=_Given(features.num_features),
                                      subsets=KID_SUBSETS, subset_size=subset,
                                      sync_on_compute=False).to(device)
    finite = True
    for images, is_real in ((real, True), (fake, False)):
        for batch in images.split(batch_size):  # (features already: taken as they are)
            f = batch.to(device).double() if extracted else features(batch.to(device)).double()
            finite = finite and bool(torch.isfinite(f).all())
            fid.update(f, real=is_real)
            kid.update(f, real=is_real)
    suffix = "" if features.name == "inception" else f"_{features.name}"
    if not finite:  # a diverged generator: LAPACK's eigvals would crash the process on NaN
        return {f"fid{suffix}": math.nan, f"kid{suffix}": math.nan,
                f"kid_std{suffix}": math.nan}
    with torch.random.fork_rng(devices=[]):  # KID's subsets: seeded, global RNG untouched
        torch.default_generator.manual_seed(seed)  # (the CPU's, which they draw from:
        # torch.manual_seed would re-seed every CUDA generator, which the fork does not
        # restore; the CUDA review's L1)
        kid_mean, kid_std = kid.compute()
    return {f"fid{suffix}": float(fid.compute()), f"kid{suffix}": float(kid_mean),
            f"kid_std{suffix}": float(kid_std)}


@torch.no_grad()
def extract(features, images, batch_size=256):
    """The features of images in [-1, 1], batch by batch as ``measure`` computes them:
    ``(N, D)`` float64 on the CPU (what a process sends to the one that measures:
    ``measure(..., extracted=True)``); ``(0, D)`` for no image."""
    device = next(features.parameters()).device
    found = [features(batch.to(device)).double().cpu() for batch in images.split(batch_size)
             if len(batch)]
    return torch.cat(found) if found else \
        torch.zeros(0, features.num_features, dtype=torch.float64)


@torch.no_grad()
def generate(generator, latents, batch_size=256):
    """The generator's images for ``latents``, in eval mode (BatchNorm's running
    statistics: the image of a latent does not depend on its batch), in batches.

    Args:
        generator: G.
        latents: ``(n, latent_dim)``, on any device (moved to G's).
        batch_size: latents per forward pass.

    Returns:
        Images ``(n, C, H, W)`` in [-1, 1], float32, on G's device. G's training mode is
        put back afterwards.
    """
    device = next(generator.parameters()).device
    was_training = generator.training
    generator.eval()
    try:
        out = [generator(z.to(device)).float() for z in latents.split(batch_size)]
    finally:
        generator.train(was_training)
    return torch.cat(out)


def to_uint8(images):
    """Images in [-1, 1] as uint8 in [0, 255]: ``round((x + 1) * 127.5)``, clamped."""
    return ((images.float() + 1) * 127.5).round_().clamp_(0, 255).to(torch.uint8)


def generator_scores(generator, real, features, n, seed, batch_size=256):
    """FID and KID of ``n`` images of ``generator`` from the fixed latents of ``seed``
    (``dcgan.fixed_latents``) against the first ``n`` real images.

    Args:
        generator: G (sampled in eval mode; its mode is put back).
        real: real images in [-1, 1]: a tensor or an iterable of batches (a DataLoader
            of ``(images, labels)`` too).
        features: the feature extractor (``build_features``).
        n: images on each side (--fid-samples).
        seed: the latents' and KID's seed.
        batch_size: images per forward pass.

    Returns:
        ``measure``'s dict.

    Raises:
        UserError: fewer than ``n`` real images.
    """
    real = _take(real, n)
    if len(real) < n:
        raise UserError(f"--fid-samples {n}: there are only {len(real)} real images")
    latents = dcgan.fixed_latents(n, generator.latent_dim, seed)
    fake = generate(generator, latents, batch_size)
    return measure(features, real.float(), fake, seed, batch_size)

"""Losses as nn.Modules, and ``build_criterion`` used by train.py.

Besides the classification criterion: the perceptual loss, the GAN losses and the
WGAN-GP gradient penalty for image-to-image and generative models.
"""

import contextlib
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torchvision.models import VGG19_Weights
from torchvision.models.vgg import cfgs, make_layers

from ops import UserError, first_sentence


def build_criterion(config):
    """Builds the training criterion from the resolved config.

    Args:
        config: a mapping with ``label_smoothing`` (float in [0, 1)).

    Returns:
        ``nn.CrossEntropyLoss`` with that label smoothing, mean over the batch.
    """
    return nn.CrossEntropyLoss(label_smoothing=float(config["label_smoothing"]))


# torchvision's ImageNet statistics: the pretrained VGG saw inputs normalised with them.
_IMAGENET_MEAN = (0.485, 0.456, 0.406)
_IMAGENET_STD = (0.229, 0.224, 0.225)


def _vgg19_layer_names(features):
    """Names the layers of VGG19's ``features`` as in the papers: conv1_1, relu1_1, pool1..."""
    names, block, index = [], 1, 0
    for m in features:
        if isinstance(m, nn.Conv2d):
            index += 1
            names.append(f"conv{block}_{index}")
        elif isinstance(m, nn.ReLU):
            names.append(f"relu{block}_{index}")
        else:
            names.append(f"pool{block}")
            block += 1
            index = 0
    return names


def _load_vgg19_state(weights, download):
    """Returns the VGG19 state_dict named by ``weights``: "imagenet" or a file path.

    Downloads only when ``download`` is true, so an offline run fails at once and clearly.
    """
    if weights == "imagenet":
        url = VGG19_Weights.IMAGENET1K_V1.url
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(urlparse(url).path).name
        if not cached.exists() and not download:
            raise UserError(
                f"PerceptualLoss: the VGG19 ImageNet weights are not in the torch hub cache "
                f"({cached}); pass weights=PATH to a local VGG19 state_dict file, weights=None "
                f"for random weights, or download=True with internet access")
        had_copy = cached.exists()
        try:
            return torch.hub.load_state_dict_from_url(url, progress=False, check_hash=True,
                                                      weights_only=True)
        except Exception as e:
            if had_copy:  # torch.hub loads a copy it finds without checking its hash
                raise UserError(
                    f"PerceptualLoss: the VGG19 ImageNet weights in {cached} cannot be loaded "
                    f"(damaged or unsafe: {first_sentence(e) or type(e).__name__}): delete "
                    f"the file and put it there again") from None
            if not isinstance(e, OSError):  # URLError, HTTPError: offline, proxy, 404
                raise
            raise UserError(
                f"PerceptualLoss: cannot download the VGG19 ImageNet weights from {url} ({e}); "
                f"pass weights=PATH to a local VGG19 state_dict file or weights=None") from e
    path = Path(weights)
    if not path.is_file():
        raise UserError(f"PerceptualLoss: weights {str(weights)!r} is neither 'imagenet', "
                        f"None, nor an existing file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # torch.load raises several types for a bad or unsafe file
        raise UserError(f"PerceptualLoss: cannot load weights from {path} (damaged or "
                        f"unsafe: {first_sentence(e) or type(e).__name__})") from None


class PerceptualLoss(nn.Module):
    """Perceptual (feature reconstruction) loss of Johnson et al. (2016) on VGG19 features.

    Both images are normalised with ImageNet's mean and std and passed through the
    convolutional part of VGG19 (Simonyan & Zisserman, 2015) up to the deepest requested
    layer; the loss is ``sum_i layer_weights[i] * distance(phi_i(input), phi_i(target))``
    with distance the mean L1 or squared error. The VGG is frozen: its parameters do not
    require grad and it stays in eval mode even after the parent calls ``.train()``. The
    target is treated as a constant (no gradient flows into it).

    Args:
        layers: VGG19 layer names where features are compared, e.g. ``relu2_2``; names are
            ``conv{block}_{i}``, ``relu{block}_{i}`` and ``pool{block}``, blocks 1-5.
        weights: ``"imagenet"`` for torchvision's ``VGG19_Weights.IMAGENET1K_V1``, used
            only if already in the torch hub cache (see ``download``); a path to a local
            state_dict file of ``vgg19`` or of its ``features``, loaded with
            ``torch.load(weights_only=True)``; or None for random weights (for tests).
        layer_weights: one weight per entry of ``layers``; default all 1.
        criterion: ``"l1"`` or ``"mse"``.
        download: with ``weights="imagenet"``, fetch the file if it is not cached.

    Returns:
        A module whose ``forward(input, target)`` takes two ``(N, 3, H, W)`` tensors with
        values in [0, 1] and returns a scalar tensor.

    Raises:
        UserError: the weights are not available (not cached, download impossible,
            missing or unreadable file, wrong keys or shapes).
        ValueError: unknown or repeated layer name, mismatched ``layer_weights``, unknown
            criterion.
    """

    def __init__(self, layers=("relu1_2", "relu2_2", "relu3_4", "relu4_4"), weights="imagenet",
                 layer_weights=None, criterion="l1", download=False):
        super().__init__()
        # vgg19() would also build its 120M-parameter classifier; make_layers with config
        # "E" is exactly how torchvision builds vgg19().features, same state_dict keys.
        features = make_layers(cfgs["E"], batch_norm=False)
        names = _vgg19_layer_names(features)
        layers = list(layers)
        unknown = [name for name in layers if name not in names]
        if unknown or not layers or len(set(layers)) != len(layers):
            raise ValueError(f"layers must be distinct VGG19 layer names, got {layers}; "
                             f"known names: {', '.join(names)}")
        if layer_weights is None:
            layer_weights = [1.0] * len(layers)
        if len(layer_weights) != len(layers):
            raise ValueError(f"layer_weights has {len(layer_weights)} entries for "
                             f"{len(layers)} layers")
        if criterion not in ("l1", "mse"):
            raise ValueError(f"criterion must be 'l1' or 'mse', not {criterion!r}")
        self.distance = F.l1_loss if criterion == "l1" else F.mse_loss

        order = sorted(range(len(layers)), key=lambda i: names.index(layers[i]))
        self.layer_names = [layers[i] for i in order]  # in network order
        self.layer_weights = [float(layer_weights[i]) for i in order]
        last = names.index(self.layer_names[-1])
        features = features[:last + 1]  # nothing deeper than the last compared layer
        for m in features:
            if isinstance(m, nn.ReLU):
                m.inplace = False  # an in-place ReLU would overwrite a compared conv output
        self._init_features(features, weights, download)

        self.slices = nn.ModuleList()
        start = 0
        for name in self.layer_names:
            end = names.index(name) + 1
            self.slices.append(features[start:end])
            start = end
        self.slices.requires_grad_(False)
        self.slices.eval()
        self.register_buffer("mean", torch.tensor(_IMAGENET_MEAN).view(1, 3, 1, 1),
                             persistent=False)
        self.register_buffer("std", torch.tensor(_IMAGENET_STD).view(1, 3, 1, 1),
                             persistent=False)

    @staticmethod
    def _init_features(features, weights, download):
        if weights is None:
            for m in features:  # the random init vgg19() uses
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                    nn.init.zeros_(m.bias)
            return
        state = _load_vgg19_state(weights, download)
        if not isinstance(state, dict):
            raise UserError(f"PerceptualLoss: weights {str(weights)!r} hold a "
                            f"{type(state).__name__}, not a state_dict")
        # Accept a whole vgg19 state_dict ("features.0.weight") or its features' ("0.weight").
        wanted = features.state_dict().keys()
        picked = {k: state.get(f"features.{k}", state.get(k)) for k in wanted}
        missing = [k for k, v in picked.items() if v is None]
        if missing:
            raise UserError(f"PerceptualLoss: weights {str(weights)!r} lack VGG19 keys "
                            f"{', '.join(missing[:4])}")
        try:
            features.load_state_dict(picked)
        except RuntimeError as e:
            raise UserError(f"PerceptualLoss: weights {str(weights)!r} do not fit VGG19: "
                            f"{e}") from e

    def train(self, mode=True):
        """Sets training mode for the module but keeps the frozen VGG in eval mode."""
        super().train(mode)
        self.slices.eval()
        return self

    def forward(self, input, target):
        if input.shape[1] != 3 or input.shape != target.shape:
            raise ValueError(f"PerceptualLoss needs two (N, 3, H, W) tensors of one shape, "
                             f"got {tuple(input.shape)} and {tuple(target.shape)}")
        with torch.no_grad():
            y = (target - self.mean) / self.std
            target_features = []
            for block in self.slices:
                y = block(y)
                target_features.append(y)
        x = (input - self.mean) / self.std
        loss = input.new_zeros(())
        for block, weight, y in zip(self.slices, self.layer_weights, target_features,
                                    strict=True):
            x = block(x)  # (N, C_i, H_i, W_i)
            loss = loss + weight * self.distance(x, y)
        return loss


class GANLoss(nn.Module):
    """The adversarial losses of the common GAN formulations, on raw discriminator outputs.

    ``vanilla``: binary cross-entropy with logits against 1 (real) or 0 (fake)
    (Goodfellow et al., 2014; called with real targets on fakes it is the non-saturating
    generator loss). ``lsgan``: mean squared error to 1 or 0 (Mao et al., 2017).
    ``hinge``: ``mean(relu(1 - x))`` for real and ``mean(relu(1 + x))`` for fake (Lim &
    Ye, 2017; Miyato et al., 2018); the generator's hinge loss is ``-mean(x)``, given with
    ``for_discriminator=False``. ``wgan``: ``-mean(x)`` for real and ``mean(x)`` for fake
    (Arjovsky et al., 2017), usually with ``gradient_penalty``. Discriminator step:
    ``loss(D(real), True) + loss(D(fake.detach()), False)``; generator step:
    ``loss(D(fake), True, for_discriminator=False)``.

    Args:
        mode: ``"vanilla"``, ``"lsgan"``, ``"hinge"`` or ``"wgan"``.

    Returns:
        A module whose ``forward(prediction, target_is_real, for_discriminator=True)``
        returns the scalar loss, averaged over every element of ``prediction``.

    Raises:
        ValueError: unknown mode (the message names the modes).
    """

    MODES = ("vanilla", "lsgan", "hinge", "wgan")

    def __init__(self, mode="vanilla"):
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"unknown GAN loss mode {mode!r}; choose one of "
                             f"{', '.join(self.MODES)}")
        self.mode = mode

    def forward(self, prediction, target_is_real, for_discriminator=True):
        if self.mode in ("vanilla", "lsgan"):
            target = torch.full_like(prediction, 1.0 if target_is_real else 0.0)
            if self.mode == "vanilla":
                return F.binary_cross_entropy_with_logits(prediction, target)
            return F.mse_loss(prediction, target)
        if self.mode == "hinge" and for_discriminator:
            margin = 1.0 - prediction if target_is_real else 1.0 + prediction
            return F.relu(margin).mean()
        # wgan, and the hinge generator loss: the critic's score, raised for "real".
        return -prediction.mean() if target_is_real else prediction.mean()


def gradient_penalty(critic, real, fake, weight=10.0):
    """The WGAN-GP gradient penalty (Gulrajani et al., 2017).

    For each sample a point on the line between ``real`` and ``fake`` is drawn, with
    ``alpha = torch.rand(N, 1, ..., 1)`` from the global generator (seed it with
    ``torch.manual_seed`` for a repeatable draw), ``x = alpha * real + (1 - alpha) * fake``;
    the penalty is ``weight * mean((||grad_x critic(x)||_2 - 1) ** 2)``, with the gradient
    taken per sample over all its elements. The gradient is built with
    ``create_graph=True`` so the penalty back-propagates into the critic's parameters;
    ``real`` and ``fake`` are detached, so nothing reaches the generator. The critic must
    treat samples independently (no BatchNorm; the paper suggests LayerNorm). Under fp16
    autocast the penalty's pass through the critic runs in float32: its gradient with
    respect to the images is not scaled by the GradScaler, and would underflow in fp16.

    Args:
        critic: module mapping a batch shaped like ``real`` to scores, one or more per
            sample.
        real: a batch of real samples, ``(N, ...)``.
        fake: a batch of generated samples of the same shape.
        weight: the penalty coefficient lambda; the paper uses 10.

    Returns:
        A scalar tensor, differentiable with respect to the critic's parameters.
    """
    real, fake = real.detach(), fake.detach()
    shape = (real.shape[0],) + (1,) * (real.dim() - 1)
    alpha = torch.rand(shape, device=real.device, dtype=real.dtype)
    interpolate = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    device = real.device.type
    # Under fp16 autocast the gradient with respect to the images would be taken in fp16
    # without the GradScaler's scale (per pixel it is small: it underflows): in float32
    fp16 = torch.is_autocast_enabled(device) and \
        torch.get_autocast_dtype(device) == torch.float16
    with torch.autocast(device, enabled=False) if fp16 else contextlib.nullcontext():
        score = critic(interpolate.float() if fp16 else interpolate)
        (grad,) = torch.autograd.grad(score, interpolate, grad_outputs=torch.ones_like(score),
                                      create_graph=True)
        norm = grad.float().flatten(1).norm(2, dim=1)  # (N,)
        return weight * ((norm - 1) ** 2).mean()

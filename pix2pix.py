"""pix2pix (Isola et al., 2017, "Image-to-Image Translation with Conditional Adversarial
Networks"): a U-Net generator and a PatchGAN discriminator, their phase losses and the
picture of input | output | target. Following the styleguide, each finished model lives in
a file named after it, and the train and test scripts import it from here.

The networks follow the paper and its reference implementation (junyanz/pytorch-CycleGAN-
and-pix2pix, ``unet_256`` and ``basic``): 4x4 convolutions of stride 2 (``layers.ConvBlock``
with ``padding=1``: the side exactly halves), LeakyReLU 0.2 on the way down, ReLU on the
way up, each decoder layer's output concatenated with its mirror encoder layer's (the skip
connections), tanh at the output (images in [-1, 1]); the encoder halves the side down to
1x1 (at most 8 times: 256 px), its first and innermost layers without normalisation. The
channels are ``width`` x 1, 2, 4, 8, 8, ... The decoder's layers of ``width * 8``
channels between the innermost and the four outer ones take dropout (0.5 in the paper; a
256 px U-Net has three). The discriminator (the 70x70 PatchGAN) takes the input and an
output or target image concatenated on channels and gives one raw score per patch:
C64-C128-C256-C512 (three of stride 2, one of stride 1), then a 1-channel convolution.

Normalisation: the paper's BatchNorm (at its batch of 1, an instance norm) makes a
sample's output depend on the others of its micro-batch, so accumulation and several
processes would not equal one large batch; the default here is InstanceNorm (per sample:
they do), ``batch`` and ``none`` are options. Dropout masks are not drawn from torch's
generator but hashed from each sample's key (``sample_keys``: seed, epoch and the sample's
place in the epoch) and the layer, so the discriminator's phase and the generator's see
the same generated image, and a step split into micro-batches or processes drops what the
large batch drops. Weights start from N(0, 0.02) (``ops.init_weights``, the paper's).
"""

import torch
import torch.nn as nn
import torch.nn.functional as F

import losses
from layers import ConvBlock
from ops import init_weights

NORMS = ("instance", "batch", "none")
GAN_LOSSES = ("vanilla", "lsgan")
MAX_DOWNS = 8       # the encoder halves the side at most this often (256 px: to 1x1)
MIN_DOWNS = 5       # ... and at least this often (32 px), for the PatchGAN's 3 halvings
PATCH_LAYERS = 3    # the 70x70 PatchGAN's stride-2 layers


def _norm(kind):
    """A ``norm_layer(channels)`` for ``kind``, or None (no normalisation)."""
    if kind == "batch":
        return nn.BatchNorm2d
    if kind == "instance":  # the reference's: no affine parameters, no running statistics
        return lambda c: nn.InstanceNorm2d(c, affine=False, track_running_stats=False)
    if kind == "none":
        return None
    raise ValueError(f"unknown norm {kind!r}; choose one of {', '.join(NORMS)}")


def downs(image_size):
    """How many times the U-Net halves ``image_size``: as often as the side divides by 2,
    at most ``MAX_DOWNS``.

    Raises:
        ValueError: a side that halves fewer than ``MIN_DOWNS`` times (not a multiple of
            32).
    """
    n, side = 0, image_size
    while side % 2 == 0 and n < MAX_DOWNS:
        side, n = side // 2, n + 1
    if n < MIN_DOWNS:
        raise ValueError(f"pix2pix's --image-size must be a multiple of {2 ** MIN_DOWNS} "
                         f"(got {image_size}): the U-Net halves it {MIN_DOWNS} times or more")
    return n


# -------------------------------------------------------------- hashed dropout masks

_MASK32 = 0xFFFFFFFF


def _mix32(x):
    """lowbias32 (Chris Wellons' hash prospector) on int64 tensors of 32-bit values, in
    16-bit halves of each multiplier, so no product leaves int64 (the hash the data path
    draws its crops with, spelled here: model files import no package)."""
    def mul(v, c):
        return (v * (c & 0xFFFF) + (((v * (c >> 16)) & 0xFFFF) << 16)) & _MASK32
    x = x ^ (x >> 16)
    x = mul(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = mul(x, 0x846CA68B)
    return x ^ (x >> 16)


def sample_keys(seed, epoch, positions):
    """The dropout key of each sample: a 32-bit hash of (seed, epoch, its position in the
    epoch's order), an int64 tensor like ``positions``."""
    base = _mix32(torch.tensor(seed & _MASK32) ^ _mix32(torch.tensor(epoch & _MASK32)))
    return _mix32(base.to(positions.device) ^ (positions & _MASK32))


def hashed_dropout(x, keys, layer, p):
    """Dropout of ``x`` (N, ...) at rate ``p`` whose mask is a function of each sample's
    key, the layer and the element alone (never torch's generator); kept elements are
    scaled by ``1 / (1 - p)``, as ``F.dropout`` does."""
    n = x.shape[0]
    element = torch.arange(x[0].numel(), device=x.device, dtype=torch.int64)
    salted = _mix32(keys.to(x.device).view(n, 1) ^ (layer * 0x9E3779B9 & _MASK32))
    draw = _mix32(salted ^ element)  # (N, elements): uniform 32-bit
    keep = (draw >= int(p * 2 ** 32)).view_as(x)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - p))


# ------------------------------------------------------------------------- networks

class UNetGenerator(nn.Module):
    """The pix2pix U-Net: an image in, an image in [-1, 1] out, of the input's side.

    Args:
        in_channels: channels of the input images.
        out_channels: channels of the output (target) images.
        image_size: the side of the square images (a multiple of 32; ``downs``).
        width: the paper's ngf, channels of the first encoder layer.
        norm: ``instance`` (default), ``batch`` or ``none``.
        dropout: the rate of the inner decoder layers' dropout (0: none).

    ``forward(x, keys=None)``: ``keys`` are the samples' dropout keys (``sample_keys``),
    from which training mode's masks are hashed; without them dropout draws from torch's
    generator (``F.dropout``), as anywhere; eval mode drops nothing.
    """

    def __init__(self, in_channels, out_channels, image_size, width=64, norm="instance",
                 dropout=0.5):
        super().__init__()
        depth = downs(image_size)
        norm_layer = _norm(norm)
        bias = norm != "batch"  # a BatchNorm's shift makes a bias redundant
        chans = [width * min(2 ** i, 8) for i in range(depth)]
        self.in_channels, self.out_channels, self.image_size = in_channels, out_channels, \
            image_size
        self.dropout = dropout
        self.down = nn.ModuleList()
        for i in range(depth):
            inner = i in (0, depth - 1)  # the outermost and innermost: no normalisation
            self.down.append(ConvBlock(in_channels if i == 0 else chans[i - 1], chans[i], 4, 2,
                                       norm_layer=None if inner else norm_layer,
                                       activation=None, use_bias=bias or inner, padding=1))
        self.up = nn.ModuleList()  # innermost first
        self.dropped = []  # the decoder layers that take dropout, by index in ``up``
        for j, i in enumerate(range(depth - 1, 0, -1)):  # up[j] makes encoder i-1's side
            c_in = chans[i] if j == 0 else 2 * chans[i]
            layers = [nn.ConvTranspose2d(c_in, chans[i - 1], 4, 2, 1, bias=bias)]
            if norm_layer is not None:
                layers.append(norm_layer(chans[i - 1]))
            self.up.append(nn.Sequential(*layers))
            if j > 0 and i >= 4:  # the reference's: between the innermost and the four
                self.dropped.append(j)  # outer layers (width * 8 channels; 256 px: three)
        self.out = nn.ConvTranspose2d(2 * chans[0], out_channels, 4, 2, 1)
        init_weights(self, "normal", 0.02)

    def forward(self, x, keys=None):
        skips, h = [], x
        for i, block in enumerate(self.down):
            h = block(h if i == 0 else F.leaky_relu(h, 0.2))
            skips.append(h)
        drop = self.training and self.dropout > 0
        for j, block in enumerate(self.up):
            h = block(F.relu(h if j == 0 else torch.cat([h, skips[-1 - j]], 1)))
            if drop and j in self.dropped:
                h = F.dropout(h, self.dropout) if keys is None else \
                    hashed_dropout(h, keys, j, self.dropout)
        return torch.tanh(self.out(F.relu(torch.cat([h, skips[0]], 1))))


class PatchDiscriminator(nn.Module):
    """The 70x70 PatchGAN: an input and an output (or target) image, concatenated on
    channels, in; one raw score (a logit) per patch out.

    Args:
        channels: channels of the concatenation (input's + target's).
        width: the paper's ndf, channels of the first layer.
        norm: ``instance`` (default), ``batch`` or ``none``; never on the first layer.

    Returns:
        A module mapping ``(N, channels, H, W)`` to scores ``(N, 1, H / 8 - 2, W / 8 - 2)``.
    """

    def __init__(self, channels, width=64, norm="instance"):
        super().__init__()
        norm_layer, bias = _norm(norm), norm != "batch"

        def leaky():
            return nn.LeakyReLU(0.2, True)

        layers, c_in = [], channels
        for i in range(PATCH_LAYERS + 1):  # three of stride 2, then one of stride 1
            c = width * min(2 ** i, 8)
            layers.append(ConvBlock(c_in, c, 4, 2 if i < PATCH_LAYERS else 1,
                                    norm_layer=None if i == 0 else norm_layer,
                                    activation=leaky, use_bias=bias or i == 0, padding=1))
            c_in = c
        layers.append(nn.Conv2d(c_in, 1, 4, 1, 1))
        self.main = nn.Sequential(*layers)
        init_weights(self, "normal", 0.02)

    def forward(self, pair):
        return self.main(pair)


def build(config, in_channels, out_channels):
    """The generator and discriminator a run's config asks for (``image_size``, and
    ``pix2pix_width``, ``pix2pix_norm``, ``pix2pix_dropout`` with their defaults when
    absent)."""
    width = config.get("pix2pix_width") or 64
    norm = config.get("pix2pix_norm") or "instance"
    dropout = config.get("pix2pix_dropout", 0.5)
    generator = UNetGenerator(in_channels, out_channels, config["image_size"], width, norm,
                              dropout)
    return generator, PatchDiscriminator(in_channels + out_channels, width, norm)


def networks(config, in_channels, out_channels):
    """``build``'s pair as one model of named networks (``nn.ModuleDict``)."""
    generator, discriminator = build(config, in_channels, out_channels)
    return nn.ModuleDict({"generator": generator, "discriminator": discriminator})


class StepFlops(nn.Module):
    """The work of one training step per sample, as one forward pass whose backward counts
    (``ops.train_flops_per_sample``): G on the input, D on (input, target) and on (input,
    output) detached, then D on (input, output) again, back-propagated into G. The
    target's place is taken by the output (the same shape)."""

    def __init__(self, generator, discriminator):
        super().__init__()
        self.generator, self.discriminator = generator, discriminator

    def forward(self, x):
        fake = self.generator(x, torch.zeros(len(x), dtype=torch.int64, device=x.device))
        d = self.discriminator
        detached = torch.cat([x, fake.detach()], 1)
        return d(detached).sum() * 2 + d(torch.cat([x, fake], 1)).sum()


# --------------------------------------------------------------------------- losses

def discriminator_loss(discriminator, x, target, fake, criterion):
    """The paper's discriminator loss: ``(loss(D(x, y), real) + loss(D(x, G(x)), fake))
    / 2`` (halved: D learns slower than G), ``fake`` detached.

    Returns:
        ``(loss, figures)``: the float32 loss, and detached ``loss_d``, ``d_real`` and
        ``d_fake`` (vanilla: D's mean probability of "real", the sigmoid of its logits;
        lsgan: its mean output).
    """
    real_scores = discriminator(torch.cat([x, target], 1)).float()
    fake_scores = discriminator(torch.cat([x, fake.detach()], 1)).float()
    loss = (criterion(real_scores, True) + criterion(fake_scores, False)) * 0.5
    shown = torch.sigmoid if criterion.mode == "vanilla" else (lambda s: s)
    return loss, {"loss_d": loss.detach(), "d_real": shown(real_scores.detach()).mean(),
                  "d_fake": shown(fake_scores.detach()).mean()}


def generator_loss(discriminator, x, target, fake, criterion, l1_weight, perceptual=None,
                   perceptual_weight=0.0):
    """The generator's loss: ``loss(D(x, G(x)), real) + l1_weight * |G(x) - y|_1``
    (+ ``perceptual_weight`` x the perceptual loss of the two in [0, 1]).

    Returns:
        ``(loss, figures)``: the float32 loss, and detached ``loss_g`` (the whole),
        ``loss_gan``, ``loss_l1`` (the mean absolute error in [-1, 1], unweighted) and,
        with a perceptual loss, ``loss_perceptual`` (unweighted).
    """
    fake32, target32 = fake.float(), target.float()
    gan = criterion(discriminator(torch.cat([x, fake], 1)).float(), True)
    l1 = F.l1_loss(fake32, target32)
    loss = gan + l1_weight * l1
    figures = {"loss_gan": gan.detach(), "loss_l1": l1.detach()}
    if perceptual is not None and perceptual_weight:
        p = perceptual((fake32 + 1) / 2, (target32 + 1) / 2)
        loss = loss + perceptual_weight * p
        figures["loss_perceptual"] = p.detach()
    figures["loss_g"] = loss.detach()
    return loss, figures


def criterion(kind):
    """``losses.GANLoss`` for ``--pix2pix-gan-loss``: vanilla (BCE) or lsgan."""
    if kind not in GAN_LOSSES:
        raise ValueError(f"unknown pix2pix GAN loss {kind!r}; choose one of "
                         f"{', '.join(GAN_LOSSES)}")
    return losses.GANLoss(kind)


# ------------------------------------------------------------------------- pictures

def to_uint8(images):
    """Images in [-1, 1] as uint8 in [0, 255]: ``round((x + 1) * 127.5)``, clamped."""
    return ((images.float() + 1) * 127.5).round_().clamp_(0, 255).to(torch.uint8)


def triptych(inputs, outputs, targets, padding=2):
    """A picture of a few samples, one row each: input | output | target, for TensorBoard.

    Args:
        inputs, outputs, targets: ``(N, C, H, W)`` in [-1, 1] (one channel is shown grey).

    Returns:
        An ``(H', W', 3)`` uint8 array.
    """
    from torchvision.utils import make_grid

    def rgb(images):
        images = to_uint8(images.detach().cpu())
        return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images[:, :3]

    rows = torch.stack([rgb(inputs), rgb(outputs), rgb(targets)], dim=1)  # (N, 3, 3, H, W)
    grid = make_grid(rows.flatten(0, 1), nrow=3, padding=padding, pad_value=128)
    return grid.permute(1, 2, 0).contiguous().numpy()

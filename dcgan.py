"""DCGAN (Radford et al., 2016): a generator and a discriminator, their losses per phase,
the fixed latents (their images and grid: gan_metrics.py's ``generate``,
tasks/_generative.py's ``sample_grid``).

The styleguide's rule: a finished model (one or more networks) lives in a file named
after it, and the train and test scripts import it from here.

The networks follow the paper: the generator projects the latent vector to a small map
and doubles its side with fractionally-strided (transposed) 5x5 convolutions, BatchNorm
and ReLU, tanh at the output (images in [-1, 1]); the discriminator mirrors it with strided
5x5 convolutions and LeakyReLU 0.2, no BatchNorm on its first layer, one raw score per
image at the end. Weights start from N(0, 0.02) (``ops.init_weights``, the paper's and
the PyTorch examples' init). Options from the styleguide's blocks: a SAGAN self-attention
block (``layers.SelfAttention``) at the middle resolution of each network, and spectral
normalisation (``layers.spectral_norm``, Miyato et al. 2018) of every discriminator layer,
which then has no BatchNorm. Image sides 28 (MNIST: 7 -> 14 -> 28), 32 (CIFAR-10:
4 -> 8 -> 16 -> 32) and 64 (4 -> ... -> 64).
"""

import torch
import torch.nn as nn

import losses
from layers import ConvBlock, SelfAttention, spectral_norm
from ops import init_weights

IMAGE_SIZES = (28, 32, 64)
GAN_LOSSES = ("vanilla", "lsgan", "hinge", "wgan-gp")
_LOSS_MODES = {"vanilla": "vanilla", "lsgan": "lsgan", "hinge": "hinge", "wgan-gp": "wgan"}


def _plan(image_size):
    """``(first side, doublings)``: 28 starts at 7 (two doublings), 32 and 64 at 4."""
    if image_size not in IMAGE_SIZES:
        raise ValueError(f"DCGAN image size must be one of {', '.join(map(str, IMAGE_SIZES))}, "
                         f"not {image_size}")
    first = 7 if image_size == 28 else 4
    return first, (image_size // first).bit_length() - 1


def _leaky():
    return nn.LeakyReLU(0.2)


class Generator(nn.Module):
    """The DCGAN generator: latent vector in, image in [-1, 1] out.

    Channels halve as the side doubles, from ``width * 2 ** (doublings - 1)`` at the first
    map to ``width`` before the output layer (64 px: 512, 256, 128, 64 for width 64).

    Args:
        latent_dim: length of the latent vector z.
        channels: channels of the images (1 for MNIST, 3 for CIFAR-10).
        image_size: side of the square images: 28, 32 or 64.
        attention: a ``layers.SelfAttention`` block after the map of side
            ``image_size // 4`` (SAGAN; 7, 8 or 16).
        width: the paper's ngf, channels of the last hidden map.
        batch_norm: BatchNorm after each hidden layer (the paper's); without it the
            layers have biases and each image is made on its own.

    Returns:
        A module mapping z of shape ``(N, latent_dim)`` (or ``(N, latent_dim, 1, 1)``) to
        images ``(N, channels, image_size, image_size)`` in [-1, 1].
    """

    def __init__(self, latent_dim, channels, image_size, attention=False, width=64,
                 batch_norm=True):
        super().__init__()
        first, doublings = _plan(image_size)
        norm = nn.BatchNorm2d if batch_norm else (lambda c: nn.Identity())
        self.latent_dim, self.channels, self.image_size = latent_dim, channels, image_size
        c = width * 2 ** (doublings - 1)
        # The paper's "project and reshape": a transposed conv over the 1x1 latent map is
        # a linear layer to (c, first, first).
        layers = [nn.ConvTranspose2d(latent_dim, c, first, 1, 0, bias=not batch_norm),
                  norm(c), nn.ReLU(True)]
        side = first
        for i in range(doublings):
            if attention and side == image_size // 4:
                layers.append(SelfAttention(c))
            last = i == doublings - 1
            out = channels if last else c // 2
            # 5x5, stride 2, padding 2, output padding 1: the side exactly doubles
            layers.append(nn.ConvTranspose2d(c, out, 5, 2, 2, output_padding=1,
                                             bias=last or not batch_norm))
            layers += [nn.Tanh()] if last else [norm(out), nn.ReLU(True)]
            c, side = out, side * 2
        self.main = nn.Sequential(*layers)
        init_weights(self, "normal", 0.02)

    def forward(self, z):
        z = z.view(z.shape[0], self.latent_dim, 1, 1)  # (N, latent, 1, 1)
        return self.main(z)  # (N, channels, image_size, image_size)


class Discriminator(nn.Module):
    """The DCGAN discriminator: image in, one raw score (a logit) per image out.

    Strided 5x5 ``ConvBlock``s halve the side down to the generator's first map, with
    LeakyReLU 0.2; BatchNorm after every one but the first (the paper), unless
    ``batch_norm`` is off or ``spectral`` is on. A last convolution over the whole small
    map gives the score; no sigmoid (the losses take logits).

    Args:
        channels: channels of the images.
        image_size: side of the square images: 28, 32 or 64.
        spectral: spectral normalisation of every convolution (the attention block's
            too), and no BatchNorm.
        attention: a ``layers.SelfAttention`` block after the map of side
            ``image_size // 4``.
        batch_norm: BatchNorm in the hidden layers; off for a WGAN-GP critic, whose
            gradient penalty needs samples treated independently.
        width: the paper's ndf, channels of the first map.

    Returns:
        A module mapping images ``(N, channels, image_size, image_size)`` to scores ``(N,)``.
    """

    def __init__(self, channels, image_size, spectral=False, attention=False,
                 batch_norm=True, width=64):
        super().__init__()
        first, doublings = _plan(image_size)
        norm = nn.BatchNorm2d if batch_norm and not spectral else None
        layers, c_in, c, side = [], channels, width, image_size
        for i in range(doublings):
            layers.append(ConvBlock(c_in, c, 5, 2, norm_layer=None if i == 0 else norm,
                                    activation=_leaky))
            side //= 2
            if attention and side == image_size // 4:
                layers.append(SelfAttention(c))
            c_in, c = c, c * 2
        layers.append(nn.Conv2d(c_in, 1, first, 1, 0))  # (N, 1, 1, 1)
        self.main = nn.Sequential(*layers)
        init_weights(self, "normal", 0.02)
        if spectral:  # after the init: the power iteration starts from the final weights
            spectral_norm(self.main)

    def forward(self, x):
        return self.main(x).flatten()  # (N,)


def build(config, channels):
    """The generator and discriminator a run's config asks for.

    Args:
        config: a dict with ``latent_dim`` (--latent-dim), ``image_size`` (--image-size),
            ``gan_loss`` (--gan-loss), and optionally ``gan_spectral_norm``
            (--gan-spectral-norm), ``gan_attention`` (--gan-attention), ``gan_width``
            (64 when absent) and ``gan_batch_norm`` (--gan-batch-norm, on when absent).
        channels: channels of the dataset's images.

    Returns:
        ``(generator, discriminator)``, on the CPU, in training mode. With ``gan_loss``
        ``wgan-gp`` the discriminator has no BatchNorm (the gradient penalty needs
        samples treated independently).
    """
    width = config.get("gan_width") or 64
    attention = bool(config.get("gan_attention", False))
    spectral = bool(config.get("gan_spectral_norm", False))
    batch_norm = bool(config.get("gan_batch_norm", True))
    generator = Generator(config["latent_dim"], channels, config["image_size"], attention,
                          width, batch_norm)
    discriminator = Discriminator(
        channels, config["image_size"], spectral, attention,
        batch_norm=batch_norm and config.get("gan_loss", "vanilla") != "wgan-gp", width=width)
    return generator, discriminator


def networks(config, channels):
    """``build``'s pair as one model of named networks (``nn.ModuleDict``): what train.py
    trains, saves by name (``generator``, ``discriminator``) and wraps network by network."""
    generator, discriminator = build(config, channels)
    return nn.ModuleDict({"generator": generator, "discriminator": discriminator})


class StepFlops(nn.Module):
    """The work of one training step per sample, as a forward pass whose backward counts
    (``ops.train_flops_per_sample``): the discriminator on real and generated images
    ``d_steps`` times (the generator's images of all but the last repeat made without
    gradients), then on the last repeat's images again, back-propagated into the
    generator (tasks.GAN's phases, a step of one micro-batch)."""

    def __init__(self, generator, discriminator, d_steps=1):
        super().__init__()
        self.generator, self.discriminator, self.d_steps = generator, discriminator, d_steps

    def forward(self, z):
        d, total = self.discriminator, 0
        for _ in range(self.d_steps - 1):
            with torch.no_grad():
                fake = self.generator(z)
            total = total + d(fake).sum() + d(fake).sum()  # (real images: as many, alike)
        fake = self.generator(z)
        total = total + d(fake.detach()).sum() + d(fake.detach()).sum()
        return total + d(fake).sum()


def _criterion(kind):
    if kind not in _LOSS_MODES:
        raise ValueError(f"unknown GAN loss {kind!r}; choose one of {', '.join(GAN_LOSSES)}")
    return losses.GANLoss(_LOSS_MODES[kind])


def _shown(scores, kind):
    """What a figure says of D's scores: the mean probability of "real" for vanilla (the
    sigmoid of the logits), the mean output for lsgan (regressed to 1 for real, 0 for fake:
    itself the probability-like value; a sigmoid of it would not be), the mean score for
    hinge and wgan-gp."""
    scores = scores.detach().float()
    return torch.sigmoid(scores).mean() if kind == "vanilla" else scores.mean()


def discriminator_loss(discriminator, real, fake, kind="vanilla", gp_weight=10.0):
    """The discriminator's (critic's) loss for one step.

    ``loss(D(real), real) + loss(D(fake), fake)`` with ``losses.GANLoss``; ``fake`` is
    detached (nothing reaches the generator). ``wgan-gp`` adds
    ``losses.gradient_penalty`` at ``gp_weight``; its interpolation draws from torch's
    global generator.

    Args:
        discriminator: D, images to one score per image.
        real: a batch of real images in [-1, 1].
        fake: a batch of generated images of the same shape.
        kind: ``vanilla``, ``lsgan``, ``hinge`` or ``wgan-gp`` (--gan-loss).
        gp_weight: the gradient penalty's weight (wgan-gp only).

    Returns:
        ``(loss, figures)``: the scalar float32 loss to back-propagate, and detached scalar
        tensors (no host read here): ``loss_d``; ``d_real`` and ``d_fake``, the mean
        probability D gives real and fake images for vanilla (sigmoid of the logits), its
        mean output for lsgan (trained towards 1 and 0), its mean score for hinge and
        wgan-gp; ``gradient_penalty`` with wgan-gp only.

    Raises:
        ValueError: unknown ``kind``, or wgan-gp with a discriminator holding BatchNorm.
    """
    criterion = _criterion(kind)
    # float32 scores: under bf16 autocast hinge's and WGAN's means would be bf16 (3 digits)
    real_scores = discriminator(real).float()  # (N,)
    fake_scores = discriminator(fake.detach()).float()  # (N,)
    loss = criterion(real_scores, True) + criterion(fake_scores, False)
    figures = {"d_real": _shown(real_scores, kind), "d_fake": _shown(fake_scores, kind)}
    if kind == "wgan-gp":
        if any(isinstance(m, nn.modules.batchnorm._BatchNorm)
               for m in discriminator.modules()):
            raise ValueError("wgan-gp needs a discriminator without BatchNorm: the gradient "
                             "penalty treats each sample on its own")
        penalty = losses.gradient_penalty(discriminator, real, fake, gp_weight)
        loss = loss + penalty
        figures["gradient_penalty"] = penalty.detach()
    figures["loss_d"] = loss.detach()
    return loss, figures


def generator_loss(discriminator, fake, kind="vanilla"):
    """The generator's loss for one step: D's verdict on ``fake`` (not detached).

    vanilla: the non-saturating ``BCE(D(G(z)), real)``; lsgan: ``(D(G(z)) - 1) ** 2``;
    hinge and wgan-gp: ``-mean(D(G(z)))``.

    Args:
        discriminator: D (its parameters get gradients too: the phase decides which
            optimizer steps).
        fake: generated images, attached to the generator's graph.
        kind: ``vanilla``, ``lsgan``, ``hinge`` or ``wgan-gp``.

    Returns:
        ``(loss, {"loss_g": detached loss})``, float32 (under autocast too).
    """
    loss = _criterion(kind)(discriminator(fake).float(), True, for_discriminator=False)
    return loss, {"loss_g": loss.detach()}


def fixed_latents(n, latent_dim, seed):
    """The fixed latent vectors of a run: the same for a seed on every machine and device.

    Drawn on the CPU from a ``torch.Generator`` seeded with ``seed`` alone (never the
    global generator, which training advances).

    Args:
        n: how many.
        latent_dim: length of each.
        seed: the seed.

    Returns:
        A float32 tensor ``(n, latent_dim)`` from N(0, 1), on the CPU.
    """
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, latent_dim, generator=g)

"""Whole networks, built from the blocks in layers.py, and ``build_network``.

``simple_cnn`` (the styleguide's example), ``resnet18`` (CIFAR variant), ``resnet9`` (the
DAWNBench fast recipe's network), ``mlp``; ``torchvision/<name>`` for any torchvision
classifier, ``timm/<name>`` for any timm model (``timm_network``). For segmentation:
``unet`` (small, for CPU runs and tests) and ``torchvision/<name>`` for torchvision's
segmentation networks (``fcn_resnet50``,
``deeplabv3_resnet50``, ``deeplabv3_mobilenet_v3_large``, ``lraspp_mobilenet_v3_large``...),
which return a dict ``{"out": logits, "aux": logits}`` (``"aux"`` where they have one).

Add a network: write an ``nn.Module`` here and register its builder with
``@register("name")``; ``--network name`` then trains it.
"""

import torch
import torch.nn as nn

from layers import BasicBlock, ConvBlock, checkpoint_forward

NETWORKS = {}
SEGMENTATION = set()  # the names in NETWORKS whose networks give per-pixel logits


def register(name, segmentation=False):
    """Decorator adding a builder ``fn(num_classes, in_channels, image_size)`` to NETWORKS;
    ``segmentation=True`` for a network that returns ``(N, num_classes, H, W)`` logits."""
    def add(fn):
        NETWORKS[name] = fn
        if segmentation:
            SEGMENTATION.add(name)
        return fn
    return add


class GradCheckpointing:
    """``set_grad_checkpointing`` for a network whose ``forward`` runs its blocks through
    ``self.run_block(module, x)``: while training with it on, a block's activations are
    recomputed in backward instead of kept (``layers.checkpoint_forward``)."""

    grad_checkpointing = False

    def set_grad_checkpointing(self, enable=True):
        self.grad_checkpointing = enable

    def run_block(self, module, x):
        if self.grad_checkpointing and self.training:
            return checkpoint_forward(module, x)
        return module(x)


class SimpleCNN(GradCheckpointing, nn.Module):
    """The pytorch-styleguide's CIFAR-10 example network: three strided ConvBlocks, a Linear.

    Its ``features`` and ``fc`` submodules carry the example's names, so freeze patterns
    such as ``features.*`` read the same.
    """

    def __init__(self, num_classes=10, in_channels=3, image_size=32):
        super().__init__()
        self.features = nn.Sequential(
            ConvBlock(in_channels, 32, 3, stride=2),  # 32 x H/2 x W/2
            ConvBlock(32, 64, 3, stride=2),           # 64 x H/4 x W/4
            ConvBlock(64, 128, 3, stride=2),          # 128 x H/8 x W/8
        )
        side = image_size
        for _ in range(3):
            side = (side + 1) // 2  # a stride-2 3x3 conv with padding 1 gives ceil(side / 2)
        self.fc = nn.Sequential(
            nn.Flatten(),
            nn.Linear(128 * side * side, num_classes),
        )

    def forward(self, x):
        for block in self.features:
            x = self.run_block(block, x)
        return self.fc(x)


class ResNet18(GradCheckpointing, nn.Module):
    """ResNet-18 for 32x32 images (He et al., 2016, CIFAR variant).

    A 3x3 stride-1 stem and no max-pool keep the resolution that small images need; four
    stages of two BasicBlocks (64, 128, 256, 512 channels), global average pool, Linear.
    """

    def __init__(self, num_classes=10, in_channels=3, image_size=32):
        super().__init__()
        self.stem = ConvBlock(in_channels, 64, 3, stride=1)
        blocks, channels = [], 64
        for width, stride in [(64, 1), (128, 2), (256, 2), (512, 2)]:
            blocks += [BasicBlock(channels, width, stride), BasicBlock(width, width, 1)]
            channels = width
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)

    def forward(self, x):
        x = self.stem(x)  # (N, 64, H, W)
        for block in self.blocks:
            x = self.run_block(block, x)
        x = self.pool(x).flatten(1)  # (N, 512)
        return self.fc(x)


class Residual(nn.Module):
    """``x + block(x)`` where the block is two conv-BN-ReLU ConvBlocks of the same width
    (ResNet-9's residual branch: ReLU after each BatchNorm, none after the sum)."""

    def __init__(self, channels):
        super().__init__()
        self.block = nn.Sequential(ConvBlock(channels, channels, 3),
                                   ConvBlock(channels, channels, 3))

    def forward(self, x):
        return x + self.block(x)


class ResNet9(GradCheckpointing, nn.Module):
    """ResNet-9, the DAWNBench CIFAR-10 network (Page, "How to train your ResNet", 2018;
    Myrtle.ai's 94% in 79 s entry).

    A conv-BN-ReLU prep layer (64 channels) at full resolution; three stages, each a
    conv-BN-ReLU that doubles the width (128, 256, 512) and a 2x2 max-pool, the first and
    the third followed by a residual block of two conv-BN-ReLU; a global max-pool and a
    bias-free Linear whose outputs are scaled by ``scale`` (0.125: small logits early in
    training, which lets the fast schedule use a high learning rate). 6.57 M parameters
    for 10 classes. Max-pools round up, so any image side works (32 -> 16 -> 8 -> 4).
    """

    def __init__(self, num_classes=10, in_channels=3, image_size=32, scale=0.125):
        super().__init__()
        self.prep = ConvBlock(in_channels, 64, 3)  # (N, 64, H, W)

        def stage(cin, cout, residual):
            layers = [ConvBlock(cin, cout, 3), nn.MaxPool2d(2, ceil_mode=True)]
            return nn.Sequential(*layers, *([Residual(cout)] if residual else []))

        self.stages = nn.Sequential(stage(64, 128, True),    # (N, 128, H/2, W/2)
                                    stage(128, 256, False),  # (N, 256, H/4, W/4)
                                    stage(256, 512, True))   # (N, 512, H/8, W/8)
        self.pool = nn.AdaptiveMaxPool2d(1)
        self.fc = nn.Linear(512, num_classes, bias=False)
        self.scale = scale

    def forward(self, x):
        x = self.prep(x)
        for stage in self.stages:
            x = self.run_block(stage, x)
        x = self.pool(x).flatten(1)  # (N, 512)
        return self.fc(x) * self.scale


class MLP(GradCheckpointing, nn.Module):
    """Flatten, Linear, ReLU, Linear: no BatchNorm, no dropout, so every sample is independent."""

    def __init__(self, num_classes=10, in_channels=3, image_size=32, hidden=512):
        super().__init__()
        self.flatten = nn.Flatten()
        self.hidden = nn.Sequential(nn.Linear(in_channels * image_size * image_size, hidden),
                                    nn.ReLU())
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x):
        x = self.flatten(x)  # (N, C*H*W)
        x = self.run_block(self.hidden, x)  # (N, hidden)
        return self.fc(x)


class UNet(GradCheckpointing, nn.Module):
    """A small U-Net (Ronneberger et al., 2015) for semantic segmentation.

    An encoder of ``depth`` stages, each two 3x3 ConvBlocks (conv, BatchNorm, ReLU) then a
    2x2 max-pool, with the width doubling from ``width``; a bottleneck of two ConvBlocks;
    a decoder that upsamples with a 2x2 transposed convolution (deterministic on CUDA,
    unlike bilinear interpolation's backward), concatenates the encoder's map of that
    scale and applies two ConvBlocks; a 1x1 convolution to the class logits. Any image
    side works: the pools round up, and an upsampled map one pixel longer than its skip
    (an odd side) loses its last row or column.
    About 118 k parameters at the defaults (width 16, depth 2, 21 classes). The encoder's
    stages are ``backbone`` as in torchvision's segmentation networks, so that
    ``--freeze 'backbone.*'`` freezes the encoder of either.

    Returns:
        ``(N, num_classes, H, W)`` logits at the input's size.
    """

    def __init__(self, num_classes=21, in_channels=3, image_size=None, width=16, depth=2,
                 norm_layer=nn.BatchNorm2d):
        super().__init__()

        def double(cin, cout):
            return nn.Sequential(ConvBlock(cin, cout, 3, norm_layer=norm_layer),
                                 ConvBlock(cout, cout, 3, norm_layer=norm_layer))

        widths = [width * 2 ** i for i in range(depth + 1)]  # e.g. 16, 32, 64
        self.backbone = nn.ModuleList()  # the encoder (torchvision's name: one --freeze)
        channels = in_channels
        for w in widths[:-1]:
            self.backbone.append(double(channels, w))
            channels = w
        self.pool = nn.MaxPool2d(2, ceil_mode=True)
        self.bottleneck = double(channels, widths[-1])
        self.up = nn.ModuleList()
        self.decode = nn.ModuleList()
        for w, wider in zip(reversed(widths[:-1]), reversed(widths[1:])):
            self.up.append(nn.ConvTranspose2d(wider, w, 2, stride=2))
            self.decode.append(double(2 * w, w))
        self.head = nn.Conv2d(widths[0], num_classes, 1)

    def forward(self, x):
        skips = []
        for block in self.backbone:
            x = self.run_block(block, x)  # (N, w, h, w')
            skips.append(x)
            x = self.pool(x)  # ceil(side / 2)
        x = self.run_block(self.bottleneck, x)
        for up, block, skip in zip(self.up, self.decode, reversed(skips)):
            x = up(x)[..., :skip.shape[-2], :skip.shape[-1]]  # (N, w, 2h, 2w'), cut to the skip
            x = self.run_block(block, torch.cat([skip, x], dim=1))
        return self.head(x)  # (N, num_classes, H, W)


@register("simple_cnn")
def simple_cnn(num_classes, in_channels, image_size):
    return SimpleCNN(num_classes, in_channels, image_size)


@register("resnet18")
def resnet18(num_classes, in_channels, image_size):
    return ResNet18(num_classes, in_channels, image_size)


@register("resnet9")
def resnet9(num_classes, in_channels, image_size):
    return ResNet9(num_classes, in_channels, image_size)


@register("mlp")
def mlp(num_classes, in_channels, image_size):
    return MLP(num_classes, in_channels, image_size)


@register("unet", segmentation=True)
def unet(num_classes, in_channels, image_size):
    return UNet(num_classes, in_channels, image_size)


@register("unet_gn", segmentation=True)
def unet_gn(num_classes, in_channels, image_size):
    """The U-Net with GroupNorm (4 groups) for BatchNorm: statistics of each sample alone,
    for batches too small for BatchNorm, and so a run equals itself under accumulation
    and any number of processes."""
    return UNet(num_classes, in_channels, image_size,
                norm_layer=lambda channels: nn.GroupNorm(4, channels))


def _torchvision_network(name, num_classes, in_channels):
    import torchvision

    segmentation = torchvision.models.list_models(module=torchvision.models.segmentation)
    available = torchvision.models.list_models(module=torchvision.models)
    if name not in available + segmentation:
        raise ValueError(f"unknown torchvision network {name!r}; choose one of: "
                         f"{', '.join(available + segmentation)}")
    if in_channels != 3:
        raise ValueError(f"torchvision/{name} takes 3-channel images, the dataset has "
                         f"{in_channels}; use a 3-channel dataset or one of "
                         f"{', '.join(sorted(NETWORKS))}")
    # weights=None: never download implicitly; --pretrained loads a local file instead.
    if name in segmentation:
        return _torchvision_segmentation(name, num_classes)
    return torchvision.models.get_model(name, weights=None, num_classes=num_classes)


def timm_architecture(name):
    """The timm architecture of ``--network timm/<name>`` (``name`` may carry a pretrained
    tag: ``vit_small_patch16_224.augreg_in21k``), checked.

    Raises:
        ValueError: timm knows no such architecture; the message names its closest names.
    """
    import difflib

    import timm

    architecture = name.split(".", 1)[0]
    if not timm.is_model(architecture):
        close = difflib.get_close_matches(architecture, timm.list_models(), n=5, cutoff=0.6)
        raise ValueError(f"timm has no model {architecture!r}"
                         + (f"; the closest: {', '.join(close)}" if close else
                            "; timm.list_models() lists them"))
    return architecture


def timm_network(name, num_classes, in_channels, image_size):
    """timm's ``name`` (``timm.create_model``) with random weights, ``num_classes`` and
    ``in_channels`` from the data set; a network whose input size is built in (a ViT's
    position embedding) is built for ``image_size``. --pretrained loads weights after."""
    import timm

    architecture = timm_architecture(name)
    extra = {}
    cfg = timm.models.get_pretrained_cfg(architecture)
    if cfg is not None and cfg.fixed_input_size:
        extra["img_size"] = image_size
    return timm.create_model(architecture, pretrained=False, num_classes=num_classes,
                             in_chans=in_channels, **extra)


def _torchvision_segmentation(name, num_classes):
    """One of torchvision's segmentation networks, random weights (its backbone's too:
    the builders' default would download ImageNet weights), with the auxiliary
    classifier where the network has one (FCN and DeepLabV3; not LR-ASPP), as the
    reference trains them and as their pretrained weights are saved."""
    import torchvision

    builder = torchvision.models.get_model_builder(name)
    aux = {"aux_loss": True} if has_aux_classifier(name) else {}
    return builder(weights=None, weights_backbone=None, num_classes=num_classes, **aux)


def has_aux_classifier(name):
    """Whether torchvision's segmentation builder ``name`` (``deeplabv3_resnet50``, ...)
    takes ``aux_loss``: FCN and DeepLabV3 do, LR-ASPP has no auxiliary head."""
    import inspect

    import torchvision

    builder = torchvision.models.get_model_builder(name)
    return "aux_loss" in inspect.signature(builder).parameters


def is_segmentation(name):
    """Whether ``--network name`` gives per-pixel logits (``unet``, torchvision's
    segmentation networks) rather than a classifier's."""
    if name in SEGMENTATION:
        return True
    if not str(name).startswith("torchvision/"):
        return False
    import torchvision

    return name.split("/", 1)[1] in torchvision.models.list_models(
        module=torchvision.models.segmentation)


def build_network(name, num_classes=10, in_channels=3, image_size=32):
    """Builds a network by registry name.

    Args:
        name: a key of NETWORKS (``simple_cnn``, ``resnet18``, ``resnet9``, ``mlp``,
            ``unet``...) or ``torchvision/<name>`` for any torchvision classifier or
            segmentation network (random weights; a segmentation network returns
            ``{"out": logits, "aux": logits}``, ``"aux"`` where it has one).
        num_classes: outputs of the classifier.
        in_channels: channels of the input images.
        image_size: side of the (square) input images; networks with a flattening
            layer need it.

    Returns:
        The nn.Module, on the CPU, in training mode.

    Raises:
        ValueError: the name is unknown (the message lists the known names).
    """
    if name.startswith("torchvision/"):
        return _torchvision_network(name.split("/", 1)[1], num_classes, in_channels)
    if name.startswith("timm/"):
        return timm_network(name.split("/", 1)[1], num_classes, in_channels, image_size)
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; choose one of: "
                         f"{', '.join(sorted(NETWORKS))}, or torchvision/<name>, "
                         f"timm/<name>")
    return NETWORKS[name](num_classes, in_channels, image_size)

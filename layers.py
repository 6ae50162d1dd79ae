"""Building blocks: nn.Modules smaller than a network.

Networks in networks.py are assembled from these blocks. Following the
pytorch-styleguide, each block builds its layers in ``__init__`` (often into an
``nn.Sequential``) and writes residual connections out in ``forward``.
"""

import contextlib

import torch
import torch.nn as nn
import torch.utils.checkpoint


class ConvBlock(nn.Module):
    """Convolution, normalisation and activation: the styleguide's basic block.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        kernel_size: side of the square kernel.
        stride: stride of the convolution.
        norm_layer: a callable ``norm_layer(channels) -> nn.Module``, or None for no norm.
        activation: a callable returning the activation module, or None for none.
        padding_type: ``"zero"``, ``"reflect"`` or ``"replicate"``; padding keeps the side
            at ``size / stride``.
        use_bias: whether the convolution has a bias (redundant before a BatchNorm).
        dropout: probability of an ``nn.Dropout`` after the activation; 0 adds none.
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1,
                 norm_layer=nn.BatchNorm2d, activation=nn.ReLU, padding_type="zero",
                 use_bias=None, dropout=0.0):
        super().__init__()
        if use_bias is None:
            use_bias = norm_layer is None
        padding = kernel_size // 2
        layers = []
        if padding_type == "zero":
            conv_padding = padding
        elif padding_type in ("reflect", "replicate"):
            pad = nn.ReflectionPad2d if padding_type == "reflect" else nn.ReplicationPad2d
            layers.append(pad(padding))
            conv_padding = 0
        else:
            raise ValueError(f"padding_type must be zero, reflect or replicate, not {padding_type!r}")
        layers.append(nn.Conv2d(in_channels, out_channels, kernel_size, stride, conv_padding,
                                bias=use_bias))
        if norm_layer is not None:
            layers.append(norm_layer(out_channels))
        if activation is not None:
            layers.append(activation())
        if dropout > 0:
            layers.append(nn.Dropout(dropout))
        self.block = nn.Sequential(*layers)

    def forward(self, x):
        return self.block(x)


class ResnetBlock(nn.Module):
    """The styleguide's residual block: ``x + conv_block(x)``, same channels and size.

    Args:
        dim: channels of input and output.
        padding_type: ``"zero"``, ``"reflect"`` or ``"replicate"``.
        norm_layer: normalisation layer constructor (``norm_layer(dim)``).
        use_dropout: put ``nn.Dropout(0.5)`` between the two convolutions.
        use_bias: whether the convolutions have biases.
    """

    def __init__(self, dim, padding_type="zero", norm_layer=nn.BatchNorm2d,
                 use_dropout=False, use_bias=False):
        super().__init__()
        self.conv_block = self.build_conv_block(dim, padding_type, norm_layer, use_dropout,
                                                use_bias)

    @staticmethod
    def build_conv_block(dim, padding_type, norm_layer, use_dropout, use_bias):
        """Returns the two-convolution body of the block as an ``nn.Sequential``."""
        first = ConvBlock(dim, dim, 3, 1, norm_layer, nn.ReLU, padding_type, use_bias,
                          dropout=0.5 if use_dropout else 0.0)
        second = ConvBlock(dim, dim, 3, 1, norm_layer, None, padding_type, use_bias)
        return nn.Sequential(first, second)

    def forward(self, x):
        out = x + self.conv_block(x)
        return out


class BasicBlock(nn.Module):
    """The ResNet-18/34 block (He et al., 2016): two 3x3 convolutions and a shortcut.

    The shortcut is the identity, or a strided 1x1 convolution with BatchNorm when the
    side or the channel count changes.

    Args:
        in_channels: channels of the input.
        out_channels: channels of the output.
        stride: stride of the first convolution (2 halves the side).
    """

    def __init__(self, in_channels, out_channels, stride=1):
        super().__init__()
        self.conv1 = ConvBlock(in_channels, out_channels, 3, stride)
        self.conv2 = ConvBlock(out_channels, out_channels, 3, 1, activation=None)
        self.shortcut = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = ConvBlock(in_channels, out_channels, 1, stride, activation=None)
        self.relu = nn.ReLU()

    def forward(self, x):
        out = self.conv2(self.conv1(x))  # (N, out, H/stride, W/stride)
        out = self.relu(out + self.shortcut(x))
        return out


def _is_batchnorm(module):
    return isinstance(module, nn.modules.batchnorm._BatchNorm)


class _RecomputeWithoutStats:
    """Context for activation recomputation: BatchNorm uses batch statistics, updates nothing.

    The first forward already updated the running statistics; recomputing in backward
    would update them a second time.
    """

    def __init__(self, module):
        self.norms = [m for m in module.modules() if _is_batchnorm(m) and m.track_running_stats]

    def __enter__(self):
        for m in self.norms:
            m.track_running_stats = False  # train mode: batch stats, no buffer updates

    def __exit__(self, *exc):
        for m in self.norms:
            m.track_running_stats = True


def checkpoint_forward(module, *args):
    """Calls ``module(*args)`` under activation checkpointing.

    Activations inside ``module`` are not kept for backward but recomputed there
    (``torch.utils.checkpoint``, ``use_reentrant=False``). The recomputation runs
    BatchNorm on batch statistics without touching the running statistics, so they are
    updated once per step, exactly as without checkpointing.

    Args:
        module: the block to run.
        *args: its inputs.

    Returns:
        What ``module(*args)`` returns.
    """
    def contexts():
        return contextlib.nullcontext(), _RecomputeWithoutStats(module)
    return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False,
                                             context_fn=contexts)

"""Building blocks: nn.Modules smaller than a network.

Networks in networks.py are assembled from these blocks. Following the
pytorch-styleguide, each block builds its layers in ``__init__`` (often into an
``nn.Sequential``) and writes residual connections out in ``forward``.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F
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
        padding: pixels padded on each side; None: ``kernel_size // 2``, which keeps the
            side at ``size / stride`` for odd kernels (an even one, pix2pix's 4x4 with
            stride 2, halves the side with ``padding=1``).
    """

    def __init__(self, in_channels, out_channels, kernel_size=3, stride=1,
                 norm_layer=nn.BatchNorm2d, activation=nn.ReLU, padding_type="zero",
                 use_bias=None, dropout=0.0, padding=None):
        super().__init__()
        if use_bias is None:
            use_bias = norm_layer is None
        padding = kernel_size // 2 if padding is None else padding
        layers = []
        if padding_type == "zero":
            conv_padding = padding
        elif padding_type in ("reflect", "replicate"):
            pad = nn.ReflectionPad2d if padding_type == "reflect" else nn.ReplicationPad2d
            layers.append(pad(padding))
            conv_padding = 0
        else:
            raise ValueError(f"padding_type must be zero, reflect or replicate, "
                             f"not {padding_type!r}")
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
    would update them a second time. The recomputation must call the same operations as
    the first forward (checkpoint compares the tensors each saves), so BatchNorm still
    gets its running statistics, with momentum 0 (``r = 1 * r + 0 * batch``, exact) and
    ``num_batches_tracked`` put back afterwards.
    """

    def __init__(self, module):
        self.norms = [m for m in module.modules() if _is_batchnorm(m) and m.track_running_stats]

    def __enter__(self):
        self.saved = [(m.momentum, m.num_batches_tracked.clone()) for m in self.norms]
        for m in self.norms:
            m.momentum = 0.0

    def __exit__(self, *exc):
        for m, (momentum, tracked) in zip(self.norms, self.saved):
            m.momentum = momentum
            m.num_batches_tracked.copy_(tracked)


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


class SelfAttention(nn.Module):
    """Self-attention over all spatial positions, from SAGAN (Zhang et al., 2019).

    1x1 convolutions make a query and a key of ``max(channels // 8, 1)`` channels and a
    value of ``channels`` channels; every position attends to every position with a
    softmax over the query-key products, and the result is added back to the input scaled
    by a learnable ``gamma``. ``gamma`` starts at 0, so at initialisation the block is the
    identity and the network first relies on local convolutions, then learns how much
    non-local evidence to use. Memory grows with ``(H * W) ** 2``: use it on small maps.

    Args:
        channels: channels of the input and of the output.

    Returns:
        A module mapping ``x`` of shape ``(N, channels, H, W)`` to
        ``gamma * attention(x) + x`` of the same shape.
    """

    def __init__(self, channels):
        super().__init__()
        inner = max(channels // 8, 1)  # SAGAN's C/8 keeps the HW x HW product cheap
        self.query = nn.Conv2d(channels, inner, 1)
        self.key = nn.Conv2d(channels, inner, 1)
        self.value = nn.Conv2d(channels, channels, 1)
        self.gamma = nn.Parameter(torch.zeros(1))

    def forward(self, x):
        n, c, h, w = x.shape
        q = self.query(x).flatten(2)  # (N, C', HW)
        k = self.key(x).flatten(2)  # (N, C', HW)
        v = self.value(x).flatten(2)  # (N, C, HW)
        attn = torch.softmax(q.transpose(1, 2) @ k, dim=-1)  # (N, HW query, HW key)
        out = v @ attn.transpose(1, 2)  # (N, C, HW query)
        out = out.view(n, c, h, w)
        return self.gamma * out + x


class AdaptiveInstanceNorm(nn.Module):
    """Adaptive instance normalisation, AdaIN (Huang & Belongie, 2017).

    Each channel of each sample is normalised to zero mean and unit variance over its
    spatial positions (``InstanceNorm2d`` without affine parameters), then scaled and
    shifted by values predicted from a style vector by one ``nn.Linear``. The output's
    per-channel mean is therefore the predicted bias and its standard deviation the
    absolute predicted scale (up to the norm's eps). The linear layer's bias starts at
    scale 1, shift 0, so a zero style gives plain instance normalisation.

    Args:
        in_channels: channels of the feature map.
        style_dim: length of the style vector.

    Returns:
        A module whose ``forward(x, style)`` maps ``x`` of shape ``(N, in_channels, H, W)``
        and ``style`` of shape ``(N, style_dim)`` to a tensor shaped like ``x``.
    """

    def __init__(self, in_channels, style_dim):
        super().__init__()
        self.norm = nn.InstanceNorm2d(in_channels, affine=False)
        self.style = nn.Linear(style_dim, 2 * in_channels)
        with torch.no_grad():
            self.style.bias[:in_channels].fill_(1.0)  # start as the identity scale
            self.style.bias[in_channels:].zero_()

    def forward(self, x, style):
        scale, bias = self.style(style).chunk(2, dim=1)  # (N, C) each
        out = self.norm(x)  # (N, C, H, W), per-channel mean 0, std 1
        out = scale[:, :, None, None] * out + bias[:, :, None, None]
        return out


def spectral_norm(module, name="weight", n_power_iterations=1):
    """Spectral normalisation (Miyato et al., 2018) through torch's parametrization.

    The effective weight is the stored weight divided by its largest singular value,
    estimated by ``n_power_iterations`` steps of power iteration at every forward pass in
    training mode; this bounds each layer's Lipschitz constant by 1, which stabilises a
    GAN discriminator. A thin wrapper over
    ``torch.nn.utils.parametrizations.spectral_norm``; the one addition is that a block
    without ``name`` (a ``ConvBlock``, an ``nn.Sequential``) gets every convolution and
    linear layer inside it normalised.

    Args:
        module: a layer holding the parameter ``name``, or a block containing such layers.
        name: the parameter to normalise.
        n_power_iterations: power-iteration steps per training-mode forward pass.

    Returns:
        ``module`` itself, parametrized in place.

    Raises:
        ValueError: ``module`` neither has ``name`` nor contains a convolution or linear
            layer that has it.
    """
    parametrize = torch.nn.utils.parametrizations.spectral_norm
    if isinstance(getattr(module, name, None), torch.Tensor):
        return parametrize(module, name=name, n_power_iterations=n_power_iterations)
    layers = [m for m in module.modules()
              if isinstance(m, (nn.modules.conv._ConvNd, nn.Linear))
              and isinstance(getattr(m, name, None), torch.Tensor)]
    if not layers:
        raise ValueError(f"{type(module).__name__} has no parameter {name!r} and contains "
                         "no convolution or linear layer with one")
    for layer in layers:
        parametrize(layer, name=name, n_power_iterations=n_power_iterations)
    return module


class DeterministicAdaptivePool2d(nn.Module):
    """``nn.AdaptiveAvgPool2d`` / ``nn.AdaptiveMaxPool2d`` through ops whose CUDA backward
    is deterministic (the adaptive ones have none: ``torch.use_deterministic_algorithms``
    makes their backward raise).

    Where the input side is a multiple of the output side, the windows do not overlap and
    are all ``in // out`` wide: ``avg_pool2d`` / ``max_pool2d`` with that kernel and
    stride compute the same values. Where the output side is a multiple of the input's,
    every window is one input element: ``repeat_interleave``. Any other size falls back
    to the adaptive op (which then raises under deterministic algorithms on CUDA).

    Args:
        output_size: as the adaptive module's (an int, a pair; None keeps that side).
        mode: ``"avg"`` or ``"max"``.
    """

    def __init__(self, output_size, mode):
        super().__init__()
        if mode not in ("avg", "max"):
            raise ValueError(f"mode must be 'avg' or 'max', not {mode!r}")
        self.output_size, self.mode = output_size, mode

    def forward(self, x):
        size = self.output_size
        size = (size, size) if isinstance(size, int) else tuple(size)
        out = tuple(x.shape[-2 + i] if s is None else s for i, s in enumerate(size))
        side = tuple(x.shape[-2:])
        if all(i % o == 0 for i, o in zip(side, out)):
            kernel = tuple(i // o for i, o in zip(side, out))
            pool = F.avg_pool2d if self.mode == "avg" else F.max_pool2d
            return pool(x, kernel, kernel)  # (N, C, *out)
        if all(o % i == 0 for i, o in zip(side, out)):
            return x.repeat_interleave(out[0] // side[0], dim=-2) \
                .repeat_interleave(out[1] // side[1], dim=-1)  # (N, C, *out)
        pool = F.adaptive_avg_pool2d if self.mode == "avg" else F.adaptive_max_pool2d
        return pool(x, out)

    def extra_repr(self):
        return f"output_size={self.output_size}, mode={self.mode!r}"


def make_pools_deterministic(module):
    """Replaces every ``nn.AdaptiveAvgPool2d`` and ``nn.AdaptiveMaxPool2d`` in ``module``
    (this project's networks and torchvision's alike) by a ``DeterministicAdaptivePool2d``
    that computes the same values: what ``--deterministic`` needs on CUDA. Pooling called
    as a function inside a network's ``forward`` (torchvision's densenet, for one) is not
    reached; its backward still raises.

    Returns:
        The names of the replaced modules.
    """
    replaced = []
    for name, child in list(module.named_modules()):
        if isinstance(child, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)) and \
                not getattr(child, "return_indices", False):
            mode = "avg" if isinstance(child, nn.AdaptiveAvgPool2d) else "max"
            parent_name, _, attr = name.rpartition(".")
            parent = module.get_submodule(parent_name) if parent_name else module
            setattr(parent, attr, DeterministicAdaptivePool2d(child.output_size, mode))
            replaced.append(name)
    return replaced

"""Tests of the GAN building blocks in layers.py against their definitions."""

import pytest
import torch
from torch import nn

from layers import AdaptiveInstanceNorm, ConvBlock, SelfAttention, spectral_norm


def _sigma_max(module):
    """Largest singular value of the module's effective weight, reshaped to (out, -1)."""
    weight = module.weight
    return torch.linalg.matrix_norm(weight.reshape(weight.shape[0], -1), ord=2)


def test_self_attention_shape_dtype_and_gradients():
    torch.manual_seed(0)
    block = SelfAttention(16)
    with torch.no_grad():
        block.gamma.fill_(0.5)  # at gamma = 0 the attention branch gets no gradient
    x = torch.randn(2, 16, 5, 4, requires_grad=True)
    out = block(x)
    assert out.shape == x.shape
    assert out.dtype == torch.float32
    out.square().sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    for name, p in block.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_self_attention_is_identity_at_init_and_not_after_gamma_changes():
    torch.manual_seed(0)
    block = SelfAttention(8)  # 8 // 8 = 1 query/key channel: the smallest case
    x = torch.randn(2, 8, 4, 4)
    assert block.gamma.item() == 0.0
    torch.testing.assert_close(block(x), x, rtol=0, atol=0)
    with torch.no_grad():
        block.gamma.fill_(1.0)
    assert not torch.allclose(block(x), x)


def test_self_attention_matches_the_sagan_formula():
    torch.manual_seed(0)
    block = SelfAttention(16)
    with torch.no_grad():
        block.gamma.fill_(0.7)
    x = torch.randn(2, 16, 3, 5)
    q = block.query(x).flatten(2)  # (N, C', HW)
    k = block.key(x).flatten(2)
    v = block.value(x).flatten(2)
    # beta[n, j, i]: how much output position j attends to position i
    beta = torch.softmax(torch.einsum("nci,ncj->nji", k, q), dim=-1)
    o = torch.einsum("nci,nji->ncj", v, beta).reshape(x.shape)
    torch.testing.assert_close(block(x), 0.7 * o + x)


def test_adain_output_statistics_are_the_style_scale_and_bias():
    torch.manual_seed(0)
    adain = AdaptiveInstanceNorm(in_channels=4, style_dim=6)
    x = torch.randn(3, 4, 16, 16) * 5 + 2
    style = torch.randn(3, 6)
    out = adain(x, style)
    assert out.shape == x.shape and out.dtype == x.dtype
    scale, bias = adain.style(style).chunk(2, dim=1)  # (N, C) each
    mean = out.mean(dim=(2, 3))
    std = out.std(dim=(2, 3), unbiased=False)
    torch.testing.assert_close(mean, bias, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(std, scale.abs(), rtol=1e-4, atol=1e-4)


def test_adain_gradients_reach_input_and_style():
    torch.manual_seed(0)
    adain = AdaptiveInstanceNorm(in_channels=3, style_dim=5)
    x = torch.randn(2, 3, 8, 8, requires_grad=True)
    style = torch.randn(2, 5, requires_grad=True)
    adain(x, style).pow(3).sum().backward()
    for t in (x, style, adain.style.weight, adain.style.bias):
        assert t.grad is not None and t.grad.abs().sum() > 0


def test_adain_with_zero_style_is_plain_instance_norm():
    adain = AdaptiveInstanceNorm(in_channels=3, style_dim=5)
    x = torch.randn(2, 3, 8, 8)
    expected = nn.functional.instance_norm(x)
    torch.testing.assert_close(adain(x, torch.zeros(2, 5)), expected)


@pytest.mark.parametrize(("make_layer", "input_shape"), [
    (lambda: nn.Conv2d(3, 16, 3), (2, 3, 8, 8)),
    (lambda: nn.Linear(20, 10), (2, 20)),
    (lambda: nn.ConvTranspose2d(8, 4, 4, 2), (2, 8, 4, 4)),
])
def test_spectral_norm_bounds_the_largest_singular_value(make_layer, input_shape):
    torch.manual_seed(0)
    layer = make_layer()
    with torch.no_grad():
        layer.weight.mul_(10.0)  # start far from sigma = 1
    assert _sigma_max(layer) > 2.0
    layer = spectral_norm(layer)
    layer.train()  # power iteration runs only in training mode
    for _ in range(5):
        layer(torch.randn(input_shape))
    with torch.no_grad():
        weight = layer.weight
    if isinstance(layer, nn.ConvTranspose2d):
        weight = weight.transpose(0, 1)  # torch normalises (out, in*k*k) here too
    sigma = torch.linalg.matrix_norm(weight.reshape(weight.shape[0], -1), ord=2)
    torch.testing.assert_close(sigma, torch.tensor(1.0), rtol=0, atol=5e-3)


def test_spectral_norm_keeps_gradients_and_wraps_every_layer_of_a_block():
    torch.manual_seed(0)
    block = spectral_norm(ConvBlock(3, 8, 3, 2, norm_layer=None))
    conv = block.block[0]
    assert torch.nn.utils.parametrize.is_parametrized(conv, "weight")
    out = block(torch.randn(2, 3, 8, 8))
    assert out.shape == (2, 8, 4, 4)
    out.sum().backward()
    assert conv.parametrizations.weight.original.grad.abs().sum() > 0


def test_spectral_norm_rejects_a_module_without_weights():
    with pytest.raises(ValueError, match="no parameter 'weight'"):
        spectral_norm(nn.ReLU())


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("side, out", [
    ((8, 8), 1), ((6, 6), (3, 3)), ((1, 1), (7, 7)), ((2, 2), (6, 6)), ((7, 7), (7, 7)),
    ((8, 4), (2, None)), ((5, 5), (3, 3)),  # the last: no exact equivalent, the fallback
])
def test_deterministic_adaptive_pool_equals_the_adaptive_one(mode, side, out):
    from layers import DeterministicAdaptivePool2d

    reference = (nn.AdaptiveAvgPool2d if mode == "avg" else nn.AdaptiveMaxPool2d)(out)
    pool = DeterministicAdaptivePool2d(out, mode)
    x = torch.randn(2, 3, *side, generator=torch.Generator().manual_seed(0))
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    want, got = reference(a), pool(b)
    torch.testing.assert_close(got, want)
    weights = torch.randn(want.shape, generator=torch.Generator().manual_seed(1))
    (want * weights).sum().backward()
    (got * weights).sum().backward()
    torch.testing.assert_close(b.grad, a.grad)


@pytest.mark.parametrize("name", ["resnet18", "resnet9", "torchvision/resnet18",
                                  "torchvision/vgg11", "torchvision/mobilenet_v3_small"])
def test_every_adaptive_pool_of_a_network_is_replaced_and_the_outputs_stay(name):
    from layers import make_pools_deterministic
    from networks import build_network

    torch.manual_seed(0)
    net = build_network(name, 10, 3, 32).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        before = net(x)
        replaced = make_pools_deterministic(net)
        after = net(x)
    assert replaced
    assert not [m for m in net.modules()
                if isinstance(m, (nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d))]
    torch.testing.assert_close(after, before)

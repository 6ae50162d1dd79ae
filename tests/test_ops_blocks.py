"""Tests of ops: one_hot, init_weights, the LR schedule and GPU peaks, against definitions."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ops
from layers import spectral_norm
from ops import init_weights, one_hot


@pytest.mark.parametrize("shape", [(7,), (2, 3), (0,)])
def test_one_hot_equals_torch_one_hot_as_float(shape):
    torch.manual_seed(0)
    labels = torch.randint(0, 5, shape)
    out = one_hot(labels, 5)
    assert out.dtype == torch.float32
    assert out.shape == (*shape, 5)
    torch.testing.assert_close(out, F.one_hot(labels, 5).float(), rtol=0, atol=0)


def test_one_hot_accepts_int32_labels():
    labels = torch.tensor([0, 2, 1], dtype=torch.int32)
    torch.testing.assert_close(one_hot(labels, 3), torch.eye(3)[[0, 2, 1]])


@pytest.mark.parametrize("bad", [3, -1])
def test_one_hot_rejects_out_of_range_labels(bad):
    with pytest.raises(ValueError, match=f"label {bad} is out of range for 3 classes"):
        one_hot(torch.tensor([0, bad, 1]), 3)


def test_one_hot_rejects_float_labels():
    with pytest.raises(ValueError, match="integer labels"):
        one_hot(torch.tensor([0.0, 1.0]), 3)


def test_init_weights_normal_std_is_gain_and_biases_are_zero():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(500, 400), nn.Conv2d(16, 32, 3), nn.ReLU())
    assert init_weights(net, "normal", gain=0.02) is net
    for layer in (net[0], net[1]):
        w = layer.weight.detach()
        torch.testing.assert_close(w.std().item(), 0.02, rtol=0.03, atol=0)
        assert abs(w.mean().item()) < 1e-3
        assert torch.count_nonzero(layer.bias) == 0


def test_init_weights_xavier_and_kaiming_stds():
    torch.manual_seed(0)
    xavier = init_weights(nn.Linear(600, 300), "xavier", gain=0.5)
    expected = 0.5 * (2.0 / (600 + 300)) ** 0.5  # Glorot & Bengio (2010), normal form
    torch.testing.assert_close(xavier.weight.std().item(), expected, rtol=0.03, atol=0)
    kaiming = init_weights(nn.Linear(600, 300), "kaiming", gain=0.5)
    expected = (2.0 / 600) ** 0.5  # He et al. (2015), fan-in, ReLU; gain is not used
    torch.testing.assert_close(kaiming.weight.std().item(), expected, rtol=0.03, atol=0)


def test_init_weights_orthogonal_rows_are_orthogonal_with_norm_gain():
    torch.manual_seed(0)
    layer = init_weights(nn.Linear(128, 64), "orthogonal", gain=0.5)
    w = layer.weight.detach()  # (64, 128): 64 orthogonal rows
    torch.testing.assert_close(w @ w.T, 0.25 * torch.eye(64), rtol=0, atol=1e-5)


def test_init_weights_batchnorm_is_normal_around_one():
    torch.manual_seed(0)
    norm = init_weights(nn.Sequential(nn.BatchNorm2d(20000)), "normal", gain=0.02)[0]
    torch.testing.assert_close(norm.weight.mean().item(), 1.0, rtol=0, atol=1e-3)
    torch.testing.assert_close(norm.weight.std().item(), 0.02, rtol=0.03, atol=0)
    assert torch.count_nonzero(norm.bias) == 0


def test_init_weights_reaches_the_stored_weight_of_a_spectral_normed_layer():
    torch.manual_seed(0)
    layer = spectral_norm(nn.Linear(64, 32))
    init_weights(layer, "orthogonal", gain=2.0)
    w = layer.parametrizations.weight.original.detach()
    torch.testing.assert_close(w @ w.T, 4.0 * torch.eye(32), rtol=0, atol=1e-4)


def test_init_weights_rejects_an_unknown_type():
    with pytest.raises(ValueError, match="normal, xavier, kaiming, orthogonal"):
        init_weights(nn.Linear(2, 2), "uniform")


@pytest.mark.parametrize("schedule, expected", [
    ("none", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("step", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 0.1, 0.1, 0.01]),
    ("onecycle", [0.25, 0.5, 0.75, 1.0, 1.0, 5 / 6, 4 / 6, 3 / 6, 2 / 6, 1 / 6]),
    # 0.5 * (1 + cos(pi * k / 6)) for the k-th step after the warmup
    ("cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.5 + 3 ** 0.5 / 4, 0.75, 0.5, 0.25,
                0.5 - 3 ** 0.5 / 4]),
])
def test_lr_factor_is_a_pure_function_of_the_step(schedule, expected):
    # 10 steps, 4 of them warmup: linear up to 1, then the schedule over the other 6
    got = [ops.lr_factor(step, 10, schedule, warmup_steps=4) for step in range(10)]
    assert got == pytest.approx(expected)


@pytest.mark.parametrize("warmup, total", [(4, 12), (10, 110), (1, 5)])
def test_cosine_decays_from_the_end_of_the_warmup(warmup, total):
    # The cosine spans the steps after the warmup: 1 where the warmup ends, 0.5 half way
    # through the decay, 0 at the end (not a cosine of the whole run, cut by the warmup).
    decay = total - warmup
    assert decay % 4 == 0
    assert ops.lr_factor(warmup - 1, total, "cosine", warmup) == 1.0  # warmup's last step
    assert ops.lr_factor(warmup, total, "cosine", warmup) == 1.0
    assert ops.lr_factor(warmup + decay // 2, total, "cosine", warmup) == pytest.approx(0.5)
    assert ops.lr_factor(warmup + decay // 4, total, "cosine", warmup) == pytest.approx(
        0.5 + 2 ** 0.5 / 4)  # (1 + cos(pi / 4)) / 2
    assert ops.lr_factor(total, total, "cosine", warmup) == pytest.approx(0.0, abs=1e-12)
    assert ops.lr_factor(total + 5, total, "cosine", warmup) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("warmup, total, ramp", [(4, 12, 4), (10, 110, 10), (0, 200, 60)])
def test_onecycle_falls_linearly_from_the_end_of_the_warmup(warmup, total, ramp):
    # warmup 0: onecycle's own warmup, 30% of the run (60 of 200 steps)
    decay = total - ramp
    assert decay % 4 == 0
    assert ops.lr_factor(ramp - 1, total, "onecycle", warmup) == 1.0
    assert ops.lr_factor(ramp, total, "onecycle", warmup) == 1.0
    assert ops.lr_factor(ramp + decay // 2, total, "onecycle", warmup) == pytest.approx(0.5)
    assert ops.lr_factor(ramp + decay // 4, total, "onecycle", warmup) == pytest.approx(0.75)
    assert ops.lr_factor(total, total, "onecycle", warmup) == pytest.approx(0.0, abs=1e-12)


def test_lr_factor_cosine_and_onecycle_default_warmup():
    assert ops.lr_factor(0, 100, "cosine") == 1.0
    assert ops.lr_factor(50, 100, "cosine") == pytest.approx(0.5)
    assert ops.lr_factor(100, 100, "cosine") == pytest.approx(0.0)
    assert ops.lr_factor(29, 100, "onecycle") == pytest.approx(1.0)  # 30% warmup by default
    with pytest.raises(ValueError, match="unknown schedule"):
        ops.lr_factor(0, 10, "exponential")


def test_peak_tflops_of_known_gpus():
    assert ops.peak_tflops("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert ops.peak_tflops("NVIDIA A100-SXM4-40GB", "fp32") == 19.5
    assert ops.peak_tflops("Some Future GPU", "bf16") is None


@pytest.mark.parametrize("name, precision, peak", [
    ("NVIDIA H100 80GB HBM3", "tf32", 494.7),    # SXM
    ("NVIDIA H100 PCIe", "bf16", 756.5),         # not the SXM figure
    ("NVIDIA H100 NVL", "bf16", 835.5),
    ("NVIDIA H200", "bf16", 989.4),
    ("NVIDIA A100-PCIE-40GB", "tf32", 156.0),
    ("NVIDIA A100 80GB PCIe", "fp16", 312.0),
    ("NVIDIA RTX A1000 6GB Laptop GPU", "bf16", None),  # "A100" is in its name
    ("NVIDIA RTX A1000", "fp32", None),
    ("Tesla V100-SXM2-16GB", "bf16", None),       # no bfloat16 on a V100
    ("Tesla V100-SXM2-16GB", "tf32", 15.7),       # no TF32: its fp32 peak
    ("Tesla T4", "fp16", 65.0),
    ("NVIDIA GeForce RTX 4090", "tf32", 82.6),
])
def test_peak_tflops_by_exact_device_name(name, precision, peak):
    assert ops.peak_tflops(name, precision) == peak


def test_saved_tensor_bytes_counts_what_autograd_keeps():
    x = torch.randn(2, 4)
    # a Linear keeps its input for the weight gradient: 2 x 4 float32
    assert ops.saved_tensor_bytes(nn.Linear(4, 3, bias=False), x) == 2 * 4 * 4
    # and a ReLU after it keeps its 2 x 3 output
    assert ops.saved_tensor_bytes(nn.Sequential(nn.Linear(4, 3), nn.ReLU()), x) == 32 + 24

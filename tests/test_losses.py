"""Tests of losses.py's GAN and perceptual losses against their definitions."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import losses
from losses import GANLoss, PerceptualLoss, gradient_penalty
from ops import UserError

EARLY = ("relu1_2", "relu2_1")  # early VGG layers only: fast on a CPU


@pytest.fixture
def perceptual():
    torch.manual_seed(0)
    return PerceptualLoss(layers=EARLY, weights=None)


# --- GANLoss ---------------------------------------------------------------------------

FORMULAS = {
    # mode: (loss for real targets, loss for fake targets), written out from the papers
    "vanilla": (lambda x: -torch.log(torch.sigmoid(x)).mean(),
                lambda x: -torch.log(1 - torch.sigmoid(x)).mean()),
    "lsgan": (lambda x: ((x - 1) ** 2).mean(), lambda x: (x ** 2).mean()),
    "hinge": (lambda x: torch.clamp(1 - x, min=0).mean(),
              lambda x: torch.clamp(1 + x, min=0).mean()),
    "wgan": (lambda x: -x.mean(), lambda x: x.mean()),
}


@pytest.mark.parametrize("mode", GANLoss.MODES)
@pytest.mark.parametrize("target_is_real", [True, False])
def test_gan_loss_matches_its_formula(mode, target_is_real):
    torch.manual_seed(0)
    prediction = torch.randn(4, 1, 3, 3, dtype=torch.float64) * 2  # patch outputs
    real_formula, fake_formula = FORMULAS[mode]
    expected = (real_formula if target_is_real else fake_formula)(prediction)
    loss = GANLoss(mode)(prediction, target_is_real)
    assert loss.shape == () and loss.dtype == torch.float64
    torch.testing.assert_close(loss, expected)


@pytest.mark.parametrize("mode", GANLoss.MODES)
def test_gan_loss_gradients_flow_to_the_prediction(mode):
    prediction = torch.randn(6, 1, requires_grad=True)
    GANLoss(mode)(prediction, True).backward()
    assert prediction.grad is not None and prediction.grad.abs().sum() > 0


def test_hinge_generator_loss_is_minus_the_mean_score():
    prediction = torch.randn(5, 1) * 3
    loss = GANLoss("hinge")(prediction, True, for_discriminator=False)
    torch.testing.assert_close(loss, -prediction.mean())


def test_gan_loss_rejects_an_unknown_mode_naming_the_modes():
    with pytest.raises(ValueError, match="vanilla, lsgan, hinge, wgan"):
        GANLoss("wasserstein")


# --- gradient_penalty -------------------------------------------------------------------

def _tiny_critic():
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 8), nn.Tanh(), nn.Linear(8, 1))


def test_gradient_penalty_equals_a_hand_computation():
    torch.manual_seed(0)
    critic = _tiny_critic()
    real, fake = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)

    torch.manual_seed(123)
    penalty = gradient_penalty(critic, real, fake, weight=10.0)

    torch.manual_seed(123)  # the same interpolation: one alpha per sample
    alpha = torch.rand(4, 1, 1, 1)
    x = (alpha * real + (1 - alpha) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(critic(x).sum(), x)
    norms = torch.sqrt((grad ** 2).sum(dim=(1, 2, 3)))
    expected = 10.0 * ((norms - 1) ** 2).mean()
    torch.testing.assert_close(penalty, expected)


def test_gradient_penalty_of_a_linear_critic_and_its_gradient():
    # critic(x) = w.x + b has gradient w everywhere, so the penalty is
    # weight * (||w|| - 1)^2 whatever the interpolation, with d/dw = 2 weight (||w|| - 1) w/||w||.
    torch.manual_seed(0)
    critic = nn.Linear(5, 1)
    real, fake = torch.randn(3, 5), torch.randn(3, 5)
    penalty = gradient_penalty(critic, real, fake, weight=2.0)
    w = critic.weight.detach()
    norm = w.norm()
    torch.testing.assert_close(penalty, 2.0 * (norm - 1) ** 2)
    penalty.backward()  # create_graph=True: the critic's update sees the penalty
    torch.testing.assert_close(critic.weight.grad, 2.0 * 2 * (norm - 1) * w / norm)


def test_gradient_penalty_under_fp16_autocast_is_taken_in_float32():
    """The CUDA review's L2: under fp16 autocast (the GradScaler's precision) the
    penalty's gradient with respect to the images is not scaled: taken in fp16 it loses
    digits (and underflows). It is the float32 penalty, and its parameter gradient too."""
    torch.manual_seed(0)
    critic = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.LeakyReLU(0.2), nn.Flatten(),
                           nn.Linear(16 * 8 * 8, 1))
    real, fake = torch.randn(8, 3, 8, 8), torch.randn(8, 3, 8, 8)
    torch.manual_seed(5)
    want = gradient_penalty(critic, real, fake)
    (want_grad,) = torch.autograd.grad(want, critic[0].weight)
    torch.manual_seed(5)
    with torch.autocast("cpu", dtype=torch.float16):
        got = gradient_penalty(critic, real, fake)
    (got_grad,) = torch.autograd.grad(got, critic[0].weight)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(got_grad, want_grad)


def test_gradient_penalty_does_not_reach_the_generator():
    torch.manual_seed(0)
    critic = _tiny_critic()
    generator_out = torch.randn(2, 3, 2, 2, requires_grad=True)
    penalty = gradient_penalty(critic, torch.randn(2, 3, 2, 2), generator_out)
    penalty.backward()
    assert generator_out.grad is None
    # The last bias does not change the input gradient, so only the weights get one.
    for layer in (critic[1], critic[3]):
        assert layer.weight.grad is not None and layer.weight.grad.abs().sum() > 0


# --- PerceptualLoss --------------------------------------------------------------------

def test_perceptual_loss_is_zero_for_identical_and_positive_for_different(perceptual):
    torch.manual_seed(1)
    x = torch.rand(2, 3, 32, 32)
    same = perceptual(x, x.clone())
    assert same.shape == () and same.dtype == torch.float32
    assert same.item() == 0.0
    assert perceptual(x, torch.rand(2, 3, 32, 32)).item() > 0.0


def test_perceptual_loss_is_the_weighted_sum_over_layers():
    torch.manual_seed(0)
    both = PerceptualLoss(layers=("relu2_1", "relu1_2"), weights=None,
                          layer_weights=(0.5, 2.0), criterion="mse")
    assert both.layer_names == ["relu1_2", "relu2_1"]  # stored in network order
    x, y = torch.rand(2, 3, 16, 16), torch.rand(2, 3, 16, 16)
    mean = torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)  # ImageNet's
    std = torch.tensor([0.229, 0.224, 0.225]).view(1, 3, 1, 1)

    def norm(t):
        return (t - mean) / std

    fx, fy = both.slices[0](norm(x)), both.slices[0](norm(y))
    expected = 2.0 * F.mse_loss(fx, fy)
    expected = expected + 0.5 * F.mse_loss(both.slices[1](fx), both.slices[1](fy))
    torch.testing.assert_close(both(x, y), expected)


def test_perceptual_loss_keeps_vgg_frozen_while_the_model_trains(perceptual):
    torch.manual_seed(0)
    model = nn.Conv2d(3, 3, 3, padding=1)
    parent = nn.ModuleDict({"model": model, "perceptual": perceptual})
    parent.train()
    assert not any(m.training for m in perceptual.slices.modules())
    assert all(not p.requires_grad for p in perceptual.parameters())
    before = [p.clone() for p in perceptual.parameters()]
    model_before = model.weight.clone()
    optimizer = torch.optim.SGD(parent.parameters(), lr=0.1)

    x, target = torch.rand(2, 3, 32, 32), torch.rand(2, 3, 32, 32)
    loss = perceptual(model(x), target)
    loss.backward()
    optimizer.step()

    assert model.weight.grad.abs().sum() > 0
    assert not torch.equal(model.weight, model_before)
    for p, p0 in zip(perceptual.parameters(), before, strict=True):
        assert p.grad is None
        assert torch.equal(p, p0)


def test_perceptual_loss_imagenet_offline_raises_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty hub cache
    with pytest.raises(UserError, match=r"weights=PATH.*weights=None"):
        PerceptualLoss(layers=EARLY, weights="imagenet")


def test_perceptual_loss_failed_download_raises_user_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))

    def offline(*args, **kwargs):
        raise OSError("no network")  # what urllib raises without a connection
    monkeypatch.setattr(losses.torch.hub, "load_state_dict_from_url", offline)
    with pytest.raises(UserError, match=r"cannot download.*weights=PATH.*weights=None"):
        PerceptualLoss(layers=EARLY, weights="imagenet", download=True)


@pytest.mark.parametrize("damage", ["random", "truncated"])
def test_perceptual_loss_damaged_cached_imagenet_file_is_one_line_naming_it(
        tmp_path, monkeypatch, damage):
    # torch.hub loads a copy in its cache without checking the hash its name carries
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    hub = tmp_path / "hub" / "checkpoints"
    hub.mkdir(parents=True)
    cached = hub / "vgg19-dcbb9e9d.pth"
    if damage == "random":
        cached.write_bytes(torch.randint(0, 256, (100_000,), dtype=torch.uint8).numpy().tobytes())
    else:  # an interrupted copy
        torch.save({"features.0.weight": torch.zeros(64, 3, 3, 3)}, tmp_path / "whole.pt")
        cached.write_bytes((tmp_path / "whole.pt").read_bytes()[:600])
    with pytest.raises(UserError) as excinfo:
        PerceptualLoss(layers=EARLY, weights="imagenet")
    message = str(excinfo.value)
    assert str(cached) in message and "delete the file" in message
    assert "\n" not in message


def test_perceptual_loss_loads_a_local_state_dict(tmp_path, perceptual):
    # A state_dict keyed like torchvision's vgg19 ("features.N.weight").
    source = PerceptualLoss(layers=EARLY, weights=None)
    state = {f"features.{k.split('.', 2)[2]}": v for k, v in source.state_dict().items()}
    path = tmp_path / "vgg19.pth"
    torch.save(state, path)
    loaded = PerceptualLoss(layers=EARLY, weights=path)
    for a, b in zip(loaded.parameters(), source.parameters(), strict=True):
        assert torch.equal(a, b)
    x, y = torch.rand(1, 3, 16, 16), torch.rand(1, 3, 16, 16)
    torch.testing.assert_close(loaded(x, y), source(x, y))


def test_perceptual_loss_bad_weights_and_layers(tmp_path):
    with pytest.raises(UserError, match="neither 'imagenet', None, nor an existing file"):
        PerceptualLoss(layers=EARLY, weights=tmp_path / "missing.pth")
    torch.save({"0.weight": torch.zeros(1)}, tmp_path / "partial.pth")
    with pytest.raises(UserError, match="lack VGG19 keys"):
        PerceptualLoss(layers=EARLY, weights=tmp_path / "partial.pth")
    with pytest.raises(ValueError, match="relu1_1"):
        PerceptualLoss(layers=("relu9_9",), weights=None)

"""ddpm.py and tasks/diffusion.py's parts on small tensors: the schedule, the U-Net, the
samplers' determinism, the draws that do not depend on how a step is split, the foreign
flags of a key two tasks own."""

import math

import pytest
import torch

import config as config_module
import ddpm
import tasks
from machinery import engine


def _task(**overrides):
    config = config_module.with_defaults({"task": "diffusion", "dataset": "synthetic",
                                          "image_size": 8, "diffusion_steps": 50,
                                          "fid_samples": 0, **overrides})
    train_set = type("S", (), {"transform": None, "in_channels": 3})()
    return tasks.task_class("diffusion")(config, train_set)


def test_the_schedules_fall_from_one_to_almost_zero():
    for kind in ddpm.SCHEDULES:
        s = ddpm.Schedule(kind, 1000)
        a = s.alpha_bar
        assert a.dtype == torch.float64 and a.shape == (1000,)
        assert (a[1:] < a[:-1]).all() and 0.99 < a[0] < 1 and a[-1] < 1e-4, kind
    linear = ddpm.betas("linear", 1000)
    assert linear[0] == pytest.approx(1e-4) and linear[-1] == pytest.approx(0.02)
    assert ddpm.betas("linear", 250)[-1] == pytest.approx(0.08)  # scaled by 1000 / T
    assert ddpm.betas("cosine", 1000).max() <= 0.999


def test_q_sample_is_the_forward_process():
    s = ddpm.Schedule("linear", 100)
    x0, noise = torch.rand(3, 1, 4, 4) * 2 - 1, torch.randn(3, 1, 4, 4)
    t = torch.tensor([0, 50, 99])
    got = s.q_sample(x0, t, noise)
    for i, ti in enumerate(t.tolist()):
        a = float(s.alpha_bar[ti])
        torch.testing.assert_close(got[i], math.sqrt(a) * x0[i] + math.sqrt(1 - a) * noise[i])


def test_the_sampled_timesteps_run_down_to_zero_once_each():
    s = ddpm.Schedule("linear", 1000)
    assert s.timesteps(5) == [999, 749, 500, 250, 0]
    assert s.timesteps(1000) == list(range(999, -1, -1))
    assert s.timesteps(5000) == list(range(999, -1, -1))


@pytest.mark.parametrize("side, channels", [(8, 3), (28, 1), (32, 3)])
def test_the_unet_keeps_the_images_shape_and_starts_at_zero(side, channels):
    unet = ddpm.UNet(channels, side, width=8, blocks=1)
    x, t = torch.randn(2, channels, side, side), torch.tensor([0, 999])
    out = unet(x, t)
    assert out.shape == x.shape and torch.equal(out, torch.zeros_like(out))  # zero last conv
    assert any(isinstance(m, ddpm.Attention) for m in unet.modules())
    assert not any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                   for m in unet.modules())
    torch.nn.init.normal_(unet.out[-1].weight)
    assert not torch.equal(unet(x, t)[0], unet(x, torch.tensor([5, 999]))[0])  # t counts


def test_the_attention_is_ddpms_own_normalised_scaled_and_projected():
    """Ho et al.'s AttnBlock: GroupNorm, softmax(q k^T / sqrt(C)) v over the positions, a
    1x1 projection (zero at first: the identity), added to the input; written out here."""
    torch.manual_seed(0)
    block, x = ddpm.Attention(16), torch.randn(2, 16, 4, 4)
    assert torch.equal(block(x), x)  # the projection starts at zero
    torch.nn.init.normal_(block.proj.weight)
    torch.nn.init.normal_(block.norm.weight)
    h = torch.nn.functional.group_norm(x, block.norm.num_groups, block.norm.weight,
                                       block.norm.bias)
    q, k, v = block.qkv(h).flatten(2).chunk(3, dim=1)  # each (N, C, HW)
    weights = torch.softmax(q.transpose(1, 2) @ k / 16 ** 0.5, dim=-1)  # (N, HW, HW)
    expected = x + block.proj((v @ weights.transpose(1, 2)).view(2, 16, 4, 4))
    torch.testing.assert_close(block(x), expected)
    assert isinstance(block.norm, torch.nn.GroupNorm)


def test_the_cuda_attention_takes_each_positions_channels_in_a_row(monkeypatch):
    """CUDA review 7's N-L1: on CUDA the attention's q, k and v come from an NHWC copy
    (each position's channels contiguous, what the fused SDPA kernels need), the same
    attention as the NCHW path (checked here on the CPU), its output in the input's
    memory format."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 48, 4, 4)
    seen = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(ddpm.F, "scaled_dot_product_attention",
                        lambda q, k, v: (seen.extend([q.stride(-1), k.stride(-1),
                                                      v.stride(-1)]), sdpa(q, k, v))[1])
    got = ddpm.rows_attention(qkv)
    assert seen == [1, 1, 1] and got.is_contiguous()
    q, k, v = qkv.flatten(2).chunk(3, dim=1)  # each (N, C, HW)
    weights = torch.softmax(q.transpose(1, 2) @ k / 16 ** 0.5, dim=-1)
    torch.testing.assert_close(got, (v @ weights.transpose(1, 2)).view(2, 16, 4, 4))
    last = ddpm.rows_attention(qkv.contiguous(memory_format=torch.channels_last))
    assert last.is_contiguous(memory_format=torch.channels_last)


def test_an_image_does_not_depend_on_its_batch():
    """The U-Net computes each image on its own (GroupNorm): one batch of 4 equals the
    4 images one by one (up to the rounding of kernels chosen by batch size)."""
    torch.manual_seed(0)
    unet = ddpm.UNet(3, 8, width=8, blocks=1)
    torch.nn.init.normal_(unet.out[-1].weight, std=0.1)
    x, t = torch.randn(4, 3, 8, 8), torch.tensor([1, 2, 3, 4])
    torch.testing.assert_close(unet(x, t), torch.cat([unet(x[i:i + 1], t[i:i + 1])
                                                     for i in range(4)]), rtol=0, atol=5e-5)


@pytest.mark.parametrize("side", [6, 30, 260])
def test_image_sides_the_unet_cannot_take_are_refused(side):
    with pytest.raises(ValueError, match="multiples of 4 from 8 to 256"):
        ddpm.UNet(3, side)


@pytest.mark.parametrize("kind", ddpm.SAMPLERS)
def test_sampling_is_a_function_of_the_seed_and_the_index(kind):
    torch.manual_seed(0)
    unet = ddpm.UNet(3, 8, width=8, blocks=1).eval()
    torch.nn.init.normal_(unet.out[-1].weight, std=0.1)
    schedule = ddpm.Schedule("linear", 50)
    sampler = ddpm.Sampler(unet, schedule, kind, steps=4, seed=3)
    whole = sampler(torch.arange(20))
    assert whole.shape == (20, 3, 8, 8) and whole.abs().max() <= 1
    parts = torch.cat([sampler(torch.arange(0, 7)), sampler(torch.arange(7, 17)),
                       sampler(torch.arange(17, 20))])
    # any batches (the rounding of kernels chosen by batch size apart, through 4 steps)
    torch.testing.assert_close(parts, whole, rtol=0, atol=2e-3)
    torch.testing.assert_close(ddpm.Sampler(unet, schedule, kind, 4, seed=3)(
        torch.arange(20)), whole, rtol=0, atol=0)  # again: the same
    other = ddpm.Sampler(unet, schedule, kind, 4, seed=4)(torch.arange(20))
    assert not torch.allclose(other, whole)
    state = torch.random.get_rng_state()
    sampler(torch.arange(3))
    assert torch.equal(torch.random.get_rng_state(), state)  # the global RNG untouched


def test_ddim_and_ddpm_differ_and_default_to_their_steps():
    unet = ddpm.UNet(1, 8, width=8, blocks=1).eval()
    torch.nn.init.normal_(unet.out[-1].weight, std=0.1)
    schedule = ddpm.Schedule("cosine", 30)
    ddim, full = ddpm.Sampler(unet, schedule, "ddim"), ddpm.Sampler(unet, schedule, "ddpm")
    assert (ddim.steps, full.steps) == (ddpm.DDIM_STEPS, 30)
    a, b = ddim(torch.arange(4)), full(torch.arange(4))
    assert a.shape == b.shape == (4, 1, 8, 8) and not torch.allclose(a, b)


def test_the_draws_do_not_depend_on_how_a_step_is_split():
    task = _task()
    whole = task.draws(engine.Where(1, 32, 0, 16, 16), "cpu")
    parts = [task.draws(engine.Where(1, 32, o, 4, 16), "cpu") for o in (0, 4, 8, 12)]
    for i in range(3):  # timesteps, noise, flips
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])
    t, noise, flips = whole
    assert t.min() >= 0 and t.max() < 50 and noise.shape == (16, 3, 8, 8)
    assert flips.dtype == torch.bool
    other = task.draws(engine.Where(2, 32, 0, 16, 16), "cpu")  # another epoch
    later = task.draws(engine.Where(1, 48, 0, 16, 16), "cpu")  # another step
    assert not torch.equal(other[1], noise) and not torch.equal(later[1], noise)


def test_the_validation_draws_are_each_images_own():
    task = _task()
    whole = task.val_draws(0, 40, "cpu")
    parts = [task.val_draws(a, b - a, "cpu") for a, b in ((0, 5), (5, 21), (21, 40))]
    for i in range(2):
        assert torch.equal(torch.cat([p[i] for p in parts]), whole[i])


def test_a_flag_two_tasks_own_is_foreign_only_to_the_others():
    """--fid-samples is the GAN's and the diffusion model's: no warning for either; a
    classifier is warned once, naming a task that reads it."""
    for task in ("gan", "diffusion"):
        assert tasks.foreign_flags({"task": task}, {"fid_samples", "fid_features"}) == []
    assert tasks.foreign_flags({"task": "gan"}, {"sample_steps"}) == [
        ("--sample-steps", "diffusion")]
    found = tasks.foreign_flags({"task": "classification"}, {"fid_samples"})
    assert found == [("--fid-samples", "gan")]


def test_ddpms_step_adds_the_posterior_variance():
    """Each DDPM step from t to the walk's next t' draws x_t' from the posterior
    q(x_t' | x_t, x0): mean (sqrt(a') b / (1 - a)) x0 + (sqrt(1 - b) (1 - a') / (1 - a)) x_t
    and variance b (1 - a') / (1 - a), b = 1 - a / a' (Ho et al.'s beta tilde; not b, the
    paper's other choice), with the sampler's own draws: first x_T, then a z each step."""
    torch.manual_seed(0)
    unet = ddpm.UNet(3, 8, width=8, blocks=1).eval()
    torch.nn.init.normal_(unet.out[-1].weight, std=0.1)
    schedule = ddpm.Schedule("linear", 50)
    sampler = ddpm.Sampler(unet, schedule, "ddpm", steps=4, seed=3)
    indices = list(range(6))
    draw = sampler._noise(indices)
    walk, a = schedule.timesteps(4), schedule.alpha_bar.tolist()
    assert walk == [49, 33, 16, 0]
    x = draw()
    with torch.no_grad():
        for t, prev in zip(walk, walk[1:] + [None]):
            a_t, a_prev = a[t], 1.0 if prev is None else a[prev]
            eps = unet(x, torch.full((len(x),), t))
            x0 = ((x - math.sqrt(1 - a_t) * eps) / math.sqrt(a_t)).clamp(-1, 1)
            b = 1 - a_t / a_prev
            mean = math.sqrt(a_prev) * b / (1 - a_t) * x0 + \
                math.sqrt(1 - b) * (1 - a_prev) / (1 - a_t) * x
            x = mean if prev is None else \
                mean + math.sqrt(b * (1 - a_prev) / (1 - a_t)) * draw()
    want = x.clamp(-1, 1)
    got = sampler(torch.tensor(indices))
    assert ((want > -1) & (want < 1)).float().mean() > 0.5  # not only the clipping's +-1
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.parametrize("steps", [2, 10, 19, 20])
def test_the_linear_schedule_below_20_steps_is_clipped_as_the_cosines(steps):
    """F2: 1000 / T x 0.02 passes 1 below T = 20; each beta is at most 0.999 (the
    cosine's clip), so alpha-bar falls and stays positive, training and both samplers
    are finite at every T the range check allows."""
    b = ddpm.betas("linear", steps)
    assert b.max() == min(0.999, 20 / steps) and (b > 0).all()
    schedule = ddpm.Schedule("linear", steps)
    a = schedule.alpha_bar
    assert (a > 0).all() and (a[1:] < a[:-1]).all()
    torch.manual_seed(0)
    unet = ddpm.UNet(3, 8, width=8, blocks=1)
    torch.nn.init.normal_(unet.out[-1].weight, std=0.1)
    x0, noise = torch.rand(4, 3, 8, 8) * 2 - 1, torch.randn(4, 3, 8, 8)
    with torch.no_grad():
        mean, _ = ddpm.loss(unet, schedule, x0, torch.tensor([0, steps - 1] * 2), noise)
    assert math.isfinite(float(mean))
    for kind in ddpm.SAMPLERS:
        assert torch.isfinite(ddpm.Sampler(unet.eval(), schedule, kind, seed=1)(
            torch.arange(2))).all(), kind


@pytest.mark.parametrize("steps", [1000, 50])
def test_the_linear_betas_from_20_steps_are_the_papers_bit_for_bit(steps):
    """The clip changes nothing where no beta reaches it: the default 1000 steps and the
    50 of bench/identity.py's ddpm recipe keep their bits (and so their checkpoints)."""
    scale = 1000 / steps
    assert torch.equal(ddpm.betas("linear", steps), torch.linspace(
        scale * 1e-4, scale * 0.02, steps, dtype=torch.float64))

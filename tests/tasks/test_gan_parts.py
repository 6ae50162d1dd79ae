"""The GAN parts before the GAN task: dcgan.py's networks, losses per phase and fixed
latents, the sample grid (tasks/_generative.py), and gan_metrics.py's images and FID/KID
(Inception's missing weights; a trained classifier's features)."""

import itertools
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_args, write_mnist
from torch import nn

import dcgan
import layers
from ops import UserError
from pipeline import data
from reporting import gan_metrics
from tasks import _generative


def _batchnorms(module):
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _sides_into(module, kind):
    """The spatial side of the input of every ``kind`` module in one forward pass."""
    sides = []
    hooks = [m.register_forward_hook(lambda m, i, o: sides.append(i[0].shape[-1]))
             for m in module.modules() if isinstance(m, kind)]
    return sides, hooks


# --------------------------------------------------------------------------- networks

@pytest.mark.parametrize("size", dcgan.IMAGE_SIZES)
@pytest.mark.parametrize("channels", [1, 3])
def test_generator_and_discriminator_shapes_for_each_image_size(size, channels):
    torch.manual_seed(0)
    g = dcgan.Generator(16, channels, size, width=8)
    d = dcgan.Discriminator(channels, size, width=8)
    x = g(torch.randn(5, 16))
    assert x.shape == (5, channels, size, size)
    assert x.min() >= -1 and x.max() <= 1 and isinstance(g.main[-1], nn.Tanh)
    assert d(x).shape == (5,)
    assert g(torch.randn(5, 16, 1, 1)).shape == x.shape  # the (N, latent, 1, 1) form too


def test_other_image_sizes_are_refused_naming_the_sizes():
    with pytest.raises(ValueError, match="28, 32, 64"):
        dcgan.Generator(16, 3, 48)
    with pytest.raises(ValueError, match="28, 32, 64"):
        dcgan.Discriminator(3, 16)


def test_dcgan_layers_and_init_follow_the_paper():
    torch.manual_seed(0)
    g = dcgan.Generator(100, 3, 64)
    d = dcgan.Discriminator(3, 64)
    convs = [m for m in g.modules() if isinstance(m, nn.ConvTranspose2d)]
    assert [c.out_channels for c in convs] == [512, 256, 128, 64, 3]
    assert all(isinstance(m, nn.ReLU) for m in g.main if isinstance(m, nn.ReLU))
    assert len(_batchnorms(g)) == 4  # every hidden layer, not the output
    # D: LeakyReLU 0.2, no BatchNorm on the first layer, BatchNorm on the others
    blocks = [m for m in d.main if isinstance(m, layers.ConvBlock)]
    assert [len(_batchnorms(b)) for b in blocks] == [0, 1, 1, 1]
    assert all(m.negative_slope == 0.2 for m in d.modules() if isinstance(m, nn.LeakyReLU))
    # weights from N(0, 0.02), BatchNorm's scale from N(1, 0.02), biases 0
    big = convs[1].weight.detach()
    assert abs(float(big.mean())) < 1e-3 and abs(float(big.std()) - 0.02) < 5e-4
    assert abs(float(blocks[3].block[0].weight.detach().std()) - 0.02) < 5e-4
    bn = _batchnorms(g)[0]
    assert abs(float(bn.weight.detach().mean()) - 1) < 0.01 and not bn.bias.any()


@pytest.mark.parametrize("size,middle", [(28, 7), (32, 8), (64, 16)])
def test_attention_sits_at_the_middle_resolution_of_both_networks(size, middle):
    g = dcgan.Generator(8, 3, size, attention=True, width=8)
    d = dcgan.Discriminator(3, size, attention=True, width=8)
    for net, x in ((g, torch.randn(2, 8)), (d, torch.randn(2, 3, size, size))):
        sides, hooks = _sides_into(net, layers.SelfAttention)
        net(x)
        assert sides == [middle]
        for h in hooks:
            h.remove()
    assert not any(isinstance(m, layers.SelfAttention)
                   for m in dcgan.Generator(8, 3, size, width=8).modules())


def test_spectral_norm_parametrizes_every_layer_of_d_and_drops_batchnorm():
    d = dcgan.Discriminator(3, 32, spectral=True, attention=True, width=8)
    weighted = [m for m in d.modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    assert weighted and all(torch.nn.utils.parametrize.is_parametrized(m, "weight")
                            for m in weighted)
    assert _batchnorms(d) == []
    plain = dcgan.Discriminator(3, 32, width=8)
    assert not any(torch.nn.utils.parametrize.is_parametrized(m) for m in plain.modules())


def test_build_reads_the_flags():
    g, d = dcgan.build({"latent_dim": 12, "image_size": 28, "gan_loss": "vanilla",
                        "gan_attention": True, "gan_width": 8}, 1)
    assert g(torch.randn(2, 12)).shape == (2, 1, 28, 28)
    assert any(isinstance(m, layers.SelfAttention) for m in d.modules())
    assert _batchnorms(d)
    _, critic = dcgan.build({"latent_dim": 12, "image_size": 32, "gan_loss": "wgan-gp",
                             "gan_width": 8}, 3)
    assert _batchnorms(critic) == []  # the gradient penalty treats samples one by one
    _, sn = dcgan.build({"latent_dim": 12, "image_size": 32, "gan_loss": "hinge",
                         "gan_spectral_norm": True, "gan_width": 8}, 3)
    assert _batchnorms(sn) == [] and torch.nn.utils.parametrize.is_parametrized(sn.main[-1])


# ----------------------------------------------------------------------------- losses

@pytest.fixture
def pair():
    torch.manual_seed(0)
    return dcgan.Generator(8, 3, 32, width=8), dcgan.Discriminator(3, 32, width=8)


def test_discriminator_loss_vanilla_is_both_bces_and_reports_probabilities(pair):
    g, d = pair
    real = torch.rand(4, 3, 32, 32) * 2 - 1
    fake = g(torch.randn(4, 8))
    d.eval()  # BatchNorm on running statistics: the same scores on the second call
    loss, figures = dcgan.discriminator_loss(d, real, fake, "vanilla")
    r, f = d(real), d(fake)
    expected = F.softplus(-r).mean() + F.softplus(f).mean()  # -log s(r) - log(1 - s(f))
    assert torch.allclose(loss, expected, atol=1e-6)
    assert torch.allclose(figures["d_real"], torch.sigmoid(r).mean())
    assert torch.allclose(figures["d_fake"], torch.sigmoid(f).mean())
    assert set(figures) == {"loss_d", "d_real", "d_fake"}
    assert all(not t.requires_grad and t.dim() == 0 for t in figures.values())
    loss.backward()
    assert all(p.grad is None for p in g.parameters())  # fake is detached
    assert all(p.grad is not None for p in d.parameters() if p.requires_grad)


@pytest.mark.parametrize("kind", ["lsgan", "hinge"])
def test_lsgan_and_hinge_report_the_mean_output(pair, kind):
    g, d = pair
    d.eval()
    real, fake = torch.rand(4, 3, 32, 32), g(torch.randn(4, 8))
    loss, figures = dcgan.discriminator_loss(d, real, fake, kind)
    r, f = d(real), d(fake)
    assert torch.allclose(figures["d_real"], r.mean()) and torch.allclose(figures["d_fake"],
                                                                          f.mean())
    if kind == "lsgan":
        expected = ((r - 1) ** 2).mean() + (f ** 2).mean()
    else:
        expected = F.relu(1 - r).mean() + F.relu(1 + f).mean()
    assert torch.allclose(loss, expected, atol=1e-6)


def test_wgan_gp_adds_the_penalty_and_refuses_a_batchnorm_critic(pair):
    g, d = pair
    real, fake = torch.rand(4, 3, 32, 32), g(torch.randn(4, 8))
    with pytest.raises(ValueError, match="without BatchNorm"):
        dcgan.discriminator_loss(d, real, fake, "wgan-gp")
    critic = dcgan.Discriminator(3, 32, batch_norm=False, width=8)
    torch.manual_seed(3)
    loss, figures = dcgan.discriminator_loss(critic, real, fake, "wgan-gp", gp_weight=5.0)
    torch.manual_seed(3)
    from losses import gradient_penalty
    penalty = gradient_penalty(critic, real, fake, 5.0)
    assert torch.allclose(figures["gradient_penalty"], penalty)
    expected = -critic(real).mean() + critic(fake).mean() + penalty
    assert torch.allclose(loss, expected, atol=1e-6)
    assert set(figures) == {"loss_d", "d_real", "d_fake", "gradient_penalty"}


@pytest.mark.parametrize("kind", dcgan.GAN_LOSSES)
def test_losses_are_float32_under_bf16_autocast(kind):
    torch.manual_seed(0)
    g = dcgan.Generator(8, 3, 32, width=8)
    d = dcgan.Discriminator(3, 32, batch_norm=kind != "wgan-gp", width=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fake = g(torch.randn(4, 8))
        loss_d, figures = dcgan.discriminator_loss(d, torch.rand(4, 3, 32, 32), fake, kind)
        loss_g, figures_g = dcgan.generator_loss(d, fake, kind)
    assert loss_d.dtype == loss_g.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in {**figures, **figures_g}.values())


def test_unknown_gan_loss_names_the_choices(pair):
    g, d = pair
    with pytest.raises(ValueError, match="vanilla, lsgan, hinge, wgan-gp"):
        dcgan.generator_loss(d, torch.rand(2, 3, 32, 32), "wgan")


@pytest.mark.parametrize("kind,formula", [
    ("vanilla", lambda s: F.softplus(-s).mean()),  # non-saturating: -log D(G(z))
    ("lsgan", lambda s: ((s - 1) ** 2).mean()),
    ("hinge", lambda s: -s.mean()),
    ("wgan-gp", lambda s: -s.mean())])
def test_generator_loss_and_its_gradient_reaches_g(pair, kind, formula):
    g, d = pair
    d.eval()
    fake = g(torch.randn(4, 8))
    loss, figures = dcgan.generator_loss(d, fake, kind)
    assert torch.allclose(loss, formula(d(fake)), atol=1e-6)
    assert set(figures) == {"loss_g"} and not figures["loss_g"].requires_grad
    loss.backward()
    assert all(p.grad is not None for p in g.parameters())


# ---------------------------------------------------------------- latents and the grid

def test_fixed_latents_depend_on_the_seed_alone():
    torch.manual_seed(1)
    a = dcgan.fixed_latents(6, 10, seed=7)
    state = torch.get_rng_state()
    torch.manual_seed(99)
    b = dcgan.fixed_latents(6, 10, seed=7)
    assert torch.equal(a, b) and a.shape == (6, 10) and a.dtype == torch.float32
    assert not torch.equal(a, dcgan.fixed_latents(6, 10, seed=8))
    torch.manual_seed(1)
    dcgan.fixed_latents(6, 10, seed=7)
    assert torch.equal(torch.get_rng_state(), state)  # the global generator is not advanced


def test_sample_grid_is_the_samples_in_uint8_in_eval_mode():
    torch.manual_seed(0)
    g = dcgan.Generator(8, 1, 28, width=8)
    z = dcgan.fixed_latents(4, 8, seed=0)
    running = _batchnorms(g)[0].running_mean.clone()
    grid = _generative.sample_grid(g, z)
    assert isinstance(grid, np.ndarray) and grid.dtype == np.uint8
    assert grid.shape == (2 + 2 * 30, 2 + 2 * 30, 3)  # 2 x 2 images of 28, 2 px apart
    assert g.training and torch.equal(_batchnorms(g)[0].running_mean, running)
    g.eval()
    with torch.no_grad():
        images = g(z)
    first = ((images[0, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    assert np.array_equal(grid[2:30, 2:30, 0], first)  # the first sample, top left
    assert np.array_equal(grid[2:30, 2:30, 2], first)  # grey: three equal channels
    second = ((images[1, 0] + 1) * 127.5).round().clamp(0, 255).to(torch.uint8).numpy()
    assert np.array_equal(grid[2:30, 32:60, 1], second)


def test_to_uint8_maps_the_ends_of_the_range():
    x = torch.tensor([-1.5, -1.0, 0.0, 1.0, 2.0])
    assert gan_metrics.to_uint8(x).tolist() == [0, 0, 128, 255, 255]


# ---------------------------------------------------------------------------- FID, KID

def test_inception_fid_without_its_file_is_one_line_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "home"))
    expected = tmp_path / "home" / "hub" / "checkpoints" / gan_metrics.INCEPTION_FILE
    assert gan_metrics.inception_weights_path() == str(expected)
    with pytest.raises(UserError) as e:
        gan_metrics.build_features(None)
    assert str(expected) in str(e.value) and "\n" not in str(e.value)
    assert "--fid-features" in str(e.value)


def test_inception_weights_holding_pickled_code_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    path = gan_metrics.inception_weights_path()
    os.makedirs(os.path.dirname(path))
    torch.save({"x": torch.zeros(1), "code": os.getcwd}, path)  # a function: pickled code
    with pytest.raises(UserError, match="cannot be loaded safely .* put https://"):
        gan_metrics.InceptionFeatures()
    with open(path, "wb") as f:  # a download cut short
        f.write(b"PK\x03\x04" + bytes(100))
    with pytest.raises(UserError, match="cannot be loaded safely"):
        gan_metrics.InceptionFeatures()


def test_inception_features_from_a_weights_file_in_torch_fidelitys_format(tmp_path,
                                                                          monkeypatch):
    # Random weights in the file's format (its keys and shapes, no download): the path
    # through torchmetrics' NoTrainInceptionV3 runs, grey images become three channels.
    from torch_fidelity import feature_extractor_inceptionv3 as fidelity

    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    with monkeypatch.context() as m:
        m.setattr(fidelity.FeatureExtractorInceptionV3, "load_state_dict",
                  lambda self, *a, **k: None)
        m.setattr(fidelity, "load_state_dict_from_url", lambda *a, **k: {})
        state = fidelity.FeatureExtractorInceptionV3("inception-v3-compat", ["2048"]).state_dict()
    path = gan_metrics.inception_weights_path()
    os.makedirs(os.path.dirname(path))
    torch.save(state, path)
    features = gan_metrics.InceptionFeatures()
    assert features.name == "inception" and features(torch.rand(2, 1, 28, 28)).shape == (2, 2048)
    del state["Conv2d_1a_3x3.conv.weight"]
    torch.save(state, path)
    with pytest.raises(UserError, match="is not torch-fidelity's Inception-v3"):
        gan_metrics.InceptionFeatures()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A classifier checkpoint of train.py (mlp, synthetic 3x8x8, one epoch)."""
    import train

    run = tmp_path_factory.mktemp("classifier") / "run"
    assert train.main(tiny_args(run, "--synthetic-size", "128")) == 0
    return str(run / "checkpoints" / "best.pt")


def _synthetic(n, seed=0):
    """The classifier's kind of images: train.py's synthetic set, validation split."""
    s = data.SyntheticImages(n, 10, 3, 8, seed, "val")
    return s.images, s.labels


def test_classifier_features_are_the_input_of_the_last_linear(classifier):
    features = gan_metrics.build_features(classifier)
    assert features.name == "classifier" and features.num_features == 512  # mlp's hidden
    x, _ = _synthetic(4)
    inner = features.net.hidden(features.net.flatten(x))
    assert torch.allclose(features(x), inner)
    # grey images at another size reach it as three channels at its size
    assert features(torch.rand(3, 1, 28, 28)).shape == (3, 512)


def test_fid_kid_of_a_set_with_itself_is_zero_and_of_other_classes_larger(classifier):
    features = gan_metrics.build_features(classifier)
    x, y = _synthetic(256)
    low, high = x[y < 5], x[y >= 5]  # two distributions: different class templates
    halves = gan_metrics.measure(features, low[::2], low[1::2])  # same distribution
    other = gan_metrics.measure(features, low[::2], high[1::2])
    assert set(other) == {"fid_classifier", "kid_classifier", "kid_std_classifier"}
    assert other["fid_classifier"] > 2 * halves["fid_classifier"] > 0
    assert other["kid_classifier"] > 10 * abs(halves["kid_classifier"])
    same = gan_metrics.measure(features, low, low.clone())
    # zero up to rounding; KID's unbiased estimate of a set against itself is a little
    # below zero (its cross term keeps each image's kernel with itself)
    assert abs(same["fid_classifier"]) < 1e-6 * other["fid_classifier"]
    assert abs(same["kid_classifier"]) < 0.1 * other["kid_classifier"]


def test_a_nan_image_gives_nan_figures_not_a_crash(classifier):
    # torch.linalg.eigvals on NaN kills the process (LAPACK's DGEBAL, a segfault): a
    # generator that diverged must not take the run down with it
    features = gan_metrics.build_features(classifier)
    x, _ = _synthetic(8)
    fake = x.clone()
    fake[3, 0, 0, 0] = float("nan")
    scores = gan_metrics.measure(features, x, fake)
    assert set(scores) == {"fid_classifier", "kid_classifier", "kid_std_classifier"}
    assert all(math.isnan(v) for v in scores.values())


def test_generator_scores_are_seeded_and_take_the_first_n_real_images(classifier,
                                                                      monkeypatch):
    monkeypatch.setattr(gan_metrics, "KID_SUBSET_SIZE", 10)  # KID draws subsets: seeded
    features = gan_metrics.build_features(classifier)
    torch.manual_seed(0)
    g = dcgan.Generator(8, 3, 28, width=8)
    x, _ = _synthetic(40)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x[:, 0, 0, 0]),
                                         batch_size=16)
    torch.manual_seed(5)
    a = gan_metrics.generator_scores(g, loader, features, n=24, seed=3)
    torch.manual_seed(6)  # the global generator plays no part
    b = gan_metrics.generator_scores(g, x[:24], features, n=24, seed=3)
    assert a == b and a["fid_classifier"] > 0 and a["kid_std_classifier"] > 0
    c = gan_metrics.generator_scores(g, x[:24], features, n=24, seed=4)
    assert c["fid_classifier"] != a["fid_classifier"]  # other latents
    with pytest.raises(UserError, match="--fid-samples 50: there are only 40 real images"):
        gan_metrics.generator_scores(g, loader, features, n=50, seed=3)


def test_fid_features_refuses_what_is_not_a_classifier_checkpoint(tmp_path, classifier):
    from machinery import checkpoint

    with pytest.raises(UserError, match="^--fid-features: checkpoint .* does not exist"):
        gan_metrics.build_features(str(tmp_path / "missing.pt"))
    state = checkpoint.load_checkpoint(classifier)
    state["config"].update(task="segmentation", network="unet")  # what such a run trains
    torch.save(state, tmp_path / "seg.pt")
    with pytest.raises(UserError, match="needs a classifier's checkpoint.*--task segmentation"):
        gan_metrics.build_features(str(tmp_path / "seg.pt"))
    torch.save({"weights": torch.zeros(1)}, tmp_path / "other.pt")
    with pytest.raises(UserError, match="not a training checkpoint"):
        gan_metrics.build_features(str(tmp_path / "other.pt"))


def test_kids_seeded_subsets_leave_every_generator_as_it_was(classifier, monkeypatch):
    """The CUDA review's L1: KID's subsets are drawn from the seed, and neither the CPU's
    generator nor any CUDA generator is re-seeded by it (torch.manual_seed would re-seed
    every CUDA generator, which fork_rng(devices=[]) does not restore: on a GPU the
    WGAN-GP alphas repeated after each validation)."""
    reseeded = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda seed: reseeded.append(seed))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda seed: reseeded.append(seed))
    features = gan_metrics.build_features(classifier)
    x, _ = _synthetic(64)
    before = torch.get_rng_state()
    first = gan_metrics.measure(features, x[::2], x[1::2], seed=5)
    assert torch.equal(torch.get_rng_state(), before) and reseeded == []
    assert gan_metrics.measure(features, x[::2], x[1::2], seed=5) == first


@pytest.mark.parametrize("size", [46, 50, 48])
def test_uneven_last_batches_give_each_process_its_own_latents(size):
    """Round 5's promise 5: where a global batch does not split evenly across the
    processes (an epoch's last: 10 over 3 as 4 + 3 + 3, 2 as 1 + 1 + 0), each process's
    ``Where`` counts the larger shares before it: over the processes and micro-batches of
    a step the slices of the step's draw tile it, each slice the positions of that
    process's own samples in the epoch's order, so no two processes draw the same
    latents."""
    from machinery import engine

    world, batch, accum = 3, 4, 2
    order = data.EpochBatchSampler(size, batch, seed=1, world_size=world)._order().tolist()
    slices = {}  # step -> [(offset, count)]
    for rank in range(world):
        sampler = data.EpochBatchSampler(size, batch, seed=1, rank=rank, world_size=world)
        plan = sampler.plan()
        starts = [0, *itertools.accumulate(g for g, _ in plan)]
        for k, local in enumerate(sampler.index_batches()):
            first = k - k % accum
            where = engine._where(sampler, plan, starts, 0, first, accum, k)
            if plan[k][1] == 0:
                continue  # a stand-in batch, weighted 0
            positions = [order.index(i) for i in local.tolist()]
            assert positions == list(range(where.first + where.offset,
                                           where.first + where.offset + where.count))
            slices.setdefault(where.first, []).append((where.offset, where.count,
                                                       where.step_samples))
    for first, parts in slices.items():
        covered = sorted(i for offset, count, _ in parts for i in range(offset, offset + count))
        assert covered == list(range(parts[0][2])), (first, parts)


def test_a_normalised_sets_classifier_sees_images_as_it_was_trained_on(tmp_path):
    """Round 5's promise 6: --fid-features with a classifier trained on MNIST (normalised
    with MNIST's mean and std): images in [-1, 1] (the generator's range, and the real
    ones brought there) are mapped to [0, 1], then normalised as data.py normalised its
    training images, before the classifier sees them."""
    import train
    from pipeline import sample_transforms

    write_mnist(tmp_path / "data")
    run = tmp_path / "run"
    assert train.main(["--dataset", "mnist", "--data-dir", str(tmp_path / "data"),
                       "--network", "mlp", "--epochs", "1", "--batch-size", "16",
                       "--num-workers", "0", "--run-dir", str(run)]) == 0
    features = gan_metrics.build_features(str(run / "checkpoints" / "last.pt"))
    mean, std = sample_transforms.STATS["mnist"]
    images = torch.rand(4, 1, 28, 28) * 2 - 1
    seen = []
    hook = features.net.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    features(images)
    hook.remove()
    expected = ((images + 1) / 2 - torch.tensor(mean).view(1, -1, 1, 1)) / \
        torch.tensor(std).view(1, -1, 1, 1)
    torch.testing.assert_close(seen[0], expected)

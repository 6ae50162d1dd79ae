"""recipes.py: EMA, MixUp/CutMix (BatchMix), the augmentation policies and random erasing."""

import copy
import io
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from helpers import assert_states_equal
from PIL import Image
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torchvision.transforms import v2

from machinery.checkpoint import CheckpointError
from ops import UserError
from pipeline import data, recipes, sample_transforms

# ------------------------------------------------------------------------------- EMA


def small_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(),
                         nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def sgd_step(net, optimizer, k):
    """One training step on batch number ``k`` (a function of k only)."""
    g = torch.Generator().manual_seed(1000 + k)
    x, y = torch.randn(8, 3, 8, 8, generator=g), torch.randint(3, (8,), generator=g)
    net.train()
    optimizer.zero_grad()
    F.cross_entropy(net(x), y).backward()
    optimizer.step()


def sgd_steps(net, optimizer, count, seed):
    """``count`` training steps on the batches ``seed * 100 + k``; yields after each."""
    for k in range(count):
        sgd_step(net, optimizer, seed * 100 + k)
        yield


@pytest.mark.parametrize("warmup", [False, True])
def test_ema_equals_a_hand_computation(warmup):
    net = small_net()
    decay = 0.9
    ema = recipes.EMA(net, decay, warmup=warmup)
    hand = {k: v.clone() for k, v in net.state_dict().items()}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for step, _ in enumerate(sgd_steps(net, optimizer, 4, seed=1), start=1):
        ema.update(net, step)
        d = min(decay, (1 + step) / (10 + step)) if warmup else decay
        for k, w in net.state_dict().items():
            hand[k] = d * hand[k] + (1 - d) * w if w.is_floating_point() else w.clone()
    if warmup:
        assert ema.decay_at(1) == pytest.approx(2 / 11) and ema.decay_at(10**6) == decay
    got = ema.state_dict()
    assert set(got) == set(net.state_dict())  # the network's own keys, nothing else
    for k, v in hand.items():
        torch.testing.assert_close(got[k], v, rtol=1e-6, atol=1e-6, msg=k)
    assert int(got["1.num_batches_tracked"]) == 4  # copied, not averaged
    assert not torch.equal(got["1.running_mean"], net.state_dict()["1.running_mean"])
    assert not ema.module.training
    assert not any(p.requires_grad for p in ema.module.parameters())


def test_ema_matches_torch_averaged_model_on_float_tensors():
    """Without warmup the average is AveragedModel's with get_ema_multi_avg_fn (started
    from the same weights), bit for bit; only num_batches_tracked differs: it truncates."""
    net = small_net()
    ours = recipes.EMA(net, 0.95, warmup=False)
    theirs = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.95), use_buffers=True)
    theirs.update_parameters(net)  # its first update copies the weights: ema_0
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for step, _ in enumerate(sgd_steps(net, optimizer, 5, seed=2), start=1):
        ours.update(net, step)
        theirs.update_parameters(net)
    mine, torch_sd = ours.state_dict(), theirs.module.state_dict()
    for k, v in mine.items():
        if v.is_floating_point():
            assert torch.equal(v, torch_sd[k]), k
    assert int(mine["1.num_batches_tracked"]) == 5
    assert int(torch_sd["1.num_batches_tracked"]) != 5
    # An AveragedModel's state_dict (torchvision's reference scripts save one) loads too.
    fresh = recipes.EMA(small_net(seed=3), 0.95)
    fresh.load_state_dict(theirs.state_dict())
    assert torch.equal(fresh.state_dict()["4.weight"], torch_sd["4.weight"])


def test_ema_resumes_exactly_through_a_weights_only_file(tmp_path):
    """Stopped after step 3, saved, loaded into fresh objects: steps 4-6 give the same
    average, bit for bit, as a run that never stopped."""
    net = small_net()
    ema = recipes.EMA(net, 0.99, warmup=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5, momentum=0.9)
    for step in range(1, 4):
        sgd_step(net, optimizer, step)
        ema.update(net, step)
    path = tmp_path / "ckpt.pt"
    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                "ema": ema.state_dict(), "step": 3}, path)
    for step in range(4, 7):  # the run that never stopped
        sgd_step(net, optimizer, step)
        ema.update(net, step)

    saved = torch.load(path, weights_only=True)
    net2 = small_net(seed=9)  # other weights: everything must come from the file
    net2.load_state_dict(saved["model"])
    optimizer2 = torch.optim.SGD(net2.parameters(), lr=0.5, momentum=0.9)
    optimizer2.load_state_dict(saved["optimizer"])
    ema2 = recipes.EMA(net2, 0.99, warmup=True)
    ema2.load_state_dict(saved["ema"])
    for step in range(saved["step"] + 1, 7):
        sgd_step(net2, optimizer2, step)
        ema2.update(net2, step)
    assert_states_equal(ema2.state_dict(), ema.state_dict())
    assert not torch.equal(ema.state_dict()["4.weight"], net.state_dict()["4.weight"])


def test_ema_refuses_a_state_dict_of_another_network():
    ema = recipes.EMA(small_net(), 0.9)
    other = nn.Linear(3, 3).state_dict()
    with pytest.raises(CheckpointError, match="does not fit"):
        ema.load_state_dict(other, "x.pt")
    with pytest.raises(ValueError):
        recipes.EMA(small_net(), 1.0)


def test_ema_module_evaluates_and_sync_is_a_no_op_in_one_process():
    net = small_net()
    ema = recipes.EMA(net, 0.9)
    before = copy.deepcopy(ema.state_dict())
    ema.sync_buffers()
    assert_states_equal(ema.state_dict(), before)
    x = torch.randn(2, 3, 8, 8)
    net.eval()
    assert torch.equal(ema.module(x), net(x))  # ema_0 is the network
    assert recipes.build_ema({"ema_decay": 0.0}, net) is None
    built = recipes.build_ema({"ema_decay": 0.999, "ema_warmup": False}, net)
    assert built.decay == 0.999 and not built.warmup


def _sync_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        ema = recipes.EMA(small_net(), 0.9)
        with torch.no_grad():
            for b in ema.module.buffers():
                b.add_(rank + 1)  # each process's statistics drifted its own way
        ema.sync_buffers()
        torch.save(ema.state_dict(), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_sync_buffers_gives_every_process_rank_zeros_statistics(tmp_path):
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_sync_worker, args=(2, port, str(tmp_path)), nprocs=2,
                       start_method="fork")
    zero, one = (torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in (0, 1))
    assert_states_equal(zero, one)
    want = small_net().state_dict()
    assert torch.equal(zero["1.running_var"], want["1.running_var"] + 1)
    assert int(zero["1.num_batches_tracked"]) == 1


def test_ema_updates_through_a_wrapper_like_from_the_plain_network():
    net = small_net()
    plain, wrapped = recipes.EMA(net, 0.9), recipes.EMA(net, 0.9)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    for step, _ in enumerate(sgd_steps(net, optimizer, 2, seed=5), start=1):
        plain.update(net, step)
        wrapped.update(nn.DataParallel(net), step)  # DDP/compile wrap the same tensors
    assert_states_equal(wrapped.state_dict(), plain.state_dict())
    with pytest.raises(ValueError, match="parameters and buffers"):
        plain.update(nn.Linear(2, 2), 3)


def test_ema_does_not_share_or_keep_gradients():
    net = small_net()
    F.cross_entropy(net(torch.randn(2, 3, 8, 8)), torch.tensor([0, 1])).backward()
    ema = recipes.EMA(net, 0.9)
    assert all(p.grad is None for p in ema.module.parameters())
    assert all(a.data_ptr() != b.data_ptr()
               for a, b in zip(ema.module.parameters(), net.parameters()))


# --------------------------------------------------------------------- MixUp, CutMix


def batch(n=8, c=3, h=6, w=5, classes=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, h, w, generator=g), torch.randint(classes, (n,), generator=g)


def draw_of(mix, kind, start=0):
    """The first draw of ``kind`` at positions start, start + 1, ..."""
    for position in range(start, start + 200):
        d = mix.draw(0, position, 8, 6, 5)
        if d.kind == kind:
            return position, d
    raise AssertionError(f"no {kind} draw")


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mix_equals_a_hand_computation(kind):
    x, y = batch()
    mix = recipes.BatchMix(0.4, 1.0, 1.0, num_classes=4, seed=3)
    position, d = draw_of(mix, kind)
    got_x, got_t = mix(x, y, 0, position)
    onehot = F.one_hot(y, 4).float()
    p = d.perm
    assert sorted(p.tolist()) == list(range(8))
    if kind == "mixup":
        assert 0 < d.lam < 1
        want_x = d.lam * x + (1 - d.lam) * x[p]
    else:
        x1, y1, x2, y2 = d.box
        assert 0 <= x1 <= x2 <= 5 and 0 <= y1 <= y2 <= 6
        want_x = x.clone()
        want_x[:, :, y1:y2, x1:x2] = x[p][:, :, y1:y2, x1:x2]
        assert d.lam == pytest.approx(1 - (x2 - x1) * (y2 - y1) / 30)
    torch.testing.assert_close(got_x, want_x)
    torch.testing.assert_close(got_t, d.lam * onehot + (1 - d.lam) * onehot[p])
    torch.testing.assert_close(got_t.sum(1), torch.ones(8))
    assert not torch.equal(got_x, x)  # and the input is left as it was:
    assert torch.equal(x, batch()[0])


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mix_arithmetic_is_torchvisions(kind):
    """With torchvision's pairing (each sample with the one before it) and the same lam
    and box, the images and targets are v2.MixUp's and v2.CutMix's."""
    x, y = batch()
    mix = recipes.BatchMix(1.0, 1.0, 1.0, num_classes=4, seed=0)
    _, d = draw_of(mix, kind)
    roll = torch.arange(8).roll(1)  # x.roll(1, 0)[i] == x[roll[i]]
    got_x, got_t = mix.apply(x, y, d._replace(perm=roll))
    params = {"labels": y, "batch_size": 8}
    if kind == "mixup":
        tv, params["lam"] = v2.MixUp(alpha=1.0, num_classes=4), d.lam
    else:
        tv = v2.CutMix(alpha=1.0, num_classes=4)
        params.update(box=d.box, lam_adjusted=d.lam)
    torch.testing.assert_close(got_x, tv.transform(x, params))
    torch.testing.assert_close(got_t, tv.transform(y, params))


def test_mix_depends_on_seed_epoch_and_position_only():
    x, y = batch(n=16, h=8, w=8)
    mix = recipes.BatchMix(0.8, 1.0, 1.0, num_classes=4, seed=7)
    a = mix(x, y, 2, 128)
    b = recipes.BatchMix(0.8, 1.0, 1.0, num_classes=4, seed=7)(x.clone(), y.clone(), 2, 128)
    assert_states_equal(a, b)
    for other in (mix(x, y, 3, 128), mix(x, y, 2, 144),
                  recipes.BatchMix(0.8, 1.0, 1.0, num_classes=4, seed=8)(x, y, 2, 128)):
        assert not torch.equal(other[1], a[1])
    # The global RNG is neither read nor moved.
    state = torch.get_rng_state()
    torch.manual_seed(123)
    c = mix(x, y, 2, 128)
    assert_states_equal(c, a)
    assert torch.equal(torch.get_rng_state(), torch.manual_seed(123).get_state())
    torch.set_rng_state(state)


def test_mix_prob_choice_and_lam_follow_their_distributions():
    mix = recipes.BatchMix(0.2, 1.0, 0.6, num_classes=4, seed=0)
    kinds = [mix.draw(0, i, 4, 8, 8).kind for i in range(2000)]
    assert kinds.count("none") / 2000 == pytest.approx(0.4, abs=0.04)
    assert kinds.count("mixup") / 2000 == pytest.approx(0.3, abs=0.04)
    only = recipes.BatchMix(1.0, 0.0, 1.0, num_classes=4, seed=0)
    lams = torch.tensor([only.draw(0, i, 4, 8, 8).lam for i in range(2000)])
    assert lams.mean() == pytest.approx(0.5, abs=0.03)  # Beta(1, 1): uniform
    assert (lams < 0.1).float().mean() == pytest.approx(0.1, abs=0.03)
    assert {only.draw(0, i, 4, 8, 8).kind for i in range(50)} == {"mixup"}


def test_unmixed_batches_get_one_hot_targets():
    x, y = batch()
    never = recipes.BatchMix(1.0, 1.0, 0.0, num_classes=4, seed=0)
    got_x, got_t = never(x, y, 0, 0)
    assert got_x is x and torch.equal(got_t, F.one_hot(y, 4).float())
    assert recipes.build_batch_mix({"mixup_alpha": 0.0, "cutmix_alpha": 0.0,
                                    "mix_prob": 1.0, "seed": 0}, 4) is None
    assert recipes.build_batch_mix({"mixup_alpha": 0.2, "cutmix_alpha": 0.0,
                                    "mix_prob": 0.0, "seed": 0}, 4) is None
    assert recipes.build_batch_mix({"mixup_alpha": 0.8, "cutmix_alpha": 1.0,
                                    "mix_prob": 1.0, "seed": 0}, 4).cutmix_alpha == 1.0


def test_a_batch_of_one_is_its_own_partner():
    x, y = batch(n=1)
    got_x, got_t = recipes.BatchMix(0.5, 0.5, 1.0, num_classes=4, seed=0)(x, y, 0, 0)
    torch.testing.assert_close(got_x, x)
    torch.testing.assert_close(got_t, F.one_hot(y, 4).float())


@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mix_keeps_channels_last(kind):
    x, y = batch()
    mix = recipes.BatchMix(1.0, 1.0, 1.0, num_classes=4, seed=0)
    position, _ = draw_of(mix, kind)
    plain = mix(x, y, 0, position)
    last = mix(x.contiguous(memory_format=torch.channels_last), y, 0, position)
    assert last[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(last[0], plain[0])
    assert torch.equal(last[1], plain[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["mixup", "cutmix"])
def test_mix_on_cuda_equals_cpu(kind):
    x, y = batch()
    mix = recipes.BatchMix(1.0, 1.0, 1.0, num_classes=4, seed=0)
    position, _ = draw_of(mix, kind)
    cpu = mix(x, y, 0, position)
    xc = x.cuda().contiguous(memory_format=torch.channels_last)
    gpu = mix(xc, y.cuda(), 0, position)
    assert gpu[0].is_cuda and gpu[0].is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(gpu[0].cpu(), cpu[0])
    torch.testing.assert_close(gpu[1].cpu(), cpu[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_sync_in_ema_update_or_batch_mix_on_cuda():
    """The loop avoids host-device syncs per step; the recipes add none. (And
    AveragedModel, which EMA's docstring says syncs at every update, does.)"""
    net = small_net().cuda()
    ema = recipes.EMA(net, 0.999)
    averaged = AveragedModel(net, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
    averaged.update_parameters(net)
    mix = recipes.BatchMix(1.0, 1.0, 1.0, num_classes=4, seed=0)
    x, y = batch()
    x, y = x.cuda().contiguous(memory_format=torch.channels_last), y.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for step in range(1, 4):
            ema.update(net, step)
        for position in range(20):  # MixUp and CutMix draws
            mix(x, y, 0, position)
        with pytest.raises(RuntimeError):
            averaged.update_parameters(net)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_label_smoothing_of_the_loss_applies_to_soft_targets():
    """CrossEntropyLoss(label_smoothing=e) on probability targets is the cross-entropy
    with (1 - e) * t + e / C: the mix of the smoothed one-hot labels (timm's order)."""
    torch.manual_seed(0)
    logits, classes, e = torch.randn(8, 5), 5, 0.1
    x, y = batch(classes=classes)
    mix = recipes.BatchMix(1.0, 0.0, 1.0, num_classes=classes, seed=0)
    d = mix.draw(0, 0, 8, 6, 5)
    _, soft = mix.apply(x, y, d)
    loss = nn.CrossEntropyLoss(label_smoothing=e)(logits, soft)
    log_q = logits.log_softmax(1)
    want = -(((1 - e) * soft + e / classes) * log_q).sum(1).mean()
    torch.testing.assert_close(loss, want)
    smooth = (1 - e) * F.one_hot(y, classes).float() + e / classes
    mixed_smooth = d.lam * smooth + (1 - d.lam) * smooth[d.perm]
    torch.testing.assert_close(loss, -(mixed_smooth * log_q).sum(1).mean())
    # Unmixed one-hot targets give the same loss as class indices.
    onehot_loss = nn.CrossEntropyLoss(label_smoothing=e)(logits, F.one_hot(y, classes).float())
    torch.testing.assert_close(onehot_loss, nn.CrossEntropyLoss(label_smoothing=e)(logits, y))


# ------------------------------------------------------------------------- policies

SHAPES = [(3, 32, 32, "cifar10"), (1, 28, 28, "mnist"), (1, 28, 28, "fashion_mnist"),
          (3, 37, 23, "imagefolder"), (3, 17, 17, "cifar100")]


@pytest.mark.parametrize("policy", recipes.POLICIES)
@pytest.mark.parametrize("channels,height,width,name", SHAPES)
def test_policies_run_on_every_kind_of_image(policy, channels, height, width, name):
    before, after = recipes.policy_transforms(policy, 9, 0.5, name)
    assert len(before) == (policy != "none") and len(after) == 1
    torch.manual_seed(0)
    for _ in range(20):  # several operations of the policy
        image = torch.randint(256, (channels, height, width), dtype=torch.uint8)
        out = v2.Compose(before)(image) if before else image
        assert out.shape == image.shape and out.dtype == torch.uint8
        normalised = out.float() / 255 - 0.5
        erased = after[0](normalised)
        assert erased.shape == normalised.shape and erased.dtype == torch.float32


def test_policy_choices_and_errors():
    digits, _ = recipes.policy_transforms("autoaugment", 9, 0.0, "mnist")
    assert digits[0].policy == v2.AutoAugmentPolicy.SVHN
    cifar, after = recipes.policy_transforms("autoaugment", 9, 0.0, "cifar100")
    assert cifar[0].policy == v2.AutoAugmentPolicy.CIFAR10 and after == []
    folder, _ = recipes.policy_transforms("autoaugment", 9, 0.0, "imagefolder")
    assert folder[0].policy == v2.AutoAugmentPolicy.IMAGENET
    rand, _ = recipes.policy_transforms("randaugment", 13, 0.0, "cifar10")
    assert rand[0].magnitude == 13 and rand[0].num_ops == 2
    trivial, _ = recipes.policy_transforms("trivialaugment", 9, 0.0, "fashion_mnist")
    rotate = trivial[0]._AUGMENTATION_SPACE["Rotate"][0](31, 28, 28)
    assert float(rotate.max()) == 30.0  # not 135: a turned 6 is a 9
    assert list(trivial[0]._AUGMENTATION_SPACE) == list(
        v2.TrivialAugmentWide._AUGMENTATION_SPACE)  # the same operations, in order
    wide, _ = recipes.policy_transforms("trivialaugment", 9, 0.0, "cifar10")
    assert type(wide[0]) is v2.TrivialAugmentWide
    for bad in ("autoaugmentt", "AutoAugment", ""):
        with pytest.raises(UserError, match="unknown --auto-augment"):
            recipes.policy_transforms(bad, 9, 0.0, "cifar10")
    with pytest.raises(UserError, match="magnitude"):
        recipes.policy_transforms("randaugment", 31, 0.0, "cifar10")
    with pytest.raises(UserError, match="random-erase"):
        recipes.policy_transforms("none", 9, 1.5, "cifar10")


def test_no_policy_flips_an_image():
    """A left-right asymmetric image never comes back mirrored (torchvision's policies
    have no flip; this would catch one added)."""
    image = torch.zeros(1, 16, 16, dtype=torch.uint8)
    image[:, 4:12, 2:5] = 255  # a bar on the left
    for policy in ("trivialaugment", "randaugment", "autoaugment"):
        before, _ = recipes.policy_transforms(policy, 5, 0.0, "mnist")
        torch.manual_seed(0)
        for _ in range(100):
            out = before[0](image).float()
            assert not torch.equal(out, image.flip(-1).float())


class PilImages(torch.utils.data.Dataset):
    """Random PIL images, as the torchvision datasets return them."""

    def __init__(self, n, channels, size):
        g = torch.Generator().manual_seed(0)
        self.images = torch.randint(256, (n, size, size, channels), dtype=torch.uint8,
                                    generator=g)

    def __len__(self):
        return len(self.images)

    def __getitem__(self, index):
        array = self.images[index].numpy()
        return Image.fromarray(array[..., 0] if array.shape[-1] == 1 else array), index % 3


def seeded(name, policy, erase, channels, size, seed=0):
    """A SeededDataset whose transform is data._transforms' with the recipes inserted,
    as the lead wires them: crop, flip, policy, to float, normalise, erase."""
    before, after = recipes.policy_transforms(policy, 9, erase, name)
    aug = [v2.RandomCrop(size, padding=size // 8)]
    if name not in recipes.DIGITS:
        aug.append(v2.RandomHorizontalFlip())
    transform = v2.Compose([v2.ToImage(), *aug, *before, v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize(*sample_transforms.STATS[name]), *after])
    return data.SeededDataset(PilImages(6, channels, size), transform, seed, True,
                              ["a", "b", "c"], channels, size)


@pytest.mark.parametrize("policy", ["trivialaugment", "randaugment", "autoaugment"])
@pytest.mark.parametrize("name,channels,size", [("cifar10", 3, 32), ("mnist", 1, 28)])
def test_policies_are_deterministic_per_seed_epoch_and_index(policy, name, channels, size):
    ds = seeded(name, policy, 0.5, channels, size)
    again = seeded(name, policy, 0.5, channels, size)
    torch.manual_seed(1)  # the global stream does not matter
    first = [ds[(i, 3)][0] for i in range(6)]
    torch.manual_seed(2)
    for i in reversed(range(6)):  # nor the order in which samples are read
        assert torch.equal(again[(i, 3)][0], first[i])
        assert first[i].shape == (channels, size, size)
    other_epoch = [ds[(i, 4)][0] for i in range(6)]
    assert sum(not torch.equal(a, b) for a, b in zip(first, other_epoch)) >= 5
    other_seed = seeded(name, policy, 0.5, channels, size, seed=1)
    assert sum(not torch.equal(other_seed[(i, 3)][0], first[i]) for i in range(6)) >= 5


def with_recipes(transform, before, after):
    """data._transforms' training transform with the recipes inserted as the lead wires
    them: the policy before the first step that makes floats, erasing at the end."""
    steps = list(transform.transforms)
    at = next(i for i, s in enumerate(steps)
              if type(s).__name__ in ("ToDtype", "Normalize", "Normalise"))
    return v2.Compose(steps[:at] + before + steps[at:] + after)


@pytest.mark.parametrize("name,channels,size", [("cifar100", 3, 32), ("mnist", 1, 28)])
def test_policies_in_the_projects_own_training_transform(name, channels, size):
    train, _ = data._transforms(name, size, True)
    transform = with_recipes(train, *recipes.policy_transforms("trivialaugment", 9, 0.5, name))
    ds = data.SeededDataset(PilImages(6, channels, size), transform, 0, True, ["a", "b", "c"],
                            channels, size)
    plain = data.SeededDataset(PilImages(6, channels, size), train, 0, True, ["a", "b", "c"],
                               channels, size)
    out = [ds[(i, 1)][0] for i in range(6)]
    assert all(o.shape == (channels, size, size) and o.dtype == torch.float32 for o in out)
    assert all(torch.equal(o, ds[(i, 1)][0]) for i, o in enumerate(out))
    assert sum(not torch.equal(o, plain[(i, 1)][0]) for i, o in enumerate(out)) >= 4


def test_random_erasing_follows_its_probability_and_fills_the_mean():
    ds = seeded("cifar10", "none", 1.0, 3, 32)
    plain = seeded("cifar10", "none", 0.0, 3, 32)
    for i in range(6):
        erased, kept = ds[(i, 0)][0], plain[(i, 0)][0]
        differ = (erased != kept).any(0)  # pixels the erasing changed
        assert differ.any() and (erased[:, differ] == 0).all()


def test_policies_on_the_synthetic_float_images():
    train = data.SyntheticImages(8, 3, 3, 16, seed=0, split="train")
    for policy in ("trivialaugment", "randaugment", "autoaugment"):
        before, after = recipes.policy_transforms(policy, 9, 0.25, "synthetic")
        ds = data.SeededDataset(train, v2.Compose([*before, *after]), 0, True,
                                train.classes, 3, 16)
        out = [ds[(i, 0)][0] for i in range(8)]
        assert all(o.dtype == torch.float32 and o.shape == (3, 16, 16) for o in out)
        assert all(torch.equal(o, ds[(i, 0)][0]) for i, o in enumerate(out))
        assert sum(not torch.equal(o, ds[(i, 1)][0]) for i, o in enumerate(out)) >= 6
    # Through the policy as uint8 and back: the image up to the 8/255 quantisation.
    image = train[0][0]
    back = recipes._OnUint8(v2.Identity())(image)
    assert float((back - image.clamp(-4, 4)).abs().max()) <= 4 / 255 + 1e-6


def test_a_composed_policy_pickles_for_spawned_workers():
    import pickle
    for name in ("mnist", "synthetic", "cifar10"):
        before, after = recipes.policy_transforms("trivialaugment", 9, 0.25, name)
        pickle.loads(pickle.dumps(v2.Compose([*before, *after])))
    buf = io.BytesIO()
    torch.save(recipes.EMA(small_net(), 0.9).state_dict(), buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)


# ------------------------------------------------------------- all of them together


def mini_run(tmp_path, num_workers=0, stop_after=None, resume=None, epochs=2):
    """A hand-written loop with every recipe, wired as train.py would: per-sample policy
    and erasing in the loader, BatchMix keyed by (epoch, samples of the epoch before the
    batch), EMA after each step. ``stop_after`` saves at that step and returns;
    ``resume`` continues from that file."""
    train_set = data.SyntheticImages(40, 3, 3, 8, seed=0, split="train")
    before, after = recipes.policy_transforms("randaugment", 9, 0.5, "synthetic")
    dataset = data.SeededDataset(train_set, v2.Compose([*before, *after]), 0, True,
                                 train_set.classes, 3, 8)
    sampler = data.EpochBatchSampler(len(dataset), 8, seed=0)
    loader = data.build_loader(dataset, batch_sampler=sampler, num_workers=num_workers)
    net = small_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    ema = recipes.EMA(net, 0.9, warmup=True)
    mix = recipes.BatchMix(0.8, 1.0, 0.8, num_classes=3, seed=0)
    criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
    step, first_epoch, position = 0, 0, 0
    if resume is not None:
        saved = torch.load(resume, weights_only=True)
        net.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        ema.load_state_dict(saved["ema"])
        step, first_epoch, position = saved["step"], saved["epoch"], saved["position"]
    try:
        for epoch in range(first_epoch, epochs):
            sampler.set_epoch(epoch, position)
            for x, y in loader:
                x, targets = mix(x, y, epoch, position)
                net.train()
                optimizer.zero_grad()
                criterion(net(x), targets).backward()
                optimizer.step()
                step += 1
                ema.update(net, step)
                position += len(y)
                if step == stop_after:
                    path = tmp_path / "stop.pt"
                    torch.save({"model": net.state_dict(), "optimizer": optimizer.state_dict(),
                                "ema": ema.state_dict(), "step": step, "epoch": epoch,
                                "position": position}, path)
                    return path
            position = 0
    finally:
        data.shutdown_loader(loader)
    return {"model": net.state_dict(), "ema": ema.state_dict()}


def test_recipes_together_are_exact_on_resume_and_with_any_workers(tmp_path):
    straight = mini_run(tmp_path)
    assert_states_equal(mini_run(tmp_path, num_workers=2), straight)
    path = mini_run(tmp_path, stop_after=7)  # inside the second epoch (5 steps each)
    assert_states_equal(mini_run(tmp_path, resume=path), straight)


@pytest.mark.parametrize("name", ["imagefolder", "cifar10", "mnist"])
def test_random_erasing_fills_the_mean_on_the_normalised_sets_as_built(tmp_path, name,
                                                                      monkeypatch):
    # Through data.build_datasets (the wiring train.py uses), on sets that are normalised:
    # the erased box is the dataset's mean, 0 after normalisation (erasing before the
    # normalisation would leave -mean/std there).
    import torchvision.datasets.cifar
    from helpers import make_config

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)
    cfg = make_config(tmp_path, name)
    erasing, _ = data.build_datasets({**cfg, "random_erase": 1.0})
    plain, _ = data.build_datasets(cfg)
    zero_boxes = 0
    for i in range(6):
        erased, kept = erasing[(i, 2)][0], plain[(i, 2)][0]
        differ = (erased != kept).any(0)
        assert differ.any()
        assert (erased[:, differ] == 0).all()
        zero_boxes += int((kept[:, differ] != 0).any())
    assert zero_boxes == 6

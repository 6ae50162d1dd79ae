"""The device data path: whole sets held as tensors, batches gathered and augmented there.

Both paths give the same samples, bit for bit on the CPU, for every source (CIFAR-like
pickles, MNIST-like idx files, synthetic, image folders through the decoded cache); the
crop and flip draws of the counter-based hash are uniform; the decoded cache is built
once, reused, rebuilt when the folder changes and never trusted half-written; resnet9.
"""

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
from helpers import (
    KILLED_BUILD,
    ROOT,
    assert_batches_equal,
    assert_states_equal,
    check_against_per_sample,
    final_state,
    folder_loaders,
    fork_popen,
    make_config,
    per_sample,
    stop_at_step,
    tiny_args,
    torchrun,
    whole_val,
    write_image_folder,
)
from PIL import Image
from torchvision.transforms import v2

import networks
from config import with_defaults
from machinery import engine, meters
from ops import UserError
from pipeline import data, decoded_cache, device_data, sample_transforms
from tasks.classification import Classification

# ------------------------------------------------------------------- sources on disk


@pytest.fixture
def cifar_integrity(monkeypatch):
    # torchvision checks each CIFAR file's md5 against the real files'.
    import torchvision.datasets.cifar

    monkeypatch.setattr(torchvision.datasets.cifar, "check_integrity", lambda *a, **k: True)


SOURCES = ["synthetic", "cifar10", "cifar100", "mnist", "fashion_mnist", "imagefolder"]


# ------------------------------------------------------------------------ the hash

def test_draws_are_the_same_for_ints_and_tensors():
    index = torch.tensor([0, 1, 2, 7, 1000, 49_999, 2**31 - 1, 2**32 - 1, 2**32 + 5])
    for seed, epoch, padding in [(0, 0, 4), (7, 3, 3), (2**31 - 1, 10**6, 1), (1, 1, 0)]:
        batched = sample_transforms.crop_flip_draws(seed, epoch, index, padding)
        for k, i in enumerate(index.tolist()):
            one = sample_transforms.crop_flip_draws(seed, epoch, i, padding)
            assert one == tuple(int(d[k]) for d in batched), (seed, epoch, i)
        top, left, flip = batched
        assert top.dtype == torch.long and int(top.max()) <= 2 * padding
        assert int(top.min()) >= 0 and set(flip.tolist()) <= {0, 1}


def test_the_hash_is_a_bijection_of_the_index():
    index = torch.arange(100_000)
    h = sample_transforms.sample_hash(3, 2, index, sample_transforms.STREAM_TOP)
    assert len(torch.unique(h)) == len(index)
    assert int(h.min()) >= 0 and int(h.max()) < 2**32
    x = torch.arange(0, 2**32, 2**32 // 65536 + 7)  # mix32 on its own, over the whole range
    assert len(torch.unique(sample_transforms.mix32(x))) == len(x)


@pytest.mark.parametrize("padding", [1, 3, 4])
def test_crop_offsets_and_flips_are_uniform(padding):
    span, n = 2 * padding + 1, 900
    for seed, epoch in [(0, 0), (0, 1), (12345, 7)]:
        top, left, flip = sample_transforms.crop_flip_draws(seed, epoch, torch.arange(n), padding)
        for draw in (top, left):
            counts = torch.bincount(draw, minlength=span)
            assert len(counts) == span and int(counts.min()) > 0  # every offset appears
            expected = n / span
            chi2 = float(((counts - expected) ** 2 / expected).sum())
            assert chi2 < 3 * span + 10, counts  # far looser than any real bias
        assert 0.43 < flip.float().mean() < 0.57
        pairs = torch.bincount(top * span + left, minlength=span * span)
        assert (pairs > 0).float().mean() > 0.9  # top and left are not tied together
        for a, b in [(top, left), (top, flip), (left, flip)]:  # nor to the flip
            assert abs(float(torch.corrcoef(torch.stack([a.float(), b.float()]))[0, 1])) < 0.1
    a = sample_transforms.crop_flip_draws(0, 0, torch.arange(n), padding)
    b = sample_transforms.crop_flip_draws(0, 1, torch.arange(n), padding)
    c = sample_transforms.crop_flip_draws(1, 0, torch.arange(n), padding)
    for other in (b, c):  # another epoch or seed: other draws
        same = (a[0] == other[0]) & (a[1] == other[1]) & (a[2] == other[2])
        assert same.float().mean() < 0.1


def test_sample_crop_needs_the_key_of_a_seeded_dataset():
    with pytest.raises(RuntimeError, match="through SeededDataset"):
        sample_transforms.SampleCrop(4)(torch.zeros(3, 8, 8))


def test_per_sample_crop_and_flip_follow_the_hash():
    # The per-sample path's crop is zero padding and a slice at the hashed offset.
    cfg = with_defaults({"dataset": "synthetic", "data_dir": "x", "seed": 9, "augment": True,
                         "image_size": 8, "synthetic_size": 32, "num_classes": 2})
    train_set, _ = data.build_datasets(cfg)
    rng = torch.get_rng_state()
    for index in range(32):
        top, left, flip = sample_transforms.crop_flip_draws(9, 4, index, 1)
        image = train_set.base.images[index]
        expected = torch.nn.functional.pad(image, [1] * 4)[:, top:top + 8, left:left + 8]
        if flip:
            expected = expected.flip(-1)
        assert torch.equal(train_set[(index, 4)][0], expected)
    assert torch.equal(torch.get_rng_state(), rng)


def test_the_per_sample_transforms_keep_their_shape():
    train, evaluation = data._transforms("cifar10", 32, True)
    assert [type(t).__name__ for t in train.transforms] == [
        "ToImage", "SampleCrop", "SampleFlip", "Normalise"]
    assert [type(t).__name__ for t in evaluation.transforms] == ["ToImage", "Normalise"]
    train, _ = data._transforms("mnist", 28, True)
    assert [type(t).__name__ for t in train.transforms] == ["ToImage", "SampleCrop",
                                                           "Normalise"]
    assert train.transforms[1].padding == 3


def test_normalise_matches_torchvision():
    x = torch.randint(0, 256, (3, 5, 7), dtype=torch.uint8)
    stats = sample_transforms.STATS["cifar10"]
    reference = v2.Normalize(*stats)(v2.ToDtype(torch.float32, scale=True)(x))
    assert torch.equal(sample_transforms.normalise(x, *stats), reference)
    batch = torch.stack([x, x.flip(-1)])
    assert torch.equal(sample_transforms.normalise(batch, *stats)[0], reference)


# ------------------------------------------------------ both paths, the same samples

@pytest.mark.parametrize("augment", [True, False])
@pytest.mark.parametrize("name", SOURCES)
def test_both_paths_give_the_same_batches(tmp_path, cifar_integrity, name, augment):
    cfg = make_config(tmp_path, name, augment)
    train_set, val_set = data.build_datasets(cfg)
    sampler = data.EpochBatchSampler(len(train_set), 8, cfg["seed"])
    train_loader, val_loader = device_data.build_device_loaders(cfg, train_set, val_set, sampler,
                                                         "cpu", log=lambda line: None)
    for epoch, start in [(0, 0), (3, 0), (2, 8)]:  # and mid-epoch, as after a resume
        sampler.set_epoch(epoch, start)
        expected = per_sample(train_set, sampler)
        got = list(train_loader)
        assert len(got) == len(train_loader) == len(sampler)
        assert_batches_equal(expected, got)
    indices = data.shard_indices(len(val_set), 0, 1)
    assert_batches_equal(per_sample(val_set, indices=indices, batch_size=8), list(val_loader))
    assert len(val_loader) == -(-len(val_set) // 8)
    x = got[0][0]
    if augment:  # the crops and flips are there: some sample differs from its plain self
        plain = torch.stack([val_set.transform(train_set.base[int(i)][0])
                             for i in next(iter(sampler.index_batches()))])
        assert not torch.equal(plain, x)
    side = 16 if name == "imagefolder" else 28 if "mnist" in name else \
        12 if name == "synthetic" else 32
    assert x.shape[1:] == (train_set.in_channels, side, side)


@pytest.mark.parametrize("name", ["cifar10", "synthetic"])
def test_batches_come_in_the_requested_memory_format(tmp_path, cifar_integrity, name):
    cfg = make_config(tmp_path, name)
    train_set, val_set = data.build_datasets(cfg)
    sampler = data.EpochBatchSampler(len(train_set), 8, cfg["seed"])
    sampler.set_epoch(1)
    loaders = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cpu",
                                        memory_format=torch.channels_last)
    expected = per_sample(train_set, sampler)
    for loader in loaders:
        for x, _ in loader:
            assert x.is_contiguous(memory_format=torch.channels_last)
    assert_batches_equal(expected, list(loaders[0]))


def test_processes_gather_their_share_of_each_global_batch(cifar_integrity, tmp_path):
    # 2 processes x 16 = 1 process x 32: each gathers its own part of the global batch.
    cfg = make_config(tmp_path, "cifar10")
    train_set, val_set = data.build_datasets(cfg)
    single = data.EpochBatchSampler(len(train_set), 32, 5)
    ranks = [data.EpochBatchSampler(len(train_set), 16, 5, rank=r, world_size=2)
             for r in (0, 1)]
    loaders = [device_data.build_device_loaders(cfg, train_set, val_set, s, "cpu", rank=r,
                                         world_size=2, log=lambda line: None)
               for r, s in enumerate([*ranks])]
    whole = device_data.build_device_loaders(cfg, train_set, val_set, single, "cpu")[0]
    for s in (single, *ranks):
        s.set_epoch(2)
    shares = [list(train) for train, _ in loaders]
    for k, (x, y) in enumerate(whole):
        assert torch.equal(torch.cat([shares[0][k][0], shares[1][k][0]]), x)
        assert torch.equal(torch.cat([shares[0][k][1], shares[1][k][1]]), y)
    vals = [torch.cat([x for x, _ in val]) for _, val in loaders]
    assert torch.equal(torch.cat(vals), torch.cat([x for x, _ in whole_val(val_set)]))


def test_a_short_last_global_batch_gives_a_stand_in(tmp_path):
    # 40 samples, 2 processes x 16: the last global batch of 8 splits 4 + 4; with 3
    # processes x 13 the last holds 1 sample and ranks 1, 2 get a stand-in (weighted 0).
    cfg = make_config(tmp_path, "synthetic")
    train_set, val_set = data.build_datasets(cfg)
    for world in (2, 3):
        for rank in range(world):
            sampler = data.EpochBatchSampler(len(train_set), 13, 5, rank=rank,
                                             world_size=world)
            loader = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cpu")[0]
            assert_batches_equal(per_sample(train_set, sampler), list(loader))
            assert [len(y) for _, y in loader] == [max(local, 1)
                                                   for _, local in sampler.plan()]


@pytest.mark.parametrize("accum", [1, 2])
def test_training_on_both_paths_gives_the_same_weights(tmp_path, accum):
    # engine.steps over each path: same batches, same plan, same weighting, same weights.
    cfg = make_config(tmp_path, "synthetic", synthetic_size=72, image_size=8)
    train_set, val_set = data.build_datasets(cfg)
    results = []
    for device_path in (False, True):
        torch.manual_seed(0)
        net = networks.build_network("simple_cnn", 4, 3, 8)
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        for group in optimizer.param_groups:
            group["base_lr"] = 0.1
        sampler = data.EpochBatchSampler(len(train_set), 8, cfg["seed"])
        if device_path:
            loader = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cpu")[0]
        else:
            loader = data.build_loader(train_set, batch_sampler=sampler)
        device = torch.device("cpu")
        loop = engine.LoopSettings(device=device, accum=accum, show_progress=False,
                                   scaler=torch.amp.GradScaler("cpu", enabled=False),
                                   timer=engine.StepTimer(device),
                                   counters=meters.Counters(device))
        progress = engine.TrainState()
        for epoch in range(2):
            sampler.set_epoch(epoch)
            progress.epoch = epoch
            engine.train_one_epoch(net, loader, optimizer,
                                   Classification(train_set.num_classes), loop, progress)
        results.append(net.state_dict())
    assert_states_equal(results[0], results[1])


# ------------------------------------------------------------------- the decision

def test_the_decision_off_auto_and_on_on_the_cpu(tmp_path):
    cfg = make_config(tmp_path, "synthetic", num_workers=2)
    train_set, val_set = data.build_datasets(cfg)
    cpu = torch.device("cpu")
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "off"}, train_set,
                                         val_set, cpu)
    assert not use and why == "data path: per-sample DataLoader, 2 workers " \
                              "(--data-on-device off)"
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "auto"}, train_set,
                                         val_set, cpu)
    assert use and why.startswith("data path: in memory (cpu): synthetic as float32 "
                                  "tensors") and "available" in why and "\n" not in why
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "on"}, train_set,
                                         val_set, cpu)
    assert use and why.startswith("data path: on cpu: synthetic as float32 tensors")
    assert device_data.device_data_decision(cfg, train_set, val_set, cpu)[0] is True  # auto


def test_the_decision_on_cuda_follows_free_memory(tmp_path, cifar_integrity, monkeypatch):
    cfg = make_config(tmp_path, "cifar10", data_on_device="auto")
    train_set, val_set = data.build_datasets(cfg)
    need = (40 + 12) * 3 * 32 * 32
    cuda = torch.device("cuda:0")
    for free, expected in [(4 * need, True), (4 * need - 1, False)]:
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device, f=free: (f, 2 * f))
        use, why = device_data.device_data_decision(cfg, train_set, val_set, cuda)
        assert use is expected, why
        assert ("uint8" in why) and ("cuda:0" in why)
    use, _ = device_data.device_data_decision({**cfg, "data_on_device": "on"}, train_set, val_set,
                                       cuda)  # more than a quarter: on still takes it
    assert use
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (need - 1, 10 * need))
    with pytest.raises(UserError, match="do not fit"):
        device_data.device_data_decision({**cfg, "data_on_device": "on"}, train_set, val_set, cuda)


def test_an_augmentation_the_device_cannot_do(tmp_path, monkeypatch):
    # A per-sample policy (--random-erase, --auto-augment) keeps auto on the per-sample
    # path, and makes on a clear error.
    cfg = {**make_config(tmp_path, "synthetic"), "random_erase": 0.5}
    train_set, val_set = data.build_datasets(cfg)
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "auto"}, train_set,
                                         val_set, torch.device("cpu"))
    assert not use
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (2**40, 2**40))
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "auto"}, train_set,
                                         val_set, torch.device("cuda"))
    assert not use and "RandomErasing" in why
    with pytest.raises(UserError, match="--data-on-device on: the device path cannot "
                                        "apply RandomErasing"):
        device_data.device_data_decision({**cfg, "data_on_device": "on"}, train_set, val_set,
                                  torch.device("cpu"))
    with pytest.raises(UserError, match="RandomErasing"):
        device_data.build_device_loaders(cfg, train_set, val_set,
                                  data.EpochBatchSampler(40, 8, 0), "cpu")


# ---------------------------------------------------------------- the decoded cache


def test_the_cache_is_built_once_then_reused(tmp_path):
    cfg = make_config(tmp_path, "imagefolder")
    lines = []
    check_against_per_sample(cfg, lines.append)
    cache = tmp_path / ".cache"
    assert len(lines) == 2 and all("built in" in line for line in lines), lines
    assert f"decoded cache: {cache}{os.sep}decoded-train-16px-" in lines[0]
    assert "15 images of 3x16x16, 0.0 MiB" in lines[0]  # 15 x 768 bytes
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and not [f for f in files if f.startswith(".tmp")]
    npy = [f for f in files if f.startswith("decoded-train") and f.endswith(".npy")][0]
    assert os.path.getsize(cache / npy) == 15 * 3 * 16 * 16 + 128  # the .npy header
    lines.clear()
    train_set, val_set = check_against_per_sample(cfg, lines.append)
    assert len(lines) == 2 and all(line.endswith("reused") for line in lines), lines
    assert sorted(os.listdir(cache)) == files
    use, why = device_data.device_data_decision({**cfg, "data_on_device": "on"}, train_set,
                                                val_set, torch.device("cpu"))
    assert use and f"imagefolder as uint8 tensors (0.0 MiB) decoded once into {cache}" in why


@pytest.mark.parametrize("change", ["added", "removed", "touched", "replaced", "size"])
def test_a_changed_folder_rebuilds_its_cache(tmp_path, change):
    cfg = make_config(tmp_path, "imagefolder")
    check_against_per_sample(cfg, lambda line: None)
    before = set(os.listdir(tmp_path / ".cache"))
    image = tmp_path / "train" / "b" / "1.png"
    if change == "added":
        Image.new("RGB", (9, 9), (200, 10, 10)).save(tmp_path / "train" / "c" / "new.png")
    elif change == "removed":
        image.unlink()
    elif change == "touched":
        stat = image.stat()
        os.utime(image, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    elif change == "replaced":  # same name, same size, other pixels
        pixels = np.asarray(Image.open(image))
        Image.fromarray(255 - pixels).save(image)
        os.utime(image, ns=(image.stat().st_atime_ns, image.stat().st_mtime_ns + 10**9))
    else:
        cfg["image_size"] = 12
    lines = []
    check_against_per_sample(cfg, lines.append)
    train_line = [line for line in lines if "decoded-train" in line][0]
    assert "built in" in train_line
    after = set(os.listdir(tmp_path / ".cache"))
    if change == "size":  # another size: another cache, the old one stays
        assert before < after
    else:  # the replaced train cache is removed; the val cache is the same
        assert len(after) == len(before) and len(after - before) == 2
        assert [line.endswith("reused") for line in lines] == [False, True]


def test_an_interrupted_build_leaves_no_cache_to_trust(tmp_path, monkeypatch):
    cfg = make_config(tmp_path, "imagefolder")
    calls = 0
    original = decoded_cache._Decoding.__getitem__

    def failing(self, index):
        nonlocal calls
        calls += 1
        if calls == 7:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the build
        return original(self, index)

    monkeypatch.setattr(decoded_cache._Decoding, "__getitem__", failing)
    with pytest.raises(KeyboardInterrupt):
        folder_loaders(cfg, lambda line: None)
    assert os.listdir(tmp_path / ".cache") == []  # the temporary file is gone too
    monkeypatch.setattr(decoded_cache._Decoding, "__getitem__", original)
    lines = []
    check_against_per_sample(cfg, lines.append)
    assert all("built in" in line for line in lines)


def test_a_build_killed_with_sigkill_is_not_trusted(tmp_path):
    cfg = make_config(tmp_path, "imagefolder")
    cache = tmp_path / ".cache"
    script = KILLED_BUILD.format(root=ROOT, cfg=cfg, cache=str(cache))
    process = fork_popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 60
        while not (cache.is_dir() and any(f.startswith(".tmp-") for f in os.listdir(cache))):
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(0.3)  # decoding, part of the array written
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert all(f.startswith(".tmp-") for f in os.listdir(cache))  # no final name
    lines = []
    check_against_per_sample(cfg, lines.append)
    assert all("built in" in line for line in lines)


def test_unreadable_images_are_replaced_and_counted_from_the_cache(tmp_path, capfd):
    cfg = make_config(tmp_path, "imagefolder")
    bad = tmp_path / "train" / "c" / "zz.jpg"
    bad.write_bytes(b"not an image")
    reason = "(UnidentifiedImageError: cannot identify image file"
    for _ in ("built", "reused"):
        lines = []
        train_set, _, sampler, (train, _) = folder_loaders(cfg, lines.append)
        err = capfd.readouterr().err
        assert err.count("warning:") == 1, err  # building, or reusing, the cache
        assert f"warning: skipping unreadable image {bad} {reason}" in err, err
        assert train_set.unreadable_count() == 1
        # the last sample stands in for itself with the first: image and label
        assert int(train.labels[-1]) == int(train.labels[0]) == 0
        assert torch.equal(train.images[-1], train.images[0])
        assert_batches_equal(per_sample(train_set, sampler), list(train))
    assert "reused" in lines[0] and "as found when the decoded cache was built" in err


def test_the_cache_is_built_by_worker_processes(tmp_path, capfd):
    cfg = make_config(tmp_path, "imagefolder", num_workers=2)
    bad = tmp_path / "train" / "b" / "zz.png"
    bad.write_text("not an image")
    train_set, _ = check_against_per_sample(cfg, lambda line: None)
    assert train_set.unreadable_count() == 1  # flagged in a worker, seen here
    assert f"warning: skipping unreadable image {bad} (" in capfd.readouterr().err


def test_an_unwritable_cache_directory_decodes_into_memory(tmp_path, capfd):
    cfg = make_config(tmp_path, "imagefolder")
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache directory would be")
    check_against_per_sample({**cfg, "cache_dir": str(blocker / "cache")}, lambda line: None)
    err = capfd.readouterr().err
    assert "warning: cannot write the decoded cache in" in err
    assert "into memory for this run only" in err


def test_the_fingerprint_covers_paths_sizes_and_times(tmp_path):
    write_image_folder(tmp_path, classes=("a", "b", "c"), per_class=5, val_per_class=2,
                       size=None, formats=("jpg", "png"))
    folder = data.SafeImageFolder(str(tmp_path / "train"))
    front = v2.Compose([v2.ToImage(), v2.Resize((16, 16), antialias=True)])
    fingerprint = decoded_cache.folder_fingerprint
    first = fingerprint(folder, decoded_cache.Resized(front, 16))
    assert fingerprint(folder, decoded_cache.Resized(front, 16)) == first
    other = v2.Compose([v2.ToImage(), v2.Resize((12, 12), antialias=True)])
    assert fingerprint(folder, decoded_cache.Resized(other, 12)) != first
    os.rename(tmp_path / "train" / "a" / "0.jpg", tmp_path / "train" / "a" / "9.jpg")
    moved = data.SafeImageFolder(str(tmp_path / "train"))
    assert fingerprint(moved, decoded_cache.Resized(front, 16)) != first


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["cifar10", "synthetic", "imagefolder"])
def test_cuda_batches_match_the_cpu(tmp_path, cifar_integrity, name):
    # The draws and the gather are integer work: the same pixels on CUDA; the float
    # normalisation may differ in the last bit.
    cfg = make_config(tmp_path, name)
    train_set, val_set = data.build_datasets(cfg)
    sampler = data.EpochBatchSampler(len(train_set), 8, cfg["seed"])
    sampler.set_epoch(1)
    cpu = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cpu")
    cuda = device_data.build_device_loaders(cfg, train_set, val_set, sampler, "cuda",
                                     memory_format=torch.channels_last)
    for a, b in zip(cpu, cuda):
        for (x0, y0), (x1, y1) in zip(a, b):
            assert x1.is_cuda and x1.is_contiguous(memory_format=torch.channels_last)
            torch.testing.assert_close(x1.cpu(), x0, rtol=0, atol=1e-6)
            assert torch.equal(y1.cpu(), y0)


# --------------------------------------------------------------------------- resnet9

def test_resnet9_shapes_parameters_and_gradients():
    net = networks.build_network("resnet9", 10, 3, 32)
    assert isinstance(net, networks.GradCheckpointing)
    assert sum(p.numel() for p in net.parameters()) == 6_573_120  # the DAWNBench network
    x = torch.randn(4, 3, 32, 32)
    out = net(x)
    assert out.shape == (4, 10)
    out.sum().backward()
    assert all(p.grad is not None for p in net.parameters())
    for classes, channels, side in [(100, 3, 32), (10, 1, 28), (3, 3, 4), (5, 3, 64)]:
        net = networks.build_network("resnet9", classes, channels, side)
        assert net(torch.randn(2, channels, side, side)).shape == (2, classes)


def test_resnet9_gradient_checkpointing_gives_the_same_gradients():
    x = torch.randn(4, 3, 16, 16)
    grads = []
    for enable in (False, True):
        torch.manual_seed(0)
        net = networks.build_network("resnet9", 10, 3, 16)
        net.set_grad_checkpointing(enable)
        net(x).sum().backward()
        grads.append({n: p.grad for n, p in net.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name])


def test_resnet9_in_channels_last():
    net = networks.build_network("resnet9").to(memory_format=torch.channels_last).eval()
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(net(x.contiguous(memory_format=torch.channels_last)),
                               net(x), rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------- train.py end to end

def test_train_on_and_off_give_the_same_weights(tmp_path, capsys):
    import train

    args = dict(network="simple_cnn", size=96, image=16, batch=16, epochs=2)
    assert train.main(tiny_args(tmp_path / "off", "--data-on-device", "off", **args)) == 0
    assert train.main(tiny_args(tmp_path / "on", "--data-on-device", "on", **args)) == 0
    out = capsys.readouterr().out
    assert "data path: on cpu" in out and "data path: per-sample DataLoader" in out
    assert_states_equal(final_state(tmp_path / "on")["model"],
                        final_state(tmp_path / "off")["model"])


def test_train_resumes_exactly_on_the_device_path(tmp_path):

    import train

    args = dict(network="simple_cnn", size=96, image=16, batch=16, epochs=2)
    assert train.main(tiny_args(tmp_path / "whole", "--data-on-device", "on", **args)) == 0
    with stop_at_step(3):
        assert train.main(tiny_args(tmp_path / "run", "--data-on-device", "on",
                                    **args)) == 143
    assert train.main(tiny_args(tmp_path / "run", "--data-on-device", "on", "--resume",
                                "auto", **args)) == 0
    assert_states_equal(final_state(tmp_path / "run")["model"],
                        final_state(tmp_path / "whole")["model"])


def test_auto_holds_small_sets_in_memory_on_the_cpu_and_says_why(tmp_path, capsys,
                                                                 monkeypatch):
    import train
    from machinery import hardware

    assert train.main(tiny_args(tmp_path / "a", "--data-on-device", "auto")) == 0
    assert "data path: in memory (cpu)" in capsys.readouterr().out
    monkeypatch.setattr(hardware, "available_memory", lambda: 1000)  # it would not fit
    assert train.main(tiny_args(tmp_path / "b", "--data-on-device", "auto")) == 0
    out = capsys.readouterr().out
    assert "data path: per-sample DataLoader" in out and "of memory available" in out


def test_on_with_an_augmentation_the_device_cannot_do_is_one_error_line(tmp_path, capsys):
    import train

    assert train.main(tiny_args(tmp_path, "--data-on-device", "on", "--random-erase",
                                "0.5")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --data-on-device on") and \
        "RandomErasing" in err[0]


def test_ddp_on_the_device_path_trains_like_one_process(tmp_path):

    import train

    flags = ("--data-on-device", "on", "--scheduler", "none", "--lr", "0.003")
    torchrun(tiny_args(tmp_path / "ddp", *flags, size=55, batch=16, epochs=2))
    assert train.main(tiny_args(tmp_path / "one", *flags, size=55, batch=32, epochs=2)) == 0
    ddp, one = final_state(tmp_path / "ddp"), final_state(tmp_path / "one")
    for key in one["model"]:  # float32 sums in another order: equal to float32 precision
        torch.testing.assert_close(ddp["model"][key], one["model"][key], rtol=1e-5,
                                   atol=1e-6)
    assert ddp["step"] == one["step"]


def test_an_image_folder_trains_on_the_device_path_through_its_cache(tmp_path, capsys):
    import train

    write_image_folder(tmp_path / "data", classes=("a", "b"), per_class=4, size=(16, 16))
    argv = ("--dataset", "imagefolder", "--data-dir", str(tmp_path / "data"),
            "--image-size", "16", "--batch-size", "4", "--data-on-device", "on")
    assert train.main(tiny_args(tmp_path / "a", *argv, network="simple_cnn")) == 0
    assert "decoded cache:" in capsys.readouterr().out
    assert train.main(tiny_args(tmp_path / "b", *argv[:-1], "off",
                                network="simple_cnn")) == 0
    assert_states_equal(final_state(tmp_path / "a")["model"],
                        final_state(tmp_path / "b")["model"])

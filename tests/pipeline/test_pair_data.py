"""pipeline/pair_data.py: the synthetic pairs, the pairfolder and its hostile cases (one
``error:`` line each), the joint transforms (segmentation's, reused) moving input and target
together, the per-sample determinism."""

import os

import numpy as np
import pytest
import torch
from PIL import Image

import train
from config import with_defaults
from ops import UserError
from pipeline import data, pair_data, pair_transforms


def config(**extra):
    return with_defaults({"task": "pix2pix", "network": "pix2pix", "dataset": "synthetic",
                          "seed": 3, "image_size": 32, "synthetic_size": 20,
                          "num_classes": 4, "augment": True, "num_workers": 0, **extra})


def write_pair(root, split, name, size=(32, 32), target_size=None, colour=(200, 40, 40)):
    for side, s in (("a", size), ("b", target_size or size)):
        folder = root / split / side
        folder.mkdir(parents=True, exist_ok=True)
        pixels = np.zeros((s[1], s[0], 3), dtype=np.uint8)
        pixels[:, : s[0] // 3] = colour  # a left band: a flip shows
        Image.fromarray(pixels).save(folder / f"{name}.png")


def tree(root, names=("x", "y", "z")):
    for split in ("train", "val"):
        for name in names:
            write_pair(root, split, name)
    return root


def test_the_synthetic_pairs_are_outlines_in_and_filled_shapes_out():
    train_set, val_set = pair_data.build_datasets(config(augment=False))
    assert (len(train_set), len(val_set)) == (20, 4)
    assert (train_set.in_channels, train_set.out_channels, train_set.image_size) == (3, 3, 32)
    a, b = train_set[0]
    assert a.shape == b.shape == (3, 32, 32) and a.dtype == b.dtype == torch.float32
    assert a.min() >= -1 and a.max() <= 1 and b.min() >= -1 and b.max() <= 1
    lit_a, lit_b = a.amax(0) > -1, b.amax(0) > -1
    assert lit_a.sum() < lit_b.sum() and not (lit_a & ~lit_b).any()  # an outline of it
    again, _ = pair_data.build_datasets(config(augment=False))
    assert torch.equal(again[0][1], b)  # from the seed
    other, _ = pair_data.build_datasets(config(augment=False, seed=4))
    assert not torch.equal(other[0][1], b)


def test_input_and_target_move_together_by_segmentations_transforms(tmp_path):
    """The same image as input and target: after the jitter (resize, crop, flip), each
    sample's two are still the same, and the flips of the epoch differ by sample."""
    tree(tmp_path)
    train_set, _ = pair_data.build_datasets(config(dataset="pairfolder",
                                                   data_dir=str(tmp_path)))
    steps = train_set.transform.transforms
    assert [type(s) for s in steps] == [pair_transforms.RandomResize,
                                        pair_transforms.RandomCrop, pair_transforms.Flip]
    flips = set()
    for index in range(3):
        for epoch in range(4):
            a, b = train_set[(index, epoch)]
            assert torch.equal(a, b)
            flips.add(bool(a[0, 16, -3] > a[0, 16, 2]))  # the band went right
            assert torch.equal(train_set[(index, epoch)][0], a)  # a function of the key
    assert flips == {True, False}


def test_the_per_sample_path_does_not_depend_on_the_workers(tmp_path):
    train_set, _ = pair_data.build_datasets(config())
    sampler = data.EpochBatchSampler(len(train_set), 4, 3)
    sampler.set_epoch(1)
    one = list(data.build_loader(train_set, batch_sampler=sampler))
    loader = data.build_loader(train_set, batch_sampler=sampler, num_workers=2)
    try:
        two = list(loader)
    finally:
        data.shutdown_loader(loader)
    for (a0, b0), (a1, b1) in zip(one, two, strict=True):
        assert torch.equal(a0, a1) and torch.equal(b0, b1)


@pytest.mark.parametrize("augment", [False, True])
def test_a_batch_is_fetched_with_the_bits_of_its_pairs_one_by_one(augment):
    """The DataLoader's batched fetch (``__getitems__``: an unaugmented synthetic batch is
    normalised at once) gives every pair's bits as indexing pair by pair does."""
    train_set, val_set = pair_data.build_datasets(config(augment=augment))
    for dataset in (train_set, val_set):
        keys = [(i * 7 % len(dataset), 2) for i in (5, 3, 19, 0, 3)]  # a repeat too
        batched = dataset.__getitems__(keys)
        assert len(batched) == len(keys)
        for (a, b), key in zip(batched, keys):
            one_a, one_b = dataset[key]
            assert torch.equal(a, one_a) and torch.equal(b, one_b)
    sampler = data.EpochBatchSampler(len(train_set), 4, 3)
    sampler.set_epoch(1)
    for x, y in data.build_loader(train_set, batch_sampler=sampler):
        assert x.shape == y.shape == (len(x), 3, 32, 32) and x.is_contiguous()


def test_a_pairfolder_pairs_by_name_and_resizes_to_the_side(tmp_path):
    tree(tmp_path)
    write_pair(tmp_path, "train", "w", size=(50, 40))
    train_set, val_set = pair_data.build_datasets(config(dataset="pairfolder",
                                                         data_dir=str(tmp_path),
                                                         augment=False))
    names = [os.path.basename(a) for a, _ in train_set.base.pairs]
    assert names == ["w.png", "x.png", "y.png", "z.png"] and len(val_set) == 3
    assert all(os.path.basename(a) == os.path.basename(b) for a, b in train_set.base.pairs)
    assert train_set[0][0].shape == (3, 32, 32)
    first = pair_data.set_identity(train_set)
    (tmp_path / "train" / "a" / "z.png").rename(tmp_path / "train" / "a" / "v.png")
    (tmp_path / "train" / "b" / "z.png").rename(tmp_path / "train" / "b" / "v.png")
    again, _ = pair_data.build_datasets(config(dataset="pairfolder", data_dir=str(tmp_path)))
    assert pair_data.set_identity(again)["fingerprint"] != first["fingerprint"]


@pytest.mark.parametrize("size", [1, 20])
def test_the_synthetic_validation_pairs_are_none_of_the_training_pairs(size):
    """The splits share colours, not samples (at --synthetic-size 1 too, where both hold
    one pair): a validation figure is never of a pair the network trained on."""
    train_set, val_set = pair_data.build_datasets(config(synthetic_size=size, augment=False))
    trained = [torch.cat(train_set[j]) for j in range(len(train_set))]  # input and target
    for i in range(len(val_set)):
        pair = torch.cat(val_set[i])
        assert not any(torch.equal(pair, t) for t in trained), i


def test_a_pairfolders_fingerprint_survives_moving_the_folder(tmp_path, monkeypatch):
    """The fingerprint is of the pairs' paths inside the folder: the folder moved (or
    named by a relative path) is the same set, and a resume from the moved copy is not
    warned of another training set."""
    tree(tmp_path / "here")

    def identity(data_dir):
        train_set, _ = pair_data.build_datasets(config(dataset="pairfolder",
                                                       data_dir=str(data_dir)))
        return pair_data.set_identity(train_set)

    first = identity(tmp_path / "here")
    (tmp_path / "away").mkdir()
    os.rename(tmp_path / "here", tmp_path / "away" / "moved")
    assert identity(tmp_path / "away" / "moved") == first
    monkeypatch.chdir(tmp_path / "away")
    assert identity("moved") == first
    os.remove(tmp_path / "away" / "moved" / "train" / "a" / "z.png")
    os.remove(tmp_path / "away" / "moved" / "train" / "b" / "z.png")
    assert identity("moved") != first  # (the pairs do count)


def _only_input(root):
    write_pair(root, "train", "lonely")
    os.remove(root / "train" / "b" / "lonely.png")


def _only_target(root):
    write_pair(root, "val", "orphan")
    os.remove(root / "val" / "a" / "orphan.png")


def _mismatch(root):
    write_pair(root, "train", "big", size=(32, 32), target_size=(40, 32))


def _unreadable(root):
    (root / "train" / "a" / "bad.png").write_bytes(b"not a png")
    write_pair(root, "train", "tmp")
    os.replace(root / "train" / "b" / "tmp.png", root / "train" / "b" / "bad.png")
    os.remove(root / "train" / "a" / "tmp.png")


def _two_of_one_name(root):
    Image.new("RGB", (32, 32)).save(root / "train" / "a" / "x.jpg")


def _no_val(root):
    import shutil
    shutil.rmtree(root / "val" / "b")


@pytest.mark.parametrize("break_it, words", [
    (_only_input, "the input {root}/train/a/lonely.png has no target: expected "
                  "{root}/train/b/lonely.png"),
    (_only_target, "the target {root}/val/b/orphan.png has no input: expected "
                   "{root}/val/a/orphan.png"),
    (_mismatch, "the target {root}/train/b/big.png is 40x32 but its input "
                "{root}/train/a/big.png is 32x32"),
    (_unreadable, "cannot read {root}/train/a/bad.png"),
    (_two_of_one_name, "{root}/train/a/x.jpg and x.png have one name"),
    (_no_val, "--dataset pairfolder needs '{root}/val/b'"),
])
def test_a_hostile_pairfolder_is_one_line_naming_the_file(tmp_path, capsys, break_it, words):
    root = tree(tmp_path / "pairs")
    break_it(root)
    assert train.main(["--task", "pix2pix", "--dataset", "pairfolder", "--data-dir", str(root),
                       "--pix2pix-width", "8", "--epochs", "1", "--batch-size", "2",
                       "--num-workers", "0", "--device", "cpu",
                       "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: ") and words.format(root=root) in err[-1], err
    assert "Traceback" not in "\n".join(err)


def test_a_missing_data_dir_is_one_line(tmp_path, capsys):
    assert train.main(["--task", "pix2pix", "--dataset", "pairfolder", "--data-dir",
                       str(tmp_path / "nowhere"), "--device", "cpu",
                       "--run-dir", str(tmp_path / "run")]) == 2
    assert f"error: --data-dir {str(tmp_path / 'nowhere')!r} does not exist" in \
        capsys.readouterr().err


def test_an_image_whose_body_is_broken_is_one_line_from_a_worker(tmp_path, capfd):
    """The header is whole, the compressed pixels are not: with DataLoader workers the run
    still ends in one line naming the file (found by the pairing's check, which reads the
    PNG's chunks up to its EXIF, or by the worker that decodes it)."""
    import struct
    root = tree(tmp_path / "pairs")
    path = root / "train" / "b" / "y.png"
    png = bytearray(path.read_bytes())
    at = png.find(b"IDAT")
    length = struct.unpack(">I", png[at - 4:at])[0]
    png[at + 6:at + 4 + length] = b"\x55" * (length - 2)  # the zlib stream, not its header
    path.write_bytes(bytes(png))
    with Image.open(path) as image:
        assert image.size == (32, 32)  # the header is whole
    assert train.main(["--task", "pix2pix", "--dataset", "pairfolder", "--data-dir", str(root),
                       "--pix2pix-width", "8", "--epochs", "1", "--batch-size", "2",
                       "--num-workers", "2", "--device", "cpu",
                       "--run-dir", str(tmp_path / "run")]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: cannot read {path}"), err
    assert "Traceback" not in "\n".join(err) and "DataLoader worker" not in "\n".join(err)


def test_a_damaged_validation_pair_met_by_a_worker_is_one_line_naming_it(tmp_path):
    """A JPEG whose header reads and whose scan data is garbage passes the pairing's size
    check; the validation loader's worker that decodes it raises the one line, not torch's
    "Caught UserError in DataLoader worker process 0." and the worker's traceback."""
    root = tree(tmp_path / "pairs")
    os.remove(root / "val" / "b" / "y.png")
    path = root / "val" / "b" / "y.jpg"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (32, 32, 3), dtype=np.uint8)) \
        .save(path, quality=95)
    jpeg = bytearray(path.read_bytes())
    for i in range(jpeg.index(b"\xff\xda") + 20, len(jpeg) - 2, 7):  # the scan, not its header
        jpeg[i], jpeg[i + 1] = 0xFF, 0xC8 + i % 3
    path.write_bytes(bytes(jpeg))
    _, val_set = pair_data.build_datasets(config(dataset="pairfolder", data_dir=str(root)))
    loader = data.build_loader(val_set, batch_size=3, num_workers=1)
    with pytest.raises(UserError) as excinfo:
        list(loader)
    assert str(excinfo.value).startswith(f"cannot read {path} ("), str(excinfo.value)
    assert "\n" not in str(excinfo.value)

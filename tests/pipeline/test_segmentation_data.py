"""Segmentation data: the mask follows its image through every crop, flip and resize (nearest,
padded with 255), from the (seed, epoch, index) draws whatever the worker count; mask
folders and VOC read as promised, and their errors are one line; pairs are decoded once."""

import os
import socket
import time

import numpy as np
import pytest
import torch
from PIL import Image

from config import with_defaults
from machinery import hardware
from machinery.runtime import say
from ops import UserError
from pipeline import data, device_data, sample_transforms
from pipeline import segmentation_data as seg

PALETTE = [0, 0, 0, 128, 0, 0, 0, 128, 0, 128, 128, 0] + [255, 255, 255] * 252


def config(**extra):
    return with_defaults({"dataset": "synthetic", "data_dir": "unused", "seed": 0,
                          "augment": True, "image_size": 16, "synthetic_size": 40,
                          "num_classes": 4, "num_workers": 0, **extra})


def save_mask(path, mask, mode="P"):
    """A mask PNG: palette (the VOC way) or grayscale (``mode="L"``)."""
    image = Image.fromarray(mask.astype(np.uint8), mode="L")
    if mode == "P":
        image = image.convert("P")  # (keeps the values as palette indices)
        image.putpalette(PALETTE)
    image.save(path)


def write_mask_folder(root, counts=(("train", 5), ("val", 2)), sizes=((30, 44), (52, 36)),
                      classes=3, names=None):
    """``root/{train,val}/{images,masks}``: blocks of colour, each its class in the mask,
    a band of 255 at the top; sizes taken in turn."""
    g = np.random.default_rng(0)
    for split, count in counts:
        os.makedirs(root / split / "images")
        os.makedirs(root / split / "masks")
        for i in range(count):
            h, w = sizes[i % len(sizes)]
            mask = g.integers(0, classes, (h // 6 + 1, w // 6 + 1)).repeat(6, 0).repeat(6, 1)
            mask = mask[:h, :w].astype(np.uint8)
            mask[:2] = 255
            image = (mask[..., None] * 60 + g.integers(0, 20, (h, w, 3))).astype(np.uint8)
            Image.fromarray(image).save(root / split / "images" / f"p{i}.png")
            save_mask(root / split / "masks" / f"p{i}.png", mask, "P" if i % 2 else "L")
    if names is not None:
        (root / "classes.txt").write_text("\n".join(names) + "\n")
    return root


def folder_config(root, **extra):
    return config(dataset="maskfolder", data_dir=str(root), **extra)


def one_line_error(excinfo, *parts):
    message = str(excinfo.value)
    assert "\n" not in message
    for part in parts:
        assert str(part) in message, message
    return message


# ------------------------------------------------------------------ geometry


class CoordinatePairs(torch.utils.data.Dataset):
    """Images whose channels are (row + 1, column + 1, 1) and masks that are a function of
    the position: after any crop and flip, ``mask == f(image)`` wherever the image is
    not padding, and padding is 0 in the image and 255 in the mask."""

    def __init__(self, n, side):
        rows = torch.arange(side, dtype=torch.float32).view(side, 1).expand(side, side)
        cols = rows.t()
        self.image = torch.stack([rows + 1, cols + 1, torch.ones(side, side)])
        self.mask = self.encode(self.image)
        self.n = n

    @staticmethod
    def encode(image):
        return ((image[0] - 1) * 7 + (image[1] - 1) * 3).to(torch.long) % 250

    def __len__(self):
        return self.n

    def __getitem__(self, index):
        return self.image, self.mask.to(torch.uint8)


def test_small_crop_and_flip_move_the_mask_with_the_image_bit_exactly():
    side = 16
    transform, _ = seg.pair_transforms(side, augment=True)
    dataset = seg.SegmentationSet(CoordinatePairs(64, side), transform, 0, True, ["a", "b"],
                                  3, side)
    flipped = padded = 0
    for index in range(64):
        image, mask = dataset[(index, 3)]
        assert image.shape == (3, side, side) and mask.shape == (side, side)
        assert mask.dtype == torch.int64
        real = image[2] == 1
        assert torch.equal(mask[real], CoordinatePairs.encode(image)[real])
        assert (mask[~real] == 255).all() and (image[:, ~real] == 0).all()
        padded += int((~real).any())
        row = int(real.sum(dim=1).argmax())  # a row with real pixels: columns run back?
        cols = image[1, row][real[row]]
        flipped += int(cols[0] > cols[-1])
    assert 20 < flipped < 44 and padded > 40  # both happen, to about half and most samples


def block_pairs(side_h, side_w, seed=0):
    """A uint8 image of 16-px blocks whose colour triple names the block's class (one class
    is 255: a block to ignore), and its mask."""
    g = np.random.default_rng(seed)
    classes = g.integers(0, 6, (side_h // 16 + 1, side_w // 16 + 1)).repeat(16, 0).repeat(16, 1)
    classes = torch.from_numpy(classes[:side_h, :side_w])
    mask = torch.where(classes == 5, 255, classes).to(torch.uint8)
    return COLOURS[classes].permute(2, 0, 1).contiguous(), mask


COLOURS = torch.tensor([[10, 200, 30], [90, 20, 150], [170, 120, 240], [240, 60, 90],
                        [40, 250, 160], [130, 130, 5]], dtype=torch.uint8)
LABELS = [0, 1, 2, 3, 4, 255]


def check_blocks_follow(image, mask):
    """Wherever the image is exactly a class's colour, the mask is that class; padding is
    black with 255 in the mask; most pixels are a class's colour (not a blend).
    Returns the number of padded pixels."""
    assert set(mask.unique().tolist()) <= set(LABELS)  # nearest: no value in between
    pure = torch.zeros(mask.shape, dtype=torch.bool)
    for colour, label in zip(COLOURS, LABELS):
        here = (image == colour.view(3, 1, 1)).all(dim=0)
        assert (mask[here] == label).all()
        pure |= here
    black = (image == 0).all(dim=0)
    assert (mask[black] == 255).all()
    assert pure.sum() > 0.4 * (~black).sum()
    return int(black.sum())


def test_photo_resize_flip_and_crop_move_the_mask_with_the_image():
    crop = 64
    train, evaluation = seg.pair_transforms(crop, augment=True)  # uint8 out: no stats
    sources = [block_pairs(40, 90, 0), block_pairs(120, 70, 1)]

    class Blocks(torch.utils.data.Dataset):
        def __len__(self):
            return 30

        def __getitem__(self, index):
            return sources[index % 2]

    dataset = seg.SegmentationSet(Blocks(), train, 0, True, ["c"] * 5, 3, crop)
    padded, sizes = 0, set()
    for index in range(30):
        image, mask = dataset[(index, 1)]
        assert image.shape == (3, crop, crop) and mask.shape == (crop, crop)
        padded += check_blocks_follow(image, mask) > 0
        with sample_transforms.seeded(0, 1, index):
            sizes.add(seg.RandomResize(34, 138)(*sources[0])[0].shape[-2])
    assert padded > 3 and len(sizes) > 10  # small draws are padded; sizes vary
    # Evaluation: the short side at the base (69), the long side at most the canvas (92),
    # padded to the canvas.
    for source, size in [(sources[0], (40, 92)), (sources[1], (92, 53)),
                         (block_pairs(60, 72, 2), (69, 82))]:
        image, mask = evaluation(*source)
        assert image.shape == (3, 92, 92) and seg.eval_canvas(crop) == 92
        check_blocks_follow(image, mask)
        real = ~(image == 0).all(dim=0)
        assert (int(real.any(dim=1).sum()), int(real.any(dim=0).sum())) == size
        assert (mask[size[0]:] == 255).all() and (mask[:, size[1]:] == 255).all()


def test_the_draws_depend_on_seed_epoch_and_index_only():
    a, _ = seg.build_datasets(config())
    b, _ = seg.build_datasets(config())
    rng = torch.get_rng_state()
    one = [a[(i, 1)] for i in range(40)]
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(x, y) and torch.equal(m, n)
               for (x, m), (y, n) in zip(one, (b[(i, 1)] for i in range(40))))
    other = [a[(i, 2)] for i in range(40)]
    assert sum(not torch.equal(m, n) for (_, m), (_, n) in zip(one, other)) > 25


def load_epoch(dataset, workers):
    sampler = data.EpochBatchSampler(len(dataset), 4, seed=0)
    sampler.set_epoch(2)
    loader = data.build_loader(dataset, batch_sampler=sampler, num_workers=workers)
    try:
        batches = list(loader)
    finally:
        data.shutdown_loader(loader)
    return [torch.cat(parts) for parts in zip(*batches)], sampler


def test_dataloader_workers_give_the_same_pairs(tmp_path):
    root = write_mask_folder(tmp_path / "set", counts=(("train", 8), ("val", 2)))
    train, _ = seg.build_datasets(folder_config(root, image_size=64))
    (x0, m0), sampler = load_epoch(train, 0)
    (x2, m2), _ = load_epoch(train, 2)
    assert torch.equal(x0, x2) and torch.equal(m0, m2)
    order = [key for batch in sampler for key in batch]
    assert torch.equal(m0, torch.stack([train[key][1] for key in order]))
    assert x0.dtype == torch.float32 and m0.dtype == torch.int64 and (m0 == 255).any()


# ------------------------------------------------------------------ the sets


def test_synthetic_classes_have_their_own_colour_and_appear_in_both_splits():
    train, val = seg.build_datasets(config(augment=False, synthetic_size=64, num_classes=5))
    assert train.classes == ["background", "rectangle1", "disc2", "diamond3", "ring4"]
    assert train.num_classes == 5 and len(val) == 12
    means = []
    for dataset in (train, val):
        images = torch.stack([dataset[i][0] for i in range(len(dataset))])
        masks = torch.stack([dataset[i][1] for i in range(len(dataset))])
        assert set(masks.unique().tolist()) == set(range(5))
        means.append(torch.stack([images.permute(0, 2, 3, 1)[masks == c].mean(0)
                                  for c in range(5)]))
    assert torch.cdist(means[0], means[0]).add(torch.eye(5) * 9).min() > 0.8  # apart
    assert torch.allclose(means[0], means[1], atol=0.15)  # the splits share colours


def test_mask_folder_reads_indices_names_and_ignore(tmp_path):
    root = write_mask_folder(tmp_path / "set", names=["sky", "road", "car", "tree"])
    train, val = seg.build_datasets(folder_config(root, augment=False))
    assert train.classes == ["sky", "road", "car", "tree"] and train.num_classes == 4
    image, mask = val[0]
    assert image.shape == (3, 16, 16) and mask.shape == (16, 16)
    assert set(mask.unique().tolist()) <= {0, 1, 2, 255} and (mask[0] == 255).all()
    (root / "classes.txt").unlink()
    train, _ = seg.build_datasets(folder_config(root, augment=False))
    assert train.classes == ["class0", "class1", "class2"]  # the largest index seen: 2


def test_mask_folder_errors_are_one_line_naming_the_file(tmp_path):
    root = write_mask_folder(tmp_path / "a")
    os.remove(root / "val" / "masks" / "p1.png")
    with pytest.raises(UserError) as e:
        seg.build_datasets(folder_config(root))
    one_line_error(e, root / "val" / "images" / "p1.png", root / "val" / "masks" / "p1.png")

    root = write_mask_folder(tmp_path / "b")
    save_mask(root / "train" / "masks" / "p3.png", np.zeros((30, 40), np.uint8))
    with pytest.raises(UserError) as e:
        seg.build_datasets(folder_config(root))
    one_line_error(e, root / "train" / "masks" / "p3.png", "40x30", "36x52")

    root = write_mask_folder(tmp_path / "c")
    Image.new("RGB", (44, 30)).save(root / "train" / "masks" / "p0.png")
    with pytest.raises(UserError) as e:
        seg.build_datasets(folder_config(root))
    one_line_error(e, root / "train" / "masks" / "p0.png", "RGB")
    Image.new("L", (44, 30)).save(root / "train" / "masks" / "p0.png", format="JPEG")
    with pytest.raises(UserError) as e:  # lossy: its values are not the indices saved
        seg.build_datasets(folder_config(root))
    one_line_error(e, root / "train" / "masks" / "p0.png", "JPEG")

    root = write_mask_folder(tmp_path / "d", names=["x", "y"])
    with pytest.raises(UserError) as e:
        seg.build_datasets(folder_config(root))
    one_line_error(e, "holds class 2", "classes.txt")

    with pytest.raises(UserError) as e:
        seg.build_datasets(folder_config(tmp_path / "nowhere"))
    one_line_error(e, "nowhere")


def test_pairs_are_decoded_once_and_again_when_a_mask_changes(tmp_path):
    root = write_mask_folder(tmp_path / "set", names=["a", "b", "c"])
    said = []
    seg.build_datasets(folder_config(root, image_size=64), log=said.append)
    seg.build_datasets(folder_config(root, image_size=64), log=said.append)
    assert [line.endswith("reused") for line in said] == [False, False, True, True]
    mask = np.array(Image.open(root / "train" / "masks" / "p0.png"))
    mask[10:20, 10:20] = 2
    save_mask(root / "train" / "masks" / "p0.png", mask, "L")
    said.clear()
    train, _ = seg.build_datasets(folder_config(root, image_size=64), log=said.append)
    assert not said[0].endswith("reused") and said[1].endswith("reused")  # train rebuilt
    assert (train.base[0][1][10:20, 10:20] == 2).all()


def test_unreadable_mask_is_skipped_with_a_warning(tmp_path, capfd):
    root = write_mask_folder(tmp_path / "set")
    Image.fromarray(np.full((30, 44), 300, np.uint16)).save(root / "train" / "masks" / "p2.png")
    train, _ = seg.build_datasets(folder_config(root, augment=False))
    err = capfd.readouterr().err
    assert f"warning: skipping unreadable pair {root / 'train' / 'masks' / 'p2.png'} (it " \
        f"holds the value 300" in err
    assert train.unreadable_count() == 1 and len(train) == 5
    assert torch.equal(train[2][1], train[3][1])  # the next readable pair stands in
    for path in (root / "val" / "masks").iterdir():
        path.write_bytes(b"")
    with pytest.raises(UserError) as e:  # (found by a decoding worker process)
        seg.build_datasets(folder_config(root, num_workers=1))
    one_line_error(e, "no image and mask pair in", root / "val" / "images")


def write_voc(root, names=(("train", ["a1", "a2"]), ("val", ["b1"]))):
    """The layout torchvision's VOCSegmentation reads (2012)."""
    voc = root / "VOCdevkit" / "VOC2012"
    for sub in ("JPEGImages", "SegmentationClass", "ImageSets/Segmentation"):
        os.makedirs(voc / sub)
    for split, stems in names:
        (voc / "ImageSets" / "Segmentation" / f"{split}.txt").write_text("\n".join(stems))
        for k, stem in enumerate(stems):
            mask = np.full((20, 30), 15, np.uint8)  # person
            mask[:, :10] = 0
            mask[:, 10] = 255  # VOC's border
            mask[0, 0] = 20 - k
            Image.fromarray(np.full((20, 30, 3), 90, np.uint8)).save(
                voc / "JPEGImages" / f"{stem}.jpg")
            save_mask(voc / "SegmentationClass" / f"{stem}.png", mask)
    return root


def test_voc_reads_its_layout_with_its_class_names(tmp_path):
    root = write_voc(tmp_path / "voc")
    train, val = seg.build_datasets(config(dataset="voc", data_dir=str(root), image_size=64))
    assert train.num_classes == 21 and train.classes[15] == "person"
    assert train.classes == list(seg.VOC_CLASSES) and len(train) == 2 and len(val) == 1
    mask = train.base[0][1]
    assert mask.shape == (20, 30) and set(mask.unique().tolist()) == {0, 15, 20, 255}


def test_voc_offline_is_one_line_and_quick(tmp_path):
    try:
        socket.create_connection(("host.robots.ox.ac.uk", 80), timeout=2).close()
        pytest.skip("online: this would download PASCAL VOC (2 GB)")
    except OSError:
        pass
    start = time.monotonic()
    with pytest.raises(UserError) as e:
        seg.build_datasets(config(dataset="voc", data_dir=str(tmp_path / "empty")))
    one_line_error(e, "could not download voc", "offline?", "empty")
    assert time.monotonic() - start < 60


@pytest.mark.parametrize("flags,words", [
    ({"auto_augment": "trivialaugment"}, "--auto-augment trivialaugment"),
    ({"random_erase": 0.25}, "--random-erase"),
    ({"dataset": "cifar10"}, "--dataset cifar10 has no masks")])
def test_what_would_move_the_image_and_not_the_mask_is_refused(flags, words):
    with pytest.raises(UserError) as e:
        seg.check_config(config(**flags))
    one_line_error(e, words)
    with pytest.raises(UserError):
        seg.build_datasets(config(**flags))


# ------------------------------------------------------------------ the device path


@pytest.mark.parametrize("kind", ["synthetic", "synthetic-photo", "maskfolder", "photos"])
def test_the_device_path_gives_the_dataloaders_batches_bit_for_bit(tmp_path, kind):
    if kind.startswith("synthetic"):  # at 64 px: the photo geometry (round 5's F2)
        cfg = config(synthetic_size=24, image_size=64 if kind == "synthetic-photo" else 16)
    else:
        cfg = folder_config(write_mask_folder(tmp_path / "set", counts=(("train", 7),
                                                                       ("val", 3))),
                            image_size=64 if kind == "photos" else 16)
    train, val = seg.build_datasets(cfg)
    (x, y), sampler = load_epoch(train, 0)
    device = seg.DeviceLoader(train, "cpu", batch_sampler=sampler)
    assert len(device) == len(sampler)
    batches = list(device)
    assert all(len(b[0]) <= 4 for b in batches)
    assert torch.equal(torch.cat([b[0] for b in batches]), x)
    assert torch.equal(torch.cat([b[1] for b in batches]), y)
    assert (y == 255).any() and y.dtype == torch.int64
    sampler.set_epoch(2, start=len(train))  # resumed after the epoch's last step
    assert list(device) == []
    loader = data.build_loader(val, batch_size=2)
    _, device_val = seg.build_device_loaders({"batch_size": 2}, train, val, sampler, "cpu")
    assert isinstance(device_val, device_data.DeviceLoader)  # train.py's checks see it
    for (a, m), (b, n) in zip(loader, device_val, strict=True):
        assert torch.equal(a, b) and torch.equal(m, n)


def test_resized_sizes_are_torchvisions_and_never_zero():
    from torchvision.transforms.v2 import functional as TF

    for h, w, size, top in [(40, 90, 69, 92), (120, 70, 69, 92), (60, 72, 69, 92),
                            (375, 500, 520, None), (500, 333, 260, None)]:
        out = TF.resize(torch.zeros(1, h, w), [size], max_size=top).shape[-2:]
        assert seg.resized_size(h, w, size, top) == tuple(out)
    evaluation = seg.pair_transforms(64, augment=True)[1]
    image, mask = evaluation(torch.zeros(3, 2, 400, dtype=torch.uint8),
                             torch.zeros(2, 400, dtype=torch.uint8))
    assert image.shape == (3, 92, 92) and (mask[:, :92] == 0).sum() == 92  # 1 x 92 px


def test_set_identity_tells_another_set(tmp_path):
    root = write_mask_folder(tmp_path / "set")
    a = seg.set_identity(seg.build_datasets(folder_config(root))[0])
    assert a == seg.set_identity(seg.build_datasets(folder_config(root))[0])
    assert a["size"] == 5
    os.rename(root / "train" / "masks" / "p4.png", root / "train" / "masks" / "p9.png")
    os.rename(root / "train" / "images" / "p4.png", root / "train" / "images" / "p9.png")
    assert seg.set_identity(seg.build_datasets(folder_config(root))[0]) != a
    synthetic = seg.set_identity(seg.build_datasets(config())[0])
    assert synthetic == seg.set_identity(seg.build_datasets(config())[0])
    assert synthetic != seg.set_identity(seg.build_datasets(config(seed=1))[0])


def test_the_device_decision_counts_images_and_masks(monkeypatch):
    train, val = seg.build_datasets(config(synthetic_size=50))
    need = 50 * 3 * 16 * 16 * 4 + 50 * 16 * 16 + 10 * (3 * 16 * 16 * 4 + 16 * 16)
    assert seg.device_nbytes(train) + seg.device_nbytes(val) == need
    use, why = seg.device_decision(config(data_on_device="auto"), train, val, "cpu")
    assert use and why.startswith("data path: in memory (cpu): synthetic images and masks")
    assert not seg.device_decision(config(data_on_device="off"), train, val, "cpu")[0]
    monkeypatch.setattr(hardware, "available_memory", lambda: need * 3)  # 33% > 25%
    use, why = seg.device_decision(config(data_on_device="auto"), train, val, "cpu")
    assert not use and "would take 33%" in why and "auto allows 25%" in why
    assert seg.device_decision(config(data_on_device="on"), train, val, "cpu")[0]


def test_masks_in_which_nothing_counts_end_the_run_in_one_line(tmp_path, capsys):
    """Round 5's F9: masks that are all 255 stop at the first validation with one error
    line, not a run that "succeeds" with loss 0 and mIoU NaN."""
    from helpers import seg_args

    import train

    root = write_mask_folder(tmp_path / "set", counts=(("train", 4), ("val", 2)))
    for mask in root.glob("*/masks/*.png"):
        width, height = Image.open(mask).size
        save_mask(mask, np.full((height, width), 255, np.uint8), "L")
    args = seg_args(tmp_path / "run", "--num-classes", "3")
    args[args.index("synthetic")] = "maskfolder"
    capsys.readouterr()
    assert train.main([*args, "--data-dir", str(root)]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err[-1].startswith("error: no mask pixel of the validation set is a class")
    assert "Traceback" not in "\n".join(err)


def test_a_maskfolder_whose_file_names_are_not_utf8_trains_and_resumes(tmp_path, capsys):
    """Round 5's F1: a Latin-1 file name (bytes that are not UTF-8) trains, is fingerprinted
    and resumes, as class folders' names do; UTF-8 names keep their fingerprint."""
    import hashlib

    from helpers import seg_args

    import train

    root = write_mask_folder(tmp_path / "set", counts=(("train", 4), ("val", 2)))
    for split in ("train", "val"):
        for kind in ("images", "masks"):
            folder = os.fsencode(str(root / split / kind))
            os.rename(folder + b"/p0.png", folder + b"/caf\xe9.png")
    args = [*seg_args(tmp_path / "run", "--num-classes", "3"), "--data-dir", str(root)]
    args[args.index("synthetic")] = "maskfolder"
    assert train.main(args) == 0
    assert train.main([*args[:args.index("--epochs") + 1], "2",
                       *args[args.index("--epochs") + 2:], "--resume", "auto"]) == 0
    assert "does not match" not in capsys.readouterr().out  # the same set on resume
    utf8 = write_mask_folder(tmp_path / "plain", counts=(("train", 2), ("val", 1)))
    train_set, _ = seg.build_datasets(folder_config(utf8))
    h, base = hashlib.sha256(), train_set.base.root
    for image, mask in train_set.base.pairs.pairs:  # the fingerprint as it was written
        h.update(f"{os.path.relpath(image, base)}\0{os.path.relpath(mask, base)}\n".encode())
    assert seg.set_identity(train_set)["fingerprint"] == h.hexdigest()


def test_square_photos_without_augmentation_train_and_evaluate_as_they_are(tmp_path):
    """Issue 37: 64 px square images at --image-size 64 --no-augment train at 64 x 64 and
    are evaluated at 64 x 64, the pixels as they are (normalised): no resize to the base
    size and no padding (the old geometry trained and evaluated on a 92 px canvas, 44%
    of it ignored)."""
    root = write_mask_folder(tmp_path / "set", sizes=((64, 64),))
    train, val = seg.build_datasets(folder_config(root, image_size=64, augment=False,
                                                  cache_dir=str(tmp_path / "cache")), say)
    mean, std = (torch.tensor(s).view(3, 1, 1) for s in sample_transforms.STATS["imagefolder"])
    for dataset in (train, val):
        image, mask = dataset[(0, 0)] if dataset is train else dataset[0]
        raw_image, raw_mask = dataset.base[0]
        assert image.shape == (3, 64, 64) and mask.shape == (64, 64)
        assert torch.equal(mask, raw_mask.long())  # no padding, no resampling
        assert torch.allclose(image, (raw_image / 255 - mean) / std, atol=1e-5)


def test_the_evaluation_canvas_fits_the_set():
    """Square images: a square canvas of the base size (69 for a crop of 64), not the
    4/3 square (92); a set of one size: no padding; mixed sizes: the largest resized
    height and width, padding only where the sizes differ."""
    def evaluated(sizes, source, augment=True):
        return seg.pair_transforms(64, augment, sizes=sizes)[1](*source)

    image, mask = evaluated([(80, 80)], block_pairs(80, 80))
    assert image.shape == (3, 69, 69) and not (mask == 255).all(dim=1).any()
    image, mask = evaluated([(60, 80)], block_pairs(60, 80))  # one size: no padding
    assert image.shape == (3, 69, 92) and (mask != 255).any(dim=0).all() \
        and (mask != 255).any(dim=1).all()
    sizes = [(60, 80), (80, 60)]  # landscape and portrait: 69 x 92 and 92 x 69
    image, mask = evaluated(sizes, block_pairs(60, 80))
    assert image.shape == (3, 92, 92) and (mask[69:] == 255).all()
    image, _ = evaluated([(64, 64)], block_pairs(64, 64), augment=False)
    assert image.shape == (3, 64, 64)  # without augmentation: the training scale


def test_num_classes_that_disagree_with_the_masks_are_said(tmp_path):
    """Round 5's F11: a maskfolder without classes.txt takes its classes from the masks;
    a --num-classes that disagrees (5 for 3) is said in one note, not dropped silently."""
    root = write_mask_folder(tmp_path / "set")  # classes 0..2, no classes.txt
    lines = []
    train, _ = seg.build_datasets(folder_config(root, augment=False, num_classes=5,
                                                cache_dir=str(tmp_path / "c")), lines.append)
    assert train.num_classes == 3
    notes = [line for line in lines if line.startswith("note:")]
    assert len(notes) == 1 and "3 classes" in notes[0] and "--num-classes 5" in notes[0] \
        and "classes.txt" in notes[0], lines
    lines.clear()
    seg.build_datasets(folder_config(root, augment=False, num_classes=3,
                                     cache_dir=str(tmp_path / "c")), lines.append)
    assert not [line for line in lines if line.startswith("note:")], lines

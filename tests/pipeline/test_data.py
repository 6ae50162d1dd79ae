"""Data: unreadable images never stop a run, deep images keep their contents, and a
sample's augmentation depends on (seed, epoch, index) only."""

import struct
import zlib

import numpy as np
import pytest
import torch
from helpers import assert_states_equal, tiny_args, write_image_folder
from PIL import Image

import train
from config import with_defaults
from ops import UserError
from pipeline import data, images


def png_header(width, height):
    """A PNG that is only a (valid) header claiming ``width x height`` 8-bit RGB pixels."""
    def chunk(kind, body):
        return (struct.pack(">I", len(body)) + kind + body
                + struct.pack(">I", zlib.crc32(kind + body)))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def truncated_jpeg(path):
    """A valid JPEG cut in its pixel data (its header is whole: it opens, then fails)."""
    pixels = torch.randint(0, 256, (64, 64, 3), generator=torch.Generator().manual_seed(1),
                           dtype=torch.uint8)
    Image.fromarray(pixels.numpy()).save(path, "JPEG", quality=95)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


EPS = (b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n"
       b"newpath 0 0 moveto 10 10 lineto stroke\nshowpage\n%%EOF\n")

# Bad files: (name, writer, why load_image refuses it). Named to sort last in the last
# class, so their replacement wraps around to sample 0.
BAD = {
    "zero_byte": ("zz.jpg", lambda p: p.write_bytes(b""), "cannot identify"),
    "truncated_jpeg": ("zz.jpg", truncated_jpeg, "truncated"),
    "text_as_png": ("zz.png", lambda p: p.write_text("not an image\n"), "cannot identify"),
    # Never identified as EPS, so Ghostscript never runs.
    "eps_as_jpg": ("zz.jpg", lambda p: p.write_bytes(EPS), "UnidentifiedImageError"),
    # Over PIL's MAX_IMAGE_PIXELS (a warning by default), and over twice it (an error).
    "bomb_warning": ("zz.png", lambda p: p.write_bytes(png_header(10_000, 10_000)),
                     "DecompressionBombWarning"),
    "bomb_error": ("zz.png", lambda p: p.write_bytes(png_header(100_000, 100_000)),
                   "DecompressionBombError"),
    # A real 12x12 image over a lowered limit (set by the test): 100 < 144 pixels.
    "over_pixel_limit": ("zz.png", lambda p: Image.new("RGB", (12, 12)).save(p),
                         "DecompressionBombWarning"),
}


def config(root, **extra):
    return with_defaults({"dataset": "imagefolder", "data_dir": str(root), "seed": 0,
                          "augment": True, "image_size": 16, **extra})


def load_all(dataset, workers, train_order=True):
    """Every sample of epoch 1 through a real loader: ``(images, labels)``."""
    if train_order:
        sampler = data.EpochBatchSampler(len(dataset), 4, seed=0)
        sampler.set_epoch(1)
        loader = data.build_loader(dataset, batch_sampler=sampler, num_workers=workers)
    else:
        loader = data.build_loader(dataset, batch_size=4, num_workers=workers)
    try:
        batches = list(loader)
    finally:
        data.shutdown_loader(loader)
    return torch.cat([x for x, _ in batches]), torch.cat([y for _, y in batches])


@pytest.mark.parametrize("kind", sorted(BAD))
def test_load_image_says_why_a_file_is_unreadable(tmp_path, monkeypatch, kind):
    name, write, reason = BAD[kind]
    write(tmp_path / name)
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100 if kind == "over_pixel_limit"
                        else Image.MAX_IMAGE_PIXELS)
    with pytest.raises(images.UnreadableImage, match=reason):
        images.load_image(tmp_path / name)


@pytest.mark.parametrize("kind", sorted(BAD))
def test_an_unreadable_image_is_replaced_warned_and_counted(tmp_path, capfd, monkeypatch,
                                                            kind):
    root = write_image_folder(tmp_path, classes=("a", "b"), per_class=3, size=(8, 8))
    name, write, _ = BAD[kind]
    bad = [root / split / "b" / name for split in ("train", "val")]
    for path in bad:
        write(path)
    if kind == "over_pixel_limit":
        monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    results = {}
    for workers in (0, 2):
        train_set, val_set = data.build_datasets(config(root))
        assert capfd.readouterr().err == ""  # built without reading the bad files
        results[workers] = (load_all(train_set, workers), load_all(val_set, workers, False))
        err = capfd.readouterr().err
        for path in bad:
            assert err.count(f"warning: skipping unreadable image {path} (") == 1, err
        assert err.count("warning:") == 2
        assert train_set.unreadable_count() == val_set.unreadable_count() == 1
    assert_states_equal(results[0], results[2])
    (train_x, train_y), (val_x, val_y) = results[0]
    assert len(train_x) == len(val_x) == 7 and train_x.shape[1:] == (3, 16, 16)
    # The last sample stands in for itself with the next readable one: sample 0.
    assert torch.equal(val_x[-1], val_x[0]) and val_y[-1] == val_y[0] == 0


def test_the_unreadable_count_reaches_the_main_process_from_spawned_workers(tmp_path):
    root = write_image_folder(tmp_path, classes=("a", "b"), per_class=2, size=(8, 8))
    (root / "train" / "b" / "zz.jpg").write_bytes(b"")
    train_set, _ = data.build_datasets(config(root))
    loader = torch.utils.data.DataLoader(train_set, batch_size=5, num_workers=1,
                                         multiprocessing_context="spawn")
    assert sum(len(y) for _, y in loader) == 5
    assert train_set.unreadable_count() == 1


def test_a_set_without_any_readable_image_is_a_user_error(tmp_path):
    root = write_image_folder(tmp_path, splits=("train",), classes=("a", "b"), per_class=3,
                              size=(8, 8))
    for name in ("a", "b"):
        (root / "val" / name).mkdir(parents=True)
        (root / "val" / name / "0.jpg").write_bytes(b"")
    with pytest.raises(UserError, match="no image in .*val.* can be read"):
        data.build_datasets(config(root))


def test_tensor_sets_count_no_unreadable_files():
    train_set, val_set = data.build_datasets(with_defaults(
        {"dataset": "synthetic", "data_dir": "x", "seed": 0, "image_size": 8,
         "augment": False, "synthetic_size": 8, "num_classes": 2}))
    assert train_set.unreadable_count() == val_set.unreadable_count() == 0


def gradient(dtype, top):
    return (np.arange(256, dtype=np.float64).reshape(16, 16) / 255 * top).astype(dtype)


@pytest.mark.parametrize("make, suffix", [
    (lambda: Image.fromarray(gradient(np.uint16, 65535)), "png"),  # I;16
    (lambda: Image.fromarray(gradient(np.int32, 65535)), "tif"),   # I, 16-bit values
    (lambda: Image.fromarray(gradient(np.int32, 2**31 - 1)), "tif"),  # I, 32-bit values
    (lambda: Image.fromarray(gradient(np.float32, 1.0)), "tif"),   # F in [0, 1]
    (lambda: Image.fromarray(gradient(np.uint8, 255)), "png"),     # L
    (lambda: Image.fromarray(gradient(np.uint8, 255)).convert("P"), "gif"),
    (lambda: Image.fromarray(gradient(np.uint8, 255)).convert("LA"), "png"),
    (lambda: Image.fromarray(gradient(np.uint8, 255)).convert("RGBA"), "png"),
    (lambda: Image.fromarray(gradient(np.uint8, 255)).convert("CMYK"), "tif"),
])
def test_images_of_any_depth_load_as_8_bit_rgb_keeping_their_contents(tmp_path, make,
                                                                       suffix):
    path = tmp_path / f"image.{suffix}"
    original = make()
    original.save(path)
    image = images.load_image(path)
    assert image.mode == "RGB" and image.size == (16, 16)
    pixels = np.asarray(image, dtype=np.float64)
    assert abs(pixels.mean() - 127.5) < 2, (original.mode, pixels.mean())  # not all white
    assert pixels[0, 0].max() <= 1 and pixels[-1, -1].min() >= 253


def test_the_image_folder_reads_with_the_safe_loader(tmp_path):
    root = write_image_folder(tmp_path, classes=("a", "b"), per_class=1, size=(8, 8))
    Image.fromarray(gradient(np.uint16, 65535)).save(root / "train" / "b" / "1.png")
    train_set, _ = data.build_datasets(config(root, augment=False))
    image, label = train_set[2]
    assert label == 1 and abs(image.mean().item() - (0.5 - 0.456) / 0.224) < 0.5


def test_a_single_class_folder_warns(tmp_path, capfd):
    root = write_image_folder(tmp_path, classes=("only",), per_class=3, size=(8, 8))
    train_set, _ = data.build_datasets(config(root))
    err = capfd.readouterr().err
    assert train_set.num_classes == 1
    assert err.count("warning:") == 1 and err.startswith("warning:") and "single class" in err


def test_two_classes_do_not_warn(tmp_path, capfd):
    root = write_image_folder(tmp_path, classes=("a", "b"), per_class=3, size=(8, 8))
    data.build_datasets(config(root))
    assert capfd.readouterr().err == ""


def test_augmentation_depends_on_seed_epoch_and_index_only():
    cfg = with_defaults({"dataset": "synthetic", "data_dir": "x", "seed": 0, "augment": True,
                         "image_size": 16, "synthetic_size": 64, "num_classes": 4})
    a, _ = data.build_datasets(cfg)
    b, _ = data.build_datasets(cfg)
    rng = torch.get_rng_state()
    epoch0 = [a[(i, 0)][0] for i in range(64)]
    epoch1 = [a[(i, 1)][0] for i in range(64)]
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is left alone
    assert sum(not torch.equal(x, y) for x, y in zip(epoch0, epoch1)) > 48
    assert all(torch.equal(epoch1[i], b[(i, 1)][0]) for i in range(64))
    assert all(torch.equal(epoch0[i], a[i][0]) for i in range(64))  # plain index: epoch 0
    other, _ = data.build_datasets({**cfg, "seed": 1})
    assert sum(not torch.equal(epoch1[i], other[(i, 1)][0]) for i in range(64)) > 48


@pytest.mark.parametrize("workers", [0, 2])
def test_training_finishes_despite_unreadable_images(tmp_path, capfd, workers):
    root = write_image_folder(tmp_path / "images", classes=("a", "b"), per_class=4,
                              size=(8, 8))
    bad = []
    for split in ("train", "val"):
        bad += [root / split / "a" / "empty.jpg", root / split / "b" / "cut.jpg"]
        bad[-2].write_bytes(b"")
        truncated_jpeg(bad[-1])
    args = tiny_args(tmp_path / "run", "--dataset", "imagefolder", "--data-dir", str(root),
                     "--num-workers", str(workers), "--data-on-device", "off",
                     network="simple_cnn", image=16, batch=4,
                     epochs=2)
    assert train.main(args) == 0
    err = capfd.readouterr().err
    for path in bad:
        assert f"warning: skipping unreadable image {path} (" in err, err


def test_a_symlink_loop_in_an_image_folder_is_read_once(tmp_path, capfd):
    # class0/loop -> .. made torchvision's walk go round: 200 images became 25,400
    # samples, every other class's images labelled class0.
    root = write_image_folder(tmp_path, classes=("class0", "class1"), per_class=4,
                              size=(8, 8))
    (root / "train" / "class0" / "loop").symlink_to("..")
    (root / "train" / "class1" / "again").symlink_to(root / "train" / "class1")
    (root / "train" / "class1" / "more").symlink_to(root / "val" / "class1")  # new images
    train_set, val_set = data.build_datasets(config(root))
    warnings = [w for w in capfd.readouterr().err.splitlines() if w.startswith("warning:")]
    assert len(warnings) == 2, warnings
    assert f"warning: skipping {root / 'train' / 'class0' / 'loop'}: it is " \
           f"{root / 'train'} again" in warnings[0]
    labels = [label for _, label in train_set.base.samples]
    assert labels == [0] * 4 + [1] * 8  # class1 and, once, the val images it links to
    assert len(train_set) == 12 and len(val_set) == 8


def test_the_walk_gives_torchvisions_samples_in_its_order_without_links(tmp_path):
    import torchvision

    root = write_image_folder(tmp_path, classes=("b", "a", "c"), per_class=3, size=(8, 8))
    (root / "train" / "a" / "deeper" / "x").mkdir(parents=True)
    Image.new("RGB", (8, 8)).save(root / "train" / "a" / "deeper" / "x" / "0.png")
    Image.new("RGB", (8, 8)).save(root / "train" / "a" / "deeper" / "1.png")
    ours = data.SafeImageFolder(str(root / "train"))
    theirs = torchvision.datasets.ImageFolder(str(root / "train"))
    assert ours.samples == theirs.samples and ours.classes == theirs.classes

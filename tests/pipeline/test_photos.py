"""Photos (issue 19): image folders at 64 px and above take the standard geometry, are
decoded once (cheaply) into the cache that both data paths read, and a pretrained
torchvision network fine-tunes on them; every bad photo is one line."""

import math
import os
import shutil

import numpy as np
import pytest
import torch
from helpers import (
    assert_batches_equal,
    assert_states_equal,
    final_state,
    load_test_py,
    photo_folder,
    tiny_args,
    tv_args,
)
from PIL import Image
from torchvision.transforms import v2

import networks
import train
from config import parse_config, with_defaults
from pipeline import data, device_data, presets
from pipeline import images as image_files


def photo_config(root, **extra):
    return with_defaults({"dataset": "imagefolder", "data_dir": str(root), "image_size": 64,
                          "num_workers": 0, "seed": 3, **extra})


# ---------------------------------------------------------------- the geometry

def test_crop_boxes_follow_torchvisions_rules_and_the_hash():
    index = torch.arange(2000)
    heights, widths = torch.full_like(index, 300), torch.full_like(index, 200)
    top, left, h, w = presets.crop_boxes(5, 1, index, heights, widths, 0.08)
    assert (top >= 0).all() and (left >= 0).all()
    assert (top + h <= 300).all() and (left + w <= 200).all()
    area = (h * w).double() / (300 * 200)
    ratio = w.double() / h.double()
    assert area.min() >= 0.07 and area.max() <= 1.0
    assert ((ratio >= 0.74) & (ratio <= 1.35)).all()  # 3/4..4/3, up to rounding
    torch.manual_seed(0)  # the same distribution as torchvision's own draws
    theirs = [v2.RandomResizedCrop.get_params(torch.zeros(3, 300, 200), (0.08, 1.0),
                                              (3 / 4, 4 / 3)) for _ in range(2000)]
    their_area = torch.tensor([b[2] * b[3] / (300 * 200) for b in theirs])
    their_ratio = torch.tensor([b[3] / b[2] for b in theirs])
    assert abs(area.mean() - their_area.mean()) < 0.02
    assert abs(ratio.log().mean() - their_ratio.log().mean()) < 0.02
    again = presets.crop_boxes(5, 1, index, heights, widths, 0.08)
    assert all(torch.equal(a, b) for a, b in zip(again, (top, left, h, w)))
    for i in range(2000):  # one sample in Python numbers (the per-sample path): the same
        one = presets.crop_box(5, 1, i, 300, 200, 0.08)
        assert one == (int(top[i]), int(left[i]), int(h[i]), int(w[i]))
    many = torch.randint(8, 3000, (2, 500), generator=torch.Generator().manual_seed(1))
    boxes = presets.crop_boxes(9, 4, torch.arange(500), many[0], many[1], 0.3)
    for i in range(500):  # any sizes (the long and thin fall back to the centre)
        assert presets.crop_box(9, 4, i, int(many[0, i]), int(many[1, i]), 0.3) == \
            tuple(int(b[i]) for b in boxes)
    other = presets.crop_boxes(5, 2, index, heights, widths, 0.08)  # another epoch
    assert (other[0] != top).float().mean() > 0.9


def test_a_very_long_photo_falls_back_to_its_centre():
    top, left, h, w = presets.crop_boxes(0, 0, torch.tensor([0]), torch.tensor([10]),
                                         torch.tensor([1000]), 1.0)  # area 1: no try fits
    assert (int(h), int(w)) == (10, round(10 * 4 / 3)) and int(left) == (1000 - 13) // 2


def test_evaluation_is_torchvisions_resize_and_centre_crop(tmp_path):
    root = photo_folder(tmp_path, formats=("png",))  # PNG: no draft mode, the same decode
    train_set, val_set = data.build_datasets(photo_config(root, augment=False))
    # The reference is torchvision's own, on the file (none of the project's functions):
    # ImageNet's Resize(256) + CenterCrop(224) at 64 px and --crop-pct 0.875: the short
    # side to floor(64 / 0.875) = 73, the centre 64 x 64, then ImageNet's statistics.
    reference = v2.Compose([v2.Resize(73), v2.CenterCrop(64), v2.PILToTensor(),
                            v2.ToDtype(torch.float32, scale=True),
                            v2.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])])
    for dataset in (val_set, train_set):  # without --augment training crops as evaluation
        for i in range(len(dataset)):
            path, label = dataset.base.folder.samples[i]
            want = reference(Image.open(path).convert("RGB"))
            got, got_label = dataset[(i, 3)]  # what the network is given, any epoch
            assert got_label == label and got.shape == want.shape == (3, 64, 64)
            # the same pixels: a level of difference is 1/255/0.229 = 0.017 here
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_the_training_crop_is_a_random_resized_crop_per_sample_seed_and_epoch(tmp_path):
    root = photo_folder(tmp_path)
    train_set, _ = data.build_datasets(photo_config(root))
    first = [train_set[(i, 0)][0] for i in range(len(train_set))]
    assert all(x.shape == (3, 64, 64) and x.dtype == torch.float32 for x in first)
    assert all(torch.equal(first[i], train_set[(i, 0)][0]) for i in range(len(first)))
    other = [train_set[(i, 1)][0] for i in range(len(first))]
    assert sum(not torch.equal(a, b) for a, b in zip(first, other)) == len(first)


@pytest.mark.parametrize("augment", [True, False])
def test_the_device_path_equals_the_loader_path_on_photos(tmp_path, augment):
    root = photo_folder(tmp_path)
    cfg = photo_config(root, augment=augment)
    train_set, val_set = data.build_datasets(cfg)
    sampler = data.EpochBatchSampler(len(train_set), 4, 3)
    sampler.set_epoch(2)
    per_sample = list(data.build_loader(train_set, batch_sampler=sampler, num_workers=2))
    train_loader, val_loader = device_data.build_device_loaders(cfg, train_set, val_set,
                                                                sampler, "cpu")
    assert_batches_equal(per_sample, list(train_loader))
    whole = list(data.build_loader(val_set, batch_size=cfg["batch_size"]))
    assert_batches_equal(whole, list(val_loader))


def photo_args(run_dir, images, *extra, **kwargs):
    return tiny_args(run_dir, "--dataset", "imagefolder", "--data-dir", str(images),
                     "--network", "simple_cnn", *extra,
                     **{"image": 64, "batch": 4, "epochs": 2, **kwargs})


def test_train_on_photos_gives_the_same_weights_on_both_paths_and_across_a_stop(tmp_path):
    from helpers import stop_at_step

    images = photo_folder(tmp_path / "images")
    off = photo_args(tmp_path / "off", images, "--data-on-device", "off", "--num-workers", "2")
    assert train.main(off) == 0
    assert train.main(photo_args(tmp_path / "on", images, "--data-on-device", "on")) == 0
    assert_states_equal(final_state(tmp_path / "on")["model"],
                        final_state(tmp_path / "off")["model"])
    run = tmp_path / "stopped"
    with stop_at_step(3):  # a real SIGTERM inside the first epoch
        assert train.main(photo_args(run, images, "--data-on-device", "on")) == 143
    assert train.main(photo_args(run, images, "--data-on-device", "on", "--resume",
                                 "auto")) == 0
    assert_states_equal(final_state(run)["model"], final_state(tmp_path / "off")["model"])


def test_test_py_evaluates_a_photo_run_as_it_validated(tmp_path):
    import json

    images = photo_folder(tmp_path / "images")
    run = tmp_path / "run"
    assert train.main(photo_args(run, images, "--tta", "flip")) == 0
    logged = [json.loads(line) for line in open(run / "metrics.jsonl")][-1]
    out = tmp_path / "r.json"
    assert load_test_py().main(["--checkpoint", str(run / "checkpoints" / "last.pt"),
                                "--num-workers", "0", "--device", "cpu", "--json",
                                str(out)]) == 0
    assert json.loads(out.read_text())["accuracy"] == logged["val_acc"]


# ------------------------------------------------------- decoded once and cheaply

def test_a_large_jpeg_is_decoded_at_reduced_size(tmp_path, monkeypatch):
    path = tmp_path / "big.jpg"
    Image.new("RGB", (2400, 1800), (90, 120, 30)).save(path)
    from PIL import JpegImagePlugin

    asked = []
    real_draft = JpegImagePlugin.JpegImageFile.draft

    def draft(self, mode, size):
        asked.append(size)
        return real_draft(self, mode, size)

    monkeypatch.setattr(JpegImagePlugin.JpegImageFile, "draft", draft)
    image = image_files.load_image(path, short_side=256)
    assert image.size == (341, 256)  # the long side truncated, as Resize(256)
    assert asked == [(342, 256)]  # no smaller than needed: 1/4 scale (600 x 450) decoded
    assert image_files.load_image(path).size == (2400, 1800)  # without a short side: all of it


def test_an_epoch_after_the_first_decodes_no_image(tmp_path, monkeypatch):
    images = photo_folder(tmp_path / "images")
    args = photo_args(tmp_path / "run", images, "--data-on-device", "off", epochs=1)
    assert train.main(args) == 0
    calls = []
    real = image_files.load_image  # the photos' decoder (presets.ShortSide) reads with it
    monkeypatch.setattr(image_files, "load_image",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    args = photo_args(tmp_path / "again", images, "--data-on-device", "off", epochs=2)
    assert train.main(args) == 0
    assert calls == []  # every image came from the cache


# ------------------------------------------------------------------ bad photos

def exif_rotated_jpeg(path, size=(160, 90)):
    image = Image.new("RGB", size, (200, 10, 10))
    image.paste((10, 10, 200), (0, 0, size[0] // 4, size[1]))  # blue at the left
    exif = image.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view": the camera was held upright
    image.save(path, exif=exif)


def test_bad_photos_are_at_most_one_line_each(tmp_path, capfd):
    root = photo_folder(tmp_path)
    bad = root / "train" / "cat"
    Image.new("CMYK", (120, 100), (0, 255, 255, 0)).save(bad / "cmyk.jpg")
    Image.fromarray(np.arange(120 * 90, dtype=np.uint16).reshape(90, 120) * 7).save(
        bad / "sixteen.png")
    exif_rotated_jpeg(bad / "rotated.jpg")
    Image.new("RGB", (40, 30), (5, 5, 5)).save(bad / "small.png")
    good = Image.new("RGB", (300, 200))
    good.save(bad / "cut.jpg")
    (bad / "cut.jpg").write_bytes((bad / "cut.jpg").read_bytes()[:400])  # truncated
    train_set, _ = data.build_datasets(photo_config(root))
    err = [line for line in capfd.readouterr().err.splitlines() if line]
    assert "Traceback" not in "\n".join(err)
    assert sum("cut.jpg" in line for line in err) == 1  # unreadable: replaced, counted
    assert sum("small.png" in line and "upscaled" in line for line in err) == 1
    assert not [line for line in err if "cmyk" in line or "sixteen" in line
                or "rotated" in line]
    names = [os.path.basename(p) for p, _ in train_set.base.folder.samples]
    rotated = train_set.base.decoded.image(names.index("rotated.jpg"))
    assert rotated.shape[1] > rotated.shape[2]  # turned upright: taller than wide
    assert rotated[2, :5].float().mean() > 150  # the blue edge is now at the top
    assert train_set.unreadable_count() == 1
    for i in range(len(train_set)):
        assert train_set[(i, 0)][0].shape == (3, 64, 64)


# --------------------------------------------------------- pretrained torchvision


def test_pretrained_torchvision_weights_are_fetched_once_and_fine_tuned(tmp_path, fake_hub,
                                                                       capsys):
    weights, state, cached = fake_hub
    images = photo_folder(tmp_path / "images")
    run = tmp_path / "run"
    assert train.main(tv_args(run, images, "--freeze", "features.*", "--lr", "0")) == 0
    out = capsys.readouterr().out
    assert cached.is_file()  # downloaded into TORCH_HOME, its hash checked
    assert "pretrained: loaded" in out and "torchvision's MobileNet_V3_Small" in out
    assert "kept the new head (classifier.3.weight, classifier.3.bias)" in out
    trained = final_state(run)["model"]
    assert trained["classifier.3.weight"].shape == (2, 1024)  # two classes: a new head
    for key, value in state.items():  # lr 0 and frozen features: the weights as fetched
        if not key.startswith("classifier.3"):
            assert torch.equal(trained[key], value), key


def test_pretrained_torchvision_offline_is_one_line_naming_the_file(tmp_path, fake_hub,
                                                                   monkeypatch, capsys):
    import urllib.error
    import urllib.request

    weights, _, cached = fake_hub
    monkeypatch.setattr(weights.value, "url",
                        "https://download.pytorch.org/models/" + cached.name)

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    monkeypatch.setattr(urllib.request, "urlopen", offline)
    images = photo_folder(tmp_path / "images")
    assert train.main(tv_args(tmp_path / "run", images)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --pretrained torchvision: cannot "
                                               "download"), err
    assert f"Put the file at {cached}" in err[0]
    assert not (tmp_path / "run").exists()


def test_a_cached_copy_of_the_weights_needs_no_network(tmp_path, fake_hub, monkeypatch):
    import urllib.request

    weights, state, cached = fake_hub
    cached.parent.mkdir(parents=True)
    shutil.copyfile(weights.value.url[len("file://"):], cached)  # the file its name hashes
    monkeypatch.setattr(urllib.request, "urlopen", lambda *a, **k: pytest.fail("downloaded"))
    assert train.main(tv_args(tmp_path / "run", photo_folder(tmp_path / "images"))) == 0


def test_the_weights_set_the_image_size_crop_and_normalisation(tmp_path):
    config, _ = parse_config(["--dataset", "imagefolder", "--network",
                              "torchvision/convnext_tiny", "--pretrained", "torchvision"])
    assert config["image_size"] == 224 and config["crop_pct"] == pytest.approx(224 / 236)
    p = presets.preset(config)
    assert p["interpolation"] == v2.InterpolationMode.BILINEAR and p["resize"] == 236
    config, _ = parse_config(["--dataset", "imagefolder", "--network",
                              "torchvision/efficientnet_b0", "--pretrained", "torchvision",
                              "--image-size", "160"])
    assert config["image_size"] == 160  # given: kept
    assert presets.preset(config)["interpolation"] == v2.InterpolationMode.BICUBIC
    config, _ = parse_config(["--dataset", "imagefolder", "--pretrained", "torchvision"])
    assert config["network"] == "torchvision/resnet18" and config["image_size"] == 224


@pytest.mark.parametrize("argv, message", [
    (["--network", "resnet18", "--pretrained", "torchvision"],
     "--pretrained torchvision takes torchvision's own weights: it needs --network "
     "torchvision/<name>, not resnet18"),
    (["--network", "torchvision/resnet18", "--pretrained", "torchvision:NOPE"],
     "resnet18 has no weights 'NOPE'; it has IMAGENET1K_V1 (or DEFAULT)"),
])
def test_a_wrong_pretrained_name_is_one_error_line(tmp_path, capsys, argv, message):
    args = ["--dataset", "imagefolder", "--data-dir", str(tmp_path), *argv]
    assert train.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_a_file_named_torchvision_wins_over_the_weights(tmp_path, monkeypatch, capsys):
    torch.save(networks.build_network("simple_cnn", 2, 3, 64).state_dict(),
               tmp_path / "torchvision")
    monkeypatch.chdir(tmp_path)
    images = photo_folder(tmp_path / "images")
    assert train.main(photo_args(tmp_path / "run", images, "--pretrained",
                                 "torchvision", epochs=1)) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("pretrained:")]
    assert len(line) == 1 and line[0].endswith(" tensors from torchvision"), line


def test_a_photo_run_without_a_network_gets_one_built_for_photos(tmp_path, capsys):
    images = photo_folder(tmp_path / "images")
    args = tiny_args(tmp_path / "run", "--dataset", "imagefolder", "--data-dir",
                     str(images), image=64, batch=4, epochs=1)
    del args[args.index("--network"):args.index("--network") + 2]
    assert train.main(args) == 0
    out = capsys.readouterr().out
    assert "network: torchvision/resnet18, built for 64 px photos" in out
    assert final_state(tmp_path / "run")["config"]["network"] == "torchvision/resnet18"


def test_the_cifar_network_on_photos_says_what_it_costs(tmp_path, capsys):
    images = photo_folder(tmp_path / "images")
    assert train.main(photo_args(tmp_path / "run", images, "--network", "resnet9",
                                 epochs=1)) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("note: resnet9")]
    assert line and "GFLOPs a forward pass per sample" in line[0]
    assert "pass --network torchvision/resnet18" in line[0]
    assert math.isfinite(float(line[0].split(": ")[2].split(" ")[0]))


def test_a_photo_export_says_how_to_preprocess_and_evaluates_alone(tmp_path):
    import json

    import onnxruntime

    images = photo_folder(tmp_path / "images")
    run = tmp_path / "run"
    assert train.main(photo_args(run, images, epochs=1)) == 0
    test_py, out = load_test_py(), tmp_path / "model.onnx"
    assert test_py.main(["--checkpoint", str(run / "checkpoints" / "last.pt"), "--device",
                         "cpu", "--num-workers", "0", "--export", str(out), "--json",
                         str(tmp_path / "a.json")]) == 0
    meta = onnxruntime.InferenceSession(str(out)).get_modelmeta().custom_metadata_map
    assert meta["preprocess"] == ("resize the short side to 73 (bilinear, aspect kept), then "
                                  "crop the centre 64x64")
    assert json.loads(meta["normalize"]) == {"mean": [0.485, 0.456, 0.406],
                                             "std": [0.229, 0.224, 0.225]}
    assert test_py.main(["--model", str(out), "--num-workers", "0", "--json",
                         str(tmp_path / "b.json")]) == 0
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    assert b["accuracy"] == a["accuracy"]

"""--dataset hf (pipeline/hf_data.py): a save_to_disk folder, Parquet files and a hub dataset
in the datasets cache give the samples an ImageFolder of the same images gives, bit for
bit; every mistake is one UserError line."""

import os

import datasets
import huggingface_hub
import numpy as np
import pytest
import torch
from helpers import cached_hub_dataset, make_config, write_sources

from ops import UserError
from pipeline import data, hf_data


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


def config_for(path, dataset="hf", **extra):
    return make_config(os.path.dirname(path), "synthetic", augment=True, dataset=dataset,
                       data_dir=path, image_size=16, **extra)


def samples(dataset, epoch=1):
    return [dataset[(i, epoch)] for i in range(len(dataset))]


def assert_same_samples(a, b):
    assert len(a) == len(b)
    for (x0, y0), (x1, y1) in zip(a, b):
        assert torch.equal(x0, x1) and y0 == y1


@pytest.fixture
def hub_cache(sources, tmp_path, monkeypatch):
    cache = str(tmp_path / "hf-cache")
    cached_hub_dataset(sources["parquet"], cache, "toyset")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.chdir(tmp_path)
    return cache


def test_saved_parquet_and_cached_hub_sets_give_the_image_folders_samples(sources, hub_cache):
    """The same images in the same order: the same tensors and labels, augmented (epoch 1)
    and for evaluation, and the ClassLabel's names as the classes."""
    folder_train, folder_val = data.build_datasets(config_for(sources["folder"],
                                                              dataset="imagefolder"))
    online = datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE
    for where in (sources["saved"], sources["parquet"], "toyset"):
        train, val = data.build_datasets(config_for(where))
        assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) \
            == online  # offline while it read, as it was after
        assert train.classes == ["a", "b", "c"] == folder_train.classes
        assert_same_samples(samples(train), samples(folder_train))
        assert_same_samples(samples(val), samples(folder_val))


def test_the_identity_of_a_set_tells_other_contents(sources, tmp_path):
    train, _ = data.build_datasets(config_for(sources["saved"]))
    other = datasets.load_from_disk(sources["saved"])
    other["train"] = other["train"].select(list(reversed(range(len(other["train"])))))
    other.save_to_disk(str(tmp_path / "reversed"))
    reversed_train, _ = data.build_datasets(config_for(str(tmp_path / "reversed")))
    assert data.set_identity(train) == data.set_identity(
        data.build_datasets(config_for(sources["saved"]))[0])
    assert data.set_identity(train) != data.set_identity(reversed_train)
    n = len(train)  # rows in another order: each image with its own label still
    for i in range(n):
        (image, label), (then, then_label) = reversed_train.base[i], train.base[n - 1 - i]
        assert label == then_label and image.tobytes() == then.tobytes()


def test_a_hub_name_not_in_the_cache_says_what_to_place_where(tmp_path, monkeypatch):
    """Read offline (no wait on the hub's retries where there is no network), one line."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    offline, load = [], datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: offline.append((
        datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE)) or load(
        *a, **k))
    with pytest.raises(UserError) as e:
        data.build_datasets(config_for("someone/images"))
    assert offline == [(True, True)]
    message = str(e.value)
    assert "'someone/images' is not in the datasets cache" in message
    assert str(tmp_path / "empty") in message and "save_to_disk" in message
    assert "\n" not in message


def test_named_columns_splits_and_their_mistakes(sources, tmp_path):
    """Columns without an Image/ClassLabel feature are named; a plain int label column
    gives the classes 0..max; unknown splits and columns are one line naming what there is."""
    saved = datasets.load_from_disk(sources["saved"])
    plain = datasets.DatasetDict({
        "train": saved["train"].rename_columns({"image": "pic", "label": "y"}).cast_column(
            "y", datasets.Value("int64")),
        "test": saved["validation"].rename_columns({"image": "pic", "label": "y"}).cast_column(
            "y", datasets.Value("int64"))})
    plain.save_to_disk(str(tmp_path / "plain"))
    path = str(tmp_path / "plain")
    with pytest.raises(UserError, match="no column whose feature is a ClassLabel .*"
                                        "--label-column"):
        data.build_datasets(config_for(path))
    train, val = data.build_datasets(config_for(path, label_column="y"))
    assert train.classes == ["0", "1", "2"] and len(val) == 6  # test: the default
    assert_same_samples(samples(train), samples(data.build_datasets(
        config_for(sources["saved"]))[0]))
    with pytest.raises(UserError, match=r"--image-column 'img'.*has no such column \(it "
                                        r"has: pic, y\)"):
        data.build_datasets(config_for(path, image_column="img", label_column="y"))
    with pytest.raises(UserError, match=r"--val-split 'dev'.*no such split \(it has: train, "
                                        r"test\)"):
        data.build_datasets(config_for(path, label_column="y", val_split="dev"))
    with pytest.raises(UserError, match="holds .* not images"):
        data.build_datasets(config_for(path, image_column="y", label_column="y"))


def test_what_is_not_a_dataset_is_one_line(sources, tmp_path):
    (tmp_path / "nothing").mkdir()
    for path, words in ((str(tmp_path / "missing"), "does not exist"),
                        (str(tmp_path / "nothing"), "neither a dataset written by"),
                        (sources["saved"] + "/train", "holds one split")):
        with pytest.raises(UserError, match=words):
            data.build_datasets(config_for(path))


def test_an_unreadable_image_is_replaced_by_the_next_and_counted(sources, tmp_path, capfd):
    saved = datasets.load_from_disk(sources["saved"])
    rows = saved["train"].cast_column("image", datasets.Image(decode=False)).to_dict()
    rows["image"][2] = {"bytes": b"not an image", "path": None}
    saved["train"] = datasets.Dataset.from_dict(rows, features=saved["train"].features)
    saved.save_to_disk(str(tmp_path / "bad"))
    train, _ = data.build_datasets(config_for(str(tmp_path / "bad")))
    good, _ = data.build_datasets(config_for(sources["saved"]))
    (image, label), (then, then_label) = train.base[2], good.base[3]  # 3 stands in for 2
    assert label == then_label and np.array_equal(np.asarray(image), np.asarray(then))
    assert train.unreadable_count() == 1
    assert "skipping unreadable image row 2 of" in capfd.readouterr().err


def test_labels_outside_the_classes_are_one_line(tmp_path):
    table = datasets.Dataset.from_dict({"image": [None], "label": [2]}, features=datasets.Features(
        {"image": datasets.Image(), "label": datasets.Value("int64")}))
    with pytest.raises(UserError, match="label 2 is not one of the 2 classes"):
        hf_data.HFImages(table, "image", "label", ["a", "b"], "here")

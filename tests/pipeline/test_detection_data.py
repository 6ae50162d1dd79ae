"""Detection data from COCO-format folders as a hostile export would have them (reliability
review 7: F2, F3, F5, F6, F7, F9; mutation round 7's S7-01): each wrong json is one line
naming the file and the annotation, an EXIF-oriented JPEG keeps its boxes on its objects,
an extreme aspect ratio is resized, a split without a readable image is one line."""

import json
import os

import pytest
import torch
from PIL import Image

import train
from ops import UserError
from pipeline import detection_data

RED = (220, 20, 20)


def write_split(folder, images, annotations, name="a.json"):
    """A COCO json in ``folder`` for ``images`` (``(file_name, width, height)``, each a grey
    PNG written there unless its name leaves the folder) with ``annotations`` as given
    (ids numbered), category 3 "square". Returns the json's path."""
    os.makedirs(folder, exist_ok=True)
    entries = []
    for i, (file_name, width, height) in enumerate(images):
        path = os.path.join(folder, file_name)
        if os.path.normpath(path).startswith(os.path.normpath(str(folder))):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            Image.new("RGB", (width, height), (90, 90, 90)).save(path)
        entries.append({"id": i + 1, "file_name": file_name, "width": width,
                        "height": height})
    doc = {"images": entries, "categories": [{"id": 3, "name": "square"}],
           "annotations": [{"id": k + 1, "iscrowd": 0, **a} for k, a in enumerate(annotations)]}
    path = os.path.join(folder, name)
    with open(path, "w") as f:
        json.dump(doc, f)
    return path


def box(image_id, bbox, category=3):
    return {"image_id": image_id, "category_id": category, "bbox": bbox}


def refused(path, folder):
    """The one line read_coco refuses ``path`` with."""
    with pytest.raises(UserError) as e:
        detection_data.read_coco(path, str(folder))
    line = str(e.value)
    assert line.startswith(path) and "\n" not in line, line
    return line


# ------------------------------------------------------------------ F2: EXIF orientation

def test_an_exif_oriented_jpeg_is_read_as_stored_and_its_box_stays_on_its_object(tmp_path):
    """A 64x48 JPEG with EXIF orientation 6 (a phone's), a red object at x 40-60, y 4-14
    of its stored pixels, the json's box there: the image is read as stored (as
    torchvision's COCO reference reads it), so the box given to the detector is on the
    object's pixels, not on a rotated image's."""
    folder = tmp_path / "train"
    path = write_split(folder, [("photo.jpg", 64, 48)], [box(1, [40, 4, 20, 10])])
    picture = Image.new("RGB", (64, 48), (90, 90, 90))
    picture.paste(RED, (40, 4, 60, 14))
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to display
    picture.save(folder / "photo.jpg", quality=95, exif=exif)
    entries, categories = detection_data.read_coco(path, str(folder))
    image, target = detection_data.CocoImages(entries, categories)[0]
    assert tuple(image.shape) == (3, 48, 64)
    red = (image[0] > 150) & (image[1] < 100)
    ys, xs = red.nonzero(as_tuple=True)
    found = [int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1]
    assert found == [40, 4, 60, 14]
    assert target["boxes"].tolist() == [[40.0, 4.0, 60.0, 14.0]]


def test_a_json_giving_the_size_transposed_is_warned_once(tmp_path, capsys):
    """The json says 48x64 for a 64x48 stored image (its size as displayed, turned by its
    EXIF orientation): one warning naming the file, once however often it is read."""
    folder = tmp_path / "train"
    path = write_split(folder, [("photo.png", 48, 64)], [box(1, [4, 4, 10, 10])])
    Image.new("RGB", (64, 48)).save(folder / "photo.png")
    entries, categories = detection_data.read_coco(path, str(folder))
    images = detection_data.CocoImages(entries, categories)
    images[0], images[0]
    err = capsys.readouterr().err
    assert err.count("warning: ") == 1 and f"{folder / 'photo.png'} is 64x48 as stored, its " \
        f"json says 48x64" in err, err


# ------------------------------------------------------------------ F3: nothing readable

def test_a_split_without_a_readable_image_is_one_error_line(tmp_path, capsys):
    """Every training image 0 bytes: one error line when the set is built (exit 2), not a
    run to the end on blank stand-ins; one readable image is enough."""
    for split in ("train", "valid"):
        write_split(tmp_path / "data" / split, [(f"{i}.png", 48, 48) for i in range(3)],
                    [box(1, [4, 4, 20, 20])])
    for i in range(3):
        (tmp_path / "data" / "train" / f"{i}.png").write_bytes(b"")
    args = ["--task", "detection", "--dataset", "coco", "--data-dir", str(tmp_path / "data"),
            "--network", "torchvision/ssdlite320_mobilenet_v3_large", "--image-size", "64",
            "--epochs", "1", "--device", "cpu", "--num-workers", "0",
            "--run-dir", str(tmp_path / "run")]
    assert train.main(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors == [f"error: no image in {str(tmp_path / 'data' / 'train')!r} can be read "
                      f"(see the warnings above)"], err
    assert err.count("warning: skipping unreadable image") == 3
    config = dict(dataset="coco", data_dir=str(tmp_path / "data"), seed=0, augment=False,
                  image_size=64)
    with pytest.raises(UserError, match="^no image in .* can be read"):  # when built: not
        detection_data.build_datasets(config)  # in a DataLoader worker, after the set-up
    Image.new("RGB", (48, 48)).save(tmp_path / "data" / "train" / "2.png")
    train_set, _ = detection_data.build_datasets(config)
    assert tuple(train_set[0][0].shape) == (3, 64, 64)  # image 2 stands in for image 0


# ------------------------------------------------------------------ F5, F9: ids and boxes

@pytest.mark.parametrize("change, words", [
    (lambda d: d["images"][0].update(id=[1]), "an image entry without id (an integer or a "
                                              "string), file_name, width and height: "),
    (lambda d: d["images"][0].update(id=True), "an image entry without id"),
    (lambda d: d["annotations"][0].update(image_id=[1]), "annotation 1: its image_id [1] is "
                                                         "not an integer or a string"),
    (lambda d: d["annotations"][0].update(image_id=True), "annotation 1: its image_id True "
                                                          "is not an integer"),
    (lambda d: d["annotations"][0].update(category_id=[3]), "annotation 1: its category_id "
                                                            "[3] is not an integer"),
    (lambda d: d["annotations"][0].update(category_id={"id": 3}),
     "annotation 1: its category_id {'id': 3} is not an integer"),
    (lambda d: d["annotations"][0].update(category_id=True),
     "annotation 1: its category_id True is not an integer"),
    (lambda d: d["annotations"][0].update(bbox=[5, 5, -10, 10]),
     "annotation 1: bbox [5, 5, -10, 10] has a negative width or height"),
    (lambda d: d["annotations"][0].update(bbox=[5, 5, 10, -1]),
     "annotation 1: bbox [5, 5, 10, -1] has a negative width or height"),
])
def test_ids_that_are_no_ids_and_negative_boxes_are_one_line(tmp_path, change, words):
    """F5: a list or an object as an id was a TypeError traceback; F9: JSON true was taken
    as id 1, a box of negative width dropped as one of zero width."""
    path = write_split(tmp_path, [("a.png", 48, 48)], [box(1, [4, 4, 20, 20])])
    with open(path) as f:
        doc = json.load(f)
    doc["categories"].append({"id": 1, "name": "one"})  # (true must not find it)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    assert words in refused(path, tmp_path)


def test_a_json_nested_too_deeply_is_one_line(tmp_path):
    path = tmp_path / "deep.json"
    path.write_text("[" * 200_000 + "]" * 200_000)
    line = refused(str(path), tmp_path)
    assert line == f"{path}: nested too deeply to be read (not a COCO annotation file)"


def test_a_box_may_cross_each_edge_by_a_rounding_and_no_more(tmp_path, capsys):
    """COCO's own boxes cross their image's edge by a rounding: accepted on all four
    edges (and clipped), refused beyond OUTSIDE_TOLERANCE; a box of zero width dropped
    with a warning."""
    crossing = [[-0.5, 2, 10, 10], [2, -0.5, 10, 10], [40, 2, 8.5, 10], [2, 40, 10, 8.5],
                [3, 3, 0, 5]]
    path = write_split(tmp_path, [("a.png", 48, 48)], [box(1, b) for b in crossing])
    entries, _ = detection_data.read_coco(path, str(tmp_path))
    assert entries[0]["boxes"].tolist() == [[0, 2, 9.5, 12], [2, 0, 12, 9.5],
                                            [40, 2, 48, 12], [2, 40, 12, 48]]
    assert "1 box of zero width or height dropped" in capsys.readouterr().err
    for bbox in ([-1.5, 2, 10, 10], [2, -1.5, 10, 10], [40, 2, 9.5, 10], [2, 40, 10, 9.5]):
        path = write_split(tmp_path, [("a.png", 48, 48)], [box(1, bbox)])
        assert "lies outside its image" in refused(path, tmp_path)


# ------------------------------------------------------------------ F7: file names

@pytest.mark.parametrize("file_name", ["../../../../../../../../etc/passwd", "/etc/hostname",
                                       "OUTSIDE", "sub/../../a.png",
                                       "../train2/a.png"])
def test_a_file_name_that_leaves_the_image_folder_is_refused(tmp_path, file_name):
    """An export's file_name is not followed out of its split's folder (an absolute path,
    ``..``): one line naming it; a sub-folder inside is read."""
    outside = tmp_path / "secret.png"
    Image.new("RGB", (48, 48)).save(outside)
    file_name = str(outside) if file_name == "OUTSIDE" else file_name
    folder = tmp_path / "data" / "train"
    path = write_split(folder, [("inside/a.png", 48, 48), (file_name, 48, 48)],
                       [box(2, [4, 4, 8, 8])])
    assert refused(path, folder) == (f"{path}: image 2: its file_name {file_name!r} is not "
                                     f"inside its image folder {folder}: refused")


def test_a_file_name_in_a_sub_folder_is_read(tmp_path):
    folder = tmp_path / "train"
    path = write_split(folder, [("sub/a.png", 48, 48), ("sub/x/../b.png", 48, 48)],
                       [box(1, [4, 4, 8, 8])])
    entries, _ = detection_data.read_coco(path, str(folder))
    assert [e["path"] for e in entries] == [os.path.join(folder, "sub/a.png"),
                                            os.path.join(folder, "sub/x/../b.png")]


# ------------------------------------------------------------------ F6: aspect ratio

@pytest.mark.parametrize("train, augment", [(True, True), (True, False), (False, False)])
def test_an_image_of_extreme_aspect_ratio_is_resized_with_a_side_of_one_pixel(train, augment):
    """A 2000x10 image at --image-size 64 (its short side 0.16 px after scale jitter):
    a side of at least 1 px, a square sample, no traceback."""
    transform = detection_data.BoxTransform(64, train, augment, 2)
    image = torch.full((3, 10, 2000), 200, dtype=torch.uint8)
    target = {"boxes": torch.tensor([[0.0, 0.0, 1000.0, 10.0]]), "labels": torch.tensor([1]),
              "crowd": torch.zeros(1, dtype=torch.bool)}
    torch.manual_seed(0)
    sample, packed = transform(image, target, 0)
    assert tuple(sample.shape) == (3, 64, 64)
    if not augment:  # the long side at 64, the short one 1 px
        assert float(sample[0, 0, :64].min()) > 0.5 and float(sample[0, 1:, :].max()) == 0
        if train:  # the box moved with the image
            assert packed["boxes"][0].tolist() == pytest.approx([0, 0, 32, 1])
        else:  # the box kept in the file's pixels, the scale given
            assert tuple(packed["scale"].tolist()) == pytest.approx((64 / 2000, 1 / 10))
    assert detection_data.fitted(10, 2000, 64) == [1, 64]
    assert detection_data.fitted(2000, 10, 64) == [64, 1]
    assert detection_data.fitted(48, 64, 64) == [48, 64]

"""--task detection through train.py and test.py: torchvision's detectors on COCO-format
folders (written here, real json and PNGs) and the synthetic shapes; mAP from torchmetrics;
the loop's promises (SIGTERM and --resume auto bit for bit, EMA, the ledger, --preflight,
AMP); the bad input of a COCO json, each one line."""

import json
import os
import signal

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    events,
    final_state,
    load_test_py,
    main_in_process,
    put_in_torch_hub,
    read_metrics,
    run_as_written,
    stop_at_step,
)
from PIL import Image

import train
from ops import UserError
from pipeline import detection_data
from tasks.detection import Detection, DetectionEvaluation, coco_results

NETWORK = "torchvision/ssdlite320_mobilenet_v3_large"  # 2.2M parameters: 0.1 s a step
CATEGORIES = [(3, "square"), (7, "round"), (11, "pointy")]  # the file's own ids


def det_args(run_dir, *extra, data=None, size=8, image=64, batch=4, epochs=1):
    """train.py flags for a tiny --task detection run (the synthetic set, or ``data``: a
    COCO-format folder)."""
    source = ["--dataset", "coco", "--data-dir", str(data)] if data else \
        ["--dataset", "synthetic", "--synthetic-size", str(size), "--num-classes", "3"]
    return ["--task", "detection", *source, "--network", NETWORK, "--image-size", str(image),
            "--batch-size", str(batch), "--epochs", str(epochs), "--num-workers", "0",
            "--run-dir", str(run_dir), "--log-every", "1", "--lr", "0.01",
            "--warmup-epochs", "0", "--device", "cpu", *extra]


def write_coco_split(folder, json_path, first, count, extra=()):
    """``count`` synthetic images (their shapes' boxes, labels mapped to ``CATEGORIES``'
    ids) as PNGs in ``folder`` and their COCO json; image ids from ``first`` by 10 (not
    indices); the first image's boxes dropped (an image without boxes); ``extra``
    annotations added as they are."""
    shapes = detection_data.SyntheticBoxes(count, 3, 48, seed=first, split="train")
    os.makedirs(folder, exist_ok=True)
    images, annotations = [], []
    for i in range(count):
        name = f"img{i}.png"
        Image.fromarray(shapes.images[i].permute(1, 2, 0).numpy()).save(
            os.path.join(folder, name))
        image_id = first + 10 * i
        images.append({"id": image_id, "file_name": name, "width": 48, "height": 48})
        target = shapes.targets[i]
        for box, label in zip(target["boxes"].tolist() if i else [],
                              target["labels"].tolist()):
            x1, y1, x2, y2 = box
            annotations.append({"id": len(annotations) + 1, "image_id": image_id,
                                "category_id": CATEGORIES[label - 1][0], "iscrowd": 0,
                                "bbox": [x1, y1, x2 - x1, y2 - y1], "area": (x2 - x1) * (y2 - y1)})
    for ann in extra:
        annotations.append({"id": len(annotations) + 1, "area": ann["bbox"][2] * ann["bbox"][3],
                            **ann})
    doc = {"images": images, "annotations": annotations,
           "categories": [{"id": i, "name": n} for i, n in CATEGORIES]}
    with open(json_path, "w") as f:
        json.dump(doc, f)
    return doc


def write_coco_folder(root, layout="tool"):
    """A COCO-format folder: a labelling tool's export (``train/``, ``valid/``, one json
    each) or COCO's own layout; a crowd box and a box of zero area in each split."""
    crowd = {"image_id": 1010, "category_id": 7, "iscrowd": 1, "bbox": [0, 0, 20, 20]}
    empty = {"image_id": 1010, "category_id": 3, "iscrowd": 0, "bbox": [5, 5, 0, 10]}
    for split, first, count in (("train", 1000, 8), ("val", 2000, 4)):
        if layout == "tool":
            folder = os.path.join(root, "valid" if split == "val" else split)
            path = os.path.join(folder, "_annotations.coco.json")
        else:
            folder = os.path.join(root, f"{split}2017")
            os.makedirs(os.path.join(root, "annotations"), exist_ok=True)
            path = os.path.join(root, "annotations", f"instances_{split}2017.json")
        shift = first - 1000
        write_coco_split(folder, path, first, count,
                         [dict(a, image_id=a["image_id"] + shift) for a in (crowd, empty)])
    return root


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    return write_coco_folder(tmp_path_factory.mktemp("coco"))


@pytest.fixture(scope="module")
def trained(tmp_path_factory, coco):
    """ssdlite trained two epochs on the COCO-format folder, with EMA and the ledger."""
    run_dir = tmp_path_factory.mktemp("det")
    assert train.main(det_args(run_dir, "--ema-decay", "0.5", "--sample-ledger",
                               data=coco, epochs=2)) == 0
    return run_dir


def test_a_detector_trains_on_a_coco_folder_and_logs_map(trained):
    records = read_metrics(trained)
    assert len(records) == 2
    last = records[-1]
    for key in ("val_map", "val_map_50", "val_map_75", "val_map_ema", "val_class_ap"):
        assert key in last, key
    assert set(last["val_class_ap"]) == {"square", "round", "pointy"}
    assert all(-1 <= last[k] <= 1 for k in ("val_map", "val_map_50", "val_map_75"))
    acc = events(trained)
    assert {"val/map", "val/map_50", "val/map_75", "train/loss"} <= set(acc.Tags()["scalars"])
    assert "val/boxes" in acc.Tags()["images"]
    best = torch.load(os.path.join(trained, "checkpoints", "best.pt"), weights_only=True)
    ema = [r["val_map_ema"] for r in records]
    assert best["progress"]["best"] == max(ema) and best["config"]["task"] == "detection"
    from machinery import ledger

    ok, lines = ledger.check(str(trained))
    assert ok, lines


def test_test_py_reports_the_logged_figures_and_writes_coco_results(trained, coco, tmp_path,
                                                                    capsys):
    out, report_path = tmp_path / "out", tmp_path / "report.json"
    predictions = tmp_path / "results" / "coco.json"  # (its folder made)
    assert load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--samples", "2", "--out", str(out), "--json",
                                str(report_path), "--num-workers", "0", "--predictions",
                                str(predictions)]) == 0
    report = json.loads(report_path.read_text())
    last = read_metrics(trained)[-1]
    assert report["weights"] == "ema"
    for key in ("map", "map_50", "map_75"):
        assert report[key] == pytest.approx(last[f"val_{key}_ema"], abs=1e-12), key
    assert report["per_class_ap"] == pytest.approx(last["val_class_ap_ema"])
    assert "mAP" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["000000.png", "000001.png"]
    results = json.loads(predictions.read_text())
    assert report["predictions"] == {"file": str(predictions), "count": len(results)}
    val = json.load(open(os.path.join(coco, "valid", "_annotations.coco.json")))
    assert results and {r["category_id"] for r in results} <= {i for i, _ in CATEGORIES}
    assert {r["image_id"] for r in results} <= {im["id"] for im in val["images"]}
    assert all(len(r["bbox"]) == 4 and 0 <= r["score"] <= 1 for r in results)
    # pycocotools on the results file and the json gives test.py's mAP: ids mapped back
    import contextlib
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(os.path.join(coco, "valid", "_annotations.coco.json"))
        evaluation = COCOeval(gt, gt.loadRes(str(predictions)), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
        evaluation.summarize()
    assert evaluation.stats[0] == pytest.approx(report["map"], abs=2e-3)


def test_predictions_that_cannot_be_written_or_are_not_a_detectors_are_one_line(
        trained, tmp_path, capsys):
    """--predictions FILE: a path that cannot be written is one line (exit 2) before the
    checkpoint is read; on another task's checkpoint, or with --model, one line too."""
    test_py = load_test_py()
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    checkpoint = str(trained / "checkpoints" / "last.pt")
    for argv, words in (
            (["--checkpoint", checkpoint, "--predictions", str(blocker / "p.json")],
             f"--predictions '{blocker / 'p.json'}': '{blocker}' is a file, not a directory"),
            (["--checkpoint", checkpoint, "--predictions", str(tmp_path)],
             "is a directory; name a file"),
            (["--checkpoint", checkpoint, "--predictions", " "], "--predictions needs a file"),
            (["--checkpoint", checkpoint, "--predictions", checkpoint],
             "is the checkpoint being evaluated"),
            (["--model", str(tmp_path / "m.onnx"), "--predictions", str(tmp_path / "p.json")],
             "--predictions is for a detection checkpoint (--checkpoint); "
             f"'{tmp_path / 'm.onnx'}' is an exported file (--model)")):
        code, out, err = main_in_process(test_py.main, argv, capsys)
        assert code == 2 and err.startswith("error: ") and words in err, err
        assert len(err.strip().splitlines()) == 1 and "mAP" not in out
    classifier = str(tmp_path / "c.pt")  # (what test.py reads before the data)
    torch.save({"model": {"fc.weight": torch.zeros(2, 2)}, "config": {
        "task": "classification", "network": "mlp", "dataset": "synthetic", "data_dir": "d",
        "seed": 0, "batch_size": 4, "synthetic_size": 8, "num_classes": 2}}, classifier)
    code, out, err = main_in_process(test_py.main, ["--checkpoint", classifier,
                                                    "--predictions", "p.json"], capsys)
    assert code == 2 and err == (f"error: --predictions is for a detection checkpoint "
                                 f"(--checkpoint); '{classifier}' is a classification "
                                 f"checkpoint\n"), err
    help_text = test_py.build_parser().format_help()
    assert "a detection checkpoint (--task detection):\n  --predictions FILE" in help_text
    assert "makes images (--task gan, diffusion, pix2pix)" in help_text  # (not detection)


def test_the_readme_detection_commands_run_as_written(tmp_path, monkeypatch, capsys):
    """The README's detection commands from a fresh directory: train, test.py's images and
    COCO results; then --pretrained torchvision from COCO's weights (torchvision's file in
    TORCH_HOME, here random weights of 91 classes): offline without the file, one line
    naming it; with it, the backbone loaded as it was and new class layers for 3 classes."""
    import re
    import urllib.error
    import urllib.request

    import torchvision

    readme = open(os.path.join(ROOT, "README.md")).read()
    block = re.search(r"## Detection\n.*?```bash\n(.*?)```", readme, flags=re.DOTALL)
    commands = [line.split("#")[0].split() for line in block.group(1).splitlines()]
    fit = {1: ["--synthetic-size", "20"], 2: ["--num-workers", "0"],
           3: ["--synthetic-size", "8", "--max-steps", "1", "--lr", "0"]}
    for i in (1, 2):
        argv = commands[i - 1]
        extra = ["--device", "cpu", "--num-workers", "0"] if argv[1] == "train.py" else []
        code, out, err = run_as_written([*argv, *extra, *fit[i]], tmp_path, monkeypatch,
                                        capsys)
        assert code == 0, err[-2000:]
    assert "mAP" in out and "per-class AP:" in out
    boxes = tmp_path / "runs" / "det-shapes" / "boxes"
    assert sorted(os.listdir(boxes)) == [f"00000{i}.png" for i in range(4)]
    results = json.loads((tmp_path / "runs" / "det-shapes" / "predictions.json").read_text())
    assert {r["image_id"] for r in results} <= set(range(4))  # (synthetic: the index)
    assert all(r["category_id"] in (1, 2, 3) and len(r["bbox"]) == 4 for r in results)

    argv = [*commands[2], "--device", "cpu", "--num-workers", "0", *fit[3]]
    assert "--pretrained" in argv and argv[argv.index("--pretrained") + 1] == "torchvision"
    weights = torchvision.models.detection.SSDLite320_MobileNet_V3_Large_Weights.COCO_V1
    torch.manual_seed(0)
    coco_state = torchvision.models.get_model_builder(argv[argv.index("--network") + 1][12:])(
        weights=None, weights_backbone=None, num_classes=91).state_dict()
    put_in_torch_hub(weights, coco_state, tmp_path, monkeypatch)
    cached = tmp_path / "torch_home" / "hub" / "checkpoints" / weights.url.rsplit("/", 1)[1]
    os.replace(cached, tmp_path / "away.pth")

    def offline(*args, **kwargs):
        raise urllib.error.URLError("no network")

    with monkeypatch.context() as m:
        m.setattr(urllib.request, "urlopen", offline)
        m.setattr(torch.hub, "urlopen", offline)  # (its own name for it)
        code, _, err = run_as_written(argv, tmp_path, monkeypatch, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: --pretrained torchvision: cannot download") and \
        f"Put the file at {cached}" in err, err
    os.replace(tmp_path / "away.pth", cached)
    code, out, err = run_as_written(argv, tmp_path, monkeypatch, capsys)
    assert code == 0, err[-2000:]
    assert "pretrained: loaded" in out and "kept the new head (head.classification_head." in out
    run = final_state(tmp_path / "runs" / "det-coco-weights")["model"]
    backbone = [k for k in run if k.startswith("backbone.")]
    assert backbone and all(torch.equal(run[k], coco_state[k]) for k in backbone)  # lr 0
    assert not any(k.endswith("num_batches_tracked") for k in backbone)  # (frozen)
    for k in (k for k in run if k.startswith("head.classification_head.")):
        fresh = run[k].shape != coco_state[k].shape
        assert fresh == bool(re.search(r"module_list\.\d+\.1\.(weight|bias)$", k)), k
        if fresh:  # 6 anchors (or 4) a place, each with 3 classes and the background
            assert run[k].shape[0] % 4 == 0 and coco_state[k].shape[0] % 91 == 0, k


def test_a_faster_rcnn_on_other_classes_keeps_coco_weights_but_its_box_predictor(tmp_path):
    """--pretrained FILE of Faster R-CNN's 91 COCO ids into a 3-class one: every tensor but
    the box predictor's (its classes, and a box per class) loaded."""
    from pipeline import presets
    from tasks.detection import build_detector

    name = "fasterrcnn_mobilenet_v3_large_320_fpn"
    torch.manual_seed(0)
    coco_state = build_detector(name, 90, 64, pretrained=True).state_dict()
    torch.save(coco_state, tmp_path / "coco.pth")
    net = build_detector(name, 3, 64, pretrained=True)
    lines = []
    kept = presets.load_pretrained(net, str(tmp_path / "coco.pth"), lines.append, "ema",
                                   "torchvision/" + name, Detection.class_heads(net))
    assert sorted(kept) == sorted(f"roi_heads.box_predictor.{m}.{p}" for m in
                                  ("cls_score", "bbox_pred") for p in ("weight", "bias"))
    mine = net.state_dict()
    assert mine["roi_heads.box_predictor.cls_score.weight"].shape[0] == 4
    assert mine["roi_heads.box_predictor.bbox_pred.weight"].shape[0] == 16
    assert all(torch.equal(mine[k], v) for k, v in coco_state.items() if k not in kept)
    assert "kept the new head (roi_heads.box_predictor." in lines[0]


def test_export_is_one_line_where_torch_export_cannot_take_the_detector(trained, tmp_path,
                                                                      capsys):
    code = load_test_py().main(["--checkpoint", str(trained / "checkpoints" / "last.pt"),
                                "--export", str(tmp_path / "d.pt2")])
    err = [line for line in capsys.readouterr().err.strip().splitlines()
           if not line.startswith("warning: ")]  # (the folder's box of zero area)
    assert code == 2 and len(err) == 1 and err[0].startswith("error: --export .pt2: "
                                                             "torch.export does not take")
    assert not (tmp_path / "d.pt2").exists()


def test_test_py_refuses_a_traced_export_and_keeps_a_users_png(trained, tmp_path, capsys):
    """--export .ts (a traced detector keeps the boxes of the image it was traced on) is
    one line; --samples never replaces a file in --out that test.py did not write: one
    line before the evaluation, the user's file as it was."""
    checkpoint = str(trained / "checkpoints" / "last.pt")
    assert load_test_py().main(["--checkpoint", checkpoint, "--export",
                                str(tmp_path / "d.ts")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: --export .ts: a traced detector keeps the number of "
                              "boxes") and not (tmp_path / "d.ts").exists()
    out = tmp_path / "out"
    out.mkdir()
    (out / "000001.png").write_bytes(b"a user's picture")
    assert load_test_py().main(["--checkpoint", checkpoint, "--samples", "2", "--out",
                                str(out), "--num-workers", "0"]) == 2
    captured = capsys.readouterr()
    assert "test.py did not write (000001.png)" in captured.err and "mAP" not in captured.out
    assert (out / "000001.png").read_bytes() == b"a user's picture"
    assert sorted(os.listdir(out)) == ["000001.png"]


def test_sigterm_mid_epoch_then_resume_equals_the_run_that_never_stopped(tmp_path):
    flags = ("--ema-decay", "0.9", "--batch-size", "2", "--num-workers", "2")  # (workers:
    #                              their augmentation must not follow from their own RNG)
    full, stopped = tmp_path / "full", tmp_path / "stopped"
    assert train.main(det_args(full, *flags)) == 0
    with stop_at_step(2):  # of 4 steps
        assert train.main(det_args(stopped, *flags)) == 128 + signal.SIGTERM
    assert final_state(stopped)["step"] == 2
    assert train.main(det_args(stopped, *flags, "--resume", "auto")) == 0
    a, b = final_state(full), final_state(stopped)
    keys = ("model", "ema", "optimizer", "rng")
    assert_states_equal({k: a[k] for k in keys}, {k: b[k] for k in keys})
    assert read_metrics(full)[-1]["val_map"] == read_metrics(stopped)[-1]["val_map"]


def test_preflight_and_bf16_run(tmp_path, capsys):
    assert train.main(det_args(tmp_path / "pre", "--preflight")) == 0
    assert "preflight" in capsys.readouterr().out.lower()
    assert train.main(det_args(tmp_path / "bf16", "--amp", "bf16", "--max-steps", "1")) == 0
    record = read_metrics(tmp_path / "bf16")[-1]
    assert torch.isfinite(torch.tensor(record["train_loss"]))


# ------------------------------------------------------------------ the data

def test_coco_layouts_map_ids_drop_crowd_in_training_and_keep_empty_images(tmp_path, capsys):
    config = dict(dataset="coco", seed=0, augment=True, image_size=64)
    for layout in ("tool", "coco"):
        root = write_coco_folder(tmp_path / layout, layout)
        train_set, val_set = detection_data.build_datasets(dict(config, data_dir=str(root)))
        assert capsys.readouterr().err.count("1 box of zero width or height dropped") == 2
        assert train_set.classes == ["square", "round", "pointy"]
        assert train_set.category_ids == [3, 7, 11] and len(val_set) == 4
        assert val_set.image_ids == [2000, 2010, 2020, 2030]
        image, target = val_set[1]  # (image 2010: its crowd box kept for evaluation)
        n = int(target["count"])
        assert bool(target["crowd"][:n].any()) and image.shape == (3, 64, 64)
        assert float(target["scale"][0]) == pytest.approx(64 / 48)
        for key in ((i, 0) for i in range(len(train_set))):
            image, target = train_set[key]
            assert not bool(target["crowd"].any())
        plain, _ = detection_data.build_datasets(dict(config, data_dir=str(root),
                                                      augment=False))
        capsys.readouterr()
        base = plain.base.targets[1]  # image 1010: its shapes' boxes and the crowd box
        assert bool(base["crowd"].any())
        assert int(plain[(1, 0)][1]["count"]) == int((~base["crowd"]).sum())  # crowd left out
        assert int(val_set[0][1]["count"]) == 0  # the image without boxes is kept


def test_augmentation_is_a_function_of_seed_epoch_and_index_and_clips_boxes():
    """v2's flip, scale jitter and crop, drawn from (seed, epoch, index): the same key gives
    the same sample, another epoch another; boxes near the corners are clipped to the crop
    or removed when it empties them (each box at least 1 px a side)."""
    config = dict(dataset="synthetic", seed=3, augment=True, image_size=64, synthetic_size=24,
                  num_classes=3)
    train_set, _ = detection_data.build_datasets(config)
    corners = {"boxes": torch.tensor([[50.0, 50.0, 63.0, 63.0], [0.0, 0.0, 10.0, 10.0]]),
               "labels": torch.tensor([1, 2]), "crowd": torch.zeros(2, dtype=torch.bool)}
    train_set.base.targets = [corners] * len(train_set)
    removed = clipped = 0
    for index in range(len(train_set)):
        a, ta = train_set[(index, 1)]
        b, tb = train_set[(index, 1)]
        assert torch.equal(a, b) and all(torch.equal(ta[k], tb[k]) for k in ta)
        n = int(ta["count"])
        boxes = ta["boxes"][:n]
        assert bool((boxes >= 0).all() and (boxes <= 64).all())
        assert bool((boxes[:, 2:] - boxes[:, :2] >= 1).all())
        removed += 2 - n
        clipped += int((boxes == 64).any() or (boxes == 0).any())
    assert removed > 0 and clipped > 0
    assert not torch.equal(train_set[(0, 1)][0], train_set[(0, 2)][0])  # epochs differ


@pytest.mark.parametrize("change, words", [
    (lambda d: d.pop("annotations"), "not a COCO annotation file"),
    (lambda d: d["annotations"].append({"id": 99, "image_id": 2000, "category_id": 5,
                                        "bbox": [1, 1, 5, 5]}),
     "annotation 99 is of category_id 5, which is not a category"),
    (lambda d: d["annotations"].append({"id": 98, "image_id": 2000, "category_id": 3,
                                        "bbox": [40, 40, 20, 5]}),
     "annotation 98: bbox [40, 40, 20, 5] lies outside its image"),
    (lambda d: d["annotations"].append({"id": 97, "image_id": 4, "category_id": 3,
                                        "bbox": [1, 1, 5, 5]}),
     "annotation 97 is of image_id 4, which no image has"),
    (lambda d: d["images"].append({"id": 5, "file_name": "gone.png", "width": 9,
                                   "height": 9}), "gone.png does not exist"),
])
def test_bad_coco_input_is_one_line_naming_the_file_and_annotation(tmp_path, change, words):
    folder = tmp_path / "val"
    path = str(folder / "a.json")
    doc = write_coco_split(folder, path, 2000, 1)
    change(doc)
    with open(path, "w") as f:
        json.dump(doc, f)
    with pytest.raises(UserError) as e:
        detection_data.read_coco(path, str(folder))
    assert str(e.value).startswith(path) and words in str(e.value), str(e.value)
    assert "\n" not in str(e.value)


def test_a_missing_json_through_train_py_is_one_error_line(tmp_path, coco, capsys):
    broken = tmp_path / "broken"
    os.makedirs(broken / "train")
    os.makedirs(broken / "val")
    assert train.main(det_args(tmp_path / "run", data=broken)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "0 .json files" in err[0], err


@pytest.mark.parametrize("flags, words", [
    (("--data-on-device", "on"), "--data-on-device on has no detection path"),
    (("--network", "torchvision/maskrcnn_resnet50_fpn"), "needs instance masks"),
    (("--network", "resnet18"), "--network resnet18 is no detector"),
    (("--mixup-alpha", "0.2"), "--mixup-alpha mixes two images"),
    (("--dataset", "cifar10"), "--dataset cifar10 has no boxes"),
    (("--pretrained", "torchvision:backbone"), "use --pretrained torchvision (the COCO "),
    (("--compile",), "--compile meets a detector's data-dependent shapes"),
])
def test_what_makes_no_sense_for_boxes_is_one_line(tmp_path, capsys, flags, words):
    assert train.main(det_args(tmp_path, *flags)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], err


# ------------------------------------------------------------------ the figures

def _batch(boxes, labels, crowd, index, scale=1.0):
    return {"boxes": boxes, "labels": labels, "crowd": crowd,
            "index": torch.tensor(index), "scale": torch.full((len(index), 2), scale)}


def test_map_is_cocos_over_all_images_whatever_the_batches():
    """Perfect boxes score 1 (a crowd box unmatched costs nothing); a false positive
    lowers it; the figures do not depend on how the images were batched; the predictions
    are compared in the file's pixels (divided by the scale)."""
    truth = [torch.tensor([[4.0, 4.0, 20.0, 20.0]]),
             torch.tensor([[30.0, 30.0, 40.0, 44.0], [0.0, 0.0, 10.0, 10.0]])]
    labels = [torch.tensor([1]), torch.tensor([2, 1])]
    crowd = [torch.tensor([False]), torch.tensor([False, True])]
    scale = 2.0  # the images were evaluated at twice their file's size
    preds = [{"boxes": truth[0] * scale, "scores": torch.tensor([0.9]), "labels": labels[0]},
             {"boxes": truth[1][:1] * scale, "scores": torch.tensor([0.8]),
              "labels": labels[1][:1]}]
    whole = DetectionEvaluation(2, "cpu")
    whole.update(preds, _batch(truth, labels, crowd, [0, 1], scale))
    result = whole.compute()
    assert result["map"] == pytest.approx(1.0) and result["count"] == 2
    assert result["class_ap"] == {1: pytest.approx(1.0), 2: pytest.approx(1.0)}
    split = DetectionEvaluation(2, "cpu")
    for i in (1, 0):
        split.update(preds[i:i + 1], _batch(truth[i:i + 1], labels[i:i + 1], crowd[i:i + 1],
                                            [i], scale))
    assert split.compute()["map"] == result["map"]
    wrong = [dict(p) for p in preds]
    wrong[0] = {"boxes": torch.cat([truth[0], torch.tensor([[40.0, 0, 48, 8]])]) * scale,
                "scores": torch.tensor([0.9, 0.95]), "labels": torch.tensor([1, 1])}
    worse = DetectionEvaluation(2, "cpu")
    worse.update(wrong, _batch(truth, labels, crowd, [0, 1], scale))
    assert worse.compute()["map"] < 1.0
    task = Detection(["a", "b"], [5, 9], [100, 200])
    found = result["predictions"].value
    results = coco_results(found, task)
    assert [(r["image_id"], r["category_id"]) for r in results] == [(100, 5), (200, 9)]
    assert results[0]["bbox"] == [4.0, 4.0, 16.0, 16.0]

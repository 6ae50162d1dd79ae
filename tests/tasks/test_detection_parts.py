"""The detection task's parts, without training: COCO's figures named as they are
(mutation round 7: S7-02 per-class AP, S7-03 mAP@75), test.py's --samples boxes on the
image as evaluated (S7-09), boxes decoded in float32 under bf16 autocast (CUDA review 7's
N-M1) and a validation with a process that holds no image (N-L3)."""

import os
import socket

import numpy
import pytest
import torch
from PIL import Image

from pipeline import detection_data
from tasks.detection import Detection, DetectionEvaluation, build_detector, write_samples


def _batch(boxes, labels, index, scale=1.0):
    return {"boxes": boxes, "labels": labels,
            "crowd": [torch.zeros(len(b), dtype=torch.bool) for b in boxes],
            "index": torch.tensor(index), "scale": torch.full((len(index), 2), scale)}


def _prediction(boxes, labels, scores):
    return {"boxes": torch.tensor(boxes), "labels": torch.tensor(labels),
            "scores": torch.tensor(scores)}


# ------------------------------------------------------------------ the figures

def test_map_75_per_class_ap_and_the_report_name_each_figure_as_it_is():
    """Class "a" (label 1) found exactly, class "b" (label 2) by a box of IoU 0.6 with its
    truth, class "c" absent from the set: mAP@50 1, mAP@75 0.5 (a: 1, b: 0); each class's
    AP (over IoU 0.50-0.95: b's 0.2) under its own name, c's None; the report's lines show
    them so."""
    truth = [torch.tensor([[0.0, 0.0, 20.0, 20.0]]), torch.tensor([[0.0, 0.0, 20.0, 20.0]])]
    labels = [torch.tensor([1]), torch.tensor([2])]
    preds = [_prediction([[0.0, 0.0, 20.0, 20.0]], [1], [0.9]),
             _prediction([[0.0, 0.0, 20.0, 12.0]], [2], [0.9])]  # IoU 240 / 400 = 0.6
    evaluation = DetectionEvaluation(3, "cpu")
    evaluation.update(preds, _batch(truth, labels, [0, 1]))
    result = evaluation.compute()
    assert result["map_50"] == pytest.approx(1.0) and result["map_75"] == pytest.approx(0.5)
    task = Detection(["a", "b", "c"])
    figures = task.extra_figures(result, None)["val_class_ap"]
    assert figures == {"a": pytest.approx(1.0), "b": pytest.approx(0.2), "c": None}
    report = task.report(result, "checkpoint", "x.pt")
    assert report["map_75"] == pytest.approx(0.5) and report["map_50"] == pytest.approx(1.0)
    lines = Detection.format_report(report, "title").splitlines()
    assert "mAP@50 1.0000  mAP@75 0.5000" in lines[1]
    assert [line.split() for line in lines[3:]] == [["a", "1.0000"], ["b", "0.2000"],
                                                    ["c", "-"]]


# ------------------------------------------------------------------ test.py --samples

def test_samples_draw_the_predicted_boxes_where_the_image_was_evaluated(tmp_path):
    """An image whose file is 40 px, evaluated at 64: the predicted box (in the file's
    pixels, as the evaluation keeps them) is drawn scaled by 64/40, on the true box's
    place."""
    transform = detection_data.BoxTransform(64, False, False, 1)
    image = torch.full((3, 40, 40), 120, dtype=torch.uint8)
    target = {"boxes": torch.tensor([[5.0, 5.0, 35.0, 35.0]]), "labels": torch.tensor([1]),
              "crowd": torch.zeros(1, dtype=torch.bool)}
    val_set = [transform(image, target, 0)]
    val_set[0][1]["count"] = torch.tensor(0)  # (the true box not drawn: the red one alone)
    found = ([0], [_prediction([[5.0, 5.0, 35.0, 35.0]], [1], [0.9])])
    written = write_samples(found, val_set, ["a"], str(tmp_path), ["000000.png"])
    assert written == [os.path.join(tmp_path, "000000.png")]
    picture = torch.from_numpy(numpy.array(Image.open(written[0]).convert("RGB")))
    red = (picture[..., 0] == 255) & (picture[..., 1] == 0) & (picture[..., 2] == 0)
    ys, xs = red.nonzero(as_tuple=True)
    assert (int(xs.min()), int(ys.min()), int(xs.max()), int(ys.max())) == (8, 8, 56, 56)


# ------------------------------------------------------------------ N-M1: bf16 boxes

@pytest.mark.parametrize("network", ["ssdlite320_mobilenet_v3_large",
                                     "fasterrcnn_mobilenet_v3_large_320_fpn"])
def test_boxes_are_decoded_in_float32_under_bf16_autocast(network):
    """Under bf16 autocast (what --amp bf16 runs the detector in), the boxes come out in
    float32 and are not bfloat16's: between 32 and 64 px bfloat16 holds multiples of 0.25
    only."""
    torch.manual_seed(0)
    net = build_detector(network, 3, 64).eval()
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        boxes = net(torch.rand(1, 3, 64, 64))[0]["boxes"]
    assert boxes.dtype == torch.float32 and len(boxes)
    middle = boxes[(boxes >= 32) & (boxes < 64)]
    assert len(middle) and bool(((middle * 4) % 1 != 0).any())
    with torch.no_grad():  # without autocast: the hooks change nothing
        plain = net(torch.rand(1, 3, 64, 64))[0]["boxes"]
    assert plain.dtype == torch.float32


@pytest.mark.parametrize("network", ["ssdlite320_mobilenet_v3_large",
                                     "fasterrcnn_mobilenet_v3_large_320_fpn"])
def test_anchors_of_bf16_feature_maps_are_those_of_float32_ones(network):
    """torchvision's anchor generators make their anchors in the feature maps' dtype: from
    bfloat16 maps (autocast's) they are the float32 maps' anchors, in float32."""
    from torchvision.models.detection.image_list import ImageList

    net = build_detector(network, 3, 512)
    generator = net.rpn.anchor_generator if hasattr(net, "rpn") else net.anchor_generator
    images = ImageList(torch.zeros(1, 3, 512, 512), [(512, 512)])
    count = len(getattr(generator, "sizes", None) or generator.aspect_ratios)
    maps = [torch.rand(1, 8, max(32 >> k, 1), max(32 >> k, 1)) for k in range(count)]
    expected = generator(images, maps)
    got = generator(images, [m.bfloat16() for m in maps])
    assert all(g.dtype == torch.float32 and torch.equal(g, e) for g, e in zip(got, expected))
    assert not torch.equal(expected[0], expected[0].bfloat16().float())  # (bf16 would show)


# ------------------------------------------------------------------ N-L3: an empty process

def _evaluation_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        evaluation = DetectionEvaluation(2, "cpu")
        if rank == 0:  # the validation set's one image: process 1 has none
            truth = [torch.tensor([[0.0, 0.0, 20.0, 20.0]])]
            evaluation.update([_prediction([[0.0, 0.0, 20.0, 20.0]], [1], [0.9])],
                              _batch(truth, [torch.tensor([1])], [0]))
        result = evaluation.compute()
        torch.save({"map": result["map"], "count": result["count"]},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_a_process_without_a_validation_image_gathers_with_the_others(tmp_path):
    """Two gloo processes, one validation image: both get the set's figures (the empty
    process's states were 1-D float32 tensors: gloo aborted)."""
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_evaluation_worker, args=(2, port, str(tmp_path)), nprocs=2,
                       start_method="fork")
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(2)]
    assert got == [{"map": pytest.approx(1.0), "count": 1}] * 2

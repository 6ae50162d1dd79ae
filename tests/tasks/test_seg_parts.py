"""Semantic segmentation's parts: the U-Net, torchvision's segmentation networks and their
pretrained weights, the figures (against torchmetrics), the poly schedule (against
PyTorch's PolynomialLR) and the mask pictures."""

import math
import urllib.request

import pytest
import torch
import torchvision
from helpers import put_in_torch_hub

import networks
import ops
from layers import ConvBlock
from pipeline import presets
from tasks import segmentation as seg_metrics
from tasks.segmentation import Segmentation

# ---------------------------------------------------------------------------- U-Net


@pytest.mark.parametrize("side", [(32, 32), (33, 17), (5, 7), (1, 1)])
def test_unet_gives_logits_at_the_input_size(side):
    net = networks.build_network("unet", num_classes=4, in_channels=3, image_size=side[0])
    out = net(torch.randn(2, 3, *side))
    assert out.shape == (2, 4, *side)


def test_unet_is_small_and_built_from_convblocks():
    net = networks.build_network("unet", num_classes=21, in_channels=1, image_size=32)
    count = sum(p.numel() for p in net.parameters())
    assert 3_000 <= count <= 150_000, count
    assert sum(isinstance(m, ConvBlock) for m in net.modules()) == 10  # 2 x (2 + 1 + 2)


def test_unet_encoder_is_its_backbone_as_in_torchvision():
    net = networks.build_network("unet", num_classes=3, in_channels=3, image_size=16)
    frozen = ops.freeze(net, ["backbone.*"])
    assert frozen and all(name.startswith("backbone.") for name in frozen)
    assert any(p.requires_grad for p in net.parameters())  # the decoder still trains


def test_unet_learns_a_segmentation():
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, 8)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()  # 3 classes, a per-pixel rule
    net = networks.build_network("unet", num_classes=3, in_channels=3, image_size=8)
    opt = torch.optim.Adam(net.parameters(), lr=2e-2)
    for _ in range(25):
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    confusion = seg_metrics.new_confusion(3)
    seg_metrics.update_confusion(confusion, net.eval()(x), y)
    assert seg_metrics.figures(confusion)["pixel_acc"] > 0.9


def test_unet_grad_checkpointing_gives_the_same_gradients_and_statistics():
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 12, 10), torch.randint(0, 3, (2, 12, 10))
    plain = networks.build_network("unet", 3, 3, 12)
    checkpointed = networks.build_network("unet", 3, 3, 12)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.set_grad_checkpointing(True)
    for net in (plain, checkpointed):
        torch.nn.functional.cross_entropy(net(x), y).backward()
    for (name, a), b in zip(plain.named_parameters(), checkpointed.parameters()):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    for (name, a), b in zip(plain.named_buffers(), checkpointed.buffers()):
        assert torch.equal(a, b), name  # running statistics updated once, not twice
    # and it keeps less than half for backward (every block's inside is recomputed)
    assert ops.saved_tensor_bytes(checkpointed, x) < 0.5 * ops.saved_tensor_bytes(plain, x)


# -------------------------------------------------------- torchvision's segmentation nets

SEGMENTATION = ["fcn_resnet50", "deeplabv3_resnet50", "deeplabv3_mobilenet_v3_large",
                "lraspp_mobilenet_v3_large"]


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setattr(urllib.request, "urlopen",
                        lambda *a, **k: pytest.fail("tried to download"))


def test_the_segmentation_networks_are_known_and_fcn_deeplab_have_an_aux_head():
    assert all(networks.is_segmentation(f"torchvision/{n}") for n in SEGMENTATION)
    assert networks.is_segmentation("unet")
    assert not networks.is_segmentation("torchvision/resnet18")
    assert not networks.is_segmentation("resnet18")
    assert [networks.has_aux_classifier(n) for n in SEGMENTATION] == [True, True, True, False]


@pytest.mark.parametrize("name", ["deeplabv3_mobilenet_v3_large", "lraspp_mobilenet_v3_large"])
def test_torchvision_segmentation_builds_offline_with_the_classes_asked(name, offline):
    net = networks.build_network(f"torchvision/{name}", num_classes=5).eval()
    with torch.no_grad():
        out = net(torch.randn(1, 3, 40, 56))
    expected = {"out", "aux"} if networks.has_aux_classifier(name) else {"out"}
    assert set(out) == expected
    assert all(v.shape == (1, 5, 40, 56) for v in out.values())


def test_an_unknown_torchvision_name_lists_the_segmentation_networks_too():
    with pytest.raises(ValueError, match="deeplabv3_resnet50"):
        networks.build_network("torchvision/deeplabv4")


# ------------------------------------------------------------- their pretrained weights

def test_pretrained_segmentation_weights_load_with_a_new_head(tmp_path, monkeypatch, offline):
    network = "torchvision/deeplabv3_mobilenet_v3_large"
    weights = presets.torchvision_weights(network, "torchvision")
    assert weights.name == "COCO_WITH_VOC_LABELS_V1"
    torch.manual_seed(0)
    saved = networks.build_network(network, num_classes=21).state_dict()  # as VOC's 21
    put_in_torch_hub(weights, saved, tmp_path, monkeypatch)
    torch.manual_seed(1)
    net = networks.build_network(network, num_classes=5)
    fresh = {k: v.clone() for k, v in net.state_dict().items()}
    line = presets.load_segmentation_weights(net, weights)
    assert "\n" not in line and "COCO_WITH_VOC_LABELS_V1 (21 classes)" in line
    assert "new heads for 5 classes, fresh: aux_classifier.4, classifier.4" in line
    heads = ("classifier.4.", "aux_classifier.4.")
    for key, value in net.state_dict().items():
        expected = fresh[key] if key.startswith(heads) else saved[key]
        assert torch.equal(value, expected), key
    assert net.classifier[4].weight.shape[0] == 5


def test_pretrained_weights_with_as_many_classes_load_whole(tmp_path, monkeypatch, offline):
    network = "torchvision/lraspp_mobilenet_v3_large"
    weights = presets.torchvision_weights(network, "torchvision")
    saved = networks.build_network(network, num_classes=21).state_dict()
    put_in_torch_hub(weights, saved, tmp_path, monkeypatch)
    net = networks.build_network(network, num_classes=21)
    line = presets.load_segmentation_weights(net, weights)
    assert "fresh" not in line
    assert all(torch.equal(v, saved[k]) for k, v in net.state_dict().items())


def test_backbone_weights_map_into_the_backbone_and_the_heads_start_fresh(tmp_path,
                                                                         monkeypatch, offline):
    network = "torchvision/lraspp_mobilenet_v3_large"
    weights = presets.torchvision_weights(network, "torchvision:backbone")
    assert weights == torchvision.models.MobileNet_V3_Large_Weights.IMAGENET1K_V1
    imagenet = torchvision.models.mobilenet_v3_large().state_dict()
    put_in_torch_hub(weights, imagenet, tmp_path, monkeypatch)
    net = networks.build_network(network, num_classes=3)
    fresh = {k: v.clone() for k, v in net.state_dict().items()}
    line = presets.load_segmentation_weights(net, weights)
    assert "backbone from torchvision's MobileNet_V3_Large_Weights.IMAGENET1K_V1" in line
    state = net.state_dict()
    for key, value in imagenet.items():
        if key.startswith("features."):  # features.N... is backbone.N...
            assert torch.equal(state["backbone." + key.removeprefix("features.")], value), key
    for key in state:
        if key.startswith("classifier."):
            assert torch.equal(state[key], fresh[key]), key
    assert sum(k.startswith("backbone.") for k in state) == \
        sum(k.startswith("features.") for k in imagenet)


def test_a_resnet_backbone_maps_by_its_own_names():
    weights = presets.torchvision_weights("torchvision/fcn_resnet50", "torchvision:backbone")
    assert weights == torchvision.models.ResNet50_Weights.IMAGENET1K_V1
    imagenet = torchvision.models.resnet50().state_dict()
    net = networks.build_network("torchvision/fcn_resnet50", num_classes=2)
    state, kept, _ = presets.fit_segmentation_weights(net, weights, imagenet)
    assert torch.equal(state["backbone.layer4.2.conv3.weight"], imagenet["layer4.2.conv3.weight"])
    assert all(k.startswith(("classifier.", "aux_classifier.")) for k in kept)
    assert not any(k.startswith("fc.") for k in state)
    net.load_state_dict(state)  # strict: every key, every shape


def test_weights_that_do_not_fit_are_one_user_error():
    weights = presets.torchvision_weights("torchvision/deeplabv3_mobilenet_v3_large",
                                          "torchvision")
    other = networks.build_network("torchvision/lraspp_mobilenet_v3_large", 21).state_dict()
    net = networks.build_network("torchvision/deeplabv3_mobilenet_v3_large", 21)
    with pytest.raises(ops.UserError, match="does not fit this network"):
        presets.fit_segmentation_weights(net, weights, other)


def test_an_unknown_weights_name_lists_backbone_for_a_segmentation_network():
    with pytest.raises(ops.UserError, match=r"COCO_WITH_VOC_LABELS_V1 \(or DEFAULT, backbone\)"):
        presets.torchvision_weights("torchvision/fcn_resnet50", "torchvision:IMAGENET1K_V1")


def test_backbone_weights_of_a_classifier_are_refused():
    with pytest.raises(ops.UserError, match="has no separate backbone"):
        presets.torchvision_weights("torchvision/resnet18", "torchvision:backbone")


# -------------------------------------------------------------------------- figures

def _random_batches(num_classes, seed, batches=3, absent=(3,)):
    g = torch.Generator().manual_seed(seed)
    for _ in range(batches):
        logits = torch.randn(2, num_classes, 9, 7, generator=g)
        logits[:, list(absent)] -= 100  # never predicted
        target = torch.randint(0, num_classes, (2, 9, 7), generator=g)
        target[torch.isin(target, torch.tensor(absent))] = 0  # never true
        target[torch.rand(target.shape, generator=g) < 0.2] = seg_metrics.IGNORE_INDEX
        yield logits, target


@pytest.mark.parametrize("seed", [0, 1])
def test_figures_equal_torchmetrics(seed):
    from torchmetrics import classification as tm

    c = 6
    confusion = seg_metrics.new_confusion(c)
    kw = {"num_classes": c, "ignore_index": 255}
    jaccard = tm.MulticlassJaccardIndex(average="macro", **kw)
    per_class = tm.MulticlassJaccardIndex(average="none", **kw)
    accuracy = tm.MulticlassAccuracy(average="micro", **kw)
    matrix = tm.MulticlassConfusionMatrix(**kw)
    for logits, target in _random_batches(c, seed):
        seg_metrics.update_confusion(confusion, logits, target)
        for metric in (jaccard, per_class, accuracy, matrix):
            metric.update(logits, target)
    assert torch.equal(confusion, matrix.compute())
    got = seg_metrics.figures(confusion, classes=list("abcdef"))
    assert got["miou"] == pytest.approx(float(jaccard.compute()), abs=1e-6)
    assert got["pixel_acc"] == pytest.approx(float(accuracy.compute()), abs=1e-6)
    assert got["class_iou"]["d"] is None  # class 3: in neither targets nor predictions
    expected = per_class.compute().tolist()
    for i, name in enumerate("abcdef"):
        if name != "d":
            assert got["class_iou"][name] == pytest.approx(expected[i], abs=1e-6)
    assert got["pixels"] == int(confusion.sum()) > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_on_cuda_reads_nothing_back_to_the_host():
    confusion = seg_metrics.new_confusion(5, "cuda")
    batches = [(x.cuda(), t.cuda()) for x, t in _random_batches(5, 0)]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call raises
    try:
        bad = sum(seg_metrics.update_confusion(confusion, x, t) for x, t in batches)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = seg_metrics.new_confusion(5)
    for logits, target in _random_batches(5, 0):
        seg_metrics.update_confusion(expected, logits, target)
    assert torch.equal(confusion.cpu(), expected) and int(bad) == 0


def test_update_takes_logits_or_classes_alike_and_counts_bad_targets_apart():
    logits = torch.randn(2, 4, 5, 5)
    target = torch.randint(0, 4, (2, 5, 5))
    target[0, 0, :3] = 255
    target[1, 1, :2] = 9  # not a class of 4, not ignored
    a, b = seg_metrics.new_confusion(4), seg_metrics.new_confusion(4)
    bad_a = seg_metrics.update_confusion(a, logits, target)
    bad_b = seg_metrics.update_confusion(b, logits.argmax(1), target)
    assert torch.equal(a, b) and int(a.sum()) == 50 - 3 - 2
    assert int(bad_a) == int(bad_b) == 2


def test_a_uint8_mask_counts_as_its_int64_copy():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 20, 6, 6, generator=g)  # 20 x 20 cells: past uint8's 255
    target = torch.randint(0, 20, (2, 6, 6), generator=g)
    target[0, 0] = 255
    a, b = seg_metrics.new_confusion(20), seg_metrics.new_confusion(20)
    seg_metrics.update_confusion(a, logits, target)
    seg_metrics.update_confusion(b, logits, target.to(torch.uint8))
    assert torch.equal(a, b) and int(a.sum()) == 72 - 6


def test_a_class_present_only_in_predictions_counts_with_iou_zero():
    confusion = seg_metrics.new_confusion(3)
    target = torch.tensor([[[0, 0, 1, 1]]])
    pred = torch.tensor([[[0, 2, 1, 1]]])  # class 2 predicted, never true
    seg_metrics.update_confusion(confusion, pred, target)
    got = seg_metrics.figures(confusion)
    assert got["class_iou"] == {"0": 0.5, "1": 1.0, "2": 0.0}
    assert got["miou"] == pytest.approx(0.5) and got["pixel_acc"] == 0.75


def test_class_names_must_match_the_matrix():
    with pytest.raises(ValueError, match="2 class names for a 3-class"):
        seg_metrics.figures(seg_metrics.new_confusion(3), classes=["a", "b"])


def test_no_pixel_counted_gives_nan_not_an_error():
    got = seg_metrics.figures(seg_metrics.new_confusion(2))
    assert math.isnan(got["miou"]) and math.isnan(got["pixel_acc"])
    assert got["class_iou"] == {"0": None, "1": None}


# --------------------------------------------------------------------- poly schedule

@pytest.mark.parametrize("warmup", [0, 3])
def test_poly_equals_pytorch_polynomial_lr_step_by_step(warmup):
    total = 20
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=1.0)
    poly = torch.optim.lr_scheduler.PolynomialLR(optimizer, total_iters=total - warmup,
                                                 power=0.9)
    for step in range(warmup, total + 3):  # past the end it stays at 0
        assert ops.lr_factor(step, total, "poly", warmup) == \
            pytest.approx(optimizer.param_groups[0]["lr"], abs=1e-12), step
        optimizer.step()
        poly.step()
    assert [ops.lr_factor(s, total, "poly", warmup) for s in range(warmup)] == \
        [(s + 1) / warmup for s in range(warmup)]


def test_poly_is_a_scheduler_choice():
    from config import parse_config

    config, _ = parse_config(["--scheduler", "poly"])
    assert config["scheduler"] == "poly"


# --------------------------------------------------------------------- mask pictures

def test_palette_is_vocs_and_distinct_and_never_white():
    colours = seg_metrics.palette(256)
    assert colours[:3].tolist() == [[0, 0, 0], [128, 0, 0], [0, 128, 0]]
    assert colours[15].tolist() == [192, 128, 128]  # VOC's person
    assert colours[20].tolist() == [0, 64, 128]  # VOC's tv/monitor
    assert len({tuple(c) for c in colours.tolist()}) == 256
    assert list(seg_metrics.IGNORE_COLOUR) not in colours.tolist()


def test_mask_grid_shows_image_truth_and_prediction_in_colours_that_map_back():
    n, c, h, w, pad = 3, 25, 6, 5, 2
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 3, h, w), dtype=torch.uint8, generator=g)
    targets = torch.randint(0, c, (n, h, w), generator=g)
    targets[:, 0, 0] = 255
    logits = torch.randn(n, c, h, w, generator=g)
    grid = seg_metrics.mask_grid(images, targets, logits, c, padding=pad)
    assert grid.dtype == torch.uint8 and grid.shape == (3, pad + n * (h + pad),
                                                        pad + 3 * (w + pad))
    colours = [tuple(x) for x in seg_metrics.palette(c).tolist()]

    def tile(row, col):
        top, left = pad + row * (h + pad), pad + col * (w + pad)
        return grid[:, top:top + h, left:left + w]

    def classes(picture):
        return torch.tensor([[colours.index(tuple(p)) if tuple(p) in colours else 255
                              for p in line] for line in picture.permute(1, 2, 0).tolist()])

    for i in range(n):
        assert torch.equal(tile(i, 0), images[i])
        assert torch.equal(classes(tile(i, 1)), targets[i])
        assert tuple(tile(i, 1)[:, 0, 0].tolist()) == seg_metrics.IGNORE_COLOUR
        assert torch.equal(classes(tile(i, 2)), logits[i].argmax(0))


def test_mask_grid_undoes_the_normalisation():
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    images = torch.rand(1, 3, 4, 4)
    normalised = (images - torch.tensor(mean).view(1, 3, 1, 1)) / torch.tensor(std).view(1, 3,
                                                                                          1, 1)
    grid = seg_metrics.mask_grid(normalised, torch.zeros(1, 4, 4, dtype=torch.long),
                                 torch.zeros(1, 4, 4, dtype=torch.long), 2, mean, std,
                                 padding=0)
    expected = (images[0] * 255).round().to(torch.uint8)
    assert (grid[:, :, :4].int() - expected.int()).abs().max() <= 1


def test_the_aux_heads_loss_weighs_aux_weight_not_one():
    """Round 5's promise 1: torchvision's fcn/deeplabv3 return {"out", "aux"}; the auxiliary
    head's loss counts aux_weight (0.5, as torchvision's reference weighs it)."""

    g = torch.Generator().manual_seed(0)
    out, aux = torch.randn(2, 3, 4, 4, generator=g), torch.randn(2, 3, 4, 4, generator=g)
    y = torch.randint(0, 3, (2, 4, 4), generator=g)
    task = Segmentation(3)
    got = task.loss(lambda x: {"out": out, "aux": aux}, None, y)
    assert task.aux_weight == 0.5
    assert torch.equal(got, task.criterion(out, y) + 0.5 * task.criterion(aux, y))
    assert torch.equal(task.loss(lambda x: out, None, y), task.criterion(out, y))

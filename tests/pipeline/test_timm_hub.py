"""timm's data configuration and pretrained weights (pipeline/timm_hub.py): a fake
Hugging Face cache written into tmp_path in the hub's layout, HF_HUB_OFFLINE=1 (nothing
tries the network), tiny timm models built without weights."""

import pickle

import pytest
import timm
import torch
from safetensors.torch import save_file
from torchvision.transforms import v2

import config as config_module
import networks
from config import with_defaults
from ops import UserError
from pipeline import presets, timm_hub

REPO = "timm/test_resnet.r160_in1k"  # test_resnet's default pretrained tag


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """An HF_HOME whose hub cache holds test_resnet's weights (1000 classes), as
    huggingface_hub lays them out; returns (the weights, the file)."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    torch.manual_seed(1)
    weights = timm.create_model("test_resnet", num_classes=1000).state_dict()
    folder = tmp_path / "hf" / "hub" / ("models--" + REPO.replace("/", "--"))
    (folder / "snapshots" / "0123abc").mkdir(parents=True)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text("0123abc")
    path = folder / "snapshots" / "0123abc" / "model.safetensors"
    save_file({k: v.contiguous() for k, v in weights.items()}, str(path))
    return weights, path


def resnet(classes=5, channels=3):
    return networks.build_network("timm/test_resnet", classes, channels, 64)


def test_pretrained_timm_loads_the_cached_weights_and_a_new_head_once(hub):
    weights, path = hub
    net, lines = resnet(), []
    fresh_head = net.fc.weight.detach().clone()
    kept = presets.load_pretrained(net, "timm", lines.append, network="timm/test_resnet")
    assert kept == ["fc.weight", "fc.bias"]
    for key, value in net.state_dict().items():
        if not key.startswith("fc."):
            assert torch.equal(value, weights[key]), key
    assert torch.equal(net.fc.weight, fresh_head)  # its fresh initialisation
    assert len(lines) == 1 and str(path) in lines[0] and "new head" in lines[0]


def test_a_tag_names_other_weights_and_an_unknown_tag_lists_them(hub):
    with pytest.raises(UserError, match=r"no pretrained weights test_resnet\.nope; its "
                                        r"tags: r160_in1k"):
        presets.load_pretrained(resnet(), "timm:nope", print, network="timm/test_resnet")
    net = resnet()
    presets.load_pretrained(net, "timm:r160_in1k", print, network="timm/test_resnet")
    assert torch.equal(net.conv1[0].weight, hub[0]["conv1.0.weight"])


def test_offline_with_nothing_cached_names_the_repository_the_file_and_where(
        tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(UserError) as e:
        presets.load_pretrained(resnet(), "timm", print, network="timm/test_resnet")
    line = str(e.value)
    folder = tmp_path / "empty" / "hub" / "models--timm--test_resnet.r160_in1k"
    assert "\n" not in line and REPO in line and "model.safetensors" in line
    assert str(folder / "snapshots" / "<revision>" / "model.safetensors") in line
    assert str(folder / "refs" / "main") in line and "HF_HUB_OFFLINE" in line


def test_timm_weights_need_a_timm_network(hub):
    with pytest.raises(UserError, match="needs --network timm/<name>, not simple_cnn"):
        presets.load_pretrained(networks.build_network("simple_cnn"), "timm", print,
                                network="simple_cnn")


def test_a_safetensors_or_pth_file_is_a_state_dict_read_without_code(hub, tmp_path):
    weights, path = hub
    net = resnet()
    presets.load_pretrained(net, str(path), print, network="timm/test_resnet")
    assert torch.equal(net.conv1[0].weight, weights["conv1.0.weight"])
    pth = tmp_path / "w.pth"
    torch.save(weights, pth)
    net = resnet()
    presets.load_pretrained(net, str(pth), print, network="timm/test_resnet")
    assert torch.equal(net.layer1[0].conv1.weight, weights["layer1.0.conv1.weight"])
    bad = tmp_path / "evil.pth"
    bad.write_bytes(pickle.dumps({"x": print}))  # a pickle that would call code
    with pytest.raises(UserError):
        presets.load_pretrained(resnet(), str(bad), print, network="timm/test_resnet")
    broken = tmp_path / "cut.safetensors"
    broken.write_bytes(path.read_bytes()[:100])
    with pytest.raises(UserError, match="does not read as weights"):
        presets.load_pretrained(resnet(), str(broken), print, network="timm/test_resnet")


class Planted:
    """Unpickled, it would write a file: what a weights file must never do."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def test_a_hub_file_of_pickled_code_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "ran"
    evil = tmp_path / "pytorch_model.bin"
    torch.save({"w": torch.zeros(1), "x": Planted(str(marker))}, evil)
    with pytest.raises(UserError, match="does not read as weights") as e:
        timm_hub.read_weights(str(evil))
    assert not marker.exists() and "\n" not in str(e.value)
    good = tmp_path / "good.bin"
    torch.save({"w": torch.ones(2)}, good)
    assert torch.equal(timm_hub.read_weights(str(good))["w"], torch.ones(2))


def test_other_input_channels_take_the_first_convolution_adapted(hub):
    net = resnet(channels=1)
    presets.load_pretrained(net, "timm", print, network="timm/test_resnet")
    assert torch.allclose(net.conv1[0].weight,
                          hub[0]["conv1.0.weight"].sum(dim=1, keepdim=True))


def test_the_data_configuration_drives_the_photos_preset():
    c = with_defaults({"network": "timm/test_vit", "dataset": "imagefolder",
                       "pretrained": None})
    p = presets.preset(c)
    assert p["mean"] == (0.5, 0.5, 0.5) and p["std"] == (0.5, 0.5, 0.5)
    assert p["interpolation"] == v2.InterpolationMode.BICUBIC
    resnet_p = presets.preset({**c, "network": "timm/resnet10t"})
    assert resnet_p["mean"] == timm.data.IMAGENET_DEFAULT_MEAN


def test_image_size_and_crop_pct_follow_the_model_and_a_users_flag_wins_once(capsys):
    c = {"network": "timm/test_vit", "dataset": "imagefolder", "pretrained": None,
         "image_size": 32, "crop_pct": 0.875}
    out = timm_hub.apply_data_config(dict(c), set(), print)
    assert (out["image_size"], out["crop_pct"]) == (160, 0.95)
    said = []
    out = timm_hub.apply_data_config(dict(c, image_size=96), {"image_size"}, said.append)
    assert (out["image_size"], out["crop_pct"]) == (96, 0.95)
    assert said == ["--image-size 96 (yours) over timm/test_vit's own 160 (its data "
                    "configuration)"]
    synthetic = timm_hub.apply_data_config(dict(c, dataset="synthetic"), set(), print)
    assert synthetic["image_size"] == 32  # (not photos: its own size)


def test_parse_config_applies_it(tmp_path):
    config, _ = config_module.parse_config(["--network", "timm/test_vit", "--dataset",
                                            "imagefolder", "--data-dir", str(tmp_path)])
    assert (config["image_size"], config["crop_pct"]) == (160, 0.95)


def test_an_unknown_timm_name_says_the_closest():
    with pytest.raises(ValueError, match="timm has no model 'test_vitt'; the closest: "
                                         "test_vit,"):
        networks.build_network("timm/test_vitt")
    c = with_defaults({"network": "timm/vit_tiny_patch16_244", "dataset": "synthetic"})
    with pytest.raises(UserError, match="--network timm/vit_tiny_patch16_244: timm has no "
                                        "model.*closest: vit_tiny_patch16_224"):
        config_module.check_config(c)


def test_a_fixed_size_model_is_built_for_the_image_size():
    net = networks.build_network("timm/test_vit", 4, 1, 48)
    assert net(torch.zeros(2, 1, 48, 48)).shape == (2, 4)
    vit = networks.build_network("timm/vit_tiny_patch16_224", 4, 3, 32)  # a strict size
    assert vit.pos_embed.shape[1] == 1 + (32 // 16) ** 2  # its class token, 2x2 patches
    assert vit(torch.zeros(1, 3, 32, 32)).shape == (1, 4)

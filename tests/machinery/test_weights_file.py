"""``test.py --export FILE.safetensors`` (machinery/weights_file.py through export.py):
the weights with the metadata that rebuilds the network, read back without code."""

import json

import pytest
import torch
from safetensors.torch import save_file

import export
import networks
from machinery import weights_file
from ops import UserError

STORED = {"network": "timm/test_vit", "num_classes": 4, "in_channels": 3, "image_size": 32,
          "dataset": "synthetic"}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    torch.manual_seed(0)
    net = networks.build_network("timm/test_vit", 4, 3, 32).eval()
    path = tmp_path_factory.mktemp("w") / "model.safetensors"
    metadata = {"training_config": json.dumps(STORED), "classes": json.dumps(list("abcd")),
                "data_config": json.dumps({"mean": [0.5] * 3})}
    ok, worst = export.export_network(net, str(path), ".safetensors", (3, 32, 32), metadata)
    return net, path, ok, worst


def test_the_export_reads_back_to_the_same_outputs(written):
    net, path, ok, worst = written
    assert ok and worst == 0.0
    run, metadata, _, _ = export.open_exported(str(path), ".safetensors")
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(run(x), net(x))
    assert json.loads(metadata["training_config"]) == STORED
    assert json.loads(metadata["classes"]) == list("abcd")
    assert metadata["format"] == "weights" and "data_config" in metadata


def test_the_rebuilt_network_is_in_eval_mode_with_every_weight(written):
    net, path, _, _ = written
    extra = {}
    loaded = weights_file.load(str(path), extra)
    assert not loaded.training
    for key, value in net.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key
    assert json.loads(extra["metadata.json"])["format"] == "weights"


def test_weights_without_the_network_they_fit_are_one_line(tmp_path):
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(UserError, match="holds weights without the network they fit") as e:
        export.open_exported(str(path), ".safetensors")
    assert "\n" not in str(e.value)


def test_weights_of_another_network_are_one_line(tmp_path):
    path = tmp_path / "other.safetensors"
    save_file({"w": torch.zeros(2)}, str(path),
              metadata={"training_config": json.dumps(STORED)})
    with pytest.raises(UserError, match="tensors missing and 1 unexpected"):
        export.open_exported(str(path), ".safetensors")


def test_a_damaged_file_is_one_line(written, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(written[1].read_bytes()[:50])
    with pytest.raises(UserError, match="cannot be read as safetensors"):
        export.open_exported(str(cut), ".safetensors")

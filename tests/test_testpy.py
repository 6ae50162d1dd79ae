"""test.py: evaluating a checkpoint the way training validated it, and its user errors."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, load_test_py, tiny_args

import data


def _train(tmp_path_factory, name, *extra, **kwargs):
    import train

    run_dir = tmp_path_factory.mktemp(name)
    assert train.main(tiny_args(run_dir, *extra, **kwargs)) == 0
    return run_dir


def _last_validation(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if "val_acc" in r][-1]


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    return _train(tmp_path_factory, "mlp", epochs=2)


@pytest.fixture(scope="module")
def cnn_channels_last_run(tmp_path_factory):
    return _train(tmp_path_factory, "cnn_cl", "--channels-last", network="simple_cnn",
                  image=16)


@pytest.fixture(scope="module")
def mlp_bf16_run(tmp_path_factory):
    return _train(tmp_path_factory, "mlp_bf16", "--amp", "bf16")


def _ckpt(run_dir):
    return str(run_dir / "checkpoints" / "last.pt")


def _evaluate(tmp_path, run_dir, *extra):
    out = tmp_path / "result.json"
    code = load_test_py().main(["--checkpoint", _ckpt(run_dir), "--num-workers", "0",
                                "--device", "cpu", "--json", str(out), *extra])
    assert code == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("run", ["mlp_run", "cnn_channels_last_run", "mlp_bf16_run"])
def test_accuracy_equals_the_val_acc_training_logged(run, request, tmp_path, capsys):
    run_dir = request.getfixturevalue(run)
    logged = _last_validation(run_dir)
    result = _evaluate(tmp_path, run_dir)
    assert result["accuracy"] == logged["val_acc"]
    torch.testing.assert_close(result["loss"], logged["val_loss"])
    assert result["checkpoint"] == _ckpt(run_dir)
    assert result["count"] == 64 // 5
    printed = capsys.readouterr().out
    assert f"accuracy {logged['val_acc']:.4f}" in printed
    assert "confusion matrix" in printed


def test_json_holds_per_class_accuracy_and_confusion(mlp_run, tmp_path, capsys):
    result = _evaluate(tmp_path, mlp_run)
    _, val = data.build_datasets(torch.load(_ckpt(mlp_run), weights_only=True)["config"])
    confusion = torch.tensor(result["confusion"])
    assert confusion.shape == (10, 10)
    assert int(confusion.sum()) == result["count"] == len(val)
    labels = torch.tensor([val[i][1] for i in range(len(val))])
    assert torch.equal(confusion.sum(dim=1), torch.bincount(labels, minlength=10))
    assert result["accuracy"] == float(confusion.diag().sum()) / result["count"]
    assert list(result["per_class"]) == val.classes
    for i, name in enumerate(val.classes):
        assert result["per_class"][name] == float(confusion[i, i]) / float(confusion[i].sum())
    printed = capsys.readouterr().out
    for name, acc in result["per_class"].items():
        assert f"{name}  {acc:.4f}" in printed


def test_absent_class_is_null_in_json():
    test_py = load_test_py()
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [0, 2, 2]])
    result = {"loss": 0.5, "acc": 5 / 8, "count": 8, "confusion": confusion}
    report = test_py.make_report("x.pt", result, ["a", "b", "c"])
    assert report["per_class"] == {"a": 0.75, "b": None, "c": 0.5}
    assert json.loads(json.dumps(report, allow_nan=False)) == report


def test_batch_size_and_data_dir_override_the_checkpoints(mlp_run, tmp_path, monkeypatch):
    seen = {}
    real_datasets, real_loader = data.build_datasets, data.build_loader

    def datasets(config):
        seen["data_dir"] = config["data_dir"]
        return real_datasets(config)

    def loader(dataset, **kwargs):
        seen["batch_size"] = kwargs["batch_size"]
        return real_loader(dataset, **kwargs)

    monkeypatch.setattr(data, "build_datasets", datasets)
    monkeypatch.setattr(data, "build_loader", loader)
    default = _evaluate(tmp_path, mlp_run)
    assert seen == {"data_dir": "data", "batch_size": 16}
    other = _evaluate(tmp_path, mlp_run, "--batch-size", "5", "--data-dir", str(tmp_path))
    assert seen == {"data_dir": str(tmp_path), "batch_size": 5}
    # The mlp treats samples independently: the batch size changes no prediction.
    assert other["confusion"] == default["confusion"]
    torch.testing.assert_close(other["loss"], default["loss"])


def _one_error_line(capsys, match):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert match in err[0], err
    return err[0]


def test_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    code = load_test_py().main(["--checkpoint", str(tmp_path / "nope.pt")])
    assert code == 2
    _one_error_line(capsys, "does not exist")


def test_truncated_checkpoint_is_one_error_line(mlp_run, tmp_path, capsys):
    blob = open(_ckpt(mlp_run), "rb").read()
    bad = tmp_path / "bad.pt"
    bad.write_bytes(blob[:len(blob) // 2])
    assert load_test_py().main(["--checkpoint", str(bad)]) == 2
    _one_error_line(capsys, "cannot be loaded")


def test_plain_state_dict_is_not_a_training_checkpoint(tmp_path, capsys):
    path = tmp_path / "weights.pt"
    torch.save({"fc.weight": torch.zeros(2, 2)}, path)
    assert load_test_py().main(["--checkpoint", str(path)]) == 2
    _one_error_line(capsys, "not a training checkpoint")


def test_checkpoint_that_does_not_fit_its_network(mlp_run, tmp_path, capsys):
    state = torch.load(_ckpt(mlp_run), weights_only=True)
    state["model"]["fc.weight"] = torch.zeros(3, 5)
    path = tmp_path / "other.pt"
    torch.save(state, path)
    assert load_test_py().main(["--checkpoint", str(path), "--num-workers", "0"]) == 2
    _one_error_line(capsys, "does not fit this network (shape mismatch: fc.weight)")


@pytest.mark.parametrize("argv, match", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--num-workers", "-1"], "--num-workers must not be negative"),
    (["--device", "tpu"], "--device 'tpu'"),
])
def test_bad_flags_are_one_error_line(mlp_run, argv, match, capsys):
    assert load_test_py().main(["--checkpoint", _ckpt(mlp_run), *argv]) == 2
    _one_error_line(capsys, match)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_device_without_cuda_is_a_user_error(mlp_run, capsys):
    assert load_test_py().main(["--checkpoint", _ckpt(mlp_run), "--device", "cuda"]) == 2
    _one_error_line(capsys, "no such CUDA device")


def test_argparse_errors_exit_2_with_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test_py().main(["--checkpoint", "x.pt", "--no-such-flag"])
    assert exit_info.value.code == 2
    _one_error_line(capsys, "unrecognized arguments: --no-such-flag")


def test_help_shows_defaults_and_the_torchscript_deprecation(capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_test_py().main(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "(default: auto)" in text and "(default: 2)" in text
    assert "TorchScript is deprecated upstream, prefer .pt2" in text


def _run_script(*argv):
    return subprocess.run([sys.executable, "test.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_script_exit_code_and_json(mlp_run, tmp_path):
    out = tmp_path / "r.json"
    proc = _run_script("--checkpoint", _ckpt(mlp_run), "--num-workers", "0",
                       "--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["accuracy"] == _last_validation(mlp_run)["val_acc"]


@pytest.mark.parametrize("kind, match", [("missing", "does not exist"),
                                         ("truncated", "cannot be loaded")])
def test_script_user_errors_have_no_traceback(mlp_run, tmp_path, kind, match):
    path = tmp_path / f"{kind}.pt"
    if kind == "truncated":
        path.write_bytes(open(_ckpt(mlp_run), "rb").read()[:100])
    proc = _run_script("--checkpoint", str(path))
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], lines
    assert "Traceback" not in proc.stderr + proc.stdout

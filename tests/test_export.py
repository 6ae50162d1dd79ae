"""test.py --export: .pt2 / .ts / .onnx artifacts that match the eager network; --quantize
(int8 ONNX copies, measured against the eager network); --model (evaluating a file)."""

import errno
import importlib.util
import json
import os
import warnings

import numpy as np
import onnx
import onnxruntime
import pytest
import torch
from helpers import load_test_py, write_image_folder

import export
from machinery import checkpoint
from networks import build_network
from pipeline import data


@pytest.fixture(scope="module")
def mlp_run(trained_run):
    return trained_run(epochs=2)  # test_testpy.py evaluates the same run


@pytest.fixture(scope="module")
def cnn_channels_last_run(trained_run):
    return trained_run("--channels-last", network="simple_cnn", image=16)


@pytest.fixture(scope="module")
def cnn_run(trained_run):
    return trained_run(network="simple_cnn", image=16)


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, trained_run):
    images = write_image_folder(tmp_path_factory.mktemp("images"))
    return trained_run("--dataset", "imagefolder", "--data-dir", str(images),
                       network="simple_cnn", image=16, batch=6, epochs=2)


def _ckpt(run_dir):
    return str(run_dir / "checkpoints" / "last.pt")


def _test_py():
    """test.py, loaded with its throughput measurement cut to two batches (speed only)."""
    module = load_test_py()
    module.THROUGHPUT_SECONDS, module.THROUGHPUT_MIN_BATCHES = 0.0, 1
    return module


def _export(run_dir, out, *extra, module=None):
    return (module or _test_py()).main(["--checkpoint", _ckpt(run_dir), "--num-workers", "0",
                                        "--device", "cpu", "--export", str(out), *extra])


def _eager(run_dir):
    """The checkpoint's network, built here independently of test.py."""
    state = torch.load(_ckpt(run_dir), weights_only=True)
    config = state["config"]
    net = build_network(config["network"], config["num_classes"], 3, config["image_size"])
    net.load_state_dict(checkpoint.unwrap_state_dict(state["model"]))
    return net.eval(), config["image_size"]


def _reload(path):
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # TorchScript's deprecation notice
        return torch.jit.load(str(path))


def _leftovers(directory):
    return [f for f in os.listdir(directory) if f.startswith(".tmp-")]


@pytest.mark.parametrize("suffix", [".pt2", ".ts"])
@pytest.mark.parametrize("run", ["mlp_run", "cnn_channels_last_run"])
def test_artifact_matches_the_eager_network_at_two_batch_sizes(run, suffix, request,
                                                               tmp_path, capsys):
    run_dir = request.getfixturevalue(run)
    out = tmp_path / "new_dir" / f"model{suffix}"
    assert _export(run_dir, out) == 0
    assert "max abs difference from the eager network" in capsys.readouterr().out
    net, side = _eager(run_dir)
    artifact = _reload(out)
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 3, side, side)
            want = net(x)
            got = artifact(x)
            assert got.shape == (batch, 10)
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert _leftovers(out.parent) == []
    # The file evaluates alone (--model) to what the checkpoint evaluates to.
    assert _evaluate_file(out, tmp_path / "file.json") == _evaluate_checkpoint(
        run_dir, tmp_path / "ckpt.json")


def _evaluate_checkpoint(run_dir, out):
    assert _test_py().main(["--checkpoint", _ckpt(run_dir), "--num-workers", "0",
                            "--device", "cpu", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    return result["accuracy"], result["per_class"], result["count"]


def _evaluate_file(path, out, *extra):
    assert _test_py().main(["--model", str(path), "--num-workers", "0", "--json", str(out),
                            *extra]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == str(path) and result["bytes"] == os.path.getsize(path)
    assert result["samples_per_sec"] > 0
    return result["accuracy"], result["per_class"], result["count"]


def test_pt2_of_a_channels_last_run_is_plain_contiguous(cnn_channels_last_run, tmp_path):
    saved = torch.load(_ckpt(cnn_channels_last_run), weights_only=True)["model"]
    assert any(t.dim() == 4 and not t.is_contiguous() for t in saved.values()), \
        "the run should have saved channels_last weights, or this test proves nothing"
    out = tmp_path / "model.pt2"
    assert _export(cnn_channels_last_run, out) == 0
    program = torch.export.load(str(out))
    inputs = [n for n in program.graph.nodes
              if n.op == "placeholder" and n.name in program.graph_signature.user_inputs]
    assert len(inputs) == 1
    example = inputs[0].meta["val"]
    assert example.is_contiguous() and example.stride()[-1] == 1
    assert all(t.is_contiguous() for t in program.state_dict.values())
    net, _ = _eager(cnn_channels_last_run)
    with torch.no_grad():  # a channels_last input is still accepted and gives the same output
        x = torch.randn(3, 3, 16, 16).to(memory_format=torch.channels_last)
        torch.testing.assert_close(program.module()(x), net(x), rtol=1e-4, atol=1e-5)


def test_outputs_that_differ_exit_1_and_keep_the_old_file(mlp_run, tmp_path, capsys,
                                                          monkeypatch):
    test_py = _test_py()
    save, real_load = export.EXPORTERS[".ts"]

    def off_by_a_bit(path):
        module = real_load(path)
        return lambda x: module(x) + 1e-2

    monkeypatch.setitem(export.EXPORTERS, ".ts", (save, off_by_a_bit))
    out = tmp_path / "model.ts"
    out.write_bytes(b"an older artifact")
    assert _export(mlp_run, out, module=test_py) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert "differ from the eager network's (max abs difference 0.01" in err[0]
    assert out.read_bytes() == b"an older artifact"
    assert _leftovers(tmp_path) == []


def test_a_crash_while_saving_leaves_no_half_file(mlp_run, tmp_path, monkeypatch):
    def crash(program, path, **kwargs):
        with open(path, "wb") as f:
            f.write(b"half an artif")
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(torch.export, "save", crash)
    out = tmp_path / "model.pt2"
    out.write_bytes(b"an older artifact")
    with pytest.raises(RuntimeError, match="disk on fire"):
        _export(mlp_run, out)
    assert out.read_bytes() == b"an older artifact"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["model.zip", "model"])
def test_unknown_suffix_is_a_user_error_before_any_work(name, tmp_path, capsys):
    # The checkpoint does not even exist: the suffix is checked first.
    code = load_test_py().main(["--checkpoint", str(tmp_path / "none.pt"),
                                "--export", str(tmp_path / name)])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --export"), err
    assert all(s in err[0] for s in (".pt2", ".ts", ".onnx"))
    assert not os.path.exists(tmp_path / name)


@pytest.mark.parametrize("absent, named", [
    (("onnx", "onnxscript", "onnxruntime"), "needs onnx, onnxscript, onnxruntime"),
    (("onnxscript",), "needs onnxscript,"),
])
def test_onnx_without_its_packages_says_what_to_install(absent, named, tmp_path,
                                                        monkeypatch, capsys):
    real = importlib.util.find_spec

    def find_spec(name, *args):
        if name in ("onnx", "onnxscript", "onnxruntime"):
            return None if name in absent else object()  # "installed"
        return real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    code = load_test_py().main(["--checkpoint", str(tmp_path / "none.pt"),
                                "--export", str(tmp_path / "model.onnx")])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and named in err[0], err
    assert "pip install onnx onnxscript" in err[0]


def test_ts_is_frozen_and_optimized_for_inference_when_loaded(cnn_run, tmp_path):
    out = tmp_path / "model.ts"
    assert _export(cnn_run, out) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        saved = torch.jit.load(str(out))
        kinds = {node.kind() for node in saved.graph.nodes()}
        assert "aten::batch_norm" not in kinds  # frozen: BatchNorm folded into the convs
        assert not hasattr(saved, "features")  # frozen: no submodules or parameters left
        loaded = export._load_ts(str(out))  # what test.py checked and evaluates
    net, side = _eager(cnn_run)
    with torch.no_grad():
        x = torch.randn(3, 3, side, side)
        torch.testing.assert_close(loaded(x), net(x), rtol=1e-4, atol=1e-5)


def test_onnx_round_trip_with_stable_names_and_metadata(mlp_run, tmp_path):
    out = tmp_path / "model.onnx"
    assert _export(mlp_run, out) == 0
    net, side = _eager(mlp_run)
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    (images,), (logits,) = session.get_inputs(), session.get_outputs()
    assert (images.name, logits.name) == ("images", "logits")
    assert isinstance(images.shape[0], str) and images.shape[1:] == [3, side, side]
    assert isinstance(logits.shape[0], str) and logits.shape[1] == 10
    with torch.no_grad():
        for batch in (1, 2, 5):
            x = torch.randn(batch, 3, side, side)
            got = torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
            torch.testing.assert_close(got, net(x), rtol=1e-4, atol=1e-5)
    meta = session.get_modelmeta().custom_metadata_map
    stored = json.loads(meta["training_config"])
    assert stored["dataset"] == "synthetic" and stored["image_size"] == side
    assert json.loads(meta["classes"]) == [f"class{i}" for i in range(10)]
    assert json.loads(meta["normalize"]) is None and meta["quantization"] == "none"


# ------------------------------------------------------------------------- --quantize

def _hand_evaluate(path, run_dir):
    """Accuracy, loss and per-class accuracy of an ONNX file, computed here with a fresh
    onnxruntime session on the validation split (test.py's code is not used)."""
    config = torch.load(_ckpt(run_dir), weights_only=True)["config"]
    _, val = data.build_datasets(config)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    loader = torch.utils.data.DataLoader(val, batch_size=config["batch_size"])
    labels, predicted, loss = [], [], 0.0
    for x, y in loader:
        out = torch.from_numpy(session.run(["logits"], {"images": x.numpy()})[0])
        loss += float(torch.nn.functional.cross_entropy(out, y, reduction="sum"))
        labels.append(y)
        predicted.append(out.argmax(dim=1))
    labels, predicted = torch.cat(labels), torch.cat(predicted)
    per_class = {name: int((predicted[labels == i] == i).sum()) / int((labels == i).sum())
                 for i, name in enumerate(val.classes) if (labels == i).any()}
    return int((predicted == labels).sum()) / len(labels), loss / len(labels), per_class


@pytest.fixture(scope="module")
def cnn_int8(cnn_run, tmp_path_factory):
    """simple_cnn exported to ONNX and quantized (static int8, 16 calibration images)."""
    where = tmp_path_factory.mktemp("cnn_int8")
    code = _export(cnn_run, where / "model.onnx", "--quantize", "int8",
                   "--calibration-samples", "16", "--json", str(where / "report.json"))
    assert code == 0
    return where


def _check_int8_export(where, run_dir, kind):
    fp32, int8 = where / "model.onnx", where / "model.int8.onnx"
    assert fp32.is_file() and int8.is_file() and _leftovers(where) == []
    assert int8.stat().st_size < fp32.stat().st_size / 2
    session = onnxruntime.InferenceSession(str(int8), providers=["CPUExecutionProvider"])
    (images,), (logits,) = session.get_inputs(), session.get_outputs()
    assert (images.name, logits.name) == ("images", "logits")
    assert isinstance(images.shape[0], str)  # dynamic batch
    model = onnx.load(str(int8))
    ops = {node.op_type for node in model.graph.node}
    if kind == "int8":
        assert {"QuantizeLinear", "DequantizeLinear"} <= ops  # QDQ format
    else:
        assert ops & {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"}, ops
    meta = session.get_modelmeta().custom_metadata_map
    assert meta["quantization"].startswith({"int8": "int8 static",
                                            "int8-dynamic": "int8 dynamic"}[kind])
    for batch in (1, 3):
        x = np.random.default_rng(0).standard_normal((batch, *images.shape[1:]))
        assert session.run(["logits"], {"images": x.astype(np.float32)})[0].shape == \
            (batch, logits.shape[1])

    report = json.loads((where / "report.json").read_text())
    export = report["export"]
    name = f"onnx {kind}"
    assert list(export["models"]) == ["eager", "onnx fp32", name]
    assert export["quantize"] == kind and export["int8_file"] == str(int8)
    assert export["models"]["onnx fp32"]["bytes"] == fp32.stat().st_size
    assert export["models"][name]["bytes"] == int8.stat().st_size
    assert export["models"]["eager"]["accuracy"] == report["accuracy"]
    for row in export["models"].values():
        assert row["samples_per_sec"] > 0 and row["count"] == report["count"]
    # The accuracy test.py reports for each file is what the file itself gives.
    for row_name, path in (("onnx fp32", fp32), (name, int8)):
        row = export["models"][row_name]
        accuracy, loss, per_class = _hand_evaluate(path, run_dir)
        assert row["accuracy"] == accuracy
        torch.testing.assert_close(row["loss"], loss, rtol=1e-5, atol=1e-6)
        assert {k: v for k, v in row["per_class"].items() if v is not None} == per_class
        assert row["accuracy_delta"] == row["accuracy"] - report["accuracy"]
    assert export["accuracy_drop"] == report["accuracy"] - export["models"][name]["accuracy"]
    return report


def test_static_int8_of_a_cnn_on_synthetic_data(cnn_int8, cnn_run, capsys):
    report = _check_int8_export(cnn_int8, cnn_run, "int8")
    assert report["export"]["calibration_samples"] == 16
    assert report["export"]["calibration_seed"] == 0  # the training run's


@pytest.fixture(scope="module")
def folder_int8(folder_run, tmp_path_factory):
    """simple_cnn trained on an image folder, exported to ONNX and quantized (static int8)."""
    where = tmp_path_factory.mktemp("folder_int8")
    code = _export(folder_run, where / "model.onnx", "--quantize", "int8", "--json",
                   str(where / "report.json"))
    assert code == 0
    return where


def test_static_int8_of_a_cnn_on_image_folder_data(folder_int8, folder_run, tmp_path):
    report = _check_int8_export(folder_int8, folder_run, "int8")
    assert report["export"]["calibration_samples"] == 18  # the whole training split (< 256)
    # The shipped file evaluates alone, its data found from what it stores.
    assert _evaluate_file(folder_int8 / "model.int8.onnx", tmp_path / "file.json") == (
        report["export"]["models"]["onnx int8"]["accuracy"],
        report["export"]["models"]["onnx int8"]["per_class"], report["count"])


def test_quantize_says_where_the_int8_file_goes(folder_run, folder_int8, tmp_path, capsys):
    out = tmp_path / "model.onnx"
    assert _export(folder_run, out, "--quantize", "int8", "--calibration-samples", "4") == 0
    printed = capsys.readouterr().out
    assert f"exported ONNX to {out} (" in printed
    assert f"quantized {out} to {tmp_path / 'model.int8.onnx'} in " in printed
    assert "4 calibration images, seed 0" in printed
    for row in ("eager", "onnx fp32", "onnx int8", "per-class accuracy:", "cat", "emu"):
        assert f"  {row}" in printed, row


def test_calibration_is_deterministic(cnn_int8, cnn_run, tmp_path):
    same = tmp_path / "same" / "model.onnx"
    other = tmp_path / "other" / "model.onnx"
    assert _export(cnn_run, same, "--quantize", "int8", "--calibration-samples", "16",
                   "--seed", "0") == 0
    assert _export(cnn_run, other, "--quantize", "int8", "--calibration-samples", "16",
                   "--seed", "1") == 0
    first = (cnn_int8 / "model.int8.onnx").read_bytes()
    assert (same.parent / "model.int8.onnx").read_bytes() == first
    assert (other.parent / "model.int8.onnx").read_bytes() != first  # other images


def test_dynamic_quantization(cnn_run, tmp_path, capsys):
    code = _export(cnn_run, tmp_path / "model.onnx", "--quantize", "int8-dynamic", "--json",
                   str(tmp_path / "report.json"))
    assert code == 0
    report = _check_int8_export(tmp_path, cnn_run, "int8-dynamic")
    assert "calibration_samples" not in report["export"]


def test_model_flag_evaluates_a_file_without_the_checkpoint(cnn_int8, tmp_path, capsys):
    path = cnn_int8 / "model.int8.onnx"
    report = json.loads((cnn_int8 / "report.json").read_text())
    row = report["export"]["models"]["onnx int8"]
    assert _evaluate_file(path, tmp_path / "a.json") == (row["accuracy"], row["per_class"],
                                                         row["count"])
    printed = capsys.readouterr().out
    assert f"model {path} (ONNX, int8 static" in printed and "simple_cnn on synthetic" in printed

    # A file without the stored config: the flags say what the data is.
    bare = onnx.load(str(path))
    del bare.metadata_props[:]
    onnx.save(bare, str(tmp_path / "bare.onnx"))
    assert _test_py().main(["--model", str(tmp_path / "bare.onnx")]) == 2
    _one_error_line(capsys, "holds no training config", "--dataset")
    assert _evaluate_file(tmp_path / "bare.onnx", tmp_path / "b.json", "--dataset",
                          "synthetic", "--synthetic-size", "64") == (
        row["accuracy"], row["per_class"], row["count"])


def test_model_flag_refuses_data_the_file_was_not_made_for(folder_int8, cnn_int8, tmp_path,
                                                           capsys):
    other = write_image_folder(tmp_path / "other", classes=("cat", "dog", "fox"))
    path = str(cnn_int8 / "model.int8.onnx")
    code = _test_py().main(["--model", path, "--dataset", "imagefolder", "--data-dir",
                            str(other), "--num-workers", "0"])
    assert code == 2
    _one_error_line(capsys, "was exported for inputs not normalised",
                    "--dataset imagefolder normalises them with mean")
    code = _test_py().main(["--model", str(folder_int8 / "model.onnx"), "--data-dir",
                            str(other), "--num-workers", "0"])
    assert code == 2
    _one_error_line(capsys, "exported for the classes [cat, dog, emu] (3)",
                    "the data has [cat, dog, fox] (3) (check --data-dir)")


def test_accuracy_drop_beyond_the_limit_is_a_warning(mlp_run, tmp_path, capsys, monkeypatch):
    test_py = _test_py()
    real_load = export.load_onnx

    def worse_int8(path):  # the int8 file's predictions moved to the next class
        run = real_load(path)
        return (lambda x: run(x).roll(1, dims=1)) if path.endswith(".int8.onnx") else run

    monkeypatch.setattr(export, "load_onnx", worse_int8)
    code = _export(mlp_run, tmp_path / "model.onnx", "--quantize", "int8",
                   "--max-accuracy-drop", "0.05", "--json", str(tmp_path / "r.json"),
                   module=test_py)
    assert code == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("warning: the int8 file's accuracy is"), err
    assert "quantization-aware training" in err[0] and "--max-accuracy-drop 0.05" in err[0]
    summary = json.loads((tmp_path / "r.json").read_text())["export"]
    assert summary["accuracy_warning"] is True and summary["accuracy_drop"] > 0.05


def test_an_accuracy_drop_within_the_limit_gives_no_warning(mlp_run, tmp_path, capsys,
                                                            monkeypatch):
    test_py = _test_py()
    real_load = export.load_onnx

    def worse_int8(path):  # the same stand-in: a drop well above the default 0.01
        run = real_load(path)
        return (lambda x: run(x).roll(1, dims=1)) if path.endswith(".int8.onnx") else run

    monkeypatch.setattr(export, "load_onnx", worse_int8)
    drops = []
    for limit in ("1", None):  # far above it, then exactly at it ("more than" warns)
        report = tmp_path / f"r{len(drops)}.json"
        code = _export(mlp_run, tmp_path / "model.onnx", "--quantize", "int8",
                       "--max-accuracy-drop", limit or repr(drops[0]), "--json",
                       str(report), module=test_py)
        assert code == 0
        assert capsys.readouterr().err.strip() == ""  # no warning line
        summary = json.loads(report.read_text())["export"]
        assert summary["accuracy_warning"] is False
        drops.append(summary["accuracy_drop"])
    assert drops[0] == drops[1] > 0.01


def test_static_quantization_that_fails_is_one_line_exit_1(mlp_run, tmp_path, monkeypatch,
                                                          capsys):
    from onnxruntime import quantization

    def fail(*args, **kwargs):
        raise RuntimeError("Unsupported op: FancyOp\nmore lines")

    monkeypatch.setattr(quantization, "quantize_static", fail)
    out = tmp_path / "model.onnx"
    assert _export(mlp_run, out, "--quantize", "int8", "--json",
                   str(tmp_path / "r.json")) == 1
    _one_error_line(capsys, "onnxruntime could not quantize", "Unsupported op: FancyOp",
                    "try --quantize int8-dynamic")
    assert out.is_file() and not (tmp_path / "model.int8.onnx").exists()
    assert json.loads((tmp_path / "r.json").read_text())["export"]["file"] == str(out)
    assert _leftovers(tmp_path) == []


def test_full_disk_while_writing_int8_keeps_the_old_file(mlp_run, tmp_path, capsys,
                                                         monkeypatch):
    test_py = _test_py()

    def full(model, path, flag):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(export, "_save_and_try", full)
    old = tmp_path / "model.int8.onnx"
    old.write_bytes(b"the previous int8 file")
    assert _export(mlp_run, tmp_path / "model.onnx", "--quantize", "int8",
                   module=test_py) == 1
    _one_error_line(capsys, f"--quantize int8 {str(old)!r}", "No space left on device",
                    "the previous file there is unchanged")
    assert old.read_bytes() == b"the previous int8 file" and _leftovers(tmp_path) == []


def _one_error_line(capsys, *names):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for name in names:
        assert name in err[0], (name, err[0])
    return err[0]


@pytest.mark.parametrize("argv, names", [
    (["--export", "m.pt2", "--quantize", "int8"],
     ["torch.export (.pt2) files cannot be quantized", "--export m.onnx"]),
    (["--export", "m.ts", "--quantize", "int8-dynamic"],
     ["works on ONNX exports only", "--export m.onnx"]),
    (["--quantize", "int8"], ["needs --export OUT.onnx"]),
    (["--export", "m.onnx", "--quantize", "int8", "--calibration-samples", "0"],
     ["--calibration-samples must be at least 1"]),
    (["--export", "m.onnx", "--quantize", "int8-dynamic", "--calibration-samples", "8"],
     ["--calibration-samples is for --quantize int8 (static)"]),
    (["--export", "m.onnx", "--seed", "3"], ["--seed picks the calibration images"]),
    (["--export", "m.onnx", "--quantize", "int8", "--max-accuracy-drop", "nan"],
     ["--max-accuracy-drop must be in [0, 1]"]),
    (["--export", "m.onnx", "--quantize", "int4"], ["invalid choice: 'int4'"]),
])
def test_bad_quantize_flags_are_one_error_line_before_any_work(argv, names, tmp_path,
                                                               monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the checkpoint does not even exist: flags come first
    try:
        code = _test_py().main(["--checkpoint", "none.pt", *argv])
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    _one_error_line(capsys, *names)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("argv, names", [
    (["--model", "m.onnx", "--checkpoint", "c.pt"], ["not allowed with argument"]),
    (["--model", "m.onnx", "--export", "n.onnx"], ["--export needs --checkpoint"]),
    (["--model", "m.zip"], ["--model 'm.zip': unknown suffix"]),
    (["--model", "m.onnx", "--device", "cuda"], ["evaluated on the CPU"]),
    (["--model", "missing.onnx"], ["--model 'missing.onnx' does not exist"]),
    (["--model", "junk.onnx"], ["cannot be loaded as ONNX"]),
    (["--model", "junk.pt2"], ["cannot be loaded as torch.export"]),
    (["--model", "junk.ts"], ["cannot be loaded as frozen TorchScript"]),
])
def test_bad_model_flags_are_one_error_line(argv, names, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for junk in ("junk.onnx", "junk.pt2", "junk.ts"):
        (tmp_path / junk).write_bytes(b"not a model")
    try:
        code = _test_py().main(argv)
    except SystemExit as e:
        code = e.code
    assert code == 2
    _one_error_line(capsys, *names)


def test_int8_output_that_is_a_directory_is_refused_before_evaluating(mlp_run, tmp_path,
                                                                      monkeypatch, capsys):
    (tmp_path / "model.int8.onnx").mkdir()

    def build_datasets(config):
        raise AssertionError("the data was loaded: the output should have been refused")

    monkeypatch.setattr(data, "build_datasets", build_datasets)
    assert _export(mlp_run, tmp_path / "model.onnx", "--quantize", "int8") == 2
    _one_error_line(capsys, f"--quantize int8 {str(tmp_path / 'model.int8.onnx')!r} is a "
                    f"directory")

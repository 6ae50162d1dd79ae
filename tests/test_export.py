"""test.py --export: .pt2 / .ts / .onnx artifacts that match the eager network."""

import importlib.util
import os
import warnings

import pytest
import torch
from conftest import load_test_py, tiny_args

import checkpoint
from networks import build_network


def _train(tmp_path_factory, name, *extra, **kwargs):
    import train

    run_dir = tmp_path_factory.mktemp(name)
    assert train.main(tiny_args(run_dir, *extra, **kwargs)) == 0
    return run_dir


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory):
    return _train(tmp_path_factory, "mlp")


@pytest.fixture(scope="module")
def cnn_channels_last_run(tmp_path_factory):
    return _train(tmp_path_factory, "cnn_cl", "--channels-last", network="simple_cnn",
                  image=16)


def _ckpt(run_dir):
    return str(run_dir / "checkpoints" / "last.pt")


def _export(run_dir, out):
    return load_test_py().main(["--checkpoint", _ckpt(run_dir), "--num-workers", "0",
                                "--device", "cpu", "--export", str(out)])


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


def test_outputs_that_differ_exit_1_and_keep_the_old_file(mlp_run, tmp_path, monkeypatch,
                                                        capsys):
    real_load = torch.jit.load

    def off_by_a_bit(path, **kwargs):
        module = real_load(path, **kwargs)
        return lambda x: module(x) + 1e-2

    monkeypatch.setattr(torch.jit, "load", off_by_a_bit)
    out = tmp_path / "model.ts"
    out.write_bytes(b"an older artifact")
    assert _export(mlp_run, out) == 1
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


def test_onnx_round_trip(mlp_run, tmp_path):
    for name in ("onnx", "onnxscript"):
        pytest.importorskip(name)
    onnxruntime = pytest.importorskip("onnxruntime")
    out = tmp_path / "model.onnx"
    assert _export(mlp_run, out) == 0
    net, side = _eager(mlp_run)
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    with torch.no_grad():
        for batch in (2, 5):
            x = torch.randn(batch, 3, side, side)
            got = torch.from_numpy(session.run(None, {name: x.numpy()})[0])
            torch.testing.assert_close(got, net(x), rtol=1e-4, atol=1e-5)

"""test.py: evaluating a checkpoint the way training validated it, and its user errors."""

import contextlib
import errno
import json
import math
import os
import signal
import sys
import tempfile

import pytest
import torch
from helpers import ROOT, fork_run, load_test_py, read_metrics

from config import parse_config, with_defaults
from machinery import checkpoint
from pipeline import data
from tasks.classification import Classification


def _last_validation(run_dir):
    return [r for r in read_metrics(run_dir) if "val_acc" in r][-1]


@pytest.fixture(scope="module")
def mlp_run(trained_run):
    return trained_run(epochs=2)  # test_export.py exports the same run


@pytest.fixture(scope="module")
def cnn_channels_last_run(trained_run):
    return trained_run("--channels-last", network="simple_cnn", image=16)


@pytest.fixture(scope="module")
def mlp_bf16_run(trained_run):
    return trained_run("--amp", "bf16")


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
    confusion = torch.tensor([[3, 1, 0], [0, 0, 0], [0, 2, 2]])
    result = {"loss": 0.5, "acc": 5 / 8, "count": 8, "confusion": confusion,
              "class_total": confusion.sum(dim=1), "class_correct": confusion.diag(),
              "top_confused": [(2, 1, 2), (0, 1, 1)]}
    report = Classification(3, ["a", "b", "c"]).report(result, "checkpoint", "x.pt")
    assert report["per_class"] == {"a": 0.75, "b": None, "c": 0.5}
    assert json.loads(json.dumps(report, allow_nan=False)) == report


def test_batch_size_and_data_dir_override_the_checkpoints(mlp_run, tmp_path, monkeypatch):
    seen = {}
    real_datasets, real_loader = data.build_datasets, data.build_loader

    def datasets(config, *args, **kwargs):
        seen["data_dir"] = config["data_dir"]
        return real_datasets(config, *args, **kwargs)

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
    state = _good_state(mlp_run)
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
    return fork_run([sys.executable, "test.py", *argv], cwd=ROOT, capture_output=True,
                    text=True, timeout=120)


def test_script_exit_code_and_json(mlp_run, tmp_path):
    out = tmp_path / "r.json"
    proc = _run_script("--checkpoint", _ckpt(mlp_run), "--num-workers", "0",
                       "--device", "cpu", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["accuracy"] == _last_validation(mlp_run)["val_acc"]


@pytest.mark.parametrize("kind, match", [("missing", "does not exist"),
                                         ("truncated", "cannot be loaded")])
def test_user_errors_have_no_traceback(mlp_run, tmp_path, kind, match, capsys):
    # (in this process: test_script_exit_code_and_json runs the script itself)
    path = tmp_path / f"{kind}.pt"
    if kind == "truncated":
        path.write_bytes(open(_ckpt(mlp_run), "rb").read()[:100])
    assert _code(["--checkpoint", str(path)]) == 2
    _only_error_line(capsys, match)


# --------------------------------------------- bad inputs: one error line, files intact

def _code(argv):
    """test.py's exit code for ``argv`` (argparse's own errors exit through SystemExit)."""
    try:
        return load_test_py().main(argv)
    except SystemExit as e:
        return e.code


def _only_error_line(capsys, *names):
    """stderr is exactly one ``error:`` line naming each of ``names``; no traceback."""
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


def _leftovers(directory):
    return sorted(f for f in os.listdir(directory) if f.startswith(".tmp-"))


@pytest.fixture
def no_evaluation(monkeypatch):
    """Fails the test if test.py gets as far as building the data."""
    def build_datasets(config):
        raise AssertionError("the data was loaded: the output should have been refused first")

    monkeypatch.setattr(data, "build_datasets", build_datasets)


def _evaluate_into(run_dir, flag, out, *extra):
    return _code(["--checkpoint", _ckpt(run_dir), "--num-workers", "0", "--device", "cpu",
                  flag, str(out), *extra])


@pytest.mark.parametrize("flag, name, kind", [
    *[(flag, name, kind) for flag, name in (("--json", "r.json"), ("--export", "m.pt2"))
      for kind in ("directory", "under_a_file")],
    ("--json", "r.json", "trailing_slash"),  # --export: refused for its missing suffix
    ("--json", "r.json", "the_checkpoint"),  # --export: cannot name a .pt file
])
def test_unwritable_output_is_refused_before_evaluating(mlp_run, tmp_path, flag, name, kind,
                                                        no_evaluation, capsys):
    if kind == "directory":
        out = tmp_path / name
        out.mkdir()
        (out / "kept.txt").write_text("kept")
        match = "is a directory"
    elif kind == "under_a_file":
        (tmp_path / "somefile").write_text("kept")
        out = tmp_path / "somefile" / name
        match = "is a file, not a directory"
    elif kind == "trailing_slash":
        out = f"{tmp_path / 'new'}{os.sep}"
        match = "is a directory"
    else:
        out = _ckpt(mlp_run)
        match = "is the checkpoint being evaluated"
    before = open(_ckpt(mlp_run), "rb").read()
    assert _evaluate_into(mlp_run, flag, out) == 2
    _only_error_line(capsys, f"{flag} {str(out)!r}", match)
    assert open(_ckpt(mlp_run), "rb").read() == before
    if kind == "directory":
        assert os.listdir(out) == ["kept.txt"]
    if kind == "under_a_file":
        assert (tmp_path / "somefile").read_text() == "kept"
    assert not os.path.exists(tmp_path / "new")
    assert _leftovers(tmp_path) == []


@pytest.fixture
def mount_point(mount_tmpfs):
    """``mount(options)`` returns the directory of a small tmpfs (conftest.mount_tmpfs)."""
    return mount_tmpfs


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--export", "m.pt2")])
def test_read_only_directory_is_refused_before_evaluating(mlp_run, mount_point, flag, name,
                                                          no_evaluation, capsys):
    # A read-only mount stops root too (chmod 0o555 would not: root ignores the mode bits).
    where = mount_point("ro,size=64k")
    out = where / "sub" / name
    assert _evaluate_into(mlp_run, flag, out) == 2
    _only_error_line(capsys, f"{flag} {str(out)!r}", f"cannot write in {str(where)!r}",
                     "Read-only file system")


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--export", "m.ts")])
def test_directory_without_write_permission_is_refused(mlp_run, tmp_path, monkeypatch, flag,
                                                       name, no_evaluation, capsys):
    # What a 0o555 directory does to a user who is not root, here for root as well.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and os.path.abspath(dir) == str(locked):
            raise PermissionError(errno.EACCES, "Permission denied")
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    out = locked / name
    assert _evaluate_into(mlp_run, flag, out) == 2
    _only_error_line(capsys, f"{flag} {str(out)!r}", "Permission denied")
    assert os.listdir(locked) == []


def test_json_and_export_naming_one_file_is_refused(mlp_run, tmp_path, no_evaluation, capsys):
    out = str(tmp_path / "m.pt2")
    assert _evaluate_into(mlp_run, "--json", out, "--export", out) == 2
    _only_error_line(capsys, "--json and --export both name")


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--export", "m.pt2"),
                                        ("--export", "m.ts")])
def test_full_disk_is_one_error_line_exit_1_and_keeps_the_old_file(mlp_run, tmp_path,
                                                                   monkeypatch, flag, name,
                                                                   capsys):
    def fsync(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    out = tmp_path / name
    out.write_bytes(b"the previous file")
    monkeypatch.setattr(os, "fsync", fsync)
    assert _evaluate_into(mlp_run, flag, out) == 1
    _only_error_line(capsys, f"{flag} {str(out)!r}", "No space left on device",
                     "the previous file there is unchanged")
    assert out.read_bytes() == b"the previous file"
    assert _leftovers(tmp_path) == []


@pytest.mark.parametrize("name", ["r.json", "m.pt2", "m.ts"])
def test_really_full_disk_is_one_error_line_exit_1(mlp_run, mount_point, name, capsys):
    where = mount_point("size=64k")
    out = where / name
    out.write_bytes(b"the previous file")
    with open(where / "filler", "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    flag = "--json" if name.endswith(".json") else "--export"
    argv = ["--checkpoint", _ckpt(mlp_run), "--num-workers", "0", "--device", "cpu", flag,
            str(out)]
    if flag == "--json":
        assert _code(argv) == 1
        _only_error_line(capsys, "No space left on device", "unchanged")
    else:
        # torch's own writers abort the whole process when the disk fills under them:
        # test.py must not let them meet the disk. A subprocess, so that an abort fails
        # only this test.
        proc = _run_script(*argv)
        assert proc.returncode == 1, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
        assert "No space left on device" in lines[0] and "unchanged" in lines[0], lines
    assert out.read_bytes() == b"the previous file"
    assert _leftovers(where) == []


@pytest.mark.parametrize("flag, name", [("--json", "r.json"), ("--export", "m.pt2")])
def test_output_in_new_directories_is_written(mlp_run, tmp_path, flag, name, capsys):
    out = tmp_path / "a" / "b" / name
    assert _evaluate_into(mlp_run, flag, out) == 0
    assert out.is_file() and _leftovers(out.parent) == []
    mode = os.stat(out).st_mode & 0o777
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask


_ABSENT = object()


def _good_state(run_dir):
    state = torch.load(_ckpt(run_dir), weights_only=True)
    state.pop("checksum", None)  # the tests change what it covers
    return state


def _with(state, **changes):
    state = dict(state)
    for key, value in changes.items():
        if value is _ABSENT:
            state.pop(key, None)
        else:
            state[key] = value
    return state


def _with_config(state, **changes):
    return _with(state, config=_with(state["config"], **changes))


@pytest.mark.parametrize("make, match", [
    (lambda s: {"fc.1.weight": 1}, "not a training checkpoint"),
    (lambda s: {"model": [1]}, "not a training checkpoint"),
    (lambda s: [1, 2], "holds a list, not a checkpoint dict"),
    (lambda s: torch.zeros(3), "holds a Tensor, not a checkpoint dict"),
    (lambda s: _with(s, config=_ABSENT), "lacks 'config' (the run's settings)"),
    (lambda s: _with(s, config=[1]), "not a training checkpoint"),
    (lambda s: _with(s, config=torch.zeros(2)), "not a training checkpoint"),
    (lambda s: _with(s, model=[1]), "its model is a list, not a state_dict"),
    (lambda s: _with(s, model=torch.zeros(2)), "its model is a Tensor, not a state_dict"),
    (lambda s: _with(s, model={"fc.1.weight": 1}), "its model's fc.1.weight is 1, not a tensor"),
    (lambda s: _with(s, model={0: torch.zeros(2)}), "its model has a key 0, not a parameter name"),
    (lambda s: _with(s, model={**s["model"], "fc.weight": torch.empty(10, 8, device="meta")}),
     "fc.weight is a torch.float32 torch.strided tensor on meta"),
    (lambda s: _with(s, model={**s["model"], "fc.bias": torch.full((10,), math.nan)}),
     "fc.bias holds NaN or infinite values"),
    (lambda s: _with(s, model={}), "does not fit this network (missing:"),
    (lambda s: _with_config(s, network=_ABSENT), "its config has no network"),
    (lambda s: _with_config(s, network=7), "its config's network is 7"),
    (lambda s: _with_config(s, dataset=None), "its config's dataset is None"),
    (lambda s: _with_config(s, batch_size=math.nan), "its config's batch_size is nan"),
    (lambda s: _with_config(s, batch_size=-1), "its config's batch_size is -1"),
    (lambda s: _with_config(s, batch_size="16"), "its config's batch_size is '16'"),
    (lambda s: _with_config(s, image_size=-8), "its config's image_size is -8"),
    (lambda s: _with_config(s, synthetic_size=math.nan), "synthetic_size is nan"),
    (lambda s: _with_config(s, num_classes=1), "num_classes is 1"),
    (lambda s: _with_config(s, seed=0.5), "seed is 0.5"),
    (lambda s: _with_config(s, data_dir=None), "data_dir is None"),
    (lambda s: _with_config(s, amp="fp8"), "amp is 'fp8'"),
    (lambda s: _with_config(s, amp=["bf16"]), "amp is ['bf16']"),
])
def test_malformed_checkpoint_is_one_error_line(mlp_run, tmp_path, make, match, capsys):
    path = tmp_path / "bad.pt"
    torch.save(make(_good_state(mlp_run)), path)
    assert _code(["--checkpoint", str(path), "--num-workers", "0", "--device", "cpu"]) == 2
    _only_error_line(capsys, match)


def test_config_batch_size_is_not_needed_with_the_flag(mlp_run, tmp_path, capsys):
    path = tmp_path / "no_batch_size.pt"
    torch.save(_with_config(_good_state(mlp_run), batch_size=_ABSENT), path)
    argv = ["--checkpoint", str(path), "--num-workers", "0", "--device", "cpu"]
    assert _code(argv) == 2
    _only_error_line(capsys, "its config has no batch_size", "--batch-size")
    assert _code([*argv, "--batch-size", "4"]) == 0


@pytest.mark.parametrize("device", [
    "meta", "mps", "banana", "", "CPU", " cpu", "cuda:-1", "cuda:0 ", "mkldnn", "xla",
    "cuda:99", "cuda:99999999999999999999",
    pytest.param("cuda", marks=pytest.mark.skipif(torch.cuda.is_available(),
                                                  reason="needs a machine without CUDA")),
])
def test_bad_device_is_one_error_line_before_loading(device, tmp_path, capsys):
    # The checkpoint does not exist: the device is checked before it is looked at.
    assert _code(["--checkpoint", str(tmp_path / "none.pt"), "--device", device]) == 2
    _only_error_line(capsys, f"--device {device!r}" if device not in ("cuda", "cuda:99")
                     else f"--device {device}:")


@pytest.mark.parametrize("argv, match", [
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--batch-size", "-1"], "--batch-size must be at least 1"),
    (["--batch-size", "nan"], "invalid int value: 'nan'"),
    (["--batch-size", "1.5"], "invalid int value: '1.5'"),
    (["--num-workers", "-1"], "--num-workers must not be negative"),
    (["--num-workers", "nan"], "invalid int value: 'nan'"),
    (["--json", ""], "--json needs a file name"),
    (["--export", ""], "--export needs a file name"),
])
def test_bad_numbers_and_names_are_one_error_line(argv, match, tmp_path, capsys):
    assert _code(["--checkpoint", str(tmp_path / "none.pt"), *argv]) == 2
    _only_error_line(capsys, match)


def test_unwritable_json_has_no_traceback(mlp_run, tmp_path, capsys):
    assert _code(["--checkpoint", _ckpt(mlp_run), "--num-workers", "0", "--device", "cpu",
                  "--json", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --json") and \
        "is a directory" in lines[0], lines
    assert captured.out == "" and "Traceback" not in captured.err  # refused before evaluating


ADDED_SINCE = ("amp", "data_on_device", "num_workers", "tta", "channels_last",
               "ema_decay", "mixup_alpha", "auto_augment", "random_erase")


def test_a_config_from_before_newer_flags_evaluates_with_their_defaults(mlp_run, tmp_path,
                                                                         capsys):
    # A checkpoint written before these flags existed: its config has none of them.
    old = _with_config(_good_state(mlp_run), **{key: _ABSENT for key in ADDED_SINCE})
    assert not set(ADDED_SINCE) & set(old["config"])
    path = tmp_path / "old.pt"
    checkpoint.save_checkpoint(old, path)
    out = tmp_path / "old.json"
    argv = ["--checkpoint", str(path), "--num-workers", "0", "--device", "cpu",
            "--json", str(out)]
    assert _code(argv) == 0, capsys.readouterr().err
    assert "Traceback" not in capsys.readouterr().err
    result = json.loads(out.read_text())
    assert result["accuracy"] == _last_validation(mlp_run)["val_acc"]
    assert result["tta"] == "none" and result["weights"] == "raw"  # the defaults


def test_the_flags_defaults_fill_a_stored_config_in_one_place():
    stored = {"network": "mlp", "dataset": "synthetic", "in_channels": 1}
    filled = with_defaults(stored)
    defaults, _ = parse_config([])
    assert {k: filled[k] for k in defaults if k not in stored} == \
        {k: v for k, v in defaults.items() if k not in stored}
    assert filled["network"] == "mlp" and filled["in_channels"] == 1  # kept
    assert filled["amp"] == "none" and filled["data_on_device"] == "auto"
    assert filled["num_workers"] == 2 and filled["tta"] == "none"
    assert with_defaults({"dataset": "synthetic"})["network"] == "simple_cnn"


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_evaluation_is_one_line_and_128_plus_its_number(
        mlp_run, tmp_path, monkeypatch, capsys, signum):
    """Round 7's F12: Ctrl-C (or a SIGTERM) while test.py evaluates ends it in one line,
    exit 130 (143), not a traceback; nothing half-written (--json not written)."""
    test_py = load_test_py()
    evaluate = test_py.evaluate_checkpoint

    def interrupted(*args, **kwargs):
        os.kill(os.getpid(), signum)
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(test_py, "evaluate_checkpoint", interrupted)
    code = test_py.main(["--checkpoint", _ckpt(mlp_run), "--num-workers", "0", "--json",
                         str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 128 + signum and "Traceback" not in err
    assert err.strip().splitlines() == [f"{signal.Signals(signum).name}: test.py stopped; "
                                        f"what it wrote is whole, the rest not written"]
    assert not (tmp_path / "r.json").exists()
    assert signal.getsignal(signal.SIGINT) is not None  # its handlers put back

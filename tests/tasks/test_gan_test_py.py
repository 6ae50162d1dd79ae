"""test.py on a GAN checkpoint (issue 27, item 4): seeded PNGs of the generator, FID and
KID against the real validation images, the generator's export with its parity check, and
the flags that make no sense for a generator, each one ``error:`` line.

The checkpoints are train.py's format 3 (tests/helpers.write_gan_checkpoint): a small
DCGAN (width 8, latents of 8) at 28 or 32 px."""

import json
import os
import sys

import numpy as np
import pytest
import torch
import torchvision
from helpers import (
    ROOT,
    fork_run,
    load_test_py,
    snapshot,
    tiny_args,
    write_gan_checkpoint,
    write_mnist,
)
from PIL import Image

import dcgan
import export
from config import with_defaults
from machinery import checkpoint
from pipeline import data
from reporting import gan_metrics


@pytest.fixture(scope="module")
def test_py():
    return load_test_py()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    """A classifier checkpoint of train.py (mlp, synthetic 3x8x8, one epoch), for
    --fid-features."""
    import train

    run = tmp_path_factory.mktemp("classifier") / "run"
    assert train.main(tiny_args(run, "--synthetic-size", "64")) == 0
    return str(run / "checkpoints" / "best.pt")


def _run(test_py, *argv):
    return test_py.main([*map(str, argv), "--device", "cpu", "--num-workers", "0"])


def _generator(state, which):
    """The generator test.py should use: ``networks`` (raw) or ``ema``'s."""
    config = state["config"]
    generator, _ = dcgan.build(config, config["in_channels"])
    generator.load_state_dict(state["ema" if which == "ema" else "networks"]["generator"])
    return generator.eval()


def _expected(state, which, n, seed):
    """The uint8 images ``(n, C, H, W)`` of that generator, in eval mode, for the fixed
    latents of ``seed``."""
    latents = dcgan.fixed_latents(n, state["config"]["latent_dim"], seed)
    with torch.no_grad():
        return gan_metrics.to_uint8(_generator(state, which)(latents))


def _pngs(directory):
    """``(names, uint8 tensor (n, C, H, W), PIL modes)`` of the PNGs in ``directory``."""
    names = sorted(os.listdir(directory))
    arrays, modes = [], set()
    for name in names:
        with Image.open(os.path.join(directory, name)) as image:
            assert image.format == "PNG"
            modes.add(image.mode)
            pixels = torch.from_numpy(np.array(image))  # (H, W) or (H, W, 3)
        arrays.append(pixels[None] if pixels.dim() == 2 else pixels.permute(2, 0, 1))
    return names, torch.stack(arrays), modes


def _one_error_line(capsys, *parts):
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    assert "Traceback" not in captured.err + captured.out
    for part in parts:
        assert part in lines[0], (part, lines[0])
    return lines[0]


# ------------------------------------------------------------------------ --samples

def test_samples_are_the_moving_averages_images_of_the_fixed_latents(tmp_path, test_py,
                                                                    capsys):
    ckpt, out, report = tmp_path / "gan.pt", tmp_path / "samples", tmp_path / "r.json"
    state = write_gan_checkpoint(ckpt, ema=True)
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 5, "--out", out,
                "--json", report) == 0
    names, pixels, modes = _pngs(out)
    assert names == [f"{i:06d}.png" for i in range(5)]
    assert modes == {"L"} and pixels.shape == (5, 1, 28, 28)  # grey: one channel
    want = _expected(state, "ema", 5, seed=3)  # the checkpoint's seed
    assert torch.equal(pixels, want)
    assert not torch.equal(want, _expected(state, "raw", 5, seed=3))  # told apart
    assert json.loads(report.read_text()) == {
        "checkpoint": str(ckpt), "task": "gan", "weights": "ema", "seed": 3,
        "samples": {"count": 5, "dir": str(out)}}
    printed = capsys.readouterr().out
    assert "the moving average of the generator" in printed
    assert f"wrote 5 samples to {out} (000000.png to 000004.png; latents of seed 3)" in printed


def test_samples_alone_read_no_data(tmp_path, test_py):
    """A generator's --samples come from its weights and seed alone: a checkpoint whose
    MNIST is not on this machine still writes them (only --fid-samples reads the data)."""
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    state = write_gan_checkpoint(ckpt, dataset="mnist", data_dir=str(tmp_path / "gone"))
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 2, "--out", out) == 0
    assert torch.equal(_pngs(out)[1], _expected(state, "raw", 2, seed=3))
    assert not (tmp_path / "gone").exists()


def test_weights_raw_and_seed_choose_the_generator_and_its_latents(tmp_path, test_py):
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    state = write_gan_checkpoint(ckpt, ema=True)
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 3, "--out", out,
                "--weights", "raw", "--seed", 11) == 0
    assert torch.equal(_pngs(out)[1], _expected(state, "raw", 3, seed=11))
    assert not torch.equal(_expected(state, "raw", 3, seed=11),
                           _expected(state, "raw", 3, seed=3))


def test_three_channels_are_rgb_pngs(tmp_path, test_py):
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    state = write_gan_checkpoint(ckpt, image_size=32, in_channels=3)  # no EMA: raw
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 4, "--out", out) == 0
    _, pixels, modes = _pngs(out)
    assert modes == {"RGB"} and pixels.shape == (4, 3, 32, 32)
    assert torch.equal(pixels, _expected(state, "raw", 4, seed=3))


def test_the_same_command_writes_the_same_bytes(tmp_path, test_py):
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    write_gan_checkpoint(ckpt, ema=True)
    argv = ["--checkpoint", str(ckpt), "--samples", "6", "--out", str(out), "--batch-size",
            "4", "--device", "cpu", "--num-workers", "0"]
    assert test_py.main(argv) == 0
    first = snapshot(out)
    os.remove(out / "000002.png")
    proc = fork_run([sys.executable, "test.py", *argv], cwd=ROOT, capture_output=True,
                    text=True)  # the script, in a process of its own
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert snapshot(out) == first and len(first) == 6  # rewritten, no .tmp- file left


def test_older_samples_are_kept_and_named_in_a_warning(tmp_path, test_py, capsys):
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    write_gan_checkpoint(ckpt)
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 5, "--out", out) == 0
    before = snapshot(out)
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 2, "--out", out,
                "--seed", 4) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"warning: 2 file(s) in {out} held other images and were replaced "
                   f"(000000.png ...)",  # round 5's F10: never without a word
                   f"warning: {out} also holds 3 numbered PNGs that this run did not "
                   f"write (000002.png on)"]
    after = snapshot(out)
    assert after.pop("notes.txt") == b"mine"
    assert after.keys() == before.keys() and all(after[f] == before[f] for f in
                                                  ("000002.png", "000003.png", "000004.png"))
    assert after["000000.png"] != before["000000.png"]  # rewritten: other latents


def test_a_users_files_in_out_are_refused_before_anything_is_written(tmp_path, test_py,
                                                                      capsys):
    """Review 6's F15: an image of the user's and a text file named 000001.png in --out:
    one error line naming both, every byte of the folder as it was, nothing added. Its
    own earlier outputs it replaces (test_older_samples_are_kept_and_named_in_a_warning)."""
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    write_gan_checkpoint(ckpt)
    out.mkdir()
    from PIL import PngImagePlugin

    tagged = PngImagePlugin.PngInfo()  # S7-23: another tool's Software chunk is not ours
    tagged.add_text("Software", "matplotlib version3.9.0, https://matplotlib.org/")
    Image.new("RGB", (9, 9), "red").save(out / "000000.png", pnginfo=tagged)
    (out / "000001.png").write_text("my notes")
    before = snapshot(out)
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 3, "--out", out) == 2
    _one_error_line(capsys, f"--out {out}: --samples would replace 2 file(s) there that "
                            f"test.py did not write (000000.png, 000001.png)")
    assert snapshot(out) == before


def test_a_full_disk_is_one_line_and_leaves_whole_pngs(test_py, mount_tmpfs, tmp_path,
                                                       capsys):
    ckpt = tmp_path / "gan.pt"
    write_gan_checkpoint(ckpt)
    out = mount_tmpfs("size=48k") / "samples"  # a dozen 4 KiB blocks
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 40, "--out", out) == 1
    line = _one_error_line(capsys, "--out", "writing failed", "No space left on device")
    names, pixels, _ = _pngs(out)  # every file there opens: whole
    assert 0 < len(names) < 40 and not any(n.startswith(".tmp-") for n in names)
    # round 7's F13: the line says what was written, not "nothing"
    assert f"the {len(names)} file(s) before it were written whole (000000.png" in line
    assert "nothing was written" not in line


# ------------------------------------------------------------------------- FID, KID

def test_real_images_are_brought_back_to_minus_one_one(tmp_path):
    write_mnist(tmp_path)
    config = with_defaults({"dataset": "mnist", "data_dir": str(tmp_path), "seed": 0,
                            "augment": False})
    _, val = data.build_datasets(config)
    normalised = torch.stack([val[i][0] for i in range(4)])  # what the loader gives
    raw = torchvision.datasets.MNIST(tmp_path, train=False).data[:4]  # (4, 28, 28) uint8
    got = gan_metrics.to_generator_range(normalised, val.transform)
    torch.testing.assert_close(got, raw[:, None].float() / 127.5 - 1, rtol=0, atol=1e-5)
    x = torch.randn(2, 3, 8, 8)  # the synthetic set is not normalised: kept as it is
    assert torch.equal(gan_metrics.to_generator_range(x, torchvision.transforms.v2.Identity()),
                       x)


def test_fid_and_kid_on_classifier_features_against_the_real_validation_images(
        tmp_path, test_py, classifier, capsys):
    write_mnist(tmp_path / "data", test=12)
    ckpt, report = tmp_path / "gan.pt", tmp_path / "r.json"
    state = write_gan_checkpoint(ckpt, ema=True, dataset="mnist",
                                 data_dir=str(tmp_path / "data"), seed=7)
    assert _run(test_py, "--checkpoint", ckpt, "--fid-samples", 10, "--fid-features",
                classifier, "--json", report) == 0
    got = json.loads(report.read_text())
    raw = torchvision.datasets.MNIST(tmp_path / "data", train=False).data
    real = raw[:10, None].float() / 127.5 - 1  # the first 10 validation images, [-1, 1]
    want = gan_metrics.generator_scores(_generator(state, "ema"), real,
                                        gan_metrics.build_features(classifier), 10, seed=7)
    assert set(want) == {"fid_classifier", "kid_classifier", "kid_std_classifier"}
    for key, value in want.items():
        assert got[key] == pytest.approx(value, rel=1e-4), key
    assert got["fid_samples"] == 10 and got["fid_features"] == classifier
    assert "fid" not in got  # never taken for Inception's
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("fid")][0]
    assert f"fid_classifier {want['fid_classifier']:.4f}" in line
    assert "10 generated images (latents of seed 7) against the first 10 validation " \
           "images of mnist" in line and "not Inception" in line
    # --seed chooses the latents and KID's subsets of test.py's FID too (R59-14)
    assert _run(test_py, "--checkpoint", ckpt, "--fid-samples", 10, "--fid-features",
                classifier, "--json", report, "--seed", 8) == 0
    other = gan_metrics.generator_scores(_generator(state, "ema"), real,
                                         gan_metrics.build_features(classifier), 10, seed=8)
    assert other["fid_classifier"] != want["fid_classifier"]
    assert json.loads(report.read_text())["fid_classifier"] == pytest.approx(
        other["fid_classifier"], rel=1e-4)


def test_inception_without_its_file_is_one_line_before_anything_is_written(
        tmp_path, test_py, monkeypatch, capsys):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))  # empty: offline
    ckpt, out = tmp_path / "gan.pt", tmp_path / "samples"
    write_gan_checkpoint(ckpt)
    assert _run(test_py, "--checkpoint", ckpt, "--fid-samples", 4, "--samples", 2,
                "--out", out) == 2
    _one_error_line(capsys, gan_metrics.inception_weights_path(), "--fid-features")
    assert gan_metrics.inception_weights_path().startswith(str(tmp_path / "torch_home"))
    assert not out.exists()


# ------------------------------------------------------------------------- --export

def test_export_is_the_generator_latents_in_images_out(tmp_path, test_py, capsys):
    ckpt, report = tmp_path / "gan.pt", tmp_path / "r.json"
    state = write_gan_checkpoint(ckpt, ema=True, image_size=32, in_channels=3)
    latents = dcgan.fixed_latents(5, 8, seed=0)
    with torch.no_grad():
        want = _generator(state, "ema")(latents)  # (5, 3, 32, 32)
    for suffix in (".pt2", ".onnx"):
        out = tmp_path / f"generator{suffix}"
        assert _run(test_py, "--checkpoint", ckpt, "--export", out, "--json", report) == 0
        written = json.loads(report.read_text())["export"]
        assert written["file"] == str(out) and written["max_abs_diff"] <= 1e-4
        if suffix == ".pt2":
            got = torch.export.load(str(out)).module()(latents)
        else:
            import onnxruntime

            session = onnxruntime.InferenceSession(str(out),
                                                   providers=["CPUExecutionProvider"])
            assert [i.name for i in session.get_inputs()] == ["latents"]
            assert [o.name for o in session.get_outputs()] == ["images"]
            meta = session.get_modelmeta().custom_metadata_map
            assert json.loads(meta["training_config"])["task"] == "gan"
            assert meta["weights"] == "ema"
            got = torch.from_numpy(session.run(None, {"latents": latents.numpy()})[0])
        assert got.shape == (5, 3, 32, 32)
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert "exported ONNX to" in capsys.readouterr().out
    # the file holds a generator: --model says so in one line
    assert test_py.main(["--model", str(tmp_path / "generator.onnx")]) == 2
    _one_error_line(capsys, "is a gan generator (it makes images)")


def test_an_export_that_differs_from_the_generator_is_exit_1_and_not_written(
        tmp_path, test_py, monkeypatch, capsys):
    save, real_load = export.EXPORTERS[".pt2"]

    def off_by_a_bit(path, extra_files=None):
        module = real_load(path, extra_files)
        return lambda z: module(z) + 1e-2

    monkeypatch.setitem(export.EXPORTERS, ".pt2", (save, off_by_a_bit))
    ckpt, out = tmp_path / "gan.pt", tmp_path / "generator.pt2"
    write_gan_checkpoint(ckpt)
    assert _run(test_py, "--checkpoint", ckpt, "--export", out) == 1
    _one_error_line(capsys, "differ from the eager network's (max abs difference 0.01")
    assert not out.exists()


# ------------------------------------------------------------------------ refusals

@pytest.mark.parametrize("argv, match", [
    ([], ["is a GAN checkpoint: there is no accuracy to evaluate", "--samples N --out DIR"]),
    (["--json", "{tmp}/r.json"], ["there is no accuracy to evaluate"]),
    (["--samples", "2", "--out", "{tmp}/s", "--tta", "flip"], ["--tta averages a classifier"]),
    (["--export", "{tmp}/g.onnx", "--quantize", "int8"],
     ["--quantize measures a classifier's accuracy cost", "is a gan checkpoint"]),
    (["--samples", "0", "--out", "{tmp}/s"], ["--samples must be at least 1"]),
    (["--samples", str(10**13), "--out", "{tmp}/s"],
     [f"--samples {10**13}: the latents alone need", "GiB of memory available"]),
    (["--samples", "2"], ["--samples N needs --out DIR"]),
    (["--samples", "2", "--out", "{tmp}/s", "--weights", "ema"], ["has no moving average"]),
    (["--out", "{tmp}/s"], ["--out DIR is where --samples N writes"]),
    (["--fid-samples", "1"], ["--fid-samples must be at least 2"]),
    (["--fid-features", "{tmp}/c.pt"], ["--fid-features CHECKPOINT", "--fid-samples N"]),
    (["--export", "{tmp}/g.pt2", "--seed", "4"], ["--seed picks"]),
    (["--samples", "2", "--out", "{tmp}/gan.pt"], ["--out", "exists and is not a directory"]),
    (["--samples", "2", "--out", "{tmp}/gan.pt/s"], ["is a file, not a directory"]),
    (["--samples", "2", "--out", ""], ["--out needs a directory name"]),
    (["--samples", "2", "--out", "{tmp}/s", "--json", "{tmp}/s"], ["both name"]),
    (["--fid-samples", "9", "--fid-features", "{classifier}"],
     ["--fid-samples 9: the validation split of synthetic has only 8 images"]),
    (["--fid-samples", "4", "--fid-features", "{tmp}/gan.pt"],
     ["--fid-features needs a classifier's checkpoint", "--task gan"]),
])
def test_what_makes_no_sense_for_a_generator_is_one_line(argv, match, tmp_path, test_py,
                                                          classifier, capsys):
    ckpt = tmp_path / "gan.pt"
    write_gan_checkpoint(ckpt)
    argv = [a.format(tmp=tmp_path, classifier=classifier) for a in argv]
    assert _run(test_py, "--checkpoint", ckpt, *argv) == 2
    _one_error_line(capsys, *match)
    assert sorted(os.listdir(tmp_path)) == ["gan.pt"]  # nothing written


def test_gan_flags_need_a_gan_checkpoint(tmp_path, test_py, classifier, capsys):
    assert _run(test_py, "--checkpoint", classifier, "--samples", 2, "--out",
                tmp_path / "s") == 2
    _one_error_line(capsys, "--samples is for a GAN checkpoint's generator",
                    "is a classification checkpoint")
    assert _run(test_py, "--model", tmp_path / "m.pt2", "--fid-samples", 4) == 2
    _one_error_line(capsys, "--fid-samples needs --checkpoint")
    assert os.listdir(tmp_path) == []


def test_a_read_only_out_is_refused_before_loading(tmp_path, test_py, mount_tmpfs, capsys):
    ckpt = tmp_path / "gan.pt"
    write_gan_checkpoint(ckpt)
    where = mount_tmpfs("ro,size=64k")
    out = where / "samples"
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 2, "--out", out) == 2
    _one_error_line(capsys, f"--out {str(out)!r}", "Read-only file system")


def _edited(state, change):
    state = {k: v for k, v in state.items() if k != "checksum"}
    change(state)
    return state


def _nan_generator(state):
    weights = state["networks"]["generator"]
    key = next(k for k in weights if k.endswith("weight"))
    weights[key] = weights[key].clone().fill_(float("nan"))


def _classifier_format(state):  # a classifier's keys, its config saying GAN
    state.update(format=2, model={})
    del state["networks"]


@pytest.mark.parametrize("change, match", [
    (lambda s: s["networks"].pop("generator"), "its networks entry holds no generator"),
    (_nan_generator, "its generator's main.0.weight holds NaN or infinite values"),
    (lambda s: s["ema"].update(generator=[1, 2]), "its moving average of the generator is "
                                                  "a list"),
    (lambda s: s["config"].pop("latent_dim"), "its config has no latent_dim"),
    (lambda s: s["config"].update(image_size=30), "its config's image_size is 30; expected "
                                                  "one of 28, 32, 64"),
    (lambda s: s["config"].update(in_channels=2), "its config's in_channels is 2"),
    (lambda s: s["config"].update(gan_width=16), "does not fit this network"),
    (_classifier_format, "lacks 'networks' (the weights): a GAN's generator"),
])
def test_a_malformed_gan_checkpoint_is_one_line(change, match, tmp_path, test_py, capsys):
    ckpt = tmp_path / "gan.pt"
    state = write_gan_checkpoint(ckpt, ema=True)
    checkpoint.save_checkpoint(_edited(state, change), ckpt)
    assert _run(test_py, "--checkpoint", ckpt, "--samples", 2, "--out",
                tmp_path / "s") == 2
    _one_error_line(capsys, match)
    assert not (tmp_path / "s").exists()


def test_the_discriminator_sees_real_images_in_minus_one_one(tmp_path):
    """Round 5's promise 2: the training batches of a normalised set (MNIST) reach the
    discriminator in [-1, 1], the generator's range, not normalised."""
    from tasks import gan

    write_mnist(tmp_path)
    config = with_defaults({"dataset": "mnist", "data_dir": str(tmp_path), "seed": 0,
                            "augment": False})
    _, val = data.build_datasets(config)
    task = gan.GAN.__new__(gan.GAN)
    task.transform = val.transform
    x = torch.stack([val[i][0] for i in range(4)])
    real, _ = task.to_device((x, torch.zeros(4, dtype=torch.long)), torch.device("cpu"),
                             torch.contiguous_format)
    raw = torchvision.datasets.MNIST(tmp_path, train=False).data[:4]
    torch.testing.assert_close(real, raw[:, None].float() / 127.5 - 1, rtol=0, atol=1e-5)

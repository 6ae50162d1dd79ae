"""What the hf and shards sources share (pipeline/sources.py), and the promises they keep
through train.py: the same images as an ImageFolder, an hf dataset and indexed shards
train to the same weights; shards streamed from a real HTTP server resume bit for bit
after SIGKILLs, and keep every step's samples from 2 to 1 to 2 processes (the ledger);
test.py evaluates on both sources."""

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import signal
import sys

import pytest
import torch
from helpers import (
    ROOT,
    assert_states_equal,
    cached_hub_dataset,
    check_against_per_sample,
    ckpt,
    final_state,
    fork_run,
    load_test_py,
    run_as_written,
    serve,
    torchrun,
    write_sources,
)

import config as config_module
import train
from config import with_defaults
from machinery import ledger
from ops import UserError
from pipeline import data, device_data, shards, sources


class Listed(sources.EncodedImages):
    def __init__(self, encoded, labels):
        super().__init__(labels, ["a", "b"], "the list")
        self.items = encoded

    def encoded(self, index):
        return self.items[index]


def test_an_unreadable_image_wraps_around_to_the_first_readable_and_none_is_an_error(
        tmp_path, capfd):
    from PIL import Image

    Image.new("RGB", (3, 2), (9, 8, 7)).save(tmp_path / "ok.png")
    good = (tmp_path / "ok.png").read_bytes()
    listed = Listed([good, b"", b"junk"], [0, 1, 1])
    image, label = listed[2]  # the last one: the first stands in
    assert label == 0 and image.size == (3, 2) and listed.unreadable_count() == 1
    assert listed[1][1] == 0 and listed.unreadable_count() == 2
    assert capfd.readouterr().err.count("skipping unreadable image sample") == 2
    with pytest.raises(UserError, match="no image of the list can be read"):
        Listed([b"", b"x"], [0, 1])[0]


def test_the_flags_and_their_defaults():
    parsed = vars(config_module.build_parser().parse_args([]))
    assert {k: parsed[k] for k in ("train_split", "val_split", "image_column", "label_column",
                                   "val_data_dir", "shard_cache", "shuffle_buffer")} == {
        "train_split": "train", "val_split": "", "image_column": "", "label_column": "",
        "val_data_dir": "", "shard_cache": "", "shuffle_buffer": 1000}


def test_photos_are_an_image_folders_photos_from_every_source(written, tmp_path):
    """At 64 px: each image decoded to its short side as the folder's decoded cache holds
    it, then the random-resized crop (training) and the centre crop (evaluation)."""
    def built(kind):
        flags = dict(zip(*[iter(source_flags(written, kind)[2:])] * 2))
        return data.build_datasets(with_defaults({
            "dataset": source_flags(written, kind)[1], "data_dir": flags["--data-dir"],
            "val_data_dir": flags.get("--val-data-dir", ""), "image_size": 64, "seed": 4,
            "num_workers": 0, "cache_dir": str(tmp_path / "cache")}))
    folder = built("folder")
    for kind in ("saved", "shards"):
        for ours, theirs in zip(built(kind), folder):
            for key in ((0, 1), (7, 1), (3, 2)) if ours.random else (0, 3, 5):
                x, y = ours[key]
                assert x.shape == (3, 64, 64) and torch.equal(x, theirs[key][0])
                assert y == theirs[key][1]


def test_the_device_path_makes_the_per_sample_paths_batches_and_streams_stay_per_sample(
        written):
    """hf and indexed shards: decoded into memory once, the device path's batches are the
    per-sample path's, bit for bit; streamed shards (and photos) stay on the per-sample
    path, which says why."""
    for kind in ("saved", "shards"):
        flags = source_flags(written, kind)
        cfg = with_defaults({"dataset": flags[1], "data_dir": flags[3], "val_data_dir": (
            flags[5] if len(flags) > 5 else ""), "image_size": 16, "seed": 4,
            "num_workers": 0, "data_on_device": "on"})
        check_against_per_sample(cfg, print)
    streamed = shards.StreamedShards(["u"], [1], [0], ["a"], "w", 0, 1, True)
    with pytest.raises(device_data.UnsupportedOnDevice, match="StreamedShards"):
        device_data._source_kind(data.SeededDataset(streamed, None, 0, False, ["a"], 3, 16))


# ------------------------------------------------------------------ through train.py

FLAGS = ["--network", "mlp", "--image-size", "16", "--batch-size", "4", "--num-workers", "0",
         "--optimizer", "sgd", "--lr", "0.05", "--warmup-epochs", "0", "--device", "cpu",
         "--seed", "3", "--data-on-device", "off", "--log-every", "1"]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


def source_flags(written, kind, base=None):
    if kind == "folder":
        return ["--dataset", "imagefolder", "--data-dir", written["folder"]]
    if kind in ("saved", "parquet"):
        return ["--dataset", "hf", "--data-dir", written[kind]]
    train_spec, val_spec = written["train_shards"], written["val_shards"]
    if base is not None:
        train_spec = f"{base}/{os.path.basename(train_spec)}"
        val_spec = f"{base}/{os.path.basename(val_spec)}"
    return ["--dataset", "shards", "--data-dir", train_spec, "--val-data-dir", val_spec]


@pytest.mark.slow
def test_the_same_images_train_to_the_same_weights_from_every_source_and_test_py_agrees(
        written, tmp_path, capsys):
    """An ImageFolder, a save_to_disk dataset, Parquet files and local shards of the same
    images in the same order: bit-identical weights after 2 epochs with augmentation; the
    hf and shards runs resume and test.py evaluates them as the folder's."""
    test_py, reports = load_test_py(), {}
    for kind in ("folder", "saved", "parquet", "shards"):
        run = tmp_path / kind
        assert train.main([*source_flags(written, kind), *FLAGS, "--epochs", "2",
                           "--run-dir", str(run), "--ckpt-every-steps", "1",
                           "--keep-last", "20"]) == 0
        assert test_py.main(["--checkpoint", ckpt(run, "last.pt"), "--json",
                             str(tmp_path / f"{kind}.json"), "--num-workers", "0"]) == 0
        reports[kind] = json.loads((tmp_path / f"{kind}.json").read_text())
    out = capsys.readouterr().out
    assert "random access" in out
    folder = final_state(tmp_path / "folder")
    for kind in ("saved", "parquet", "shards"):
        assert_states_equal(final_state(tmp_path / kind)["model"], folder["model"])
        assert reports[kind]["loss"] == reports["folder"]["loss"], (kind, reports)
        assert reports[kind]["accuracy"] == reports["folder"]["accuracy"]
    for kind in ("saved", "shards"):  # resumed in the middle of an epoch
        resumed = tmp_path / f"{kind}-resumed"
        assert train.main([*source_flags(written, kind), *FLAGS, "--epochs", "2", "--run-dir",
                           str(resumed), "--resume", ckpt(tmp_path / kind,
                                                          "step-00000005.pt")]) == 0
        assert_states_equal(final_state(resumed)["model"], folder["model"])


KILL = """import os, signal, sys
sys.path.insert(0, {root!r})
from torch.optim.optimizer import register_optimizer_step_post_hook
import train
steps = [0]
def kill(optimizer, args, kwargs):
    steps[0] += 1
    if steps[0] == {step}:
        os.kill(os.getpid(), signal.SIGKILL)
register_optimizer_step_post_hook(kill)
sys.exit(train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_streamed_shards_resume_bit_for_bit_after_sigkills_at_random_steps(written,
                                                                            tmp_path):
    """Shards served by http.server, streamed by 2 DataLoader workers (a reader each):
    SIGKILLs at two random steps, each followed by --resume auto, end with the weights and
    the ledger of the run that never stopped."""
    rng = random.Random(os.environ.get("PYTEST_SEED", "shards"))
    steps = 12  # 3 epochs of 4 steps (15 samples, batches of 4)
    with serve(written["shards"]) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        flags = [*source_flags(written, "shards", base), *FLAGS, "--epochs", "3",
                 "--num-workers", "2", "--shuffle-buffer", "3", "--sample-ledger",
                 "--ckpt-every-steps", "1"]
        whole, killed = tmp_path / "whole", tmp_path / "killed"
        assert train.main([*flags, "--run-dir", str(whole)]) == 0
        first = rng.randrange(1, steps // 2)
        for step, resume in ((first, []), (rng.randrange(2, steps - first), ["--resume",
                                                                            "auto"])):
            script = tmp_path / f"kill{step}.py"
            script.write_text(KILL.format(root=ROOT, step=step))
            proc = fork_run([sys.executable, str(script), *flags, "--run-dir", str(killed),
                             *resume], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
            assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
            assert "streamed (the shard order and a shuffle buffer of 3" in proc.stdout
        assert train.main([*flags, "--run-dir", str(killed), "--resume", "auto"]) == 0
    assert_states_equal(final_state(killed)["model"], final_state(whole)["model"])
    assert final_state(killed)["step"] == steps
    assert ledger.main([str(killed)]) == 0
    same, lines = ledger.compare(whole, killed)
    assert same, lines


@pytest.mark.slow
def test_streamed_shards_keep_every_steps_samples_from_two_to_one_to_two_processes(
        written, tmp_path):
    """A global batch of 4: 2 processes of 2, resumed at step 2 on 1 process of 4, that
    resumed at step 5 on 2 processes again: every step trains the samples of the run that
    never stopped (the ledger), and each epoch is a permutation of the set."""
    with serve(written["shards"]) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        flags = [*source_flags(written, "shards", base), *FLAGS, "--epochs", "2",
                 "--shuffle-buffer", "3", "--sample-ledger", "--ckpt-every-steps", "1",
                 "--keep-last", "20"]
        whole, two, one, again = (tmp_path / n for n in ("whole", "two", "one", "again"))
        assert train.main([*flags, "--run-dir", str(whole)]) == 0
        torchrun([*flags, "--batch-size", "2", "--run-dir", str(two)])
        assert train.main([*flags, "--run-dir", str(one), "--resume",
                           ckpt(two, "step-00000002.pt")]) == 0
        torchrun([*flags, "--batch-size", "2", "--run-dir", str(again), "--resume",
                  ckpt(one, "step-00000005.pt")])
    for run in (two, one, again):
        same, lines = ledger.compare(whole, run)
        assert same, lines
        assert ledger.main([str(run)]) == 0
    assert ledger.step_samples(again).keys() == set(range(6, 9))
    stream = shards.stream_order([4, 4, 4, 3], 3, 0, 3)[0].tolist()  # the set's own order
    assert [ledger.step_samples(whole)[s] for s in (1, 2)] == [sorted(stream[:4]),
                                                               sorted(stream[4:8])]
    torch.testing.assert_close(final_state(again)["model"], final_state(whole)["model"])


def test_the_stream_order_does_not_depend_on_the_number_of_processes():
    """What a requeue rests on: the order is the set's, drawn from (seed, epoch) alone."""
    a = shards.stream_order([4, 4, 4, 3], 3, 1, 3)[0]
    sampler = data.EpochBatchSampler
    one = [k for b in sampler(15, 4, 3, order=lambda s, e: a) for k in b]
    two = [sampler(15, 2, 3, rank=r, world_size=2, order=lambda s, e: a) for r in (0, 1)]
    merged = [k for b0, b1 in zip(*two) for k in b0 + b1]
    assert one == merged == [(i, 0) for i in a.tolist()]


def readme_blocks():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    section = text.split("## Data where you keep it", 1)[1].split("\n## ", 1)[0]
    return [block.splitlines() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


@pytest.mark.slow
def test_the_readme_section_runs_as_written(written, tmp_path, monkeypatch, capsys):
    """From a fresh directory: the hub dataset in the cache (put there as its download
    leaves it), local shards, and the same shards served by a real HTTP server on the
    README's port; each trained, resumed and evaluated, the served run's ledger checked."""
    import datasets

    cache = str(tmp_path / "hf-cache")
    cached_hub_dataset(written["parquet"], cache, "AI-Lab-Makerere/beans")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    shutil.copytree(written["shards"], tmp_path / "shards")
    fast = ["--num-workers", "0", "--device", "cpu"]  # (appended: a small CPU)
    outputs, blocks = [], readme_blocks()
    assert len(blocks) == 3
    with contextlib.ExitStack() as stack:
        for line in (line for block in blocks for line in block):
            argv = shlex.split(line.split("  #")[0])
            if argv[:2] == ["python", "-c"]:  # the download: done above, offline
                continue
            if argv[:3] == ["python", "-m", "http.server"]:
                stack.enter_context(serve(tmp_path / argv[argv.index("--directory") + 1],
                                          port=int(argv[3])))
                continue
            extra = fast if argv[1] == "train.py" else ["--num-workers", "0"] \
                if argv[1] == "test.py" else []
            code, out, err = run_as_written([*argv, *extra], tmp_path, monkeypatch, capsys)
            assert code == 0, (line, out[-2000:], err[-2000:])
            outputs.append(out)
    assert "random access" in "".join(outputs) and "streamed (the shard order" in "".join(
        outputs)
    assert "ledger ok: 3 epoch(s), 2 start(s)" in outputs[-2]
    for run in ("beans", "shards", "served"):
        assert final_state(tmp_path / "runs" / run)["epoch"] == 3
    assert "accuracy" in outputs[-1]

"""--verify-resume (issue 38): the user's own command line stopped inside an accumulation
window, resumed in a fresh process and compared tensor by tensor with an uninterrupted run;
it names what breaks the promise (a dropout with a generator of its own, a dataset drawing
from the global RNG in a worker)."""

import json
import os

import pytest
import torch
from helpers import ROOT, fork_popen, main_in_process, seg_args, tiny_args

import train
from machinery import verify_resume

TIMEOUT = 600


@pytest.fixture
def verify(monkeypatch, capsys):
    """``verify(args, cwd=ROOT)``: train.py's ``main(ARGS --verify-resume)`` in this process,
    its three runs processes of their own, forked from a process that has imported train.py
    (``fork_popen``: the new interpreters' start is tests/test_world_sizes.py's and the
    README's test): (exit code, output)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the runs: two workers on two cores
    monkeypatch.setattr(verify_resume, "start_process", fork_popen)

    def run(args, cwd=ROOT):
        monkeypatch.chdir(cwd)
        capsys.readouterr()
        code, out, err = main_in_process(train.main, [*args, "--verify-resume",
                                                      "--verify-resume-steps", "4"], capsys)
        return code, out + err

    return run


def small(run_dir, *extra, **kwargs):
    return tiny_args(run_dir, "--virtual-batch-size", "16", *extra,
                     **{"batch": 8, "size": 48, "epochs": 2, **kwargs})


# ------------------------------------------------------------------ unit: the comparison

def test_first_difference_names_the_tensor_and_its_largest_difference():
    a = {"model": {"w": torch.zeros(3), "b": torch.ones(2)}, "step": 4,
         "rng": {"torch": torch.arange(5, dtype=torch.uint8)}}
    b = {"model": {"w": torch.tensor([0.0, 0.5, -2.0]), "b": torch.ones(2)}, "step": 4,
         "rng": {"torch": torch.arange(5, dtype=torch.uint8)}}
    path, detail = verify_resume.first_difference(a, b)
    assert path == ("model", "w") and "largest difference 2" in detail and "2 differ" in detail
    assert verify_resume.part_of(path) == "the network's weights"
    assert verify_resume.first_difference(a, a) is None
    nan = {"x": torch.tensor([float("nan"), 1.0])}
    assert verify_resume.first_difference(nan, {"x": nan["x"].clone()}) is None
    assert verify_resume.first_difference({"step": 3}, {"step": 4}) == (("step",), "3 against 4")
    assert verify_resume.first_difference({"a": 1}, {"a": 1, "b": 2})[0] == ("b",)
    path, _ = verify_resume.first_difference({"x": torch.zeros(2)}, {"x": torch.zeros(3)})
    assert path == ("x",)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16,
                                   torch.float16], ids=str)
def test_a_difference_of_one_rounding_is_not_exact(dtype):
    """Bit for bit: one element one ulp away (what another summation order gives) is a
    difference, named, not "close enough"."""
    a = torch.linspace(-3, 3, 7, dtype=dtype)
    b = a.clone()
    b[2] = torch.nextafter(b[2], torch.tensor(float("inf"), dtype=dtype))
    assert b[2] != a[2] and torch.allclose(a.double(), b.double(), rtol=1e-2)
    path, detail = verify_resume.first_difference({"w": a}, {"w": b})
    assert path == ("w",) and "element 2 of 7, 1 differ" in detail
    assert verify_resume.compare_checkpoints({"model": {"w": a}}, {"model": {"w": b}})


def test_ledgers_of_different_lengths_are_not_equal(tmp_path):
    """A resumed run that recorded fewer (or more) steps than the uninterrupted one, each
    recorded step alike, is a difference: the steps' count is said."""
    def write(run_dir, steps):
        os.makedirs(run_dir / "samples", exist_ok=True)
        lines = [{"start": 0, "epoch": 0, "seen": 0, "size": 8, "rank": 0, "world_size": 1}]
        lines += [{"step": k + 1, "epoch": 0, "seen": 2 * k + 2, "samples": [2 * k, 2 * k + 1]}
                  for k in range(steps)]
        (run_dir / "samples" / "rank0.jsonl").write_text(
            "".join(json.dumps(line) + "\n" for line in lines))
        return run_dir

    whole, fewer, more = (write(tmp_path / name, n) for name, n in
                          (("whole", 3), ("fewer", 2), ("more", 4)))
    assert verify_resume.compare_ledgers(whole, write(tmp_path / "same", 3)) is None
    assert verify_resume.compare_ledgers(whole, fewer) == (
        "the samples seen (--sample-ledger): process 0 recorded 3 steps uninterrupted, 2 "
        "resumed")
    assert "recorded 3 steps uninterrupted, 4 resumed" in verify_resume.compare_ledgers(
        whole, more)
    (fewer / "samples" / "rank0.jsonl").unlink()
    assert "recorded 3 steps uninterrupted, 0 resumed" in verify_resume.compare_ledgers(
        whole, fewer)


def test_the_config_and_checksum_are_not_state():
    a = {"model": {"w": torch.ones(1)}, "config": {"run_dir": "a"}, "checksum": 1}
    b = {"model": {"w": torch.ones(1)}, "config": {"run_dir": "b"}, "checksum": 2}
    assert verify_resume.compare_checkpoints(a, b) is None


def test_its_own_flags_and_the_run_dir_are_not_passed_on():
    argv = ["--epochs", "2", "--verify-resume", "--verify-resume-steps", "5", "--run-dir",
            "runs/mine", "--lr", "0.1", "--verify-r", "--run-dir=x", "--seed", "3"]
    assert verify_resume.strip_flags(argv) == ["--epochs", "2", "--lr", "0.1", "--seed", "3"]


def test_the_stop_point_is_drawn_from_the_seed_inside_the_window():
    points = {verify_resume.stop_point(seed, 6, 4) for seed in range(30)}
    assert all(1 <= step <= 5 and 1 <= micro <= 3 for step, micro in points)
    assert len(points) > 3
    assert verify_resume.stop_point(7, 6, 4) == verify_resume.stop_point(7, 6, 4)
    assert verify_resume.stop_point(7, 6, 1)[1] == 0


def test_on_cuda_without_deterministic_the_runs_get_it_and_a_note_says_so_first(tmp_path,
                                                                              monkeypatch):
    """Review 6's L4: on CUDA the check compares bits, which cuDNN's autotuned kernels
    break even between two uninterrupted runs; without --deterministic it used to find
    that after four runs. Now its runs get the flag, and its first line says so."""
    import tempfile

    from config import parse_config

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # (run makes its directory)
    assert verify_resume.determinism("cpu", False) == ([], None)
    assert verify_resume.determinism("cuda", True) == ([], None)
    flags, note = verify_resume.determinism("cuda", False)
    assert flags == ["--deterministic"] and note.startswith("note: --verify-resume on CUDA")
    assert verify_resume.device_type({"device": "cpu", "gpus": None}) == "cpu"
    assert verify_resume.device_type({"device": "auto", "gpus": "0"}) == "cuda"

    said, checked = [], []
    monkeypatch.setattr(verify_resume, "device_type", lambda config: "cuda")
    monkeypatch.setattr(verify_resume, "_check", lambda config, argv, *rest: (
        checked.append((list(said), argv)), 0)[1])
    argv = small(tmp_path / "mine", "--verify-resume")
    assert verify_resume.run(parse_config(argv)[0], argv, "train.py", say=said.append) == 0
    assert checked == [([note], [*argv, "--deterministic"])]  # said before any run


def test_ctrl_c_stops_the_check_and_its_child_and_removes_its_directory(tmp_path, monkeypatch,
                                                                         capsys):
    """Review 6's F9: a stop signal while a child trains ends the check at once: the child
    gets it too, the temporary directory goes, exit 130 in one line (not exit 1 blaming
    the run, after waiting for it, the directory left). The child here only sleeps."""
    import signal
    import tempfile
    import threading
    import time

    from config import parse_config
    from machinery import runtime

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where mkdtemp makes its own
    monkeypatch.setenv("PYTHONPATH", ROOT)
    started = tmp_path / "started"
    child = tmp_path / "sleeps.py"
    child.write_text(f"import pathlib, time\npathlib.Path({str(started)!r}).touch()\n"
                     f"time.sleep(20)\n")
    argv = small(tmp_path / "mine", "--verify-resume")

    def ctrl_c():  # to the process, as a terminal's is: the kernel picks the thread
        while not started.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=ctrl_c, daemon=True).start()
    stop, begun = runtime.StopRequest(), time.monotonic()
    try:
        code = verify_resume.run(parse_config(argv)[0], argv, str(child), stop=stop)
    finally:
        stop.restore()
    assert code == 130 and time.monotonic() - begun < 15  # the child stopped, not awaited
    assert capsys.readouterr().err.strip().splitlines() == [
        "SIGINT: --verify-resume interrupted: its runs are stopped and its temporary "
        "directory is removed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sleeps.py", "started"]  # no
    # verify-resume-* left, and no run directory of the user's


# -------------------------------------------------------------------- the whole check

def test_a_classifier_with_accumulation_and_workers_resumes_exactly(verify, tmp_path):
    # simple_cnn (BatchNorm), augmentation, two micro-batches a step, a DataLoader worker
    run_dir = tmp_path / "mine"
    code, out = verify(small(run_dir, "--num-workers", "1", "--data-on-device", "off",
                             network="simple_cnn", image=12))
    assert code == 0, out[-3000:]
    assert "resume exact" in out and "before micro-batch 2 of 2" in out
    assert not run_dir.exists()  # the user's run directory is never made


def test_the_device_path_with_ema_resumes_exactly(verify, tmp_path):
    code, out = verify(small(tmp_path / "mine", "--data-on-device", "on", "--ema-decay",
                             "0.9", "--mixup-alpha", "0.4"))
    assert code == 0, out[-3000:]
    assert "resume exact" in out


def test_segmentation_resumes_exactly(verify, tmp_path):
    code, out = verify(seg_args(tmp_path / "mine", "--virtual-batch-size", "8", batch=4,
                                size=16, image=16))
    assert code == 0, out[-3000:]
    assert "resume exact" in out


def test_a_gan_resumes_exactly(verify, tmp_path):
    # two phases (the discriminator's twice: --d-steps 2), each over two micro-batches
    code, out = verify(tiny_args(tmp_path / "mine", "--task", "gan", "--fid-samples", "0",
                                 "--gan-width", "4", "--latent-dim", "4", "--d-steps", "2",
                                 "--virtual-batch-size", "16", "--optimizer", "adam",
                                 "--lr", "1e-3", network="dcgan", batch=8, size=48, image=28,
                                 epochs=2))
    assert code == 0, out[-3000:]
    assert "resume exact" in out


def test_a_diffusion_model_resumes_exactly(verify, tmp_path):
    # one network drawing its noise and timesteps from the step's ``where``, accumulated
    code, out = verify(["--task", "diffusion", "--dataset", "synthetic", "--synthetic-size",
                        "48", "--image-size", "16", "--diffusion-width", "8",
                        "--diffusion-steps", "50", "--epochs", "2", "--batch-size", "8",
                        "--virtual-batch-size", "16", "--ema-decay", "0.9", "--num-workers",
                        "0", "--device", "cpu", "--fid-samples", "0", "--run-dir",
                        str(tmp_path / "mine")])
    assert code == 0, out[-3000:]
    assert "resume exact" in out and "the EMA weights" in out


# Under torchrun: tests/test_world_sizes.py (3 processes, each with a DataLoader worker).


# ------------------------------------------------------- what breaks the promise, named

OWN_DROPOUT = '''
import torch
from tasks.classification import Classification


class OwnDropout(torch.nn.Module):
    """Dropout drawing from a generator of its own: unseeded, and not in any checkpoint."""

    def __init__(self, p):
        super().__init__()
        self.p, self.generator = p, torch.Generator()

    def forward(self, x):
        if not self.training:
            return x
        keep = torch.rand(x.shape, generator=self.generator) >= self.p
        return x * keep / (1 - self.p)


class DropoutTask(Classification):
    @classmethod
    def build_networks(cls, config, dataset):
        return torch.nn.Sequential(OwnDropout(0.3), super().build_networks(config, dataset))
'''

NOISY_DATA = '''
import torch
from tasks.classification import Classification


class Noisy(torch.utils.data.Dataset):
    """Each image with noise drawn from torch's global RNG in __getitem__."""

    def __init__(self, base):
        self.base = base

    def __len__(self):
        return len(self.base)

    def __getitem__(self, index):
        image, label = self.base[index]
        return image + 0.1 * torch.rand(image.shape), label


class NoisyTask(Classification):
    @classmethod
    def datasets(cls, config, log, should_stop=None):
        train_set, val_set = super().datasets(config, log, should_stop)
        train_set.base = Noisy(train_set.base)
        return train_set, val_set
'''


def test_a_dropout_with_a_generator_of_its_own_is_named(verify, tmp_path):
    (tmp_path / "dropout_task.py").write_text(OWN_DROPOUT)
    code, out = verify(small(tmp_path / "mine", "--task", "dropout_task.py:DropoutTask",
                             "--no-augment"), cwd=tmp_path)
    assert code == 1, out[-3000:]
    error = [line for line in out.splitlines() if line.startswith("error:")][-1]
    assert "resume differs at step 4" in error and "(the network's weights)" in error
    assert "largest difference" in error
    assert "same batches and ended with other weights" in error
    assert "generator of its own" in error
    assert "two uninterrupted runs differ" not in error  # it is the resume's doing


def test_a_dataset_drawing_from_the_global_rng_in_a_worker_is_named(verify, tmp_path):
    (tmp_path / "noisy_task.py").write_text(NOISY_DATA)
    code, out = verify(small(tmp_path / "mine", "--task", "noisy_task.py:NoisyTask",
                             "--no-augment", "--num-workers", "1", "--data-on-device", "off"),
                       cwd=tmp_path)
    assert code == 1, out[-3000:]
    error = [line for line in out.splitlines() if line.startswith("error:")][-1]
    assert "resume differs at step 4" in error and "the batches differ" in error
    assert "__getitem__" in error

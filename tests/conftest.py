"""pytest's side of the tests: fixtures, hooks and the session's settings, nothing else.

The rule: this file holds only what pytest itself calls, fixtures (``train_main``,
``trained_run``, ``mount_tmpfs``, ``fake_hub``, ``scontrol``) and hooks (the quick half's
``slow`` marks below), plus the settings every test process needs before torch loads.
Plain functions, classes and constants shared by test modules (tiny_args, read_metrics,
final_state, write_image_folder, torchrun...) live in tests/helpers.py; test modules import
them with ``from helpers import ...``, never from this file.

tests/ follows the code's layout: tests/machinery/, tests/pipeline/, tests/reporting/ and
tests/tasks/ test those packages, tests/ itself the top-level modules (train.py, test.py,
config.py, export.py, ...). Test files need unique basenames (there is no __init__.py:
pytest imports each module by its basename, and QUICK_MODULES below names them so).
"""

import hashlib
import os
import shutil
import subprocess

# Idle OpenMP threads spin briefly, then sleep (set before torch loads libgomp, inherited by
# every train.py, torchrun and bench process the tests start). On 2 cores shared with other
# processes (torchrun's and the DataLoader's workers, other jobs), libgomp's default spin
# (300,000 rounds) holds the core the computing thread needs: a tiny run took 10-30x longer,
# at random. 1000 rounds cost nothing on an idle machine (OMP_WAIT_POLICY=passive, no spin,
# made a small unet's runs 1.7x slower). The numbers computed do not change.
os.environ.setdefault("GOMP_SPINCOUNT", "1000")
# One thread a process, here and in every process the tests start (a test that is about
# threads sets its own): the suite runs two workers on two cores, each starting processes
# of its own, and the tiny tensors here gain nothing from a second thread. Two threads a
# worker were four on two cores, each waiting on a sibling the scheduler had parked: one
# test file took 162 s with two threads a process, 37 s with one (side by side, a loaded
# machine), and half the CPU time.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest
import torch
from helpers import tiny_args

# Fixed for reproducibility (the runs in this process and those it starts agree).
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


# The quick half of the suite (`python -m pytest -m "not slow"`): modules of unit tests on
# small tensors and files. Every other module trains through train.py, starts processes
# (torchrun, subprocesses) or waits for signals, and is marked slow.
QUICK_MODULES = {"test_config", "test_layers", "test_losses", "test_ops_blocks", "test_files",
                 "test_runtime", "test_runlog", "test_data", "test_seg_parts",
                 "test_segmentation_data", "test_docs_blocks", "test_optional_imports",
                 "test_gan_parts", "test_checkpoint", "test_cuda", "test_layout",
                 "test_meters"}


# The modules that take longest (process launches: --verify-resume's runs, gpu.sh's smoke
# profile, torchrun), handed to the workers first (pytest-xdist's --dist loadscope sends
# a module's tests to one worker, in this order), so that none is left to run alone at the
# end while the other worker idles. Only the order of the work depends on this list.
FIRST = ("test_verify_resume", "test_bench", "test_distributed", "test_restarts",
         "test_world_sizes", "test_cluster", "test_ledger", "test_user_task", "test_gan",
         "test_watchdog", "test_preflight", "test_diffusion", "test_mlflow", "test_looking")


def pytest_collection_modifyitems(items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] not in QUICK_MODULES:
            item.add_marker(pytest.mark.slow)
    rank = {name: i for i, name in enumerate(FIRST)}
    items.sort(key=lambda item: rank.get(item.module.__name__.rsplit(".", 1)[-1], len(FIRST)))


@pytest.fixture
def train_main():
    import train
    return train.main


@pytest.fixture
def mount_tmpfs(tmp_path):
    """``mount_tmpfs(options, where=None)``: mounts a real tmpfs (``size=256k``, ``ro``...)
    at ``where`` (default: a new directory in tmp_path) and returns it; unmounted after
    the test. Skipped where mounting is not permitted (not root, no CAP_SYS_ADMIN)."""
    mounted = []

    def mount(options, where=None):
        if os.name != "posix" or not shutil.which("mount"):
            pytest.skip("needs mount(8)")
        where = where or tmp_path / f"mnt{len(mounted)}"
        where.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounted.append(where)
        return where

    yield mount
    for where in reversed(mounted):
        if subprocess.run(["umount", str(where)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True)


@pytest.fixture(scope="session")
def trained_run(tmp_path_factory):
    """``trained_run(*flags, **tiny_args_kwargs)``: the run directory of a finished tiny
    training (``tiny_args``), trained once per session for each set of arguments and
    shared by the test files that evaluate or export it (do not change its files)."""
    import train

    runs = {}

    def run(*extra, **kwargs):
        key = (extra, tuple(sorted(kwargs.items())))
        if key not in runs:
            run_dir = tmp_path_factory.mktemp("trained")
            assert train.main(tiny_args(run_dir, *extra, **kwargs)) == 0
            runs[key] = run_dir
        return runs[key]

    return run


@pytest.fixture
def fake_hub(tmp_path, monkeypatch):
    """torchvision's mobilenet_v3_small weights served from a local file (a real download
    through torch.hub, hash-checked): random weights, a name with their hash."""
    import torchvision

    weights = torchvision.models.MobileNet_V3_Small_Weights.IMAGENET1K_V1
    torch.manual_seed(0)
    state = torchvision.models.mobilenet_v3_small().state_dict()
    served = tmp_path / "served"
    served.mkdir()
    blob = served / "blob.pth"
    torch.save(state, blob)
    digest = hashlib.sha256(blob.read_bytes()).hexdigest()[:8]
    named = served / f"mobilenet_v3_small-{digest}.pth"
    os.replace(blob, named)
    monkeypatch.setattr(weights.value, "url", named.as_uri())
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch_home"))
    return weights, state, tmp_path / "torch_home" / "hub" / "checkpoints" / named.name


@pytest.fixture
def scontrol(tmp_path, monkeypatch):
    """A stand-in scontrol on PATH that writes down its arguments."""
    shim, log = tmp_path / "bin", tmp_path / "scontrol.log"
    shim.mkdir()
    (shim / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    (shim / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}{os.pathsep}{os.environ['PATH']}")
    return log

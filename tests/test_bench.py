"""Every benchmark runs, with its smallest settings, so that none can rot unseen.

The figures they print are not checked (a test never asserts a time); that each script
runs to its end, prints its table and leaves nothing in the repository is.
"""

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from helpers import ROOT, fork_run, python_client

# script -> (smallest arguments, a line of its output that says it got to its figures)
SMALLEST = {
    "checkpoint.py": (["--network", "mlp", "--repeats", "1", "--steps", "2", "--batch-size",
                       "8", "--epoch-samples", "256", "--epoch-batch", "32", "--every", "2",
                       "--device", "cpu"], "save, total"),
    "data.py": (["--samples", "256", "--batch-size", "64", "--workers", "0", "--repeats",
                 "1"], "first batch identical on every path: yes"),
    "distributed.py": (["--network", "mlp", "--size", "64", "--batch", "32", "--epochs", "1",
                        "--repeats", "1"], "scaling efficiency"),
    "identity.py": (["--base", "HEAD", "--recipes", "adam-clip"],
                    "1 of 1 recipes equal to HEAD"),
    "export.py": (["--networks", "simple_cnn", "--samples", "64", "--steps", "2",
                   "--calibration-samples", "8", "--batches", "1", "--seconds", "0.01"],
                  "| simple_cnn | int8 .onnx |"),
    "overhead.py": (["--network", "mlp", "--image-size", "8", "--batch-size", "16", "--steps",
                     "4", "--chunk", "2", "--repeats", "1", "--warmup", "1", "--prefetch",
                     "0,2"], "engine --prefetch 2"),
    "preflight.py": (["--repeats", "1", "--", "--network", "mlp", "--synthetic-size", "64",
                      "--image-size", "8", "--batch-size", "16"], "median of 1: plain"),
    "precision.py": (["--device", "cpu", "--network", "mlp", "--batch-size", "4",
                      "--image-size", "8", "--steps", "2", "--warmup", "1", "--repeats", "1",
                      "--compile", "off", "--amp", "fp32,bf16"], "bf16"),
    "prefetch.py": (["--device", "cpu", "--network", "mlp", "--batch-size", "16", "--steps",
                     "4", "--repeats", "1", "--warmup", "1", "--workers", "0", "--prefetch",
                     "0"], "recommendation:"),
    "recipes.py": (["--network", "mlp", "--batch-size", "16", "--steps", "2", "--chunk", "1",
                    "--repeats", "1", "--samples", "16"], "+ random_erase 1"),
    "segmentation.py": (["--samples", "16", "--size", "32", "--crop-size", "24", "--epochs",
                         "1", "--batch-size", "8", "--workers", "0"], "plain     "),
    "sweep.py": (["--trials", "1", "--epochs", "1", "--synthetic-size", "64"],
                 "median pruning trained"),
    "shards.py": (["--images", "16", "--per-shard", "8", "--buffer", "4", "--repeats", "1"],
                  "http   ours (streamed)"),
    "train_paths.py": (["--images", "40", "--batch-size", "16", "--workers", "0", "--repeats",
                        "1"], "device path / per-sample path:"),
    "timm_peer.py": (["--timm-train", "no-such-file.py", "--model", "test_resnet",
                      "--classes", "2", "--per-class", "4", "--val-per-class", "2", "--epochs",
                      "1", "--batch-size", "4", "--repeats", "1"], "figure: train.py training"),
}
WRITES_INTO = {"checkpoint.py": "--dir", "export.py": "--dir", "identity.py": "--dir",
               "segmentation.py": "--dir", "sweep.py": "--dir"}
# The scripts gpu.sh's smoke profile runs (at its own smallest settings): its test below
# checks each one's figures, so they are not run a second time here.
IN_GPU_SH_SMOKE = {"gan.py": "gan.train_py.steps_per_s", "diffusion.py":
                   "diffusion.train_py.steps_per_s", "pix2pix.py": "pix2pix.train_py.steps_per_s",
                   "photos.py": "photos.64.device.images_per_s",
                   "detection.py": "detection.train_py.samples_per_s",
                   "lightning.py": "lightning.mlp.train_py.samples_per_s"}


def test_every_bench_script_has_a_smallest_run():
    scripts = {name for name in os.listdir(os.path.join(ROOT, "bench"))
               if name.endswith(".py") and name != "common.py"}
    assert scripts == set(SMALLEST) | set(IN_GPU_SH_SMOKE)
    assert not set(SMALLEST) & set(IN_GPU_SH_SMOKE)


@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_bench_runs_with_its_smallest_settings(script, tmp_path):
    # Each script a fork of a process that has imported train.py and torch (``fork_run``),
    # as `python bench/NAME.py ARGS` (its folder first on the path, its own argv and
    # streams): not 3 s of CPU a script to start an interpreter.
    args, shows = SMALLEST[script]
    if script in WRITES_INTO:
        args = [*args, WRITES_INTO[script], str(tmp_path)]
    before = set(os.listdir(ROOT))
    env = dict(os.environ)  # (one thread a process: tests/conftest.py)
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    out = fork_run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT, env=env,
                   capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert shows in out.stdout, out.stdout[-2000:]
    assert "Traceback" not in out.stderr
    assert set(os.listdir(ROOT)) - before == set()  # nothing left in the repository


def test_gpu_script_is_valid_bash_and_names_every_bench():
    path = os.path.join(ROOT, "bench", "gpu.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    text = open(path).read()
    missing = [s for s in SMALLEST if f"bench/{s}" not in text
               and s not in ("distributed.py", "identity.py", "preflight.py",
                             "timm_peer.py", "shards.py", "sweep.py")]  # CPU checks
    assert missing == []
    # One interpreter throughout: no command calls python or python3 by name.
    bare = [line for line in text.splitlines() if not line.lstrip().startswith("#")
            and re.search(r"(^|[\s;|&(])python3?\s", line)]
    assert bare == []
    # Its CUDA tests run in one process, without the suite's workers (addopts "-n 2"): the
    # borrowed GPU's image has no pytest-xdist, and with the addopts pytest would refuse -n.
    pytest_calls = [line for line in text.splitlines() if '-m pytest' in line]
    assert pytest_calls and all("-o addopts=" in line for line in pytest_calls)
    # Every test file it names (in its commands and its comments) exists: tests/ follows the
    # code's layout (tests/pipeline/...), and a moved file must not leave gpu.sh running none.
    named = set(re.findall(r"tests/(?:[a-z_]+/)*test_[a-z0-9_]+\.py", text))
    assert "tests/test_cuda.py" in named
    assert sorted(p for p in named if not os.path.isfile(os.path.join(ROOT, p))) == []


# What gpu.sh calls besides $PYTHON: a PATH of these alone has no python in it.
TOOLS = ["bash", "mkdir", "dirname", "mktemp", "touch", "timeout", "tee", "grep", "awk",
         "sed", "rm", "cat", "tail", "sleep", "env", "sh", "ls", "uname"]


def _gpu_sh(tmp_path, python=sys.executable, **env_extra):
    """Runs bench/gpu.sh's smoke profile with PATH holding TOOLS only (no python) and
    $OUT in ``tmp_path/out``; returns ``(completed process, seconds)``."""
    tools = tmp_path / "tools"
    tools.mkdir(exist_ok=True)
    for name in TOOLS:
        found = shutil.which(name)
        if found and not (tools / name).exists():
            (tools / name).symlink_to(found)
    assert shutil.which("python", path=str(tools)) is None
    env = {**os.environ, "GPU_SH_SMOKE": "1", "PATH": str(tools),
           "PYTHON": str(python), "OUT": str(tmp_path / "out"), **env_extra}
    for name in ("GPU_SH_FULL", "GPU_SH_SKIP", "GPU_SH_BUDGET", "RANK", "WORLD_SIZE"):
        if name not in env_extra:
            env.pop(name, None)
    start = time.monotonic()
    out = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    return out, time.monotonic() - start


def _shim(tmp_path, body):
    """A $PYTHON that runs ``body`` (sh) first, then python: a fork of a process that has
    imported train.py (``python_client``): gpu.sh's thirty-odd runs do not each spend 3.3 s
    of CPU starting an interpreter (gpu.sh's commands, arguments and streams are the same)."""
    python = python_client(tmp_path / "python")
    shim = tmp_path / "python-shim"
    shim.write_text(f"#!/bin/sh\n{body}\nexec {python} \"$@\"\n")
    shim.chmod(0o755)
    return shim


def test_gpu_script_smoke_writes_its_log_and_figures_under_out(tmp_path):
    # The whole smoke profile (the CPU, smallest settings) without python on PATH: every
    # command goes through $PYTHON. Slow (every check is a process that imports torch) and
    # worth it: this is the only run of the script before a GPU is borrowed. One check
    # fails (a $PYTHON that fails the segmentation run): said, and every other check runs.
    before = set(os.listdir(ROOT))
    shim = _shim(tmp_path, 'case "$*" in *train.py*/segmentation) exit 3;; esac')
    out, _ = _gpu_sh(tmp_path, shim)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    assert "FAILED: segmentation (exit status 3)" in out.stdout
    assert out.stdout.rstrip().endswith("gpu.sh: some checks FAILED")
    log = (tmp_path / "out" / "gpu-sh.log").read_text()
    assert log == out.stdout + out.stderr  # the whole log, as it scrolled by
    result = json.loads((tmp_path / "out" / "gpu-figures.json").read_text())
    assert result["profile"] == "smoke" and result["status"] == "failed"
    assert result["failed"] == ["segmentation (exit status 3)"] and result["skipped"] == [
        "compile (the smoke profile: torch.compile on a CPU takes minutes)"]
    figures = result["figures"]  # the rest ran
    for key in ("mlp.device.bf16", "mlp.loader.bf16", "simple_cnn.device.bf16",
                "simple_cnn.device.none"):
        assert figures[f"{key}.samples_per_s"]["value"] > 0
        assert 0 < figures[f"{key}.compute_efficiency"]["value"] <= 1
    assert figures["simple_cnn.bf16_over_fp32"]["value"] > 0
    assert figures["photos.64.device.images_per_s"]["value"] > 0
    assert figures["lightning.mlp.train_py.samples_per_s"]["value"] > 0
    assert figures["gan.train_py.steps_per_s"]["value"] > 0  # train.py's DCGAN, and ...
    assert figures["gan.plain.steps_per_s"]["value"] > 0     # ... the example's loop
    assert figures["diffusion.train_py.steps_per_s"]["value"] > 0  # train.py's DDPM, and
    assert figures["diffusion.plain.steps_per_s"]["value"] > 0     # the diffusers-shaped loop
    assert figures["pix2pix.plain.steps_per_s"]["value"] > 0  # the reference's loop
    assert figures["detection.plain.samples_per_s"]["value"] > 0  # torchvision's reference
    for script, figure in IN_GPU_SH_SMOKE.items():  # each bench run here, not on its own
        assert figures[figure]["value"] > 0, script
        assert f"bench/{script}" in log
    assert figures["tests.passed"]["value"] >= 1  # the CUDA cases' CPU part
    assert figures["env.torch"]["value"].startswith(torch.__version__)
    lines = [line for line in log.splitlines() if line.startswith("figure: ")]
    assert {line.split()[1] for line in lines} == set(figures)  # each figure is a line
    assert result["goals"]["resnet9.device.bf16.samples_per_s"]["met"] is None
    assert set(os.listdir(ROOT)) - before == set()  # nothing left in the repository


def test_gpu_script_cuts_a_hanging_check_and_keeps_to_its_budget(tmp_path):
    # Every train.py run hangs. Each is cut at its own limit (2 s here) and the next runs.
    shim = _shim(tmp_path, 'case "$*" in *train.py*) exec sleep 120;; esac')
    skip = ("imports tests photos lightning resnet18-bf16 resnet18-fp32 segmentation gan "
            "diffusion pix2pix detection")
    out, seconds = _gpu_sh(tmp_path, shim, GPU_SH_T_TRAIN="2", GPU_SH_SKIP=skip)
    assert out.returncode == 1, out.stdout[-3000:]
    result = json.loads((tmp_path / "out" / "gpu-figures.json").read_text())
    assert result["failed"] == ["resnet9-device: cut by its time limit of 2 s",
                                "resnet9-loader: cut by its time limit of 2 s"]
    assert seconds < 60  # not the 120 s the runs would have hung
    # Within a budget of 6 s (each check's limit 300 s here), the first run is cut at what
    # is left of it, and the next one, with under GPU_SH_MIN_LEFT (3 s) left, never starts.
    out, seconds = _gpu_sh(tmp_path, shim, GPU_SH_BUDGET="6", GPU_SH_MIN_LEFT="3",
                           GPU_SH_SKIP=skip)
    assert out.returncode == 1, out.stdout[-3000:]
    assert re.search(r"FAILED: resnet9-device: cut by its time limit of [3-6] s", out.stdout)
    assert "SKIPPED: resnet9-loader (the 6 s budget is spent)" in out.stdout
    assert seconds < 30


@pytest.mark.slow
def test_gpu_script_says_what_detection_lacks_before_it_runs_it(tmp_path):
    """The CUDA review's N-M2: an interpreter without pycocotools (the lent GPU's image):
    the imports check names it, detection's step rate is one FAILED line at once and is
    not started (it trained 30-45 s and died without a figure)."""
    blocker = tmp_path / "blocker" / "pycocotools"
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('not on this image')\n")
    shim = tmp_path / "python-shim"
    shim.write_text(f"#!/bin/sh\nPYTHONPATH={blocker.parent} exec {sys.executable} \"$@\"\n")
    shim.chmod(0o755)
    skip = ("tests photos lightning resnet9-device resnet18-bf16 resnet18-fp32 segmentation "
            "gan diffusion pix2pix resnet9-loader")
    out, _ = _gpu_sh(tmp_path, shim, GPU_SH_SKIP=skip)
    assert out.returncode == 1, out.stdout[-3000:]
    result = json.loads((tmp_path / "out" / "gpu-figures.json").read_text())
    assert result["failed"] == [
        "detection: pycocotools (detection's mAP (torchmetrics' MeanAveragePrecision "
        "backend)) cannot be imported: its step rate is not run (carry the wheel: README.md, "
        "'On a borrowed GPU')"]
    assert result["figures"]["env.missing_for_detection"]["value"] == "pycocotools"
    assert "bench/detection.py" not in out.stdout  # not started


def _bench_module(name, monkeypatch):
    """Imports bench/NAME.py as a module, its folder last on the path (for ``common``:
    first, bench/data.py would hide the repository's data.py)."""
    monkeypatch.setattr(sys, "path", [*sys.path, os.path.join(ROOT, "bench")])
    spec = importlib.util.spec_from_file_location(f"bench_{name}",
                                                  os.path.join(ROOT, "bench", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_precision_bench_uses_train_pys_optimizer_and_bf16_check(monkeypatch):
    precision = _bench_module("precision", monkeypatch)
    net = torch.nn.Linear(4, 2)
    cpu = torch.device("cpu")
    # train.py fuses SGD under fp16 (GradScaler reads no flag back then); so does the bench
    assert precision.make_loop(cpu, "fp16", net)[1].defaults["fused"] is True
    assert not precision.make_loop(cpu, "fp32", net)[1].defaults["fused"]
    # bf16 on a GPU before compute capability 8.0: refused as train.py refuses it, even
    # where torch.cuda.is_bf16_supported() says yes (it counts emulated bf16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    problem = precision.amp_problem(torch.device("cuda"), "bf16")
    assert problem and "has no native bfloat16" in problem


def test_overhead_bench_bare_loop_uses_the_engines_sgd_implementation(monkeypatch):
    overhead = _bench_module("overhead", monkeypatch)
    engine_sgd = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=0.1, fused=True)
    bare = overhead.make_optimizer(torch.nn.Linear(4, 2), engine_sgd)
    assert bare.defaults["fused"] is True and bare.defaults["nesterov"] is True

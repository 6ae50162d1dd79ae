"""Every benchmark runs, with its smallest settings, so that none can rot unseen.

The figures they print are not checked (a test never asserts a time); that each script
runs to its end, prints its table and leaves nothing in the repository is.
"""

import os
import subprocess
import sys

import pytest
from conftest import ROOT

# script -> (smallest arguments, a line of its output that says it got to its figures)
SMALLEST = {
    "checkpoint.py": (["--network", "mlp", "--repeats", "1", "--steps", "2", "--batch-size",
                       "8", "--epoch-samples", "256", "--epoch-batch", "32", "--every", "2",
                       "--device", "cpu"], "save, total"),
    "data.py": (["--samples", "256", "--batch-size", "64", "--workers", "0", "--repeats",
                 "1"], "first batch identical on every path: yes"),
    "distributed.py": (["--network", "mlp", "--size", "64", "--batch", "32", "--epochs", "1",
                        "--repeats", "1"], "scaling efficiency"),
    "export.py": (["--networks", "simple_cnn", "--samples", "64", "--steps", "2",
                   "--calibration-samples", "8", "--batches", "1", "--seconds", "0.01"],
                  "| simple_cnn | int8 .onnx |"),
    "overhead.py": (["--network", "mlp", "--image-size", "8", "--batch-size", "16", "--steps",
                     "4", "--chunk", "2", "--repeats", "1", "--warmup", "1", "--prefetch",
                     "0,2"], "engine --prefetch 2"),
    "photos.py": (["--images", "2", "--sizes", "1mp", "--image-size", "64", "--workers", "0",
                   "--finetune-steps", "2", "--repeats", "1"], "targets, per core: first pass"),
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
    "train_paths.py": (["--images", "40", "--batch-size", "16", "--workers", "0", "--repeats",
                        "1"], "device path / per-sample path:"),
}
WRITES_INTO = {"checkpoint.py": "--dir", "export.py": "--dir", "photos.py": "--dir",
               "segmentation.py": "--dir"}


def test_every_bench_script_has_a_smallest_run():
    scripts = {name for name in os.listdir(os.path.join(ROOT, "bench"))
               if name.endswith(".py") and name != "common.py"}
    assert scripts == set(SMALLEST)


@pytest.mark.parametrize("script", sorted(SMALLEST))
def test_bench_runs_with_its_smallest_settings(script, tmp_path):
    args, shows = SMALLEST[script]
    if script in WRITES_INTO:
        args = [*args, WRITES_INTO[script], str(tmp_path)]
    before = set(os.listdir(ROOT))
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None), env.pop("LOCAL_RANK", None)
    out = subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert shows in out.stdout, out.stdout[-2000:]
    assert "Traceback" not in out.stderr
    assert set(os.listdir(ROOT)) - before == set()  # nothing left in the repository


def test_gpu_script_is_valid_bash_and_names_every_bench():
    path = os.path.join(ROOT, "bench", "gpu.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    text = open(path).read()
    missing = [s for s in SMALLEST if f"bench/{s}" not in text and s != "distributed.py"]
    assert missing == []


def _gpu_sh(env_extra, tmp_path):
    env = {**os.environ, "GPU_SH_SMOKE": "1", "OMP_NUM_THREADS": "2", **env_extra}
    return subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def test_gpu_script_prints_a_line_per_figure_and_exits_0(tmp_path):
    out = _gpu_sh({}, tmp_path)  # its smallest settings, on the CPU
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    figures = [line for line in out.stdout.splitlines() if line.startswith("figure: train.py")]
    assert len(figures) == 2 and all("samples/s, efficiency" in f for f in figures), figures
    assert "FAILED" not in out.stdout and out.stdout.rstrip().endswith("every check passed")


def test_gpu_script_exits_1_when_a_check_fails(tmp_path):
    # A python that fails whenever it runs train.py: the script says so and goes on.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "python").write_text(f"#!/bin/sh\ncase \"$*\" in *train.py*) exit 3;; esac\n"
                                 f"exec {sys.executable} \"$@\"\n")
    (shim / "python").chmod(0o755)
    out = _gpu_sh({"PATH": f"{shim}{os.pathsep}{os.environ['PATH']}"}, tmp_path)
    assert out.returncode == 1
    assert out.stdout.count("FAILED: train.py simple_cnn") == 2
    assert "first batch identical on every path: yes" in out.stdout  # the rest still ran

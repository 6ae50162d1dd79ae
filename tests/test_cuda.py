"""The CUDA paths, run where a GPU is present (skipped on CPU-only machines)."""

import json

import pytest
import torch
from conftest import final_state, tiny_args

import train

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def cuda_args(run_dir, *extra):
    args = tiny_args(run_dir, *extra, network="simple_cnn", size=256, image=16, epochs=2)
    args[args.index("--device") + 1] = "cuda"
    return args


@pytest.mark.parametrize("flags", [
    ("--amp", "fp16"),
    ("--amp", "bf16", "--channels-last"),
    ("--grad-checkpointing", "--num-workers", "2", "--prefetch", "2"),
    ("--compile",),
])
def test_cuda_training_paths(tmp_path, flags):
    assert train.main(cuda_args(tmp_path, *flags)) == 0
    records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert all(r["train_loss"] == r["train_loss"] for r in records)  # not NaN
    assert len(records) == 2 and 0 < records[-1]["compute_efficiency"] <= 1
    state = final_state(tmp_path)
    assert all(t.device.type == "cpu" for t in state["model"].values())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])


def test_fp16_scaler_state_resumes_on_cuda(tmp_path):
    assert train.main(cuda_args(tmp_path, "--amp", "fp16")) == 0
    scale = final_state(tmp_path)["scaler"]["scale"]
    assert train.main(cuda_args(tmp_path, "--amp", "fp16", "--resume", "auto",
                                "--epochs", "3")) == 0
    assert final_state(tmp_path)["epoch"] == 3 and scale > 0


def test_mfu_reported_on_a_known_gpu(tmp_path):
    if train.ops.peak_tflops(torch.cuda.get_device_name(), True) is None:
        pytest.skip(f"no datasheet peak for {torch.cuda.get_device_name()}")
    assert train.main(cuda_args(tmp_path, "--amp", "bf16")) == 0
    record = json.loads(open(tmp_path / "metrics.jsonl").readlines()[-1])
    assert 0 < record["mfu"] < 1 and record["tflops"] > 0

"""runtime.py: which device a process takes, and what a CUDA device can do (checked on any
machine: the CUDA queries are stood in for)."""

import pytest
import torch

from machinery import hardware, runtime
from ops import UserError


@pytest.fixture
def four_gpus(monkeypatch):
    """A machine with four CUDA GPUs, as far as runtime.py asks; records set_device."""
    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(device))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    return chosen


def config(device="auto", gpus=None):
    return {"device": device, "gpus": gpus}


@pytest.mark.parametrize("flags, expected", [
    (config("cuda:2"), torch.device("cuda", 2)),
    (config("cuda"), torch.device("cuda", 0)),
    (config("auto"), torch.device("cuda", 0)),
    (config("auto", gpus="3,1"), torch.device("cuda", 3)),  # DataParallel's first GPU
])
def test_the_training_gpu_becomes_the_current_device(four_gpus, flags, expected):
    procs = runtime.setup_processes(flags)
    assert procs.device == expected
    assert four_gpus == [expected]  # events, pinned memory and kernels follow it


def test_the_cpu_selects_no_gpu(four_gpus):
    assert runtime.setup_processes(config("cpu")).device == torch.device("cpu")
    assert four_gpus == []


def test_more_processes_than_gpus_is_one_error_line(four_gpus, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "6")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    with pytest.raises(UserError, match=r"process 5 is local rank 5 of its machine, which "
                       r"has 4 GPU\(s\): start at most 4 processes per machine \(torchrun "
                       r"--nproc_per_node 4\), or train on CPU processes with --device cpu"):
        runtime.setup_processes(config())
    assert four_gpus == []  # refused before touching any GPU


@pytest.mark.parametrize("capability, native", [
    ((7, 0), False), ((7, 5), False), ((8, 0), True), ((8, 6), True), ((9, 0), True),
    ((12, 0), True)])
def test_bfloat16_counts_only_where_the_gpu_computes_it(capability, native):
    assert hardware.native_bf16(capability) is native  # V100 7.0 and T4 7.5 emulate it


def test_amp_bf16_asks_the_training_gpu_not_the_current_one(four_gpus, monkeypatch):
    asked = []

    def capability(device=None):
        asked.append(device)
        return (8, 0) if torch.device(device).index == 1 else (7, 0)

    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla V100")
    with pytest.raises(UserError, match="--amp bf16: Tesla V100 has no native bfloat16"):
        hardware.amp_dtype("bf16", torch.device("cuda", 0))
    assert asked == [torch.device("cuda", 0)]
    assert hardware.amp_dtype("fp16", torch.device("cuda", 0)) == torch.float16  # not asked
    assert asked == [torch.device("cuda", 0)]


def test_settling_the_buckets_keeps_a_networks_own_forward(tmp_path):
    """CUDA review 7's N-L2: DDP's buckets are settled by replacing the network's forward
    for one call; a forward the instance had of its own (torch.compile's OptimizedModule,
    a wrapper a user's task returns) is put back, not deleted."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        net = torch.nn.Linear(3, 2)
        plain = net.forward
        net.forward = lambda x: plain(x) * 2  # the instance's own
        model = runtime.distributed(net, torch.device("cpu"))
        x = torch.ones(4, 3)
        assert "forward" in vars(net)
        torch.testing.assert_close(model(x), plain(x) * 2)
        assert all(p.grad is None for p in net.parameters())
    finally:
        dist.destroy_process_group()

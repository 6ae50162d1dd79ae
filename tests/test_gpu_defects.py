"""CPU tests for defects of the CUDA-only paths (issue 28): each fails when its defect
comes back. What needs a GPU is in tests/test_cuda.py."""

import datetime
import functools
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from helpers import ROOT, assert_states_equal, final_state, read_metrics, tiny_args
from torch.autograd import DeviceType

import ops
import train
from config import with_defaults
from machinery import checkpoint, elastic, hardware, meters, param_groups, runtime, watchdog
from networks import build_network
from pipeline import data, device_data
from reporting import lr_finder, metrics, profiling, runlog
from tasks.classification import Classification


def _overflow_first_step(monkeypatch):
    """The GradScaler starts at 2^40, which overflows fp16 gradients, so the first
    optimizer step is skipped; its backoff brings the scale to 2^10 at once, so the later
    steps are taken."""
    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(
        torch.amp.GradScaler, init_scale=2.0 ** 40, backoff_factor=2.0 ** -30))




# ---------------------------------------------------------------- N1: fused SGD, fp16

def test_fused_sgd_after_a_skipped_first_step_equals_the_plain_sgd(tmp_path, monkeypatch):
    # --deterministic fills torch.empty_like with NaN: a momentum buffer that the skipped
    # first step left unwritten would make the weights NaN.
    _overflow_first_step(monkeypatch)
    args = ["--amp", "fp16", "--deterministic", "--momentum", "0.9"]
    assert train.main(tiny_args(tmp_path / "fused", *args, size=48)) == 0
    fused = final_state(tmp_path / "fused")
    assert fused["progress"]["scaler_skips"] >= 1
    assert all(torch.isfinite(v).all() for v in fused["model"].values())

    class Unfused(torch.optim.SGD):
        def __init__(self, params, **kwargs):
            kwargs.pop("fused", None)
            super().__init__(params, **kwargs)

    monkeypatch.setattr(torch.optim, "SGD", Unfused)
    assert train.main(tiny_args(tmp_path / "plain", *args, size=48)) == 0
    plain = final_state(tmp_path / "plain")
    assert plain["progress"]["scaler_skips"] == fused["progress"]["scaler_skips"]
    assert_states_equal(fused["model"], plain["model"])


def test_the_group_unfreezing_adds_gets_zero_momentum_buffers():
    config = with_defaults({"optimizer": "sgd", "momentum": 0.9, "freeze": ["hidden.*"],
                            "amp": "fp16"})
    net = build_network("mlp", 10, 3, 8)
    frozen = ops.freeze(net, config["freeze"])
    optimizer = ops.build_optimizer(net, config, torch.device("cpu"))
    assert optimizer.defaults["fused"]
    names = param_groups.unfreeze_into(net, optimizer, config)
    assert names and sorted(names) == sorted(frozen)
    params = dict(net.named_parameters())
    for name in names:  # a skipped first step after the unfreezing leaves them as they are
        assert torch.equal(optimizer.state[params[name]]["momentum_buffer"],
                           torch.zeros_like(params[name]))


# ------------------------------------------------ N2: Adam resumed onto a fused group

def test_adam_resumed_onto_fused_groups_has_steps_where_the_kernel_needs_them(tmp_path, capsys):
    # Trained unfused (CPU, no fp16), resumed fused (fp16). torch moves the saved steps only
    # when the saved group says fused; on CUDA they would stay on the CPU and the fused
    # kernel fail. On the CPU only the dtype can differ: the checkpoint's steps are made
    # float64 (what an unfused group under another default dtype holds).
    args = tiny_args(tmp_path / "run", "--optimizer", "adamw", "--lr", "0.001", epochs=1)
    assert train.main(args) == 0
    for path in (tmp_path / "run" / "checkpoints").glob("*.pt"):
        saved = checkpoint.load_checkpoint(path)
        assert saved["optimizer"]["param_groups"][0]["fused"] is None
        for state in saved["optimizer"]["state"].values():
            state["step"] = state["step"].double()
        checkpoint.save_checkpoint(saved, path)
    resumed = tiny_args(tmp_path / "run", "--optimizer", "adamw", "--lr", "0.001",
                        "--amp", "fp16", "--resume", "auto", epochs=2)
    assert train.main(resumed) == 0
    assert "resuming from" in capsys.readouterr().out
    final = final_state(tmp_path / "run")
    assert final["optimizer"]["param_groups"][0]["fused"] is True
    assert final["step"] == 2 * saved["step"]
    for state in final["optimizer"]["state"].values():
        assert state["step"].dtype == torch.float32 and state["step"].device.type == "cpu"
        assert float(state["step"]) == final["step"]


# ------------------------------------------- N3: CUBLAS_WORKSPACE_CONFIG, set in time

def test_importing_runtime_sets_the_cublas_workspace_config():
    # Before any cuBLAS gemm of the process: PyTorch reads it once, at the first one.
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    code = ("import os; from machinery import runtime; "
            "print(os.environ.get('CUBLAS_WORKSPACE_CONFIG'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, check=True,
                         capture_output=True, text=True, timeout=120).stdout
    assert out.strip().splitlines()[-1] == ":4096:8"


def test_cublas_refusing_deterministic_is_one_error_line(tmp_path, monkeypatch, capsys):
    # What torch raises at a gemm when the variable was not set at the process's first one.
    def refuse(*args, **kwargs):
        raise RuntimeError(
            "Deterministic behavior was enabled with either `torch.use_deterministic_"
            "algorithms(True)` or `at::Context::setDeterministicAlgorithms(true)`, but this "
            "operation is not deterministic because it uses CuBLAS and you have CUDA >= 10.2. "
            "To enable deterministic behavior in this case, you must set an environment "
            "variable before running your PyTorch application: CUBLAS_WORKSPACE_CONFIG=:4096:8"
            " or CUBLAS_WORKSPACE_CONFIG=:16:8.")

    monkeypatch.setattr(ops, "train_flops_per_sample", refuse)
    assert train.main(tiny_args(tmp_path, "--deterministic")) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err
    assert errors[0].startswith("error: --deterministic: cuBLAS") and ":4096:8" in errors[0]


# ------------------------------- N5: --data-on-device sized within the memory fraction

def test_the_device_path_decision_counts_within_the_memory_fraction(monkeypatch):
    config = with_defaults({"dataset": "synthetic", "synthetic_size": 64, "image_size": 8,
                            "num_classes": 10, "data_on_device": "auto"})
    train_set, val_set = data.build_datasets(config)
    need = device_data.source_nbytes(train_set) + device_data.source_nbytes(val_set)
    total, reserved = 1000 * need, 0
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (total // 2, total))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: reserved)
    cuda = torch.device("cuda", 0)

    def decide(fraction, mode="auto"):
        return device_data.device_data_decision(
            {**config, "gpu_memory_fraction": fraction, "data_on_device": mode},
            train_set, val_set, cuda)

    assert decide(0.0)[0]  # no cap: a quarter of the card's half is plenty
    use, why = decide(2 * need / total)  # the cap leaves 2 sets' worth: half of it
    assert not use and "50% of the" in why and "--gpu-memory-fraction" in why
    assert decide(4 * need / total)[0]
    reserved = need  # what the process holds already counts against its cap
    assert not decide(4 * need / total)[0]
    with pytest.raises(ops.UserError, match="do not fit .* under --gpu-memory-fraction"):
        decide(need / total, "on")


# ------------------------------------------------ N6: the profiler's CUDA time, once

def test_top_operators_on_cuda_count_each_kernel_once():
    # kineto's key_averages: a kernel row (device CUDA) and the aten op that launched it,
    # credited with the same self device time; a user annotation spans them on the GPU.
    def row(key, device_type, device_us, cpu_us=0.0, annotation=False):
        return SimpleNamespace(key=key, device_type=device_type, count=2,
                               self_device_time_total=device_us, self_cpu_time_total=cpu_us,
                               is_user_annotation=annotation)

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA
    rows = [row("aten::cudnn_convolution", cpu, 600.0, 50.0),
            row("sm90_xmma_fprop_implicit_gemm", cuda, 600.0),
            row("aten::add_", cpu, 400.0, 30.0),
            row("elementwise_kernel", cuda, 400.0),
            row("ProfilerStep#2", cuda, 1000.0, annotation=True),
            row("ProfilerStep#2", cpu, 0.0, 90.0)]
    prof = SimpleNamespace(key_averages=lambda: rows)
    lines = profiling.top_operators(prof, cuda=True)
    assert "(of 1.000 ms over 2 operators)" in lines[0]  # torch's own device total
    assert [line.split()[-3] for line in lines[1:]] == ["sm90_xmma_fprop_implicit_gemm",
                                                        "elementwise_kernel"]
    shares = [float(line.split()[0].rstrip("%")) for line in lines[1:]]
    assert shares == [60.0, 40.0]
    lines = profiling.top_operators(prof, cuda=False)  # the CPU's: the operators
    assert "(of 0.080 ms over 2 operators)" in lines[0]


# --------------------------------------- N7: a step the GradScaler skipped is not clipped

def test_grad_clipped_leaves_out_the_steps_the_scaler_skipped():
    # A step whose fp16 gradients overflowed has an inf (or NaN) norm; the GradScaler skips
    # it, so it was not clipped. (On the CPU an overflowing mlp gives NaN, which never
    # compared above the clip; CUDA's kernels can give inf.)
    counters = meters.Counters(torch.device("cpu"), clip=1.0)
    for norm in (float("inf"), 2.0, float("nan"), 0.5, float("-inf")):
        counters.add_grad_norm(torch.tensor(norm))
    values = counters.read()
    assert values["grad_clipped"] == 1
    assert values["grad_norm_count"] == 2 and values["grad_norm_sum"] == 2.5


# -------------------------- N18: the counters read back once, and keep a bounded list

def test_counters_read_the_device_once_and_keep_few_norms(monkeypatch):
    counters = meters.Counters(torch.device("cpu"), clip=3.0)
    norms = [float(1 + i % 5) for i in range(3 * meters.FOLD_NORMS + 7)]
    norms[5] = float("inf")
    for i, norm in enumerate(norms):
        counters.add_grad_norm(torch.tensor(norm))
        counters.add_loss(torch.tensor(2.0 if i != 9 else float("nan")), 4)
        assert len(counters.grad_norms) < meters.FOLD_NORMS  # bounded, whatever --log-every
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name:
                            reads.append(_n) or _r(self, *a))
    values = counters.read()
    monkeypatch.undo()
    assert reads == ["tolist"]  # one transfer from the device: one sync on CUDA
    finite = [n for n in norms if n != float("inf")]
    assert values["grad_norm_count"] == len(finite)
    assert values["grad_norm_sum"] == sum(finite)
    assert values["grad_clipped"] == sum(n > 3.0 for n in finite)
    assert values["loss_count"] == 4 * (len(norms) - 1) and values["worst_streak"] == 1
    assert values["loss_sum"] == 2.0 * 4 * (len(norms) - 1) and values["streak"] == 0


# ------------------------------ N8: the MFU peak with --amp none follows each TF32 switch

@pytest.mark.parametrize("cudnn_tf32, matmul_tf32, share, peak", [
    (True, False, 1.0, 51.2),     # an mlp: cuBLAS in plain fp32 (torch's default)
    (True, False, 0.0, 378.0),    # all convolutions: cuDNN in TF32 (its default)
    (True, True, 1.0, 378.0),     # torch.backends.cuda.matmul.allow_tf32 = True
    (False, True, 0.0, 51.2),
    (True, False, 0.5, 1 / (0.5 / 51.2 + 0.5 / 378.0)),  # half and half: the time-weighted
])
def test_mfu_peak_with_amp_none_follows_the_tf32_switch_of_each_flop_kind(
        monkeypatch, cudnn_tf32, matmul_tf32, share, peak):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 PCIe")
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", cudnn_tf32)
    before = torch.backends.cuda.matmul.allow_tf32  # (a C switch: monkeypatch cannot undo)
    torch.backends.cuda.matmul.allow_tf32 = matmul_tf32
    try:
        cuda = torch.device("cuda", 0)
        assert hardware.peak_tflops(cuda, None, 2, share) == pytest.approx(2 * peak)
        assert hardware.peak_tflops(cuda, torch.bfloat16, 1, share) == 756.5  # tensor cores
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.parametrize("network, share", [("mlp", 1.0), ("simple_cnn", (0.0, 0.2))])
def test_the_matmul_share_of_a_networks_flops(network, share):
    net = build_network(network, 10, 3, 16)
    flops, matmul = ops.train_flops_per_sample(net, (3, 16, 16), torch.device("cpu"),
                                               kinds=True)
    assert flops == ops.train_flops_per_sample(net, (3, 16, 16), torch.device("cpu"))
    if isinstance(share, tuple):
        assert share[0] < matmul / flops < share[1]  # its classifier head only
    else:
        assert matmul == flops


# --------------------------------- N10: the FLOP count after --unfreeze-at, and resumed

def test_flops_are_counted_again_after_unfreezing_and_on_a_resume_past_it(tmp_path):
    def flops(run_dir):  # tflops = flops_per_sample x samples/s / 1e12, on the CPU too
        return [round(r["tflops"] * 1e12 / r["samples_per_sec"]) for r in read_metrics(run_dir)]

    args = ("--freeze", "hidden.*", "--unfreeze-at", "2")
    assert train.main(tiny_args(tmp_path / "whole", *args, epochs=3)) == 0
    frozen, unfrozen, later = flops(tmp_path / "whole")
    net = build_network("mlp", 10, 3, 8)
    assert unfrozen == later == ops.train_flops_per_sample(net, (3, 8, 8), torch.device("cpu"))
    assert unfrozen > 1.3 * frozen  # the hidden layer's weight gradients, and the input's
    assert train.main(tiny_args(tmp_path / "part", *args, epochs=2)) == 0
    assert train.main(tiny_args(tmp_path / "part", *args, "--resume", "auto",
                                epochs=3)) == 0
    assert flops(tmp_path / "part") == [frozen, unfrozen, unfrozen]


# ------------------------------- N9: a resumed epoch's throughput, from its own samples

def test_a_resumed_epochs_samples_per_sec_counts_only_what_it_trained(tmp_path):
    # Stopped at half an epoch and resumed: the rate is the other half's samples over the
    # resumed run's time; the defect divided the whole epoch's samples by it (about 2x).
    # Checked exactly, samples/s x epoch_time, not against another run's rate: on a
    # shared 2-core machine two runs' rates differed by 0.2-4.5x with the fix in.
    args = ("--log-every", "4")
    assert train.main(tiny_args(tmp_path / "whole", *args, size=128)) == 0
    assert train.main(tiny_args(tmp_path / "part", *args, "--max-steps", "4", size=128)) == 0
    assert train.main(tiny_args(tmp_path / "part", *args, "--max-steps", "0", "--resume",
                                "auto", size=128)) == 0
    whole, resumed = read_metrics(tmp_path / "whole")[-1], read_metrics(tmp_path / "part")[-1]
    assert whole["step"] == resumed["step"] == 8  # 128 samples, 16 a step
    assert whole["samples_per_sec"] * whole["epoch_time"] == pytest.approx(128)
    assert resumed["samples_per_sec"] * resumed["epoch_time"] == pytest.approx(64)
    for record in (whole, resumed):  # TFLOP/s (and MFU) follow the same samples
        assert record["tflops"] * 1e12 / record["samples_per_sec"] == pytest.approx(
            ops.train_flops_per_sample(build_network("mlp", 10, 3, 8), (3, 8, 8),
                                       torch.device("cpu")))


# -------------------------------- N11: the epoch line's advice follows the data path

def test_the_epoch_lines_advice_follows_the_data_path(tmp_path, monkeypatch):
    record = {"epoch": 1, "step": 4, "train_loss": 1.0, "samples_per_sec": 100.0,
              "compute_efficiency": 0.5, "data_time": 1.0, "compute_time": 1.0}
    config = {"epochs": 2, "num_workers": 0}
    task = Classification(10)
    loader = metrics.epoch_line(record, config, task)
    assert "--num-workers (now 0)" in loader and "--prefetch" in loader
    device = metrics.epoch_line(record, config, task, on_device=True)
    assert "--prefetch" not in device and "--num-workers" not in device
    assert "--batch-size" in device and "on the device" in device
    seen = []
    real = metrics.epoch_line
    monkeypatch.setattr(metrics, "epoch_line", lambda *a: seen.append(a[3:]) or real(*a))
    for path in ("on", "off"):
        assert train.main(tiny_args(tmp_path / path, "--data-on-device", path)) == 0
    assert seen == [(True,), (False,)]


# ------------------------- N13: out of memory in --find-lr, and at set-up on each path

def _no_memory(*args, **kwargs):  # the CPU allocator's words
    raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator:"
                       " can't allocate memory: you tried to allocate 4294967296 bytes.")


def _error_lines(capsys):
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("error:")]


def test_out_of_memory_in_the_lr_range_test(tmp_path, monkeypatch, capsys):
    real_sweep, events = lr_finder.sweep, []

    def sweep(config, procs, model, *args):
        monkeypatch.setattr(model, "forward", _no_memory)
        return real_sweep(config, procs, model, *args)

    real_failed = runlog.RunLog.failed
    monkeypatch.setattr(lr_finder, "sweep", sweep)
    monkeypatch.setattr(runlog.RunLog, "failed",
                        lambda self: events.append("failed") or real_failed(self))
    monkeypatch.setattr(hardware, "dump_memory_snapshot",  # (None on the CPU: no CUDA history)
                        lambda run_dir, device: events.append("snapshot") or "snap.pickle")
    assert train.main(tiny_args(tmp_path, "--find-lr", "--memory-snapshot")) == 1
    errors = _error_lines(capsys)
    assert len(errors) == 1 and "out of memory in the forward pass at batch size 16" in errors[0]
    assert "--amp bf16" in errors[0] and "snap.pickle" in errors[0]
    assert events == ["failed", "snapshot"]  # --mlflow's run is marked FAILED


@pytest.mark.parametrize("path, broken, where, advice", [
    ("on", "source_tensors", "holding the data on cpu", "use --data-on-device off"),
    ("off", "train_flops_per_sample", "setting up the run", "lower --batch-size"),
])
def test_out_of_memory_at_set_up_says_what_to_try_on_each_path(tmp_path, monkeypatch, capsys,
                                                               path, broken, where, advice):
    module = device_data if broken == "source_tensors" else ops
    monkeypatch.setattr(module, broken, _no_memory)
    snapshots = []
    monkeypatch.setattr(hardware, "dump_memory_snapshot",
                        lambda run_dir, device: snapshots.append(1) or "snap.pickle")
    assert train.main(tiny_args(tmp_path, "--data-on-device", path, "--memory-snapshot")) == 1
    errors = _error_lines(capsys)
    assert len(errors) == 1 and errors[0].startswith("error: out of memory (it tried to "
                                                     "allocate 4.00 GiB more) " + where)
    assert errors[0].endswith(advice + (", or free memory" if path == "off" else ""))
    assert "snap.pickle" in errors[0] and snapshots == [1]


# ------------------ N14: cuBLAS/cuDNN allocation failures, DataParallel's replica errors

@pytest.mark.parametrize("text, expected", [
    ("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`",
     "CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    ("cuDNN error: CUDNN_STATUS_ALLOC_FAILED", "cuDNN error: CUDNN_STATUS_ALLOC_FAILED"),
])
def test_cublas_and_cudnn_allocation_failures_are_out_of_memory(text, expected):
    assert ops.memory_error(RuntimeError(text)) == expected
    assert ops.memory_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED")) is None


def test_dataparallels_replica_error_keeps_the_allocators_words():
    # DataParallel raises a replica's error again through torch's ExceptionWrapper.
    from torch._utils import ExceptionWrapper

    try:
        raise torch.OutOfMemoryError(
            "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 1 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free.")
    except torch.OutOfMemoryError:
        wrapped = ExceptionWrapper(where="in replica 1 on device 1")
    with pytest.raises(torch.OutOfMemoryError) as raised:
        wrapped.reraise()
    assert str(raised.value).startswith("Caught OutOfMemoryError in replica 1 on device 1")
    assert ops.memory_error(raised.value) == ("CUDA out of memory (in replica 1 on device 1): "
                                              "it tried to allocate 2.00 GiB more")


# ------------------------------- N16: --gpu-memory-fraction on every GPU of --gpus

def test_the_memory_fraction_caps_every_gpu_of_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    capped = []
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda fraction, device: capped.append((fraction, device)))
    cuda = torch.device("cuda", 1)
    config = {"gpu_memory_fraction": 0.3, "memory_snapshot": False, "gpus": "1,3"}
    hardware.set_memory_options(config, cuda)
    assert capped == [(0.3, 1), (0.3, 3)]
    capped.clear()
    hardware.set_memory_options({**config, "gpus": None}, cuda)
    assert capped == [(0.3, cuda)]


# ------------------- N20: NCCL's group bound to the device; N12: gloo's side interface

def test_nccl_groups_are_bound_to_the_processs_device(monkeypatch):
    calls = []
    monkeypatch.setattr(elastic.dist, "init_process_group",
                        lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    cuda = torch.device("cuda", 1)
    elastic.join_process_group("nccl", 0, 2, device=cuda)
    elastic.join_process_group("gloo", 0, 2, device=torch.device("cpu"))
    assert calls == [("nccl", {"device_id": cuda}), ("gloo", {})]


@pytest.mark.parametrize("nccl, gloo", [
    ("eth", "eth0"),          # a prefix, as NCCL reads it
    ("=eth1", "eth1"),        # exact
    ("ib,eth", "eth0"),       # the first interface either names
    ("^docker,lo", "eth0"),   # excluded: the rest
    ("=eth", None),           # no such interface: left unset
    ("", None),
])
def test_gloo_follows_nccl_socket_ifname(nccl, gloo):
    interfaces = ["lo", "docker0", "eth0", "eth1"]
    environ = {"NCCL_SOCKET_IFNAME": nccl}
    assert runtime.default_gloo_interface(environ, interfaces) == gloo
    assert environ.get("GLOO_SOCKET_IFNAME") == gloo
    environ = {"NCCL_SOCKET_IFNAME": nccl, "GLOO_SOCKET_IFNAME": "bond0"}  # the user's wins
    assert runtime.default_gloo_interface(environ, interfaces) is None
    assert environ["GLOO_SOCKET_IFNAME"] == "bond0"


# --------------------------------------------- C14: --compile with --gpus (DataParallel)

def test_compile_with_dataparallel_is_one_error_line(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path / "a", "--compile", "--gpus", "0,1")) == 2
    errors = _error_lines(capsys)
    assert errors == ["error: --compile does not work with --gpus 0,1 (DataParallel); for "
                      "several GPUs use torchrun (DistributedDataParallel), which compiles, "
                      "or drop --compile"]
    # One GPU is no DataParallel: --compile passes the config check (then no GPU here).
    assert train.main(tiny_args(tmp_path / "b", "--compile", "--gpus", "0")) == 2
    assert "--compile" not in _error_lines(capsys)[0]


# ------------------- L4: the process group's timeout is behind the hang watchdog's

def test_the_collective_timeout_lets_the_watchdog_write_first(monkeypatch):
    """NCCL's 10-minute default would abort before the watchdog (20 x the median step)
    whenever a step takes over 30 s: the group gets a longer timeout, and torch's own
    only where the watchdog is off."""
    assert watchdog.collective_timeout(None) >= watchdog.FACTOR * 6 * 60  # steps of 6 min
    assert watchdog.collective_timeout(900) == 1800 and watchdog.collective_timeout(5) == 600
    assert watchdog.collective_timeout(0) is None
    calls = []
    monkeypatch.setattr(elastic.dist, "init_process_group",
                        lambda backend, **kwargs: calls.append((backend, kwargs)))
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    elastic.join_process_group("gloo", 0, 2, collective_timeout=1800)
    assert calls == [("gloo", {"timeout": datetime.timedelta(seconds=1800)})]


def test_ncclS_own_dump_lands_in_the_run_directory(tmp_path, monkeypatch):
    for name in ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_BUFFER_SIZE",
                 "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.setenv(name, "")  # (restored after the test, set or not)
        monkeypatch.delenv(name)
    monkeypatch.setenv("WORLD_SIZE", "2")
    watchdog.enable_flight_recorder({"hang_timeout": None, "run_dir": str(tmp_path)})
    where = os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"]
    assert where == str(tmp_path / "hang-nccl-trace-rank")  # (NCCL adds the rank)
    assert os.listdir(tmp_path) == []  # nothing made before a hang

"""The CUDA paths, run where a GPU is present (skipped on CPU-only machines).

bench/gpu.sh runs this file first. Tests that need two GPUs (DataParallel, NCCL, a device
other than GPU 0) skip on one.
"""

import contextlib

import pytest
import torch
from helpers import assert_states_equal, final_state, read_metrics, tiny_args

import networks
import train
from machinery import engine, saving

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def cuda_args(run_dir, *extra, device="cuda"):
    args = tiny_args(run_dir, *extra, network="simple_cnn", size=256, image=16, epochs=2)
    args[args.index("--device") + 1] = device
    return args




@pytest.mark.parametrize("flags", [
    ("--amp", "fp16"),
    ("--amp", "bf16", "--channels-last"),
    ("--grad-checkpointing", "--data-on-device", "off", "--num-workers", "2",
     "--prefetch", "2"),                                          # workers and a prefetcher
    ("--compile",),
    ("--data-on-device", "off", "--num-workers", "2"),             # pinned per-sample path
    ("--data-on-device", "off", "--amp", "bf16", "--channels-last"),
    ("--data-on-device", "on", "--prefetch", "2"),                # prefetch is dropped
])
def test_cuda_training_paths(tmp_path, flags):
    assert train.main(cuda_args(tmp_path, *flags)) == 0
    logged = read_metrics(tmp_path)
    assert all(r["train_loss"] == r["train_loss"] for r in logged)  # not NaN
    assert len(logged) == 2 and 0 < logged[-1]["compute_efficiency"] <= 1
    state = final_state(tmp_path)
    assert all(t.device.type == "cpu" for t in state["model"].values())
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])


def test_fp16_scaler_state_resumes_on_cuda(tmp_path):
    # --deterministic: the resumed run and the uninterrupted one compute the same steps.
    flags = ("--amp", "fp16", "--deterministic", "--scheduler", "none")
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    assert train.main(cuda_args(whole, *flags, "--epochs", "3")) == 0
    assert train.main(cuda_args(resumed, *flags)) == 0
    assert train.main(cuda_args(resumed, *flags, "--resume", "auto", "--epochs", "3")) == 0
    a, b = final_state(resumed), final_state(whole)
    assert a["epoch"] == b["epoch"] == 3 and a["scaler"]["scale"] > 0
    assert a["scaler"] == b["scaler"]  # scale and growth tracker continued exactly
    assert_states_equal(a["model"], b["model"])


@pytest.mark.parametrize("network", ["resnet9", "resnet18", "torchvision/resnet18"])
def test_deterministic_runs_on_cuda_and_repeats_itself(tmp_path, network):
    # Adaptive pooling has no deterministic CUDA backward: --deterministic swaps it.
    runs = [tmp_path / "a", tmp_path / "b"]
    for run in runs:
        args = cuda_args(run, "--deterministic", "--network", network)
        args[args.index("--synthetic-size") + 1] = "64"
        assert train.main(args) == 0
    assert_states_equal(final_state(runs[0])["model"], final_state(runs[1])["model"])


@pytest.mark.parametrize("flags", [
    (),
    ("--amp", "fp16", "--grad-clip", "1"),
    ("--amp", "bf16", "--ema-decay", "0.9", "--mixup-alpha", "0.2"),
    ("--data-on-device", "off", "--num-workers", "2"),
])
def test_no_device_sync_between_log_steps(tmp_path, monkeypatch, flags):
    # CUDA's sync debug mode raises at any synchronising call while the steps of the second
    # epoch run; the log steps (which read the counters) and the loader's start are exempt.
    real_run_epoch, real_log = train.run_epoch, train.log_train
    real_init = engine._Prefetcher.__init__

    def exempt(call):
        def run(*args, **kwargs):
            torch.cuda.set_sync_debug_mode(0)
            try:
                return call(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode("error")
        return run

    def run_epoch(training, loader, epoch, stop):
        if epoch == 0:  # the first epoch warms up (cuDNN's autotuner, allocations)
            return real_run_epoch(training, loader, epoch, stop)
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real_run_epoch(training, loader, epoch, stop)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    monkeypatch.setattr(train, "run_epoch", run_epoch)
    monkeypatch.setattr(train, "log_train", exempt(real_log))
    monkeypatch.setattr(engine._Prefetcher, "__init__", exempt(real_init))
    assert train.main(cuda_args(tmp_path, "--log-every", "1000", *flags)) == 0


def test_mfu_reported_on_a_known_gpu(tmp_path):
    if train.ops.peak_tflops(torch.cuda.get_device_name(), "bf16") is None:
        pytest.skip(f"no datasheet peak for {torch.cuda.get_device_name()}")
    assert train.main(cuda_args(tmp_path, "--amp", "bf16")) == 0
    record = read_metrics(tmp_path)[-1]
    assert 0 < record["mfu"] < 1 and record["tflops"] > 0


def test_amp_bf16_follows_the_gpus_native_support():
    device = torch.device("cuda", 0)
    native = train.hardware.native_bf16(torch.cuda.get_device_capability(device))
    if native:
        assert train.hardware.amp_dtype("bf16", device) == torch.bfloat16
    else:
        with pytest.raises(train.UserError, match="no native bfloat16"):
            train.hardware.amp_dtype("bf16", device)


@two_gpus
def test_a_second_gpu_is_the_one_used(tmp_path):
    last = torch.cuda.device_count() - 1
    try:
        assert train.main(cuda_args(tmp_path, device=f"cuda:{last}")) == 0
        assert torch.cuda.current_device() == last
    finally:
        torch.cuda.set_device(0)
    assert 0 < read_metrics(tmp_path)[-1]["compute_efficiency"] <= 1  # its events, its work


@two_gpus
def test_dataparallel_replicas_compute_in_bfloat16():
    net = networks.build_network("simple_cnn", 10, 3, 16).cuda(0)
    seen = []
    net.fc.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    config = {"gpus": "0,1", "amp": "bf16", "compile": False}
    model = train.wrap_model(net, config, torch.device("cuda", 0), 1)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model(torch.randn(8, 3, 16, 16, device="cuda:0"))
    assert seen and set(seen) == {torch.bfloat16}, seen


@two_gpus
def test_nccl_processes_train_like_one_gpu(tmp_path):
    from helpers import torchrun

    flags = ("--no-augment", "--scheduler", "none", "--deterministic")
    ddp = tmp_path / "ddp"
    args = tiny_args(ddp, *flags, network="mlp", size=64, batch=16, epochs=2)
    args[args.index("--device") + 1] = "cuda"
    out = torchrun(args)
    assert "process(es), cuda:0)" in out  # NCCL, one GPU a process
    single = tmp_path / "single"
    args = tiny_args(single, *flags, network="mlp", size=64, batch=32, epochs=2)
    args[args.index("--device") + 1] = "cuda"
    assert train.main(args) == 0
    torch.testing.assert_close(final_state(ddp)["model"], final_state(single)["model"])


def test_out_of_memory_under_a_memory_fraction_dumps_a_snapshot(tmp_path):
    """--gpu-memory-fraction caps the caching allocator: a resnet18 batch of 512 does not fit
    in 1% of the GPU; the run ends in one error line, exit 1, with --memory-snapshot's file."""
    import pickle
    import subprocess
    import sys

    from helpers import ROOT

    run_dir = tmp_path / "run"
    args = cuda_args(run_dir, "--gpu-memory-fraction", "0.01", "--memory-snapshot")
    args[args.index("--network") + 1] = "resnet18"
    args[args.index("--batch-size") + 1] = "256"
    args[args.index("--image-size") + 1] = "64"
    proc = subprocess.run([sys.executable, "train.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "out of memory in" in errors[0] and "CUDA out of memory" in errors[0]
    snapshot = run_dir / "memory_snapshot.pickle"
    assert str(snapshot) in errors[0]
    with open(snapshot, "rb") as f:
        assert "segments" in pickle.load(f)


def test_gpu_memory_fraction_is_set_for_the_process(tmp_path):
    import subprocess
    import sys

    from helpers import ROOT

    code = ("import sys, torch; from machinery import runtime; "
            "hardware.set_memory_options({'gpu_memory_fraction': "
            "0.25, 'memory_snapshot': False}, torch.device('cuda', 0)); "
            "print(torch.cuda.get_per_process_memory_fraction(0))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    assert float(out.strip().splitlines()[-1]) == pytest.approx(0.25)


def test_gradient_norm_under_fp16_on_cuda(tmp_path):
    assert train.main(cuda_args(tmp_path, "--amp", "fp16", "--grad-clip", "1e6")) == 0
    logged = read_metrics(tmp_path)
    norms = [r["grad_norm"] for r in logged]
    assert all(n > 0 for n in norms) and all(r["grad_clipped"] == 0 for r in logged)


def test_adam_trained_on_the_cpu_resumes_fused_on_cuda(tmp_path, monkeypatch):
    # The checkpoint's groups are not fused, so torch leaves their step tensors on the CPU;
    # the fused AdamW on CUDA needs them on the parameters' device.
    flags = ("--optimizer", "adamw", "--lr", "0.001")
    assert train.main(cuda_args(tmp_path, *flags, "--epochs", "1", device="cpu")) == 0
    real_restore, seen = saving.restore, []

    def restore(saved, path, net, ema, optimizer, *args):
        real_restore(saved, path, net, ema, optimizer, *args)
        seen.extend((s["step"], p) for p, s in optimizer.state.items())

    monkeypatch.setattr(saving, "restore", restore)
    assert train.main(cuda_args(tmp_path, *flags, "--resume", "auto")) == 0
    assert seen and all(step.device == p.device and step.dtype == torch.float32
                        for step, p in seen)
    assert final_state(tmp_path)["epoch"] == 2


def test_deterministic_after_a_run_that_used_cublas_in_the_same_process(tmp_path):
    # PyTorch reads CUBLAS_WORKSPACE_CONFIG once, at the process's first gemm: importing
    # runtime sets it, so a --deterministic run after any other works (a notebook).
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    assert train.main(cuda_args(tmp_path / "a", "--epochs", "1")) == 0
    assert train.main(cuda_args(tmp_path / "b", "--epochs", "1", "--deterministic")) == 0


def test_data_on_device_auto_fits_within_the_memory_fraction(tmp_path, capsys):
    # A set of about 1.5x the cap (far under a quarter of the card's free memory): auto
    # must keep it on the per-sample path, and the run trains.
    total = torch.cuda.mem_get_info()[1]
    fraction = 0.005  # about 0.7 GB of an H200
    side = 32
    samples = int(1.5 * fraction * total / (3 * side * side * 4))  # float32 images
    args = cuda_args(tmp_path, "--gpu-memory-fraction", str(fraction), "--data-on-device",
                     "auto", "--epochs", "1", "--max-steps", "3", "--image-size", str(side))
    args[args.index("--synthetic-size") + 1] = str(samples)
    try:
        assert train.main(args) == 0
    finally:  # the cap stays with the process: the CUDA tests after this one need the card
        torch.cuda.set_per_process_memory_fraction(1.0)
    assert "data path: per-sample" in capsys.readouterr().out


def test_profiler_cuda_total_is_torchs_own_device_total(tmp_path, monkeypatch, capsys):
    import re

    from torch.autograd import DeviceType

    from reporting import profiling

    real_top, seen = profiling.top_operators, []

    def top_operators(prof, cuda, *args):
        seen.append(prof)
        return real_top(prof, cuda, *args)

    monkeypatch.setattr(profiling, "top_operators", top_operators)
    assert train.main(cuda_args(tmp_path, "--profile-steps", "2", "--epochs", "1")) == 0
    out = capsys.readouterr().out
    total = float(re.search(r"top operators by self CUDA time \(of ([0-9.]+) ms", out)[1])
    device = sum(e.self_device_time_total for e in seen[0].key_averages()
                 if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                 and not e.key.startswith("ProfilerStep")) / 1000
    assert total == pytest.approx(device, rel=0.01)
    shares = [float(m) for m in re.findall(r"^ +([0-9.]+)% ", out, re.M)]
    assert shares and sum(shares) <= 100.5


def test_fp16_steps_the_scaler_skipped_are_not_clipped_and_sgd_stays_finite(tmp_path,
                                                                           monkeypatch):
    # The first step overflows (scale 2^40) and is skipped; then the scale is 2^10. A fused
    # SGD that skipped its first step must not use an unwritten momentum buffer.
    import functools

    monkeypatch.setattr(torch.amp, "GradScaler", functools.partial(
        torch.amp.GradScaler, init_scale=2.0 ** 40, backoff_factor=2.0 ** -30))
    assert train.main(cuda_args(tmp_path, "--amp", "fp16", "--grad-clip", "1e6",
                                "--deterministic")) == 0
    state = final_state(tmp_path)
    assert state["progress"]["scaler_skips"] >= 1
    assert all(torch.isfinite(t).all() for t in state["model"].values())
    assert all(r["grad_clipped"] == 0 for r in read_metrics(tmp_path))


def test_gan_latents_reach_the_gpu_from_pinned_memory(monkeypatch):
    """The CUDA review's M2: a pageable host-to-device copy waits for the queued kernels
    (once per discriminator repeat); the latents are pinned first, and their values are
    the CPU draw's."""
    from tasks import gan

    pinned = _pins(monkeypatch)
    task = gan.GAN.__new__(gan.GAN)
    task.seed, task.latent_dim = 3, 8
    where = engine.Where(epoch=0, first=0, offset=4, count=8, step_samples=16)
    on_gpu = task.latents("discriminator", where, torch.device("cuda", 0))
    assert pinned and on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), task.latents("discriminator", where,
                                                  torch.device("cpu")))


def _pins(monkeypatch):
    """The host tensors pinned from now on (``Tensor.pin_memory``'s calls), as a list."""
    pinned = []
    pin = torch.Tensor.pin_memory
    monkeypatch.setattr(torch.Tensor, "pin_memory",
                        lambda self, *a: (pinned.append(1), pin(self, *a))[1])
    return pinned


@contextlib.contextmanager
def _no_sync():
    """CUDA's sync debug mode at "error": a synchronising call (a pageable, blocking copy
    from the host among them) raises."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_pix2pix_dropout_keys_reach_the_gpu_from_pinned_memory(monkeypatch):
    """The CUDA review's M1: at 64 px and above a step's dropout keys were a pageable,
    blocking copy (a stream sync every step); pinned now, no sync, the CPU's values."""
    import dataclasses
    import types

    from tasks import pix2pix as pix2pix_task

    pinned = _pins(monkeypatch)
    task = pix2pix_task.Pix2Pix.__new__(pix2pix_task.Pix2Pix)
    task.seed = 3
    generator = types.SimpleNamespace(dropout=0.5, dropped=[0])  # (what keys() reads)

    @dataclasses.dataclass
    class Where:
        epoch: int = 1
        first: int = 16
        offset: int = 4
        count: int = 8

    with _no_sync():
        on_gpu = task.keys(generator, Where(), torch.device("cuda", 0))
    assert pinned and on_gpu.is_cuda
    assert torch.equal(on_gpu.cpu(), task.keys(generator, Where(), torch.device("cpu")))


def test_the_ddpm_sampler_copies_its_noise_without_a_sync(monkeypatch):
    """The CUDA review's L2: DDPM sampling copied each walked step's CPU noise with a
    blocking copy (a stream sync per step); pinned now: a sampling raises nothing under
    the sync debug mode."""
    import ddpm

    unet = ddpm.UNet(3, 8, 8, 1).cuda().eval()
    sampler = ddpm.Sampler(unet, ddpm.Schedule("linear", 50), "ddpm", 5, seed=3)
    sampler(torch.arange(4))  # (a first call: cuDNN's choices, allocations)
    pinned = _pins(monkeypatch)
    with _no_sync():
        images = sampler(torch.arange(4))
    assert len(pinned) == 5  # x_T, then the noise of each step but the last
    assert images.is_cuda and images.shape == (4, 3, 8, 8) and torch.isfinite(images).all()


def test_the_counters_fold_sample_counts_from_pinned_memory(monkeypatch):
    """The CUDA review's L3: a fold's sample counts were a pageable copy, which CUDA may
    synchronise (the sync debug mode cannot see it); pinned now, the same sums."""
    from machinery import meters

    pinned = _pins(monkeypatch)
    counters = meters.Counters(torch.device("cuda", 0))
    for _ in range(meters.FOLD_NORMS):  # one fold
        counters.add_loss(torch.tensor(0.5, device="cuda"), 4)
    assert len(pinned) == 1
    read = counters.read()
    assert read["loss_sum"] == 0.5 * 4 * meters.FOLD_NORMS
    assert read["loss_count"] == 4 * meters.FOLD_NORMS


def test_deterministic_segmentation_validates_on_cuda(tmp_path):
    """The CUDA review's H2: a unet run with --deterministic trains and validates on CUDA
    (the validation loss summed per pixel: nll_loss2d's sum has no deterministic kernel)."""
    assert train.main(["--task", "segmentation", "--dataset", "synthetic", "--network",
                       "unet", "--deterministic", "--device", "cuda", "--synthetic-size",
                       "64", "--image-size", "16", "--epochs", "1", "--num-workers", "0",
                       "--run-dir", str(tmp_path)]) == 0


def _gan_cuda_args(run_dir, features, *extra):
    return ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", "64", "--gan-width",
            "8", "--latent-dim", "16", "--fid-samples", "8", "--fid-features", features,
            "--batch-size", "16", "--epochs", "1", "--num-workers", "0", "--device", "cuda",
            "--run-dir", str(run_dir), *extra]


@pytest.fixture(scope="module")
def cuda_features(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("features")
    assert train.main(["--dataset", "synthetic", "--synthetic-size", "64", "--network", "mlp",
                       "--epochs", "1", "--batch-size", "16", "--num-workers", "0",
                       "--device", "cuda", "--run-dir", str(run_dir)]) == 0
    return str(run_dir / "checkpoints" / "last.pt")


def test_wgan_gp_with_compile_is_one_line_on_cuda(tmp_path, cuda_features, capsys):
    """The CUDA review's H1: the pair is refused before anything starts."""
    assert train.main(_gan_cuda_args(tmp_path, cuda_features, "--gan-loss", "wgan-gp",
                                     "--compile", "--max-steps", "1")) == 2
    assert "error: --compile with --gan-loss wgan-gp" in capsys.readouterr().err


def test_fp16_d_steps_unscale_each_step_by_its_backwards_scale_on_cuda(tmp_path,
                                                                       cuda_features,
                                                                       monkeypatch):
    """The CUDA review's M1 on the GPU (fp16's home): with the scale growing at every
    update, each optimizer step is unscaled by the scale its backward used."""
    events = []
    init, scale, unscale = (torch.amp.GradScaler.__init__, torch.amp.GradScaler.scale,
                            torch.amp.GradScaler.unscale_)
    monkeypatch.setattr(torch.amp.GradScaler, "__init__",
                        lambda self, *a, **k: init(self, *a, **{**k, "growth_interval": 1}))
    monkeypatch.setattr(torch.amp.GradScaler, "scale", lambda self, loss: (
        events.append(("backward", self.get_scale())), scale(self, loss))[1])
    monkeypatch.setattr(torch.amp.GradScaler, "unscale_", lambda self, optimizer: (
        events.append(("step", self.get_scale())), unscale(self, optimizer))[1])
    assert train.main(_gan_cuda_args(tmp_path, cuda_features, "--amp", "fp16", "--max-steps",
                                     "2", "--d-steps", "2", "--grad-clip", "10")) == 0
    steps = [i for i, (kind, _) in enumerate(events) if kind == "step"]
    assert len(steps) == 6 and all(events[i][1] == events[i - 1][1] for i in steps), events


def test_fid_leaves_every_cuda_generator_as_it_was(cuda_features):
    """The CUDA review's L1: KID's seeded subsets do not re-seed the CUDA generators (the
    WGAN-GP alphas would repeat after each validation)."""
    from reporting import gan_metrics

    features = gan_metrics.build_features(cuda_features).cuda()
    real, fake = torch.rand(16, 3, 32, 32) * 2 - 1, torch.rand(16, 3, 32, 32) * 2 - 1
    torch.cuda.manual_seed_all(123)
    torch.randn(5, device="cuda")  # moved off its seed
    before = torch.cuda.get_rng_state_all()
    gan_metrics.measure(features, real, fake, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(before, torch.cuda.get_rng_state_all()))


def test_a_resume_on_the_other_data_path_says_so(tmp_path, capsys):
    """The CUDA review's L7: the checkpoint records the data path on CUDA; a resume that
    takes the other one (auto deciding otherwise) warns, naming the flag that keeps it."""
    assert train.main(cuda_args(tmp_path, "--data-on-device", "on", "--epochs", "1")) == 0
    assert torch.load(tmp_path / "checkpoints" / "last.pt",
                      weights_only=True)["data"]["path"] == "device"
    capsys.readouterr()
    assert train.main(cuda_args(tmp_path, "--data-on-device", "off", "--resume", "auto")) == 0
    assert "--data-on-device on keeps its path" in capsys.readouterr().err


def test_ddp_on_a_gpu_settles_its_buckets_before_the_first_step(tmp_path):
    """Issue 50 (review 6's M2): runtime.distributed spends DDP's one-bucket iteration
    before the first step on CUDA too (DDP with device_ids indexes its inputs: the
    settling call passes one), so the first real forward rebuilds the buckets; no
    gradient and no buffer is left changed. One process of NCCL on GPU 0."""
    import torch.distributed as dist

    from machinery import runtime

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1, device_id=torch.device("cuda", 0))
    try:
        net = networks.build_network("resnet9", 10, 3, 16).cuda()
        before = {k: v.clone() for k, v in net.state_dict().items()}
        model = runtime.distributed(net, torch.device("cuda", 0))
        assert all(p.grad is None for p in net.parameters())
        assert all(torch.equal(v, before[k]) for k, v in net.state_dict().items())
        model(torch.randn(2, 3, 16, 16, device="cuda")).sum().backward()
        assert model._has_rebuilt_buckets
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("memory_format", [torch.contiguous_format, torch.channels_last],
                         ids=["nchw", "channels_last"])
def test_ssim_of_an_image_with_itself_is_one_in_either_format(memory_format):
    """Review 6's L1: SSIM's depthwise filter on channels_last images went to cuDNN and
    its TF32: SSIM(x, x) of flat shapes read 0.93. Autotuned, as training is."""
    from tasks.pix2pix import Pix2PixEvaluation

    x = (torch.rand(8, 3, 4, 4).repeat_interleave(16, -1).repeat_interleave(16, -2) * 2
         - 1).cuda().to(memory_format=memory_format)
    with torch.backends.cudnn.flags(enabled=True, benchmark=True):
        evaluation = Pix2PixEvaluation(torch.device("cuda"))
        evaluation.update(x, x.clone())
        assert evaluation.compute()["ssim"] >= 0.9999
    assert torch.backends.cudnn.allow_tf32  # put back


def test_fid_generation_holds_one_batch_of_images_on_the_gpu():
    """Review 6's L5: the images a validation makes for FID are extracted a batch at a
    time (_generative.made_features), not all kept (twice) on the GPU: 1,024 images of
    3 x 128 x 128 would be 200 MB, twice; one batch of 64 is 12.6 MB."""
    from tasks import _generative

    features = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten()).cuda()
    features.register_parameter("anchor", torch.nn.Parameter(torch.zeros(1, device="cuda")))
    features.num_features = 3

    def make(indices):
        return torch.rand(len(indices), 3, 128, 128, device="cuda")

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    found = _generative.made_features(features, make, torch.arange(1024), 64)
    assert found.shape == (1024, 3) and found.device.type == "cpu"
    assert torch.cuda.max_memory_allocated() - start < 40 * 2**20


def test_ddpm_attention_runs_on_a_fused_kernel_in_nchw():
    """CUDA review 7's N-L1: with the math path off, DDPM's attention runs (flash or
    memory-efficient) on NCHW activations under bf16, and agrees with the math path."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import ddpm

    torch.manual_seed(0)
    block = ddpm.Attention(64).cuda()
    torch.nn.init.normal_(block.proj.weight, std=0.1)
    x = torch.randn(4, 64, 16, 16, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            fused = block(x)
        with sdpa_kernel([SDPBackend.MATH]):
            math = block(x)
    torch.testing.assert_close(fused.float(), math.float(), rtol=2e-2, atol=2e-2)

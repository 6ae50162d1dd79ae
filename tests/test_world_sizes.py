"""Exact at the world sizes users run (issue 50): 3 and 4 processes resume bit for bit, and
a run resumed on another number of processes that keeps the global batch trains the same
samples at every step, to float rounding of the weights.

A DDP wrapper all-reduces its first backward in one bucket and rebuilds its buckets after
it; with 3 or more processes the sum of an element depends on its place in its bucket, so
a resumed run's first step (on the one bucket) ended in other bits than the same step of
the run that never stopped (on rebuilt ones): CUDA review 6's M2. ``runtime.distributed``
spends that one-bucket iteration on zeros before any step.

Each torchrun costs 15-20 s on two cores (the processes import torch), so one launch here
runs several train.main in turn (``SEVERAL``) and the single-process runs are made in this
process. 8 processes: checked by hand (docs/distributed.md), too slow for the suite.
"""

import json
import os

import pytest
import torch
from helpers import (
    FLAGS,
    ROOT,
    ckpt,
    final_state,
    finish,
    start_torchrun,
    tiny_args,
    write_launcher,
)

import config as config_module
import dcgan
import ddpm
import pix2pix
import train
from machinery import ledger, runtime, verify_resume
from networks import build_network
from reporting import gan_metrics

pytestmark = pytest.mark.slow  # (torchruns of 3 and 4 processes; conftest agrees)
TIMEOUT = 600

# train.main once per argv in RUNS, in the same torchrun processes; each run joins a group
# of its own (a store prefix of its own: a torchrun restart's round number).
SEVERAL = """
import json
import os
RUNS = json.loads({runs!r})
for i, argv in enumerate(RUNS):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(i)
    code = train.main(argv)
    if code:
        sys.exit(code)
sys.exit(0)
"""


def several(tmp_path, runs, nproc):
    """Runs train.main(argv) for each argv of ``runs`` in one torchrun of ``nproc``
    processes; returns its output."""
    script = write_launcher(tmp_path / "several.py", SEVERAL.format(runs=json.dumps(runs)))
    rc, out = finish(start_torchrun([], script=script, nproc=nproc), timeout=TIMEOUT)
    assert rc == 0, out[-3000:]
    return out


def assert_exact(whole, resumed):
    """The two runs' last checkpoints are equal bit for bit (the config aside)."""
    difference = verify_resume.compare_checkpoints(final_state(whole), final_state(resumed))
    assert difference is None, difference


def assert_rounding(whole, resumed):
    """The same step, and weights (and the EMA's) equal to float32 rounding."""
    a, b = final_state(whole), final_state(resumed)
    assert a["step"] == b["step"]
    torch.testing.assert_close(b["model"], a["model"])
    torch.testing.assert_close(b["ema"], a["ema"])


# ---------------------------------------------------- every wrapper, every task's networks

def _networks(task):
    config = config_module.with_defaults({"task": task, "latent_dim": 8, "gan_width": 4,
                                          "pix2pix_width": 4, "image_size": 32,
                                          "diffusion_width": 8})
    if task == "gan":
        return dcgan.networks(config, 3)
    if task == "pix2pix":
        return pix2pix.networks(config, 3, 3)
    if task == "diffusion":
        return ddpm.build(config, 3)
    return build_network("resnet9", 10, 3, 8)  # (BatchNorm: buffers that must not move)


@pytest.mark.parametrize("task", ["classification", "gan", "pix2pix", "diffusion"])
def test_every_ddp_wrapper_trains_its_first_step_on_rebuilt_buckets(tmp_path, task):
    """The mechanism, in a one-process group: every wrapper train.py makes (one network;
    each of several) has spent its one-bucket iteration before the first step, so the
    first real forward already rebuilds the buckets; and nothing of the network moved
    (no gradient left, buffers and weights as they were)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        net = _networks(task)
        before = {k: v.clone() for k, v in net.state_dict().items()}
        config = config_module.with_defaults({"task": task})
        model = train.wrap_model(net, config, torch.device("cpu"), world_size=2)
        wrappers = model.values() if isinstance(model, torch.nn.ModuleDict) else [model]
        for wrapped in wrappers:
            assert isinstance(wrapped, torch.nn.parallel.DistributedDataParallel)
            assert all(p.grad is None for p in wrapped.module.parameters())
            params = [p for p in wrapped.module.parameters() if p.requires_grad]
            wrapped.module.forward = lambda *a, params=params: sum(p.sum() for p in params)
            try:
                wrapped(torch.zeros(())).backward()
            finally:
                del wrapped.module.forward
            assert wrapped._has_rebuilt_buckets, task  # (DDP's own flag, set at a rebuild)
        for key, value in net.state_dict().items():
            assert torch.equal(value, before[key]), key
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------- 3 processes

def test_verify_resume_under_three_processes_is_exact(tmp_path):
    """Review 6's M2 as the user meets it: --verify-resume under torchrun of 3 processes
    said "resume differs" and blamed a dropout or a kernel; with gradient accumulation
    (a stop inside its window), an EMA and a DataLoader worker in each process. (This is
    --verify-resume's test under torchrun: process 0 starts a torchrun of its own with as
    many processes, the others end at once; 2 processes take the same path.)"""
    args = tiny_args(tmp_path / "mine", *FLAGS, "--virtual-batch-size", "4", "--ema-decay",
                     "0.9", "--num-workers", "1", size=48, batch=2, epochs=2)
    rc, out = finish(start_torchrun([*args, "--verify-resume", "--verify-resume-steps", "3"],
                                    nproc=3), timeout=TIMEOUT)
    assert rc == 0, out[-3000:]
    assert "3 process(es)" in out and "resume exact" in out


# ---------------------------------------------- 4 processes, and another number of them

def test_four_processes_resume_exactly_and_a_requeue_keeps_the_steps(tmp_path, capsys):
    """One torchrun of 4 processes (global batch 16: 2 per process, 2 micro-batches a
    step; 56 samples, steps of 16, 16, 16, 8 an epoch; an EMA):

    - a run resumed at step 2 ends bit for bit as the run that never stopped (M2);
    - so does a run with ``--preflight train`` (its step used up DDP's first iteration);
    - a one-process run's checkpoint resumed on 4 processes with --batch-size 4;

    then, in this process, the 4 processes' checkpoint resumed on one with --batch-size 16
    (no accumulation). Both requeues train the same samples at every step as the run that
    never stopped (the ledger) and end within rounding of its weights. Resumed on one
    process with the checkpoint's --batch-size 2, the global batch would be 4: one line
    naming the flags that keep it, exit 2, nothing written."""
    flags = (*FLAGS, "--ema-decay", "0.9", "--sample-ledger", "--ckpt-every-steps", "1",
             "--keep-last", "20")
    whole, resumed, preflight = (tmp_path / name for name in ("whole", "resumed", "preflight"))
    one, one_on_four, four_on_one = (tmp_path / n for n in ("one", "one4", "four1"))
    assert train.main(tiny_args(one, *flags, "--virtual-batch-size", "16", size=56, batch=8,
                                epochs=2)) == 0
    four = ("--virtual-batch-size", "4")
    several(tmp_path, [
        tiny_args(whole, *flags, *four, size=56, batch=2, epochs=2),
        tiny_args(resumed, *flags, *four, "--resume", ckpt(whole, "step-00000002.pt"),
                  size=56, batch=2, epochs=2),
        tiny_args(preflight, *flags, *four, "--preflight", "train", size=56, batch=2,
                  epochs=2),
        tiny_args(one_on_four, *flags, "--resume", ckpt(one, "step-00000002.pt"),
                  "--batch-size", "4", "--virtual-batch-size", "0", size=56, epochs=2),
    ], nproc=4)
    assert final_state(whole)["step"] == 8
    assert_exact(whole, resumed)
    assert_exact(whole, preflight)
    assert_rounding(one, one_on_four)
    assert ledger.compare(one, one_on_four)[0], ledger.compare(one, one_on_four)[1]

    capsys.readouterr()
    assert train.main(tiny_args(four_on_one, *flags, "--resume", ckpt(whole, "step-00000002.pt"),
                                "--batch-size", "16", "--virtual-batch-size", "0",
                                size=56, epochs=2)) == 0
    assert "note: the checkpoint took" not in capsys.readouterr().out
    assert_rounding(whole, four_on_one)
    same, lines = ledger.compare(whole, four_on_one)
    assert same and lines == ["the same samples at each of steps 3-8 (6 steps)"], lines
    assert len(ledger.step_samples(whole)[8]) == 8  # the short step: 2 per process

    refused = tmp_path / "refused"
    assert train.main(["--resume", ckpt(whole, "step-00000002.pt"), "--run-dir",
                       str(refused)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the checkpoint took 16 samples per optimizer step (4 process(es)), "
                   "this run takes 4 (1): to continue the same training on 1 process(es), "
                   "pass --virtual-batch-size 16 (accumulating 8 batches of 2) or "
                   "--batch-size 16 --virtual-batch-size 0"], err
    assert not refused.exists()


def test_a_global_batch_no_world_size_can_keep_is_one_line(tmp_path, capsys):
    """3 processes cannot share 16 samples a step: the line says which numbers can. On
    the checkpoint's own number of processes, another --batch-size is the user's choice:
    a note."""
    run_dir = tmp_path / "run"
    assert train.main(tiny_args(run_dir, *FLAGS, "--max-steps", "1", size=32)) == 0
    saved = final_state(run_dir)
    with pytest.raises(runtime.UserError) as caught:
        runtime.check_step_size(saved, saved["config"], world=3)
    assert str(caught.value) == (
        "the checkpoint took 16 samples per optimizer step (1 process(es)), this run takes "
        "48 (3): 3 processes cannot share 16 samples per step; to continue the same "
        "training, run a number of processes that divides 16, with --batch-size 16 / "
        "processes")
    runtime.check_step_size(saved, {**saved["config"], "batch_size": 4}, world=4)  # kept
    capsys.readouterr()
    runtime.check_step_size(saved, {**saved["config"], "batch_size": 8}, world=1)
    assert capsys.readouterr().out == (
        "note: the checkpoint took 16 samples per optimizer step (1 process(es)), this run "
        "takes 8 (1); to continue the same training, set --batch-size (per process) so that "
        "they match\n")


# ------------------------------------------------ the review's other items: L1, L5, M4

def test_ssims_filter_gets_nchw_images_whatever_their_format(monkeypatch):
    """Review 6's L1: outputs in channels_last (--channels-last) kept that format through
    torchmetrics' padding into SSIM's depthwise filter, which torch then hands to cuDNN
    and its TF32 (SSIM(x, x) 0.93 on flat shapes). The CPU shows the format the filter
    gets; tests/test_cuda.py the figure."""
    import torch.nn.functional as F

    from tasks.pix2pix import Pix2PixEvaluation

    formats, conv2d = [], F.conv2d

    def watched(x, *args, **kwargs):
        formats.append(x.is_contiguous())
        return conv2d(x, *args, **kwargs)

    x = torch.rand(4, 3, 4, 4).repeat_interleave(16, -1).repeat_interleave(16, -2) * 2 - 1
    for memory_format in (torch.contiguous_format, torch.channels_last):
        evaluation = Pix2PixEvaluation(torch.device("cpu"))
        monkeypatch.setattr(F, "conv2d", watched)
        evaluation.update(x.to(memory_format=memory_format), x.to(memory_format=memory_format))
        monkeypatch.setattr(F, "conv2d", conv2d)
        assert evaluation.compute()["ssim"] > 0.9999
    assert formats == [True, True]


class _Features(torch.nn.Module):
    """A feature extractor as gan_metrics.measure takes one: 6 numbers of an image."""

    name, num_features = "classifier", 6

    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.LazyLinear(6))

    def forward(self, images):
        return self.net(images)


def test_fid_holds_one_batch_of_made_images_and_each_process_its_share_of_real_ones(
        monkeypatch):
    """Review 6's L5: a validation made all --fid-samples images before extracting their
    features (on the GPU, twice: a list, then its concatenation: 16 GB at 256 px), and
    every process kept up to --fid-samples real images of its shard where it needs only
    its share of the first ones (63 GB of host memory on an 8-GPU node). Now the images
    are made and extracted a batch at a time, the same bits; a process keeps its share."""
    from tasks import _generative
    from tasks.gan import GAN, GANEvaluation

    torch.manual_seed(0)
    features = _Features()
    features(torch.zeros(1, 3, 8, 8))
    images = torch.rand(20, 3, 8, 8) * 2 - 1
    asked = []

    def make(indices):
        asked.append(len(indices))
        return images[indices]

    task = type("Task", (), {"fid_samples": 20, "features": features, "seed": 3})()
    real = gan_metrics.extract(features, images.flip(0), 8)
    got = _generative.generated_scores(task, make, real, batch_size=8)
    assert asked == [8, 8, 4]  # one batch at a time
    assert got == gan_metrics.measure(features, images.flip(0), images, 3, 8)  # the bits

    import torch.distributed as dist

    monkeypatch.setattr(gan_metrics, "build_features", lambda path: features)
    config = config_module.with_defaults({"task": "gan", "latent_dim": 8, "gan_width": 4})
    gan = GAN(config, type("Set", (), {"transform": None})(), fid_samples=8, val_size=10)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for rank, share in ((0, 5), (1, 3)):  # shards 0-4 and 5-9 of the 10; the first 8
        monkeypatch.setattr(dist, "get_rank", lambda group=None, rank=rank: rank)
        evaluation = GANEvaluation(gan, dcgan.networks(config, 3))
        for batch in images[:5].split(2):
            evaluation.update(batch, None)
        assert evaluation.have == share, rank


LEASE_S, START_S = 900, 120  # a lent GPU's 15 minutes; a machine's start, at most


def _gpu_sh_plan(tmp_path, **env_extra):
    """bench/gpu.sh's GPU profile run with a $PYTHON that does nothing for train.py,
    pytest and the benches (imports skipped: no GPU here): its budget line and the checks
    it starts, in order."""
    import re
    import subprocess
    import sys

    tmp_path.mkdir()
    shim = tmp_path / "python-shim"
    shim.write_text(f'#!/bin/sh\ncase "$*" in *train.py*|*pytest*|*bench/*) exit 0;; esac\n'
                    f'exec {sys.executable} "$@"\n')
    shim.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("GPU_SH_") and k not in ("RANK", "WORLD_SIZE")}
    env.update(PYTHON=str(shim), OUT=str(tmp_path / "out"), GPU_SH_SKIP="imports",
               **env_extra)
    done = subprocess.run(["bash", os.path.join(ROOT, "bench", "gpu.sh")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)
    budget = int(re.search(r"budget (\d+) s", done.stdout).group(1))
    return budget, re.findall(r"^== (\S+) ", done.stdout, re.M)


def test_each_gpu_sh_call_fits_a_lease_with_a_second_try(tmp_path):
    """Review 6's M4: the slot profile held about 510 s of work for its 480 s budget, in
    a 560 s call: one try a lease, its last checks cut. Now a call of either GPU profile
    (the slot's goal figures and CUDA tests; the rates' step rates) has a budget that,
    with its call's timeout_s (bench/README.md), fits one lease twice after the start."""
    import re

    readme = open(os.path.join(ROOT, "bench", "README.md"), encoding="utf-8").read()
    timeouts = {int(t) for t in re.findall(r"timeout_s=(\d+)", readme)}
    assert len(timeouts) == 1, timeouts  # the one call, written once
    timeout_s = timeouts.pop()
    assert START_S + 2 * timeout_s <= LEASE_S
    budget, checks = _gpu_sh_plan(tmp_path / "slot")
    assert budget + 30 <= timeout_s  # (the install, a check's 10 s to die, the JSON)
    assert checks == ["resnet9-device", "resnet18-bf16", "resnet18-fp32", "tests"]
    budget, checks = _gpu_sh_plan(tmp_path / "rates", GPU_SH_RATES="1")
    assert budget + 30 <= timeout_s
    assert checks == ["segmentation", "gan", "diffusion", "pix2pix", "detection",
                      "resnet9-loader"]

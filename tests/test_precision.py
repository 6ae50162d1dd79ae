"""Virtual batch size, mixed precision, activation checkpointing, channels_last, compile,
FLOP counting: each proven equivalent to (or consistent with) the plain fp32 path."""

import copy
import os
import shutil

import pytest
import torch
import torch.nn.functional as F
from helpers import assert_states_equal, final_state, read_metrics, tiny_args

import layers
import ops
import tasks
import train
from config import parse_config, with_defaults
from machinery import checkpoint, engine, meters
from networks import build_network
from pipeline import data
from tasks.classification import Classification

CPU = torch.device("cpu")
CHANNELS_LAST = torch.channels_last


# ----------------------------------------------------------------------------- helpers

@pytest.fixture(autouse=True)
def _one_thread():
    # The tensors here are tiny: a second thread only adds synchronisation, which on a
    # busy 2-core machine made resnet18's steps 10-30x slower. Restored afterwards.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _synthetic(size, image=8, augment=True):
    config = with_defaults({"dataset": "synthetic", "data_dir": "data", "seed": 0,
                            "augment": augment, "image_size": image, "synthetic_size": size,
                            "num_classes": 10})
    return data.build_datasets(config)[0]


def _run_settings(accum=1, **kwargs):
    kwargs.setdefault("scaler", torch.amp.GradScaler("cpu", enabled=False))
    return engine.LoopSettings(device=CPU, accum=accum, show_progress=False,
                               timer=engine.StepTimer(CPU), counters=meters.Counters(CPU),
                               **kwargs)


def _train_epoch(net, train_set, batch, run, optimizer):
    """One epoch through engine.train_one_epoch, as train.py drives it."""
    sampler = data.EpochBatchSampler(len(train_set), batch, seed=0)
    loader = data.build_loader(train_set, batch_sampler=sampler)
    progress = engine.TrainState()
    task = Classification(train_set.num_classes,
                                criterion=torch.nn.CrossEntropyLoss(label_smoothing=0.1))
    engine.train_one_epoch(net, loader, optimizer, task, run, progress)
    return sampler, progress


def _capture_step_grads(monkeypatch, optimizer, net):
    """Records every parameter's .grad each time optimizer.step runs."""
    captured = []
    real_step = optimizer.step

    def step(*args, **kwargs):
        captured.append([p.grad.detach().clone() for p in net.parameters()])
        return real_step(*args, **kwargs)

    monkeypatch.setattr(optimizer, "step", step)
    return captured


def _sgd(net, lr):
    return torch.optim.SGD([{"params": list(net.parameters()), "base_lr": lr}], lr=lr)




def _resume_from(run_dir, name, new_dir, args):
    """Resumes from ``run_dir``'s checkpoint ``name``, writing into ``new_dir``."""
    path = os.path.join(run_dir, "checkpoints", name)
    return train.main(args(new_dir) + ["--resume", path])


# ------------------------------------------------------------------ virtual batch size

def test_accumulated_gradient_equals_whole_batch_gradient(monkeypatch):
    # 44 samples, micro-batches of 8, 3 per step: windows of 8+8+8 and 8+8+4 samples.
    train_set = _synthetic(44)
    torch.manual_seed(0)
    net = build_network("mlp", 10, 3, 8)
    optimizer = _sgd(net, 0.0)  # lr 0: every window sees the same weights
    captured = _capture_step_grads(monkeypatch, optimizer, net)
    sampler, progress = _train_epoch(net, train_set, 8, _run_settings(accum=3), optimizer)
    assert (progress.step, progress.epoch_samples) == (2, 44)

    batches = list(sampler)
    windows = [sum(batches[:3], []), sum(batches[3:], [])]
    assert [len(w) for w in windows] == [24, 20]
    criterion = torch.nn.CrossEntropyLoss(label_smoothing=0.1)
    for keys, grads in zip(windows, captured, strict=True):
        x = torch.stack([train_set[k][0] for k in keys])
        y = torch.tensor([train_set[k][1] for k in keys])
        net.zero_grad()
        criterion(net(x), y).backward()
        for p, g in zip(net.parameters(), grads, strict=True):
            torch.testing.assert_close(g, p.grad)


@pytest.mark.parametrize("size", [256, 300])  # 300: the last window has 44 samples
def test_virtual_batch_trains_like_the_big_batch(tmp_path, size):
    def args(run_dir, *extra):
        return tiny_args(run_dir, *extra, size=size, epochs=2, batch=32)

    assert train.main(args(tmp_path / "big", "--batch-size", "128")) == 0
    assert train.main(args(tmp_path / "virtual", "--virtual-batch-size", "128")) == 0
    big, virtual = final_state(tmp_path / "big"), final_state(tmp_path / "virtual")
    assert big["step"] == virtual["step"] == 2 * -(-size // 128)
    torch.testing.assert_close(virtual["model"], big["model"])
    torch.testing.assert_close(virtual["optimizer"]["state"], big["optimizer"]["state"])
    torch.manual_seed(0)  # train.py's seed: the initial weights, which training moved
    assert not torch.equal(big["model"]["fc.weight"], build_network("mlp", 10, 3, 8).fc.weight)


def test_virtual_batch_not_a_multiple_is_a_user_error(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path, "--batch-size", "32", "--virtual-batch-size", "100"))
    assert code == 2
    err = capsys.readouterr().err
    assert "error: --virtual-batch-size 100 must be a multiple of --batch-size 32" in err
    assert "Traceback" not in err


# ------------------------------------------------------------------- mixed precision

def test_bf16_learns_and_resumes_bit_for_bit(tmp_path):
    def args(run_dir):
        return tiny_args(run_dir, "--amp", "bf16", "--keep-last", "5", network="simple_cnn",
                         epochs=3)

    assert train.main(args(tmp_path / "whole")) == 0
    losses = [m["train_loss"] for m in read_metrics(tmp_path / "whole")]
    assert losses[2] < losses[1] < losses[0]
    assert _resume_from(tmp_path / "whole", "epoch-0001.pt", tmp_path / "resumed", args) == 0
    whole, resumed = final_state(tmp_path / "whole"), final_state(tmp_path / "resumed")
    for key in ("model", "optimizer", "scaler", "step", "epoch"):
        assert_states_equal(resumed[key], whole[key])


def test_fp16_trains_and_its_grad_scaler_survives_a_resume(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def args(run_dir):
        return tiny_args(run_dir, "--amp", "fp16", "--keep-last", "5", epochs=2)

    def scaler_of(run_dir):
        saved = final_state(run_dir)["scaler"]
        return saved["scale"], saved["_growth_tracker"]

    assert train.main(args(tmp_path / "whole")) == 0
    whole = final_state(tmp_path / "whole")
    saved = whole["scaler"]
    # GradScaler's initial scale 2^16; 8 steps, none skipped, and no growth before 2000
    assert scaler_of(tmp_path / "whole") == (2.0 ** 16, 8)
    assert whole["progress"]["scaler_skips"] == 0
    fresh = torch.amp.GradScaler("cpu")
    fresh.load_state_dict(saved)
    assert_states_equal(fresh.state_dict(), saved)
    events = EventAccumulator(str(tmp_path / "whole")).Reload()
    skips = events.Scalars("train/scaler_skips")
    assert skips[-1].value == whole["progress"]["scaler_skips"]

    # Resumed from the first epoch's checkpoint, the scaler continues (growth tracker and
    # scale), so the run ends exactly where the uninterrupted one did.
    mid_path = tmp_path / "whole" / "checkpoints" / "epoch-0001.pt"
    mid = checkpoint.load_checkpoint(mid_path)
    assert mid["step"] == 4 and mid["scaler"]["_growth_tracker"] > 0
    assert _resume_from(tmp_path / "whole", "epoch-0001.pt", tmp_path / "resumed", args) == 0
    assert scaler_of(tmp_path / "resumed") == scaler_of(tmp_path / "whole")
    resumed = final_state(tmp_path / "resumed")
    for key in ("model", "optimizer", "scaler", "step"):
        assert_states_equal(resumed[key], whole[key])

    # The resumed run takes its scaler from the checkpoint: the same checkpoint with another
    # scale and growth tracker ends with those, moved on by epoch 2's 4 steps (no overflow
    # at a scale of 2^10; growth only every 2000 steps).
    mid["scaler"].update(scale=2.0 ** 10, _growth_tracker=1000)
    checkpoint.save_checkpoint(mid, tmp_path / "edited.pt")
    assert train.main(args(tmp_path / "edited") + ["--resume", str(tmp_path / "edited.pt")]) == 0
    assert final_state(tmp_path / "edited")["progress"]["scaler_skips"] == \
        mid["progress"]["scaler_skips"]
    assert scaler_of(tmp_path / "edited") == (2.0 ** 10, 1004)


def test_grad_clipping_sees_unscaled_gradients(monkeypatch):
    train_set = _synthetic(32)
    torch.manual_seed(0)
    net = build_network("mlp", 10, 3, 8)
    optimizer = _sgd(net, 0.1)
    captured = _capture_step_grads(monkeypatch, optimizer, net)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    run = _run_settings(accum=2, scaler=scaler, amp_dtype=torch.float16, grad_clip=0.01)
    _train_epoch(net, train_set, 8, run, optimizer)
    assert len(captured) == 2  # no step skipped: every step was taken and clipped
    for grads in captured:
        norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))
        torch.testing.assert_close(norm, torch.tensor(0.01), rtol=1e-4, atol=0.0)


def test_overflowing_fp16_steps_are_skipped_and_counted():
    train_set = _synthetic(32)
    torch.manual_seed(0)
    net = build_network("mlp", 10, 3, 8)
    before = copy.deepcopy(net.state_dict())
    optimizer = _sgd(net, 0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40)  # overflows fp16 gradients
    run = _run_settings(scaler=scaler, amp_dtype=torch.float16)
    _, progress = _train_epoch(net, train_set, 8, run, optimizer)
    assert progress.step == 4
    assert run.counters.read()["scaler_skips"] == 4
    assert scaler.get_scale() == 2.0 ** 36  # halved after each skipped step
    assert_states_equal(net.state_dict(), before)


def test_amp_the_device_cannot_do_is_a_user_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.amp, "is_autocast_available", lambda device_type: False)
    assert train.main(tiny_args(tmp_path / "a", "--amp", "bf16")) == 2
    err = capsys.readouterr().err
    assert "error: --amp bf16: no autocast on cpu" in err and "Traceback" not in err


def test_amp_dtype_autocast_would_silently_disable_is_a_user_error(tmp_path, capsys,
                                                                   monkeypatch):
    # Older torch builds warn "the target dtype is not supported" and run in fp32.
    real_autocast = torch.autocast

    def autocast(device_type, dtype=None, enabled=True, **kwargs):
        return real_autocast(device_type, dtype=dtype, enabled=enabled and dtype is None,
                             **kwargs)

    monkeypatch.setattr(torch, "autocast", autocast)
    assert train.main(tiny_args(tmp_path, "--amp", "fp16")) == 2
    err = capsys.readouterr().err
    assert "error: --amp fp16: autocast on cpu cannot do torch.float16" in err


# ------------------------------------------------------------ activation checkpointing

@pytest.mark.parametrize("name,side", [("simple_cnn", 16), ("resnet18", 8)])
def test_grad_checkpointing_changes_no_gradient_weight_or_bn_statistic(name, side):
    torch.manual_seed(0)
    plain = build_network(name, 10, 3, side)
    ckpt = copy.deepcopy(plain)
    ckpt.set_grad_checkpointing(True)
    nets = (plain, ckpt)
    optimizers = [torch.optim.SGD(n.parameters(), lr=0.1, momentum=0.9) for n in nets]
    g = torch.Generator().manual_seed(1)
    steps = 2
    for _ in range(steps):
        x = torch.randn(4, 3, side, side, generator=g)
        y = torch.randint(0, 10, (4,), generator=g)
        for net, optimizer in zip(nets, optimizers):
            net.train()
            optimizer.zero_grad()
            F.cross_entropy(net(x), y).backward()
        for p, q in zip(plain.parameters(), ckpt.parameters(), strict=True):
            torch.testing.assert_close(q.grad, p.grad)
        for optimizer in optimizers:
            optimizer.step()
    state, ckpt_state = plain.state_dict(), ckpt.state_dict()
    tracked = [k for k in state if k.endswith("num_batches_tracked")]
    assert tracked and all(int(state[k]) == steps for k in tracked)
    for key in state:
        if key.endswith("num_batches_tracked"):
            assert torch.equal(ckpt_state[key], state[key]), key
        else:
            torch.testing.assert_close(ckpt_state[key], state[key], msg=key)


# simple_cnn keeps each block's input instead of two tensors of its output's size (about
# half); resnet18's blocks hold five or more tensors each (about a third).
@pytest.mark.parametrize("name,at_most", [("simple_cnn", 0.6), ("resnet18", 0.4)])
def test_grad_checkpointing_keeps_far_fewer_activations(name, at_most, monkeypatch):
    torch.manual_seed(0)
    net = build_network(name, 10, 3, 16)
    x = torch.randn(2, 3, 16, 16)
    plain = ops.saved_tensor_bytes(net, x)
    net.set_grad_checkpointing(True)
    ckpt = ops.saved_tensor_bytes(net, x)
    assert 0 < ckpt < at_most * plain, (ckpt, plain)


def test_checkpoint_forward_updates_cumulative_batchnorm_once():
    # momentum=None: running statistics are the mean over all batches so far.
    torch.manual_seed(0)
    block = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4, momentum=None),
                                torch.nn.ReLU())
    twin = copy.deepcopy(block)
    for _ in range(3):
        x = torch.randn(2, 3, 6, 6, requires_grad=True)
        block(x).square().sum().backward()
        layers.checkpoint_forward(twin, x).square().sum().backward()
    assert int(twin[1].num_batches_tracked) == 3 and twin[1].momentum is None
    for (name, value), twin_value in zip(block.state_dict().items(), twin.state_dict().values()):
        torch.testing.assert_close(twin_value, value, msg=name)
    for p, q in zip(block.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad)


def test_grad_checkpointing_flag_trains_the_same_weights(tmp_path):
    def args(run_dir, *extra):
        return tiny_args(run_dir, *extra, network="simple_cnn", epochs=2)

    assert train.main(args(tmp_path / "plain")) == 0
    assert train.main(args(tmp_path / "ckpt", "--grad-checkpointing")) == 0
    plain, ckpt = final_state(tmp_path / "plain"), final_state(tmp_path / "ckpt")
    assert ckpt["config"]["grad_checkpointing"] is True
    for key, value in plain["model"].items():
        torch.testing.assert_close(ckpt["model"][key], value, msg=key)


# ------------------------------------------------------------------------ channels_last

@pytest.mark.parametrize("name", ["simple_cnn", "resnet18", "mlp"])
def test_channels_last_outputs_and_gradients_match_contiguous(name):
    torch.manual_seed(0)
    net = build_network(name, 10, 3, 8)
    cl = copy.deepcopy(net).to(memory_format=CHANNELS_LAST)
    x = torch.randn(4, 3, 8, 8)
    x_cl = x.to(memory_format=CHANNELS_LAST)
    assert x_cl.is_contiguous(memory_format=CHANNELS_LAST) and not x.is_contiguous(
        memory_format=CHANNELS_LAST)
    for mode in ("eval", "train"):
        getattr(net, mode)()
        getattr(cl, mode)()
        # Other kernels sum in another order; float32 rounding differs by ~1e-5.
        torch.testing.assert_close(cl(x_cl), net(x), rtol=1e-4, atol=1e-4)
    net.zero_grad()
    cl.zero_grad()
    net(x).square().mean().backward()
    cl(x_cl).square().mean().backward()
    for p, q in zip(net.parameters(), cl.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-3, atol=1e-4 * p.grad.abs().max())


def test_build_model_puts_conv_weights_in_channels_last(tmp_path):
    train_set = _synthetic(16)
    for flag in ([], ["--channels-last"]):
        config, _ = parse_config(tiny_args(tmp_path, *flag, network="resnet18"))
        net, model = train.build_model(config, train_set, CPU, 1, lambda message: None,
                                       tasks.of(config))
        assert model is net
        weights = [p for p in net.parameters() if p.dim() == 4]
        assert len(weights) == 20  # stem, 8 blocks of 2, 3 shortcut convolutions
        channels_last = [w.is_contiguous(memory_format=CHANNELS_LAST) for w in weights]
        if flag:
            assert all(channels_last)
        else:  # a 1x1 kernel is both; a 3x3 one is not
            assert not any(c for c, w in zip(channels_last, weights) if w.shape[-1] > 1)


def test_channels_last_run_feeds_channels_last_batches(tmp_path, monkeypatch):
    seen = {"train": [], "weights": [], "eval": []}  # channels_last or not, per forward

    def hook_for(kind):
        def hook(module, inputs):
            seen[kind].append(inputs[0].is_contiguous(memory_format=CHANNELS_LAST))
            if kind == "train":
                seen["weights"].append(all(p.is_contiguous(memory_format=CHANNELS_LAST)
                                           for p in module.parameters() if p.dim() == 4))
        return hook

    real_steps, real_evaluate = engine.steps, engine.evaluate

    def steps(model, *args, **kwargs):  # a generator: the hook stays while it runs
        handle = model.register_forward_pre_hook(hook_for("train"))
        try:
            yield from real_steps(model, *args, **kwargs)
        finally:
            handle.remove()

    def evaluate(model, *args, **kwargs):
        handle = model.register_forward_pre_hook(hook_for("eval"))
        try:
            return real_evaluate(model, *args, **kwargs)
        finally:
            handle.remove()

    monkeypatch.setattr(engine, "steps", steps)
    monkeypatch.setattr(engine, "evaluate", evaluate)

    def args(run_dir, *extra):  # 2 epochs of 4 batches, one validation batch each
        return tiny_args(run_dir, *extra, network="simple_cnn", epochs=2)

    assert train.main(args(tmp_path / "cl", "--channels-last")) == 0
    assert seen == {"train": [True] * 8, "weights": [True] * 8, "eval": [True] * 2}
    seen.update(train=[], weights=[], eval=[])
    assert train.main(args(tmp_path / "plain")) == 0
    assert seen == {"train": [False] * 8, "weights": [False] * 8, "eval": [False] * 2}
    cl, plain = final_state(tmp_path / "cl"), final_state(tmp_path / "plain")
    for key, value in plain["model"].items():
        torch.testing.assert_close(cl["model"][key], value, rtol=1e-4, atol=1e-5, msg=key)


# ------------------------------------------------------------------------------ compile

def test_compiled_run_saves_weights_an_uncompiled_network_loads(tmp_path, monkeypatch):
    # The aot_eager backend traces forward and backward like inductor but generates no
    # C++; test_compile_inductor_smoke below runs the real backend.
    real_compile = torch.compile
    compiled = []

    def compile_(model, **kwargs):
        compiled.append(real_compile(model, backend="aot_eager"))
        return compiled[-1]

    monkeypatch.setattr(torch, "compile", compile_)
    assert train.main(tiny_args(tmp_path, "--compile", "--max-steps", "2")) == 0
    assert len(compiled) == 1 and isinstance(compiled[0], torch._dynamo.eval_frame.OptimizedModule)
    _check_plain_checkpoint(tmp_path, compiled[0])


def _check_plain_checkpoint(run_dir, compiled_model):
    state = final_state(run_dir)
    assert state["step"] == 2
    assert not [k for k in state["model"] if "_orig_mod" in k or k.startswith("module.")]
    net = build_network("mlp", 10, 3, 8)
    net.load_state_dict(state["model"])  # strict
    x = torch.randn(4, 3, 8, 8)
    compiled_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(net.eval()(x), compiled_model(x))


def _c_compiler():
    return shutil.which("gcc") or shutil.which("cc")


@pytest.mark.skipif(not os.environ.get("SLOW_TESTS"),
                    reason="inductor compiles C++ for 20-70 s on a 2-core CPU; "
                           "set SLOW_TESTS=1 to run")
@pytest.mark.skipif(not _c_compiler(), reason="torch.compile's inductor needs a C compiler "
                    "(gcc or cc) on the CPU, and none is installed")
def test_compile_inductor_smoke(tmp_path, monkeypatch):
    real_compile = torch.compile
    compiled = []

    def compile_(model, **kwargs):
        compiled.append(real_compile(model, **kwargs))
        return compiled[-1]

    monkeypatch.setattr(torch, "compile", compile_)
    try:
        code = train.main(tiny_args(tmp_path, "--compile", "--max-steps", "2"))
    except Exception as e:  # noqa: BLE001 - only the compiler's environment is forgiven
        if type(e).__name__ in ("CppCompileError", "InductorError", "BackendCompilerFailed") \
                and any(w in str(e) for w in ("gcc", "cc1", "compiler", "#include", "ld:")):
            pytest.skip(f"inductor could not compile here: {str(e).splitlines()[0][:200]}")
        raise
    assert code == 0
    _check_plain_checkpoint(tmp_path, compiled[0])


# -------------------------------------------------------------------------------- FLOPs

def test_mlp_flops_are_the_hand_count():
    c, h, w, hidden, k = 3, 8, 8, 512, 10
    d = c * h * w
    forward = 2 * (d * hidden + hidden * k)
    # Backward: the output layer's input and weight gradients, the hidden layer's weight
    # gradient only (the images need no gradient); bias gradients are sums, not counted.
    backward = 2 * (2 * hidden * k) + 2 * d * hidden
    net = build_network("mlp", k, c, h)
    assert ops.train_flops_per_sample(net, (c, h, w), CPU) == forward + backward == 423_936
    net.set_grad_checkpointing(True)  # model FLOPs: the recomputed forward does not count
    assert ops.train_flops_per_sample(net, (c, h, w), CPU) == 423_936


def test_metrics_report_tflops(tmp_path):
    assert train.main(tiny_args(tmp_path, epochs=2)) == 0
    records = read_metrics(tmp_path)
    assert len(records) == 2
    for record in records:
        assert "mfu" not in record  # no known GPU here
        torch.testing.assert_close(record["tflops"],
                                   423_936 * record["samples_per_sec"] / 1e12)


def test_autocast_replica_keeps_the_dtype_in_a_thread_that_drops_it():
    # DataParallel's worker threads re-enter autocast with the caller's enabled flag but
    # not its dtype (CUDA's default there is float16; on the CPU it is bfloat16): each
    # replica runs under engine.Autocast, which sets the run's dtype again.
    import threading

    net = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    dtypes = {}

    def replica(name, module):  # what parallel_apply's _worker does around a replica
        with torch.autocast("cpu", enabled=True):
            dtypes[name] = module(x).dtype

    for name, module in (("plain", net), ("wrapped", engine.Autocast(net, "cpu",
                                                                     torch.float16))):
        thread = threading.Thread(target=replica, args=(name, module))
        thread.start()
        thread.join()
    assert dtypes == {"plain": torch.bfloat16, "wrapped": torch.float16}
    assert engine.Autocast(net, "cpu", None)(x).dtype == torch.float32

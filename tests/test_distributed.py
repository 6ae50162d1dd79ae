"""Scale out: DistributedDataParallel under torchrun (gloo on the CPU) and DataParallel.

The promises (docs/design.md): P processes of --batch-size B train like one process of P*B,
also with gradient accumulation and when the last global batch is short or leaves a
process with no sample; evaluation over P processes equals one process's; only rank 0
writes files; a signal to one process stops all of them with one checkpoint; checkpoints
move between 1 and P processes and DataParallel.

Every two-process run is a real ``torchrun`` subprocess. Each costs about ten seconds on
two cores (three Python processes import torch), so the runs that several tests read are
made once per module; single-process references run in this process (``train.main``).
"""

import collections
import contextlib
import glob
import json
import os
import re
import signal
from types import SimpleNamespace

import pytest
import torch
from helpers import (
    FLAGS,
    assert_exit_codes,
    assert_states_equal,
    ckpt,
    final_state,
    finish,
    read_metrics,
    signal_a_worker_once_an_epoch_is_saved,
    start_torchrun,
    tiny_args,
    torchrun,
    write_launcher,
)

import train
from config import parse_config
from machinery import checkpoint
from networks import build_network
from pipeline import data

# ----------------------------------------------------------------------------- helpers


def assert_close_f32(a, b):
    """Numbers computed in float32 (and logged as Python floats) agree to float32 precision."""
    torch.testing.assert_close(torch.tensor(a, dtype=torch.float32),
                               torch.tensor(b, dtype=torch.float32))




# ------------------------------------------------------------ runs shared by the tests

UNFREEZE = ("--freeze", "hidden.*", "--unfreeze-at", "2", "--unfreeze-lr-scale", "1")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run on 2 processes of batch 16 and one in 1 process of batch 32, same seed.

    55 samples: each epoch has a global batch of 32 and a short one of 23, split 12/11
    between the processes; the 11 validation samples split 5/6. Two optimizer steps an
    epoch, twelve in all, each checkpointed. The hidden layers are frozen in epoch 1 and
    unfrozen at epoch 2 (``UNFREEZE``): DDP, which picks the parameters it synchronises
    when it is built, must synchronise them too, also in a run resumed after that.
    """
    base = tmp_path_factory.mktemp("runs")
    flags = (*FLAGS, *UNFREEZE, "--ckpt-every-steps", "1", "--keep-last", "20")
    ddp, single = base / "ddp", base / "single"
    out = torchrun(tiny_args(ddp, *flags, size=55, batch=16, epochs=6))
    assert train.main(tiny_args(single, *flags, size=55, batch=32, epochs=6)) == 0
    return SimpleNamespace(ddp=str(ddp), single=str(single), flags=flags, out=out)


# ---------------------------------------------------------------------- DDP promises

def test_two_processes_train_like_one_with_the_global_batch(runs):
    ddp, single = final_state(runs.ddp), final_state(runs.single)
    assert ddp["step"] == single["step"] == 12
    assert torch.tensor(data.shard_indices(11, 0, 2)).numel() == 5  # the split is uneven
    torch.testing.assert_close(ddp["model"], single["model"])
    torch.testing.assert_close(ddp["optimizer"]["state"], single["optimizer"]["state"])
    start = build_network("mlp", 10, 3, 8).state_dict()
    assert not torch.allclose(ddp["model"]["fc.weight"], start["fc.weight"])  # it trained


def test_evaluation_over_two_processes_equals_one(runs):
    ddp, single = read_metrics(runs.ddp), read_metrics(runs.single)
    assert [r["epoch"] for r in ddp] == [r["epoch"] for r in single] == [1, 2, 3, 4, 5, 6]
    accuracies = [r["val_acc"] for r in single]
    assert 0 < min(accuracies) < 1  # not saturated, so a lost or doubled sample shows
    assert 0 < min(r["val_acc5"] for r in single)  # top-5 hits on both processes count
    for a, b in zip(ddp, single):
        assert (a["val_acc"], a["val_acc5"]) == (b["val_acc"], b["val_acc5"])
        assert_close_f32(a["val_loss"], b["val_loss"])
        assert_close_f32(a["train_loss"], b["train_loss"])
        assert a["step"] == b["step"]


def test_only_rank_zero_writes(runs):
    def names(run_dir):
        return sorted(re.sub(r"tfevents\..*", "tfevents", n) for n in os.listdir(run_dir))

    assert names(runs.ddp) == names(runs.single)
    assert len(glob.glob(os.path.join(runs.ddp, "events.out.tfevents.*"))) == 1
    assert [r["epoch"] for r in read_metrics(runs.ddp)] == [1, 2, 3, 4, 5, 6]
    with open(os.path.join(runs.ddp, "command.txt")) as f:
        invocations = [line for line in f if not line.startswith(" ")]
    assert len(invocations) == 1
    ckpts = sorted(os.listdir(os.path.join(runs.ddp, "checkpoints")))
    assert ckpts == sorted(os.listdir(os.path.join(runs.single, "checkpoints")))
    assert runs.out.count("done: ") == 1 and runs.out.count("Trainable parameters:") == 1


def test_ddp_checkpoint_resumes_in_one_process(runs, tmp_path, train_main, capsys):
    # Step 5 is inside epoch 3: the one process continues mid-epoch, then to 8 epochs.
    path = ckpt(runs.ddp, "step-00000005.pt")
    assert checkpoint.load_checkpoint(path)["progress"]["epoch_samples"] == 32
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    assert train_main(tiny_args(resumed, *runs.flags, "--resume", path, size=55, batch=32,
                                epochs=8)) == 0
    assert "note: the checkpoint took" not in capsys.readouterr().out  # 2 x 16 = 1 x 32
    assert train_main(tiny_args(fresh, *runs.flags, size=55, batch=32, epochs=8)) == 0
    assert final_state(resumed)["step"] == 16
    torch.testing.assert_close(final_state(resumed)["model"], final_state(fresh)["model"])
    resumed_metrics, fresh_metrics = read_metrics(resumed), read_metrics(fresh)[2:]
    assert [r["epoch"] for r in resumed_metrics] == [3, 4, 5, 6, 7, 8]
    for a, b in zip(resumed_metrics, fresh_metrics, strict=True):  # epoch 3 began under DDP
        assert_close_f32(a["train_loss"], b["train_loss"])
        assert a["val_acc"] == b["val_acc"]


def test_resuming_with_another_global_batch_says_so(runs, tmp_path, train_main, capsys):
    path = ckpt(runs.ddp, "step-00000005.pt")
    assert train_main(["--resume", path, "--run-dir", str(tmp_path / "run"), "--epochs",
                       "3"]) == 2  # one process of the checkpoint's 16: refused (issue 50)
    assert ("error: the checkpoint took 32 samples per optimizer step (2 process(es)), this "
            "run takes 16 (1)") in capsys.readouterr().err


def test_one_process_checkpoint_resumes_under_torchrun(runs, tmp_path):
    resumed = tmp_path / "resumed"
    out = torchrun(tiny_args(resumed, *runs.flags, "--resume",
                             ckpt(runs.single, "step-00000005.pt"), size=55, batch=16, epochs=6))
    assert out.count("override: batch_size = 16 (checkpoint had 32)") == 1  # rank 0 says it
    assert "note: the checkpoint took" not in out  # 1 x 32 = 2 x 16
    torch.testing.assert_close(final_state(resumed)["model"], final_state(runs.single)["model"])
    resumed_metrics, single_metrics = read_metrics(resumed), read_metrics(runs.single)[2:]
    assert [r["epoch"] for r in resumed_metrics] == [3, 4, 5, 6]
    for a, b in zip(resumed_metrics, single_metrics, strict=True):  # epoch 3 began alone
        assert_close_f32(a["train_loss"], b["train_loss"])
        assert a["val_acc"] == b["val_acc"]


@pytest.mark.parametrize("size, batch, virtual, last_local", [
    (33, 16, 0, (1, 0)),   # 32 + 1: process 1 has nothing of the last batch
    (49, 8, 16, (1, 0)),   # micro-batches 16,16 | 16,1: an empty share inside a window
])
def test_short_or_empty_share_of_the_last_batch(tmp_path, train_main, size, batch, virtual,
                                                last_local):
    sampler = data.EpochBatchSampler(size, batch, seed=0, rank=1, world_size=2)
    assert sampler.plan()[-1] == last_local  # the case this parameter set is about
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    # The default cosine schedule this time: both runs have the same number of steps.
    torchrun(tiny_args(ddp, "--no-augment", "--virtual-batch-size", virtual, size=size,
                       batch=batch, epochs=6))
    assert train_main(tiny_args(single, "--no-augment", "--virtual-batch-size", str(2 * virtual),
                                size=size, batch=2 * batch, epochs=6)) == 0
    assert final_state(ddp)["step"] == final_state(single)["step"] == 12
    torch.testing.assert_close(final_state(ddp)["model"], final_state(single)["model"])
    for a, b in zip(read_metrics(ddp), read_metrics(single), strict=True):
        assert_close_f32(a["train_loss"], b["train_loss"])


def test_gradual_unfreezing_under_ddp_trains_like_one_process(runs):
    # The shared runs unfreeze hidden.* at epoch 2 (two steps an epoch): frozen in epoch 1,
    # trained since, and the same under DDP as in one process (resumed under torchrun after
    # the unfreezing: test_one_process_checkpoint_resumes_under_torchrun).
    step = [checkpoint.load_checkpoint(ckpt(runs.single, name))["model"]
            for name in ("step-00000001.pt", "epoch-0001.pt")]  # steps 1 and 2
    assert torch.equal(step[0]["hidden.0.weight"], step[1]["hidden.0.weight"])
    assert not torch.equal(step[0]["fc.weight"], step[1]["fc.weight"])
    ddp, single = final_state(runs.ddp)["model"], final_state(runs.single)["model"]
    assert not torch.equal(single["hidden.0.weight"], step[1]["hidden.0.weight"])
    torch.testing.assert_close(ddp, single)


RECORD_SAVES = """
real_save = checkpoint.save_checkpoint
def save_checkpoint(state, path, also=()):  # write down each save: rank, step, file names
    import json
    names = [os.path.basename(p) for p in (path, *also)]
    with open({log!r}, "a") as f:
        f.write(json.dumps({{"rank": int(os.environ["RANK"]), "step": state["step"],
                            "names": names}}) + "\\n")
    return real_save(state, path, also)
checkpoint.save_checkpoint = save_checkpoint
"""


def test_sigterm_to_one_rank_stops_both_with_one_save(tmp_path, train_main):
    run_dir, log = tmp_path / "ddp", tmp_path / "saves.jsonl"
    launcher = write_launcher(tmp_path / "launch.py", RECORD_SAVES.format(log=str(log)))
    # 1000 epochs would take minutes: the signal comes once an epoch is saved.
    rc, out, workers = signal_a_worker_once_an_epoch_is_saved(
        run_dir, tiny_args(run_dir, *FLAGS, size=256, batch=16, epochs=1000), signal.SIGTERM,
        script=launcher)
    assert rc != 0
    # Both leave through the save-and-exit path (143); torchrun, seeing one exit, sends
    # SIGTERM to the other, which may then end by it (-15) once its own exit has begun.
    assert_exit_codes(out, 143)
    for pid in workers.values():
        assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    assert out.count("SIGTERM: saved") == 1, out[-3000:]

    with open(log) as f:
        saves = [json.loads(line) for line in f]
    assert {s["rank"] for s in saves} == {0}  # only rank 0 writes
    rotating = [s for s in saves if any(checkpoint.ROTATING.match(n) for n in s["names"])]
    routine = collections.Counter(r["step"] for r in rotating)  # and at each such step the
    stop_saves = []                                   # last.pt written before its validation
    for s in saves:
        if s not in rotating and routine[s["step"]]:
            routine[s["step"]] -= 1
        elif s not in rotating:
            stop_saves.append(s)
    stopped = final_state(run_dir)
    assert saves[-1]["step"] == stopped["step"]  # the stop's checkpoint is the last save
    # One save of the stop; none when the stop came at an epoch's end, whose save it keeps.
    assert [s["step"] for s in stop_saves] == [stopped["step"]] or (
        stop_saves == [] and stopped["step"] in {r["step"] for r in rotating}), saves
    assert 0 < stopped["epoch"] < 1000

    # One process of twice the batch continues; it ends where a run that never stopped does.
    end = stopped["step"] + 12
    assert train_main(["--resume", "auto", "--run-dir", str(run_dir), "--batch-size", "32",
                       "--max-steps", str(end)]) == 0
    fresh = tmp_path / "fresh"
    assert train_main(tiny_args(fresh, *FLAGS, "--max-steps", str(end), size=256, batch=32,
                                epochs=1000)) == 0
    assert final_state(run_dir)["step"] == final_state(fresh)["step"] == end
    torch.testing.assert_close(final_state(run_dir)["model"], final_state(fresh)["model"])


def _is_zombie(pid):
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    return True


NAN_ON_RANK_1 = """
import losses  # what tasks/classification.py builds its criterion with
real_build = losses.build_criterion
def build_criterion(config):  # rank 1's loss turns NaN at its 4th batch; rank 0's later
    criterion, calls = real_build(config), []
    def nan_on_rank_1(logits, labels):
        calls.append(1)
        loss = criterion(logits, labels)
        return loss * float("nan") if os.environ["RANK"] == "1" and len(calls) >= 4 else loss
    return nan_on_rank_1
losses.build_criterion = build_criterion
"""


SLOW_FIRST = """
import datetime, time
import torch.distributed as dist
from pipeline import data
real_init, real_build = dist.init_process_group, data.build_datasets
def init_process_group(*args, **kwargs):  # a timeout far below the build's length
    return real_init(*args, **{{**kwargs, "timeout": datetime.timedelta(seconds={timeout})}})
def build_datasets(config, *args, **kwargs):
    if os.environ["RANK"] == "0":
        {action}
    return real_build(config, *args, **kwargs)
dist.init_process_group, data.build_datasets = init_process_group, build_datasets
"""


def test_the_others_wait_for_process_0_longer_than_the_group_timeout(tmp_path):
    # Process 0 reads (downloads, decodes) for 5 s; a barrier would fail at the group's
    # 2 s timeout (10 minutes with NCCL), the waiting processes must not.
    patch = SLOW_FIRST.format(timeout=2, action="time.sleep(5)")
    launcher = write_launcher(tmp_path / "launch.py", patch)
    out = torchrun(tiny_args(tmp_path / "run", *FLAGS, size=64, batch=16, epochs=1),
                   script=launcher)
    assert "process 0 is reading synthetic (downloading it if needed); the other 1 wait " \
           "for it, however long it takes" in out
    assert final_state(tmp_path / "run")["epoch"] == 1


def test_when_process_0_dies_while_the_others_wait_they_end_with_one_line(tmp_path):
    patch = SLOW_FIRST.format(timeout=60, action="time.sleep(3); os.kill(os.getpid(), 9)")
    launcher = write_launcher(tmp_path / "launch.py", patch)
    rc, out = finish(start_torchrun(tiny_args(tmp_path / "run", *FLAGS, size=64, batch=16),
                                    script=launcher))
    assert rc != 0
    assert "SIGTERM: stopped while process 0 was reading synthetic" in out, out[-3000:]
    assert "[rank1]: Traceback" not in out and "[rank1]:" not in out, out[-3000:]


def test_a_peer_that_dies_mid_run_is_one_error_line(tmp_path):
    run_dir = tmp_path / "run"
    rc, out, _ = signal_a_worker_once_an_epoch_is_saved(
        run_dir, tiny_args(run_dir, *FLAGS, size=256, batch=16, epochs=1000), signal.SIGKILL)
    assert rc != 0
    assert "error: process 0 lost another process of the run (" in out, out[-3000:]
    assert "[rank0]: Traceback" not in out and "[rank0]:" not in out, out[-3000:]
    assert checkpoint.load_checkpoint(ckpt(run_dir, "last.pt"))["epoch"] >= 1  # intact


def test_a_loss_non_finite_on_one_rank_stops_both(tmp_path):
    # At step 4 rank 1's loss is NaN while rank 0's is still finite; the all-reduced
    # gradient makes both processes' weights NaN. Both must stop at that save, with the
    # same message naming the last good checkpoint, and no process may hang.
    run_dir = tmp_path / "ddp"
    launcher = write_launcher(tmp_path / "launch.py", NAN_ON_RANK_1)
    rc, out = finish(start_torchrun(tiny_args(run_dir, "--ckpt-every-steps", "1",
                                              "--max-nonfinite", "3", epochs=3),
                                    script=launcher), timeout=120)  # out of step: a hang
    assert rc != 0
    last = str(run_dir / "checkpoints" / "last.pt")
    assert out.count(f"error: the weights are not finite at step 4; lower --lr or add "
                     f"--grad-clip. The last good checkpoint is {last}") == 2, out[-3000:]
    assert_exit_codes(out, 1)
    assert final_state(run_dir)["step"] == 3  # the last save before the NaN


NO_CHECKPOINT_ON_RANK_1 = """
real_find = checkpoint.find_latest
def find_latest(run_dir, *args, **kwargs):  # as if rank 1's machine could not see run_dir
    return (None, None) if os.environ["RANK"] == "1" else real_find(run_dir, *args, **kwargs)
checkpoint.find_latest = find_latest
"""


def test_processes_that_see_different_checkpoints_stop(runs, tmp_path):
    run_dir = tmp_path / "run"
    os.makedirs(run_dir / "checkpoints")
    state = checkpoint.load_checkpoint(ckpt(runs.single, "last.pt"))
    checkpoint.save_checkpoint(state, str(run_dir / "checkpoints" / "last.pt"))
    launcher = write_launcher(tmp_path / "launch.py", NO_CHECKPOINT_ON_RANK_1)
    rc, out = finish(start_torchrun(tiny_args(run_dir, "--resume", "auto", size=55),
                                    script=launcher), timeout=120)
    assert rc != 0
    assert out.count("error: the processes found different checkpoints to resume from "
                     "(step by rank, -1 = none: [12, -1])") == 2, out[-3000:]
    assert_exit_codes(out, 2)
    assert sorted(os.listdir(run_dir / "checkpoints")) == ["last.pt"]  # nothing written


def test_sync_bn_on_cpu_processes_is_a_user_error():
    config, _ = parse_config(tiny_args("unused", "--sync-bn", network="simple_cnn"))
    train_set, _ = data.build_datasets(config)
    with pytest.raises(train.UserError, match="--sync-bn"):
        train.build_model(config, train_set, torch.device("cpu"), 2, print,
                          train.tasks.of(config))


# --------------------------------------------------------------------- DataParallel

def test_dataparallel_state_dict_round_trip():
    net = build_network("mlp", 10, 3, 8)
    wrapped = torch.nn.DataParallel(net)  # on a machine without CUDA it calls net
    keys = list(wrapped.state_dict())
    assert keys and all(k.startswith("module.") for k in keys)
    weights = checkpoint.unwrap_state_dict(wrapped.state_dict())
    assert not any(k.startswith("module.") for k in weights)
    plain = build_network("mlp", 10, 3, 8)
    plain.load_state_dict(weights)
    assert_states_equal(plain.state_dict(), net.state_dict())
    x = torch.randn(4, 3, 8, 8)
    torch.testing.assert_close(plain(x), wrapped(x))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without CUDA")
def test_gpus_without_cuda_is_a_user_error(tmp_path, train_main, capsys):
    assert train_main(tiny_args(tmp_path / "run", "--gpus", "0")) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --gpus 0: no GPU") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def _with_prefix(weights):
    return {f"module.{k}": v for k, v in weights.items()}


def test_resume_from_a_checkpoint_with_module_prefixes(runs, tmp_path, train_main):
    state = checkpoint.load_checkpoint(ckpt(runs.single, "step-00000005.pt"))
    state["model"] = _with_prefix(state["model"])  # as a DataParallel run of old saved it
    path = checkpoint.save_checkpoint(state, str(tmp_path / "prefixed.pt"))
    resumed = tmp_path / "resumed"
    assert train_main(tiny_args(resumed, *runs.flags, "--resume", path, size=55, batch=32,
                                epochs=6)) == 0
    assert_states_equal(final_state(resumed)["model"], final_state(runs.single)["model"])


def test_pretrained_weights_with_module_prefixes(runs, tmp_path, train_main):
    weights = final_state(runs.single)["model"]
    path = str(tmp_path / "weights.pt")
    torch.save(_with_prefix(weights), path)
    run = tmp_path / "run"
    # lr 0 and no weight decay: the run ends with exactly the weights it started from.
    assert train_main(tiny_args(run, "--pretrained", path, "--lr", "0", "--weight-decay",
                                "0", size=55)) == 0
    assert_states_equal(final_state(run)["model"], weights)


CUDA2 = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")


@CUDA2
def test_dataparallel_on_two_gpus_trains_like_one_gpu(tmp_path, train_main):
    one, two = tmp_path / "one", tmp_path / "two"
    args = ("--no-augment", "--amp", "none")
    assert train_main(tiny_args(one, *args, "--device", "cuda:0", size=55, batch=32,
                                epochs=3)) == 0
    assert train_main(tiny_args(two, *args, "--gpus", "0,1", size=55, batch=32,
                                epochs=3)) == 0
    assert not any(k.startswith("module.") for k in final_state(two)["model"])
    torch.testing.assert_close(final_state(two)["model"], final_state(one)["model"],
                               rtol=1e-4, atol=1e-5)
    resumed = tmp_path / "resumed"  # a DataParallel checkpoint in a plain one-GPU run
    assert train_main(tiny_args(resumed, *args, "--device", "cuda:0", "--resume",
                                ckpt(two, "last.pt"), size=55, batch=32, epochs=4)) == 0


SIGTERM_IN_THE_FINAL_VALIDATION = """
import signal
real_validate = train.validate
def validate(training):  # rank 1 alone gets a SIGTERM as the --max-steps validation starts
    if os.environ["RANK"] == "1" and training.state.step == 3:  # (epoch 1's was at step 2)
        os.kill(os.getpid(), signal.SIGTERM)
    return real_validate(training)
train.validate = validate
"""


def test_a_signal_in_the_max_steps_final_validation_under_torchrun_ends_it_together(
        tmp_path):
    """Review 7's S7-21: under DDP the --max-steps final validation is not cut by a signal
    to one process (the others would wait in its collectives): it runs to its end on both,
    and the run ends as one (its steps saved, its final record written)."""
    run_dir = tmp_path / "run"
    script = write_launcher(tmp_path / "launch.py", SIGTERM_IN_THE_FINAL_VALIDATION)
    out = torchrun(tiny_args(run_dir, "--max-steps", "3", epochs=2), script=script)
    assert "--max-steps 3 reached at step 3" in out and "Traceback" not in out
    assert final_state(run_dir)["step"] == 3
    assert [(r["step"], r.get("final")) for r in read_metrics(run_dir)][-1] == (3, True)

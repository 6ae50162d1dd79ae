"""The recipes in train.py (issue 13): EMA, MixUp/CutMix, AutoAugment policies and random
erasing, all at once, deterministic with any number of workers and exact on resume."""

import json
import re

import pytest
import torch
from helpers import (
    assert_states_equal,
    final_state,
    stop_at_step,
    tiny_args,
    torchrun,
    write_launcher,
)

import train

EVERYTHING = ("--ema-decay", "0.9", "--mixup-alpha", "0.4", "--cutmix-alpha", "1.0",
              "--mix-prob", "0.8", "--auto-augment", "trivialaugment", "--random-erase",
              "0.5")


def recipe_args(run_dir, *extra, workers=0, epochs=2):
    args = tiny_args(run_dir, *EVERYTHING, *extra, network="simple_cnn", size=96, image=16,
                     epochs=epochs)
    args[args.index("--num-workers") + 1] = str(workers)
    return args


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("whole")
    assert train.main(recipe_args(run_dir)) == 0
    return run_dir


def test_every_recipe_at_once_is_the_same_with_two_workers(whole, tmp_path):
    assert train.main(recipe_args(tmp_path, workers=2)) == 0
    a, b = final_state(whole), final_state(tmp_path)
    assert_states_equal(a["model"], b["model"])
    assert_states_equal(a["ema"], b["ema"])


def test_every_recipe_at_once_resumes_bit_for_bit(whole, tmp_path):
    with stop_at_step(8):  # mid-epoch 2 (6 steps an epoch)
        assert train.main(recipe_args(tmp_path)) == 143
    assert final_state(tmp_path)["step"] == 8
    assert train.main(recipe_args(tmp_path, "--resume", "auto")) == 0
    a, b = final_state(whole), final_state(tmp_path)
    for key in ("model", "ema", "optimizer"):
        assert_states_equal(a[key], b[key])


def test_ema_is_validated_logged_and_chooses_best(whole):
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    assert all({"val_loss_ema", "val_acc_ema", "val_acc"} <= set(r) for r in records)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(whole))
    events.Reload()
    assert [round(e.value, 6) for e in events.Scalars("val_ema/acc")] == \
        [round(r["val_acc_ema"], 6) for r in records]
    best = torch.load(whole / "checkpoints" / "best.pt", weights_only=True)
    assert best["progress"]["best"] == max(r["val_acc_ema"] for r in records)
    ema, raw = final_state(whole)["ema"], final_state(whole)["model"]
    assert set(ema) == set(raw) and any(not torch.equal(ema[k], raw[k]) for k in raw)


def test_pretrained_takes_the_moving_average_unless_told(whole, tmp_path, capsys):
    path = str(whole / "checkpoints" / "last.pt")
    saved = final_state(whole)
    zero = ("--lr", "0", "--weight-decay", "0", "--no-augment", "--auto-augment", "none",
            "--random-erase", "0", "--mixup-alpha", "0", "--cutmix-alpha", "0",
            "--ema-decay", "0", "--epochs", "1")
    assert train.main(recipe_args(tmp_path / "ema", "--pretrained", path, *zero)) == 0
    assert "moving average" in capsys.readouterr().out
    assert_states_equal(final_state(tmp_path / "ema")["model"]["fc.1.weight"],
                        saved["ema"]["fc.1.weight"])
    assert train.main(recipe_args(tmp_path / "raw", "--pretrained", path,
                                  "--pretrained-weights", "raw", *zero)) == 0
    assert_states_equal(final_state(tmp_path / "raw")["model"]["fc.1.weight"],
                        saved["model"]["fc.1.weight"])


@pytest.mark.parametrize("flag, value, message", [
    ("--mixup-alpha", "-1", "--mixup-alpha must not be negative"),
    ("--cutmix-alpha", "-0.5", "--cutmix-alpha must not be negative"),
    ("--ema-decay", "1", "--ema-decay must be in [0, 1)"),
    ("--mix-prob", "1.5", "--mix-prob must be in [0, 1]"),
    ("--random-erase", "2", "--random-erase must be in [0, 1]"),
    ("--randaugment-magnitude", "31", "--randaugment-magnitude must be in [0, 30]"),
    ("--auto-augment", "cutout", "invalid choice"),
])
def test_bad_recipe_values_are_one_error_line(tmp_path, capsys, flag, value, message):
    assert train.main(tiny_args(tmp_path, f"{flag}={value}")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_policies_need_augmentation(tmp_path, capsys):
    assert train.main(tiny_args(tmp_path, "--no-augment", "--auto-augment",
                                "randaugment")) == 2
    assert "need --augment" in capsys.readouterr().err


RECORD_MIX = """
from pipeline import recipes
real_call = recipes.BatchMix.__call__
def call(self, x, y, epoch, position):
    out = real_call(self, x, y, epoch, position)
    draw = self.draw(epoch, position, len(x), x.shape[-2], x.shape[-1])
    print(f"mix rank={os.environ['RANK']} epoch={epoch} batch={position} n={len(x)} "
          f"kind={draw.kind} lam={float(draw.lam):.6f}", flush=True)
    return out
recipes.BatchMix.__call__ = call
"""


def test_under_ddp_each_process_mixes_its_own_share_with_the_same_draw(tmp_path):
    # Documented: each process mixes within its own share of the global batch; the
    # coefficient and the choice come from (seed, epoch, batch), so they are the same on
    # every process.
    launcher = write_launcher(tmp_path / "launch.py", RECORD_MIX)
    out = torchrun(tiny_args(tmp_path / "ddp", "--mixup-alpha", "0.4", "--cutmix-alpha", "1.0",
                             size=64, batch=16), script=launcher, timeout=180)  # exit 0
    draws, ranks = {}, {}
    for rank, epoch, batch, n, kind, lam in re.findall(
            r"mix rank=(\d) epoch=(\d+) batch=(\d+) n=(\d+) kind=(\w+) lam=([\d.]+)", out):
        assert int(n) == 16  # the process's own share, not the global batch of 32
        draws.setdefault((epoch, batch), set()).add((kind, lam))
        ranks.setdefault((epoch, batch), set()).add(rank)
    assert sorted(draws) == [("0", "0"), ("0", "1")]  # 64 samples, global batches of 32
    assert all(len(d) == 1 for d in draws.values())  # one draw, the same on both ranks
    assert all(r == {"0", "1"} for r in ranks.values())


def test_test_py_evaluates_the_moving_average_as_training_logged_it(whole, capsys):
    from helpers import load_test_py

    best = str(whole / "checkpoints" / "best.pt")
    records = [json.loads(line) for line in (whole / "metrics.jsonl").read_text().splitlines()]
    best_record = max(records, key=lambda r: r["val_acc_ema"])
    out = whole / "ema.json"
    assert load_test_py().main(["--checkpoint", best, "--device", "cpu", "--num-workers", "0",
                                "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["weights"] == "ema" and "moving average" in capsys.readouterr().out
    assert report["accuracy"] == best_record["val_acc_ema"]
    assert abs(report["loss"] - best_record["val_loss_ema"]) < 1e-6
    assert load_test_py().main(["--checkpoint", best, "--device", "cpu", "--num-workers", "0",
                                "--weights", "raw", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["weights"] == "raw" and report["accuracy"] == best_record["val_acc"]


def test_test_py_flips_as_training_did(tmp_path):
    from helpers import load_test_py

    assert train.main(tiny_args(tmp_path, "--tta", "flip")) == 0
    logged = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    out = tmp_path / "r.json"
    argv = ["--checkpoint", str(tmp_path / "checkpoints" / "last.pt"), "--device", "cpu",
            "--num-workers", "0", "--json", str(out)]
    assert load_test_py().main(argv) == 0
    report = json.loads(out.read_text())
    assert report["tta"] == "flip" and abs(report["loss"] - logged["val_loss"]) < 1e-6
    assert load_test_py().main([*argv, "--tta", "none"]) == 0
    assert json.loads(out.read_text())["loss"] != report["loss"]

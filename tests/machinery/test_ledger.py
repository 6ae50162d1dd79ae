"""--sample-ledger (issue 38): each step's samples per process, cut back to the checkpoint
on resume; ``python -m machinery.ledger`` names the first duplicate or missing sample. And
README's section on --verify-resume and the ledger, run as written."""

import errno
import glob
import io
import json
import os
import re
import shlex
import subprocess
import sys
import types

import pytest
import torch
from helpers import ROOT, ckpt, fork_popen, run_as_written, tiny_args, torchrun

import train
from machinery import ledger, verify_resume
from ops import RunFailed


def write(run_dir, rank, lines):
    os.makedirs(run_dir / "samples", exist_ok=True)
    with open(run_dir / "samples" / f"rank{rank}.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


def header(start=0, epoch=0, seen=0, size=4, rank=0, world=1):
    return {"start": start, "epoch": epoch, "seen": seen, "size": size, "rank": rank,
            "world_size": world}


def steps(*samples, epoch=0, first=1, seen=0):
    out = []
    for k, s in enumerate(samples):
        seen += len(s)
        out.append({"step": first + k, "epoch": epoch, "seen": seen, "samples": s})
    return out


def test_a_permutation_passes_and_a_duplicate_or_missing_sample_is_named(tmp_path):
    write(tmp_path, 0, [header(), *steps([2, 0], [3, 1]), *steps([1], epoch=1, first=3)])
    ok, lines = ledger.check(tmp_path)
    assert ok and lines[0] == "epoch 1: a permutation of the 4 samples"
    assert "in progress, 1 of 4" in lines[1]
    write(tmp_path, 0, [header(), *steps([2, 0], [3, 0])])
    ok, lines = ledger.check(tmp_path)
    assert not ok and lines == ["error: epoch 1: sample 0 twice, at step 1 (rank 0) and "
                                "step 2 (rank 0)"]
    write(tmp_path, 0, [header(), *steps([2, 0], [3]), *steps([0], epoch=1, first=3)])
    ok, lines = ledger.check(tmp_path)
    assert not ok and "epoch 1: sample 1 is missing" in lines[0]


def test_two_processes_then_one_and_a_step_no_file_holds(tmp_path):
    # world size 2 for step 1, then 1 process: the epoch is the union of every file
    write(tmp_path, 0, [header(world=2), *steps([2]), header(1, 0, 2), *steps([0, 3],
                                                                             first=2, seen=2)])
    write(tmp_path, 1, [header(rank=1, world=2), {"step": 1, "epoch": 0, "seen": 2,
                                                   "samples": [1]}])
    ok, lines = ledger.check(tmp_path)
    assert ok and "processes: 2, 1" in lines[-1], lines
    write(tmp_path, 0, [header(), *steps([2, 0]), *steps([1], first=3)])
    (tmp_path / "samples" / "rank1.jsonl").unlink()
    ok, lines = ledger.check(tmp_path)
    assert not ok and "step 2 is in no ledger file" in lines[0]


def test_a_ledger_begun_mid_epoch_checks_what_it_saw(tmp_path):
    write(tmp_path, 0, [header(start=1, seen=2), *steps([3, 1], first=2, seen=2)])
    ok, lines = ledger.check(tmp_path)
    assert ok and "the ledger began at its sample 2" in lines[0]
    write(tmp_path, 0, [header(start=1, seen=2), *steps([3], first=2, seen=2),
                        *steps([0], epoch=1, first=3)])
    ok, lines = ledger.check(tmp_path)
    assert not ok and "1 samples after the ledger began" in lines[0]


def test_a_damaged_last_line_ends_the_file(tmp_path):
    write(tmp_path, 0, [header(), *steps([2, 0], [3, 1])])
    with open(tmp_path / "samples" / "rank0.jsonl", "a") as f:
        f.write('{"step": 3, "epoch": 1, "se')  # killed mid-write
    assert ledger.check(tmp_path)[0]
    ledger.truncate(tmp_path / "samples" / "rank0.jsonl", 1)
    assert [line.get("step") for line in ledger.read_lines(
        tmp_path / "samples" / "rank0.jsonl")] == [None, 1]


def test_a_resume_on_fewer_processes_cuts_every_dropped_processs_file(tmp_path):
    """Four processes went on to step 6 after the checkpoint of step 3; the resume on one
    process (rank 0 cuts the files of ranks 1-3 it no longer has, as its own) keeps steps
    1-3 in every file: steps 4-6 are trained again, by rank 0 alone."""
    for rank in range(4):
        write(tmp_path, rank, [header(rank=rank, world=4, size=24),
                               *({"step": k, "epoch": 0, "seen": 4 * k,
                                  "samples": [4 * (k - 1) + rank]} for k in range(1, 7))])
    sampler = types.SimpleNamespace(observer=None)
    state = types.SimpleNamespace(step=3, epoch=0, epoch_samples=12)
    kept = ledger.Ledger(tmp_path, 0, 1, state, 24, sampler)
    kept.close()
    assert sampler.observer is kept
    for rank in range(4):
        lines = ledger.read_lines(tmp_path / "samples" / f"rank{rank}.jsonl")
        assert [line.get("step") for line in lines] == [None, 1, 2, 3] + (
            [None] if rank == 0 else []), rank  # rank 0: its new header


class _FullDisk(io.StringIO):
    """A ledger file on a full disk: what is written is refused when flushed."""

    def flush(self):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_one_line_naming_the_ledger_file(tmp_path, monkeypatch):
    """The header's write at the start (the disk already full), and a step's later: one
    RunFailed line naming the file and the full disk, and a close that raises nothing."""
    sampler = types.SimpleNamespace(observer=None)
    state = types.SimpleNamespace(step=0, epoch=0, epoch_samples=0)
    path = str(tmp_path / "samples" / "rank0.jsonl")
    monkeypatch.setattr(ledger, "open", lambda *a, **k: _FullDisk(), raising=False)
    with pytest.raises(RunFailed) as excinfo:
        ledger.Ledger(tmp_path, 0, 1, state, 24, sampler)
    assert str(excinfo.value).startswith(f"writing the sample ledger {path} failed (No space "
                                         f"left on device)"), str(excinfo.value)
    monkeypatch.undo()
    kept = ledger.Ledger(tmp_path, 0, 1, state, 24, sampler)
    kept._file.close()
    kept._file = _FullDisk()
    with pytest.raises(RunFailed, match=f"writing the sample ledger {re.escape(path)} failed"):
        kept.step(state)
    kept.close()  # (train.py's finally): nothing more


def test_a_ledger_cut_short_by_a_failed_write_does_not_blame_the_data(tmp_path):
    """An empty file (the disk was full at the start); a process's file without the header
    its start wrote in every file: a write failed, not the training set."""
    write(tmp_path, 0, [])
    ok, lines = ledger.check(tmp_path)
    assert not ok and lines[0].startswith(
        f"error: the sample ledger holds no header ({tmp_path / 'samples' / 'rank0.jsonl'})")
    write(tmp_path, 0, [header(world=2), *steps([2], [0])])
    write(tmp_path, 1, [])
    ok, lines = ledger.check(tmp_path)
    assert not ok and lines[0].startswith(
        f"error: the sample ledger {tmp_path / 'samples' / 'rank1.jsonl'} lacks the header "
        f"of the start at step 0 (2 processes)"), lines
    # a resume's header lost in one file (its other start's header there): named too
    write(tmp_path, 0, [header(world=2), *steps([2]), *steps([0], first=2, seen=2)])
    write(tmp_path, 1, [header(rank=1, world=2), *steps([1]),
                        header(1, 0, 2, rank=1, world=2), *steps([3], first=2, seen=2)])
    ok, lines = ledger.check(tmp_path)
    assert not ok and lines[0].startswith(
        f"error: the sample ledger {tmp_path / 'samples' / 'rank0.jsonl'} lacks the header "
        f"of the start at step 1 (2 processes)"), lines


def args(run_dir, *extra, epochs=2):
    return tiny_args(run_dir, "--sample-ledger", "--data-on-device", "off", *extra,
                     size=40, batch=8, epochs=epochs)


def test_a_resume_from_an_older_checkpoint_cuts_the_ledger_back(tmp_path):
    # A run that went on after its checkpoint at step 4 (and whose later checkpoints were
    # lost, as after SIGKILL): the resume trains steps 5.. again, the ledger keeps them once.
    assert train.main(args(tmp_path, "--ckpt-every-steps", "2", "--keep-last", "9",
                           epochs=1)) == 0
    for path in glob.glob(ckpt(tmp_path, "*.pt")):
        if torch.load(path, weights_only=True)["step"] > 4:
            os.remove(path)
    assert train.main(args(tmp_path, "--resume", "auto", epochs=2)) == 0
    lines = ledger.read_lines(tmp_path / "samples" / "rank0.jsonl")
    assert [line["step"] for line in lines if "step" in line] == list(range(1, 11))
    ok, report = ledger.check(tmp_path)
    assert ok and report[:2] == ["epoch 1: a permutation of the 40 samples",
                                 "epoch 2: a permutation of the 40 samples"], report


def test_under_torchrun_then_one_process_every_epoch_is_a_permutation(tmp_path):
    torchrun(args(tmp_path, "--max-steps", "4", "--no-augment"))  # 2 x 8 a step: 3 an epoch
    assert train.main(args(tmp_path, "--resume", "auto", "--max-steps", "0", "--batch-size",
                           "16", epochs=3)) == 0  # the global batch of 2 x 8 kept (issue 50)
    assert sorted(os.listdir(tmp_path / "samples")) == ["rank0.jsonl", "rank1.jsonl"]
    done = subprocess.run([sys.executable, "-m", "machinery.ledger", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "epoch 3: a permutation of the 40 samples" in done.stdout
    assert "processes: 2, 1" in done.stdout


def readme_section():
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split("### Check the resume of your own run", 1)[1].split("\n## ", 1)[0]


def test_the_readme_section_runs_as_written(tmp_path, monkeypatch, capsys):
    commands = re.findall(r"```bash\n(.*?)```", readme_section(), re.S)[0].splitlines()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # --verify-resume's runs: two on two cores
    monkeypatch.setattr(verify_resume, "start_process", fork_popen)  # (forks: no 3 s starts)
    outputs = []
    for command in commands:
        code, out, err = run_as_written(shlex.split(command), tmp_path, monkeypatch, capsys)
        assert code == 0, out[-2000:] + err[-2000:]
        outputs.append(out)
    assert "resume exact" in outputs[0] and "before micro-batch 2 of 2" in outputs[0]
    assert "ledger ok: 3 epoch(s), 2 start(s)" in outputs[-1]
    assert not (tmp_path / "runs").exists() or os.listdir(tmp_path / "runs") == ["ledger"]

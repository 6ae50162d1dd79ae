"""--sample-ledger: the samples every optimizer step trained on, and the check that each
epoch is a permutation of the training set.

Each process appends to ``<run-dir>/samples/rank<N>.jsonl`` a header at each start of the
run (fresh or resumed), then one line per optimizer step, written and flushed after it:

    {"start": 0, "epoch": 0, "seen": 0, "size": 96, "rank": 0, "world_size": 2}
    {"step": 1, "epoch": 0, "seen": 32, "samples": [17, 3, 88, ...]}

``samples`` are the indices this process trained on in the step (all its micro-batches),
as the sampler handed them to the loader (``EpochBatchSampler.observer``: the same
batches the DataLoader's workers or the device path load); ``seen`` is the epoch's
samples consumed by all processes after the step. A run that resumes from step S first
cuts every rank's file back to step S (lines of steps after the checkpoint were trained
again), so the ledger follows the checkpoints: any number of resumes, SIGKILL included,
and a change of world size leave one line per step and process.

    python -m machinery.ledger RUN_DIR    # exit 0: every epoch a permutation; 1: not

names the first duplicate or missing sample (and the steps that saw it);

    python -m machinery.ledger RUN_DIR OTHER_RUN_DIR    # exit 0: the same samples

says whether two runs trained on the same samples at every step both recorded (each
step's global batch, whatever the processes: a run resumed on another number of them
against the run that never stopped), or names the first step that differs. Lines are
flushed, not fsynced: after a power loss the last steps before a checkpoint may be
missing, and the check says so (missing samples), which is the truth of the file.
"""

import collections
import contextlib
import glob
import json
import os
import re
import sys

from machinery import files
from ops import RunFailed

FOLDER = "samples"
_NAME = re.compile(r"rank(\d+)\.jsonl$")


def path_of(run_dir, rank):
    return os.path.join(run_dir, FOLDER, f"rank{rank}.jsonl")


class Off:
    """No ledger: what a run without --sample-ledger records (nothing)."""

    def step(self, state):
        pass

    def close(self):
        pass


OFF = Off()


class Ledger:
    """One process's ledger file, fed by the training sampler (its ``observer``).

    Args:
        run_dir: the run directory.
        rank, world_size: this process and the run's processes.
        state: the run's ``engine.TrainState`` after the restore (where it starts).
        size: samples in the training set.
        sampler: the training ``EpochBatchSampler``; the ledger becomes its observer.
    """

    def __init__(self, run_dir, rank, world_size, state, size, sampler):
        self.path, self._file = path_of(run_dir, rank), None
        with self._failing():
            os.makedirs(os.path.join(run_dir, FOLDER), exist_ok=True)
            truncate(self.path, state.step)
            if rank == 0:  # the files of processes this run no longer has
                for other, path in rank_files(run_dir):
                    if other >= world_size:
                        truncate(path, state.step)
            self._file = open(self.path, "a", encoding="utf-8")
        self._write({"start": state.step, "epoch": state.epoch, "seen": state.epoch_samples,
                     "size": size, "rank": rank, "world_size": world_size})
        self._pending = collections.deque()  # (epoch position after it, local indices)
        self._position = 0
        sampler.observer = self

    def begin(self, epoch, start):  # the sampler starts handing out an epoch's batches
        self._pending.clear()
        self._position = start

    def batch(self, global_count, local):  # (from the loader's thread, maybe)
        self._position += global_count
        self._pending.append((self._position, local.tolist()))

    def step(self, state):
        """Records the step just taken: the batches handed out up to its position."""
        samples = []
        while self._pending and self._pending[0][0] <= state.epoch_samples:
            samples += self._pending.popleft()[1]
        self._write({"step": state.step, "epoch": state.epoch, "seen": state.epoch_samples,
                     "samples": samples})

    def _write(self, line):
        with self._failing():
            self._file.write(json.dumps(line, separators=(",", ":")) + "\n")
            self._file.flush()

    @contextlib.contextmanager
    def _failing(self):
        """A write the file system refused (a full disk) stops the run with one line naming
        the file; the file is closed without writing more (the checker reads what it got)."""
        try:
            yield
        except OSError as e:
            self.close()
            raise RunFailed(f"writing the sample ledger {self.path} failed "
                            f"({e.strerror or e}); the checkpoints are intact: continue "
                            f"with --resume auto once there is room") from None

    def close(self):
        """Closes the file; each line was flushed when written, so this writes nothing but
        a line whose write failed (again refused: dropped)."""
        if self._file is not None:
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = None


def open_ledger(config, run_dir, procs, state, size, sampler):
    """The run's ledger (``Ledger``) with --sample-ledger, else ``OFF``."""
    if not config.get("sample_ledger"):
        return OFF
    return Ledger(run_dir, procs.rank, procs.world_size, state, size, sampler)


def rank_files(run_dir):
    """``[(rank, path)]`` of the ledger files in ``run_dir``, by rank."""
    found = []
    for path in glob.glob(os.path.join(run_dir, FOLDER, "rank*.jsonl")):
        match = _NAME.search(os.path.basename(path))
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def read_lines(path):
    """The well-formed lines of a ledger file, up to the first damaged one (a line cut by
    a kill mid-write ends the file)."""
    lines = []
    with open(path, encoding="utf-8") as f:
        for text in f:
            try:
                line = json.loads(text)
            except ValueError:
                break
            if not isinstance(line, dict) or not ("step" in line or "start" in line):
                break
            lines.append(line)
    return lines


def truncate(path, step):
    """Cuts ``path`` back to the steps up to ``step`` (a resume from that step's
    checkpoint trains the later ones again), atomically; nothing when it is absent."""
    if not os.path.exists(path):
        return
    kept = [line for line in read_lines(path) if line.get("step", line.get("start")) <= step]
    files.atomic_write(path, lambda f: f.writelines(
        json.dumps(line, separators=(",", ":")) + "\n" for line in kept))


def check(run_dir):
    """Checks the ledger of ``run_dir``: each epoch a permutation of the training set.

    Returns:
        ``(ok, lines)``: whether it holds, and what to print (the first problem first).
    """
    ranks = rank_files(run_dir)
    if not ranks:
        return False, [f"error: no ledger in {os.path.join(run_dir, FOLDER)} (train with "
                       f"--sample-ledger)"]
    headers, steps = [], []
    for rank, path in ranks:
        for line in read_lines(path):
            (steps if "step" in line else headers).append({**line, "rank": rank})
    unwritten = _unwritten_header(run_dir, ranks, headers)
    if unwritten:
        return False, [unwritten]
    sizes = sorted({h["size"] for h in headers})
    if len(sizes) != 1:
        return False, [f"error: the training set changed size during the run ({sizes}): "
                       f"its epochs cannot be permutations of one set"]
    size = sizes[0]
    first = min(headers, key=lambda h: h["start"])
    gap = _missing_steps(steps, first["start"])
    if gap:
        return False, [f"error: step {gap} is in no ledger file (the run went on without "
                       f"--sample-ledger?): its samples cannot be checked"]
    by_epoch = collections.defaultdict(list)
    for line in sorted(steps, key=lambda s: (s["step"], s["rank"])):
        by_epoch[line["epoch"]].append(line)
    out = []
    last = max(by_epoch) if by_epoch else None
    for epoch in sorted(by_epoch):
        lines = by_epoch[epoch]
        seen = {}
        for line in lines:
            for index in line["samples"]:
                if not 0 <= index < size:
                    return False, [f"error: epoch {epoch + 1}: sample {index} at step "
                                   f"{line['step']} (rank {line['rank']}) is not in the "
                                   f"training set of {size}"]
                if index in seen:
                    step, rank = seen[index]
                    return False, [f"error: epoch {epoch + 1}: sample {index} twice, at step "
                                   f"{step} (rank {rank}) and step {line['step']} (rank "
                                   f"{line['rank']})"]
                seen[index] = (line["step"], line["rank"])
        unknown = first["seen"] if epoch == first["epoch"] else 0  # before the ledger began
        finished = epoch != last or max(line["seen"] for line in lines) >= size
        if not finished:
            out.append(f"epoch {epoch + 1}: in progress, {len(seen)} of {size} samples so "
                       f"far, none twice")
            continue
        if unknown == 0 and len(seen) < size:
            missing = min(set(range(size)) - set(seen))
            return False, [f"error: epoch {epoch + 1}: sample {missing} is missing ("
                           f"{size - len(seen)} of {size} never trained on)"]
        if unknown and len(seen) != size - unknown:
            return False, [f"error: epoch {epoch + 1}: {len(seen)} samples after the ledger "
                           f"began at its sample {unknown}, where {size - unknown} were left"]
        out.append(f"epoch {epoch + 1}: a permutation of the {size} samples"
                   + (f" (the ledger began at its sample {unknown}: the {size - unknown} "
                      f"after it, each once)" if unknown else ""))
    worlds = [str(h["world_size"]) for h in sorted(headers, key=lambda h: h["start"])
              if h["rank"] == 0]
    out.append(f"ledger ok: {len(by_epoch)} epoch(s), {len(worlds)} start(s) (processes: "
               f"{', '.join(worlds)}), steps {first['start'] + 1}-"
               f"{max((s['step'] for s in steps), default=first['start'])}")
    return True, out


def _unwritten_header(run_dir, ranks, headers):
    """An error line when a file lacks a header its run wrote: each start writes one in
    every process's file (a dropped process's file is cut back, its headers before the
    cut kept), so a missing one is a write that failed (a full disk) and cut the ledger
    short: the data is not to blame. None when every header is there."""
    if not headers:
        return (f"error: the sample ledger holds no header ({', '.join(p for _, p in ranks)}): "
                f"its first write failed (a full disk?) or was cut short; nothing to check")
    have = {(h["rank"], h["start"]) for h in headers}
    for start, world in sorted({(h["start"], h["world_size"]) for h in headers}):
        for rank in range(world):
            if (rank, start) not in have:
                return (f"error: the sample ledger {path_of(run_dir, rank)} lacks the "
                        f"header of the start at step {start} ({world} processes): a write "
                        f"failed (a full disk?) or the file was cut short; its samples "
                        f"cannot be checked")
    return None


def _missing_steps(steps, start):
    """The first step after ``start`` that no file records, or None."""
    recorded = {line["step"] for line in steps}
    for step in range(start + 1, max(recorded, default=start) + 1):
        if step not in recorded:
            return step
    return None


def step_samples(run_dir):
    """``{step: the sorted sample indices all processes trained on in it}`` of a run's
    ledger: a step's global batch, whatever the processes that shared it."""
    steps = collections.defaultdict(list)
    for _, path in rank_files(run_dir):
        for line in read_lines(path):
            if "step" in line:
                steps[line["step"]] += line["samples"]
    return {step: sorted(samples) for step, samples in sorted(steps.items())}


def compare(run_dir, other):
    """Whether two runs trained on the same samples at every step both recorded (a run
    resumed on another number of processes against the run that never stopped).

    Returns:
        ``(same, lines)``: the first step whose samples differ, or the steps compared.
    """
    a, b = step_samples(run_dir), step_samples(other)
    both = sorted(set(a) & set(b))
    if not both:
        return False, [f"error: {run_dir} and {other} recorded no step in common"]
    for step in both:
        if a[step] != b[step]:
            extra, missing = (sorted(set(y) - set(x)) for x, y in ((a[step], b[step]),
                                                                    (b[step], a[step])))
            return False, [f"error: step {step}: other samples ({len(a[step])} against "
                           f"{len(b[step])}; {other} has {extra[:5]} where {run_dir} has "
                           f"{missing[:5]})"]
    return True, [f"the same samples at each of steps {both[0]}-{both[-1]} ({len(both)} "
                  f"steps)"]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2) or any(a.startswith("-") for a in argv):
        print("usage: python -m machinery.ledger RUN_DIR [OTHER_RUN_DIR]", file=sys.stderr)
        return 2
    ok, lines = check(argv[0]) if len(argv) == 1 else compare(*argv)
    for line in lines:
        print(line, file=sys.stdout if ok or not line.startswith("error:") else sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

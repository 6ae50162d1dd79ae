"""What --preflight costs: a one-epoch run of a recipe with and without it, side by side.

    python bench/preflight.py                      # the default synthetic recipe, 5 pairs
    python bench/preflight.py --repeats 9 -- --network resnet18 --synthetic-size 2048
    python bench/preflight.py --device cuda -- --dataset cifar10

Each repeat runs ``python train.py --dataset synthetic --epochs 1 ARGS`` twice in fresh
processes, plain and with ``--preflight train``, in an order that alternates at every
repeat (so that a change in the machine's load hits both alike), each in a run directory
of its own that is removed afterwards. Printed per repeat and as medians: the wall time of
each whole process (imports and set-up included), their difference, and the preflight's
own time as it prints it (``preflight: N stages ok in T s``), also as a share of the plain
run's wall time. That share is the figure the issue's target (under 5% of a one-epoch CPU
run) is about. On a shared CPU the wall difference is noisy: the preflight's own time is
the steadier figure. This prints figures; it asserts nothing.
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LINE = re.compile(r"preflight: (\d+) stages ok in ([0-9.]+) s")


def one_run(args, run_dir, preflight):
    """Wall seconds of one train.py process, and the preflight's own seconds (or None)."""
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--dataset", "synthetic",
            "--epochs", "1", *args, "--run-dir", run_dir]
    if preflight:
        argv += ["--preflight", "train"]
    start = time.perf_counter()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"error: train.py exited {done.returncode}: {done.stderr.strip()[-500:]}")
    found = LINE.search(done.stdout)
    if preflight and not found:
        sys.exit("error: no 'preflight: ... stages ok' line in train.py's output")
    return wall, float(found.group(2)) if found else None


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="pairs of runs")
    parser.add_argument("--device", default="cpu", help="train.py's --device")
    parser.add_argument("args", nargs="*", help="more train.py flags (after --)")
    options = parser.parse_args(argv)
    args = ["--device", options.device, *options.args]
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-preflight-") as tmp:
        for repeat in range(options.repeats):
            walls = {}
            for preflight in ((False, True) if repeat % 2 == 0 else (True, False)):
                run_dir = os.path.join(tmp, f"{repeat}-{preflight}")
                walls[preflight] = one_run(args, run_dir, preflight)
                shutil.rmtree(run_dir, ignore_errors=True)
            (plain, _), (checked, own) = walls[False], walls[True]
            rows.append((plain, checked, own))
            print(f"repeat {repeat + 1}: plain {plain:.2f} s, with --preflight {checked:.2f} "
                  f"s ({checked - plain:+.2f} s); the preflight's own {own:.2f} s = "
                  f"{own / plain:.1%} of the plain run", flush=True)
    plain, checked, own = (statistics.median(column) for column in zip(*rows))
    diff = statistics.median(c - p for p, c, _ in rows)
    share = statistics.median(o / p for p, _, o in rows)
    print(f"median of {len(rows)}: plain {plain:.2f} s, with --preflight {checked:.2f} s "
          f"({diff:+.2f} s); the preflight's own {own:.2f} s = {share:.1%} of the plain "
          f"run ({' '.join(args)})")


if __name__ == "__main__":
    main()

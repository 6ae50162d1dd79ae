"""What pruning saves and what sweep.py's driver costs: one sweep with median pruning and
the same sweep without (the same recipe, space and sampler seed), side by side.

    python bench/sweep.py                          # 20 trials each, mlp on the synthetic set
    python bench/sweep.py --trials 40 --epochs 6 --synthetic-size 2048

Each sweep runs ``python sweep.py RECIPE --sweep-dir DIR/<pruner>`` in a fresh process (its
trials plain train.py processes) on a recipe this script writes: mlp on the synthetic set,
``--epochs`` epochs, constant LR, TPE over lr (log-uniform 1e-4..1) and the optimizer (sgd,
adamw), objective val_loss. Printed for each: the wall time, the optimizer steps its trials
trained (each trial's last metrics.jsonl record), the trials pruned, the best val_loss and
its trial, and the driver's own time per trial as sweep.py prints it (the sweep's wall time
less its trial processes' own, per trial) with its share of a trial's time (the issue's
target: at most 5%). The directories are removed afterwards unless ``--keep``. This prints
figures; it asserts nothing.
"""

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OVERHEAD = re.compile(r"the driver's own time ([0-9.]+) s per trial \(([0-9.]+)% of a "
                      r"trial's ([0-9.]+) s\)")


def recipe(args, pruner):
    return {"dataset": "synthetic", "network": "mlp", "synthetic_size": args.synthetic_size,
            "image_size": 8, "batch_size": 32, "epochs": args.epochs, "augment": False,
            "scheduler": "none", "num_workers": 0,
            "sweep": {"trials": args.trials, "sampler": "tpe", "pruner": pruner,
                      "seed": args.seed, "objective": "loss",
                      "space": {"lr": {"log_uniform": [1.0e-4, 1.0]},
                                "optimizer": {"choice": ["sgd", "adamw"]}}}}


def last_record(run_dir):
    record = {}
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                record = json.loads(line)
    return record


def one_sweep(args, directory, name, pruner):
    path = os.path.join(directory, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(recipe(args, pruner), f)
    sweep_dir = os.path.join(directory, name)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "sweep.py"), path,
                           "--sweep-dir", sweep_dir], cwd=directory, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"sweep.py ({name}) ended with {done.returncode}:\n{done.stdout[-3000:]}"
                 f"{done.stderr[-3000:]}")
    trials = sorted(d for d in os.listdir(sweep_dir) if re.fullmatch(r"trial-\d+", d))
    steps = sum(last_record(os.path.join(sweep_dir, t)).get("step", 0) for t in trials)
    pruned = done.stdout.count(" pruned at step ")
    best = re.search(r"best: trial (\d+), val_loss ([0-9.eE+-]+)", done.stdout)
    overhead = OVERHEAD.search(done.stdout)
    return {"name": name, "wall": wall, "trials": len(trials), "steps": steps,
            "pruned": pruned, "best": f"{best[2]} (trial {best[1]})" if best else "-",
            "overhead": f"{overhead[1]} s ({overhead[2]}% of {overhead[3]} s)"
            if overhead else "-"}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--synthetic-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed, both sweeps")
    p.add_argument("--dir", default=None, help="where the sweeps go (default: a temporary "
                   "directory, removed)")
    p.add_argument("--keep", action="store_true", help="keep the sweeps' directories")
    args = p.parse_args()
    directory = args.dir or tempfile.mkdtemp(prefix="bench-sweep-")
    os.makedirs(directory, exist_ok=True)
    try:
        rows = [one_sweep(args, directory, "median", "median"),
                one_sweep(args, directory, "none", "none")]
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
    print(f"{args.trials} trials, mlp on {args.synthetic_size} synthetic samples, "
          f"{args.epochs} epochs, TPE seed {args.seed}")
    print("| pruner | wall s | trials | steps trained | pruned | best val_loss | "
          "driver's own time per trial |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['wall']:.0f} | {r['trials']} | {r['steps']} | "
              f"{r['pruned']} | {r['best']} | {r['overhead']} |")
    if rows[1]["steps"]:
        print(f"median pruning trained {rows[0]['steps'] / rows[1]['steps']:.2f}x the steps "
              f"of no pruning")


if __name__ == "__main__":
    main()

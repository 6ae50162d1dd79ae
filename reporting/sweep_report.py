"""What a finished sweep (sweep.py) leaves in its directory and on the terminal: the best
trial's recipe (best.yaml, for ``train.py --config``), the table of trials, TensorBoard's
hparams view across the trials (``DIR/hparams/trial-<n>``) and Optuna's plots as PNGs
(optimization_history.png, param_importances.png, intermediate_values.png).
"""

import contextlib
import os
import shutil
import warnings

import yaml

PLOTS = ("optimization_history", "param_importances", "intermediate_values")


def finish(study, sweep_dir, recipe, objective, direction, overhead, process_seconds):
    """Writes best.yaml, the hparams and the plots, prints the table; returns the best
    trial (a FrozenTrial) or None when no trial completed."""
    import optuna

    trials = study.get_trials(deepcopy=False)
    print(table(trials, objective), flush=True)
    complete = [t for t in trials if t.state == optuna.trial.TrialState.COMPLETE]
    best = None
    if complete:
        pick = min if direction == "minimize" else max
        best = pick(complete, key=lambda t: (t.value, -t.number) if pick is max
                    else (t.value, t.number))
        write_best(os.path.join(sweep_dir, "best.yaml"), recipe, best, objective)
        print(f"best: trial {best.number}, {objective} {best.value:.4g}: "
              f"{os.path.join(sweep_dir, 'best.yaml')} (python train.py --config "
              f"{os.path.join(sweep_dir, 'best.yaml')})", flush=True)
    else:
        print("best: no trial completed, so no best.yaml", flush=True)
    write_hparams(os.path.join(sweep_dir, "hparams"), trials, objective)
    for line in write_plots(study, sweep_dir, len(complete)):
        print(line, flush=True)
    if process_seconds:
        per_trial = overhead / len(process_seconds)
        mean = sum(process_seconds) / len(process_seconds)
        print(f"sweep: the driver's own time {per_trial:.2f} s per trial "
              f"({100 * per_trial / mean:.1f}% of a trial's {mean:.1f} s)", flush=True)
    return best


def last_step(trial):
    return max(trial.intermediate_values) if trial.intermediate_values else None


def table(trials, objective):
    """The trials, one row each: number, state, value, the last reported step, params."""
    names = sorted({name for t in trials for name in t.params})
    header = ["trial", "state", objective, "step", *names]
    rows = [header]
    for t in trials:
        value = "" if t.value is None else f"{t.value:.4g}"
        step = last_step(t)
        rows.append([str(t.number), t.state.name.lower(), value,
                     "" if step is None else str(step),
                     *(_shown(t.params.get(n, "")) for n in names)])
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip()
                     for row in rows)


def _shown(value):
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def best_recipe(recipe, best):
    """The recipe of the best trial: the sweep's recipe with its parameters."""
    return {**recipe, **best.params}


def write_best(path, recipe, best, objective):
    text = (f"# sweep.py's best trial: {best.number}, {objective} {best.value:.6g}\n"
            + yaml.safe_dump(best_recipe(recipe, best), sort_keys=False))
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def write_hparams(directory, trials, objective):
    """TensorBoard's HPARAMS view: one run per finished trial, its parameters and its
    objective (a pruned trial's: its last reported value), the step it reached."""
    from torch.utils.tensorboard import SummaryWriter

    shutil.rmtree(directory, ignore_errors=True)  # written again, whole, at each end
    for t in trials:
        if t.state.is_finished() and t.params:
            step = last_step(t)
            metrics = {f"hparams/{objective}": float("nan") if t.value is None else t.value,
                       "hparams/step": -1 if step is None else step}
            with SummaryWriter(os.path.join(directory, f"trial-{t.number}")) as writer:
                writer.add_hparams({**t.params, "state": t.state.name.lower()}, metrics,
                                   run_name=".")


def write_plots(study, sweep_dir, completed):
    """Optuna's matplotlib plots as PNGs; returns the lines that say what was written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.visualization import matplotlib as plots

    lines = []
    for name in PLOTS:
        path = os.path.join(sweep_dir, f"{name}.png")
        if name == "param_importances" and completed < 2:
            with contextlib.suppress(FileNotFoundError):
                os.remove(path)
            lines.append(f"plots: {name} skipped: it needs 2 completed trials, "
                         f"the study has {completed}")
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                ax = getattr(plots, f"plot_{name}")(study)
            figure = (ax.flat[0] if hasattr(ax, "flat") else ax).figure
            figure.savefig(path, dpi=100, bbox_inches="tight")
            plt.close(figure)
            lines.append(f"plots: {path}")
        except (ValueError, RuntimeError, ImportError) as e:  # (a plot Optuna refuses)
            lines.append(f"plots: {name} skipped: {str(e).splitlines()[0] if str(e) else e}")
    return lines

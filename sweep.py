"""Many runs of one recipe: an Optuna study whose trials are ordinary train.py runs.

    python sweep.py configs/sweep_synthetic.yaml               # the recipe's sweep: section
    python sweep.py RECIPE.yaml --trials 40 --sweep-dir sweeps/lr
    python sweep.py RECIPE.yaml --nproc-per-node 4             # each trial a torchrun of 4
    python sweep.py RECIPE.yaml -- --epochs 3 --amp bf16       # train.py flags for every trial
    python sweep.py RECIPE.yaml                                # again: resumes where it stopped

The recipe is a train.py recipe plus a ``sweep:`` section (trials, sampler, pruner, seed,
objective, space). Each trial is a train.py process (``--nproc-per-node N``: a torchrun of
N) in the run directory ``DIR/trial-<number>/``, started with ``--config
DIR/trial-<number>/trial.yaml --resume auto``; it reports each validation's figure to the
study and stops where the pruner says (machinery/sweep_trial.py). The study lives in
Optuna's storage (``DIR/study.db`` by default), so several sweep.py processes can work one
study, and a sweep stopped anywhere continues where it stood:

* a trial that was running when its driver died is taken up again, from its last
  checkpoint (each trial holds a lock file, ``DIR/trial-<number>.lock``, while a driver or
  its train.py works it: a running trial whose lock is free is an orphan);
* the sampler's draws depend on the trial's number and the finished trials only: each
  trial gets a sampler of its own, seeded from (the sweep's seed, the trial's number), and
  TPE runs without its "constant liar" (which reads the running trials). So a restarted
  driver proposes the values the uninterrupted one would have.

At the end: ``DIR/best.yaml`` (the best trial's recipe, for ``train.py --config``), a table
of the trials, TensorBoard's hparams view (``DIR/hparams``) and Optuna's plots as PNGs
(reporting/sweep_report.py).
"""

import signal
import sys

if __name__ == "__main__":  # Ctrl-C while torch loads: exit quietly with 130
    signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(128 + signum))

import collections
import contextlib
import difflib
import fcntl
import json
import math
import os
import re
import subprocess
import tempfile
import threading
import time
import warnings
import zlib

import numpy as np
import yaml

import tasks
from config import OneLineParser, RecipeLoader, build_parser, check_config, parse_config
from machinery import sweep_trial
from ops import UserError
from reporting import sweep_report

ROOT = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(ROOT, "train.py")
EXIT_USER_ERROR, EXIT_STOPPED = 2, 1
KINDS = ("log_uniform", "uniform", "choice", "int")
SWEEP_KEYS = ("trials", "sampler", "pruner", "seed", "objective", "direction", "space")
SAMPLERS = ("tpe", "random", "grid")
NOT_SEARCHED = ("config", "run_dir", "resume", "verify_resume", "replay")  # the sweep's own
DISTRIBUTED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                   "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                   "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "GROUP_WORLD_SIZE",
                   "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE")


class Stopped(Exception):
    """A trial's process ended by a signal (or the driver was asked to stop): the trial
    stays RUNNING, to be taken up by the next sweep.py."""


# ---------------------------------------------------------------------------- main

def main(argv=None):
    """Runs (or continues) the sweep; returns the exit code: 0 when the study has its
    trials, 2 for a user error (one ``error:`` line), 1 when a trial's process was stopped
    by a signal (the trial resumes on the next sweep.py), 128 + n when the driver was."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--" in argv:
        argv, fixed = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    else:
        fixed = []
    if os.environ.get("WORLD_SIZE") and os.environ.get("RANK"):  # sweep.py under torchrun:
        if os.environ["RANK"] != "0":    # process 0 drives the sweep, its trials each a
            return 0                     # torchrun of this machine's processes
        argv = [*argv, "--nproc-per-node", os.environ.get("LOCAL_WORLD_SIZE", "1")]
    try:
        sweep = Sweep(parse_args(argv), fixed)
        return sweep.run()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_USER_ERROR
    except Stopped as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.args[1] if len(e.args) > 1 else EXIT_STOPPED


def parse_args(argv):
    p = OneLineParser(prog="sweep.py", description="Many train.py runs of one recipe: an "
                      "Optuna study (see the recipe's sweep: section).")
    p.add_argument("recipe", help="a train.py recipe with a sweep: section")
    p.add_argument("--sweep-dir", help="where the study and the trials' run directories go "
                   "(default: sweeps/<the recipe's name>)")
    p.add_argument("--trials", type=int, help="how many trials the study has when done "
                   "(default: the recipe's sweep.trials)")
    p.add_argument("--sampler", choices=SAMPLERS, help="default: the recipe's, else tpe")
    p.add_argument("--pruner", choices=sweep_trial.PRUNERS,
                   help="default: the recipe's, else median")
    p.add_argument("--storage", help="Optuna's storage: an SQLAlchemy URL, or a journal "
                   "file's path (default: sqlite:///DIR/study.db)")
    p.add_argument("--nproc-per-node", type=int, default=1,
                   help="processes per trial: above 1, each trial is a torchrun of them")
    p.add_argument("--python", default=sys.executable,
                   help="the interpreter that runs each trial (and torchrun)")
    args = p.parse_args(argv)
    if args.trials is not None and args.trials < 1:
        raise UserError(f"--trials {args.trials}: must be at least 1")
    if args.nproc_per_node < 1:
        raise UserError(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    return args


# ---------------------------------------------------------------------- the recipe

def read_recipe(path):
    """The recipe (a dict without ``sweep``) and its ``sweep`` section."""
    try:  # as train.py reads a recipe: no anchors or aliases, no key given twice
        with open(path, encoding="utf-8") as f:
            recipe = yaml.load(f, Loader=RecipeLoader)
    except OSError as e:
        raise UserError(f"cannot read the recipe {path!r}: {e.strerror}") from None
    except (yaml.YAMLError, ValueError, RecursionError) as e:
        first = (str(e) or "nested too deeply").splitlines()[0]
        raise UserError(f"{path!r} is not valid YAML: {first}") from None
    if not isinstance(recipe, dict) or not isinstance(recipe.get("sweep"), dict):
        raise UserError(f"{path!r} has no sweep: section (a mapping with trials, sampler, "
                        f"pruner, seed, objective and space)")
    section = recipe.pop("sweep")
    for key in section:
        if key not in SWEEP_KEYS:
            raise UserError(f"sweep.{key} in {path!r} is not a sweep key; they are "
                            f"{', '.join(SWEEP_KEYS)}")
    return recipe, section


def _named(spec, names, what):
    """A ``name`` or ``{name: {options}}`` spec: ``(name, options)``, the name checked."""
    if isinstance(spec, dict) and len(spec) == 1:
        name, options = next(iter(spec.items()))
    else:
        name, options = spec, {}
    if name not in names or not isinstance(options or {}, dict):
        raise UserError(f"sweep.{what} {spec!r}: one of {', '.join(names)} (or a mapping of "
                        f"one of them to its options)")
    return name, dict(options or {})


def check_space(space):
    """The space's shape: each key a flag's name, each value one of ``KINDS``; returns it
    as ``{name: (kind, values, step)}``."""
    if not isinstance(space, dict) or not space:
        raise UserError("sweep.space: a mapping of train.py flags (their YAML names) to "
                        "{log_uniform: [low, high]}, {uniform: [low, high]}, {choice: [...]}"
                        " or {int: [low, high], step: k}")
    keys = set(build_parser().parse_args([]).__dict__)
    checked = {}
    for name, spec in space.items():
        name = str(name).replace("-", "_")
        if name not in keys or name in NOT_SEARCHED:
            close = difflib.get_close_matches(name, sorted(keys), n=1)
            hint = f" (did you mean {close[0]}?)" if close and name not in NOT_SEARCHED else ""
            raise UserError(f"sweep.space.{name}: train.py has no flag --"
                            f"{name.replace('_', '-')} to search{hint}" if name not in keys
                            else f"sweep.space.{name}: the sweep sets --"
                            f"{name.replace('_', '-')} itself")
        kinds = [k for k in KINDS if isinstance(spec, dict) and k in spec]
        extra = set(spec) - {*KINDS, "step"} if isinstance(spec, dict) else set()
        if len(kinds) != 1 or extra or ("step" in spec and kinds != ["int"]):
            raise UserError(f"sweep.space.{name}: {spec!r} is not one of {{log_uniform: [low, "
                            f"high]}}, {{uniform: [low, high]}}, {{choice: [...]}}, {{int: "
                            f"[low, high], step: k}}")
        kind, values = kinds[0], spec[kinds[0]]
        step = spec.get("step", 1)
        if kind == "choice":
            if not isinstance(values, list) or not values:
                raise UserError(f"sweep.space.{name}.choice: a non-empty list")
        else:
            numbers = isinstance(values, list) and len(values) == 2 and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)
            if not numbers or not values[0] < values[1] or (kind == "int" and not all(
                    isinstance(v, int) for v in values)):
                raise UserError(f"sweep.space.{name}.{kind}: [low, high] with low < high"
                                + (" (integers)" if kind == "int" else "") + f", not {values!r}")
            if kind == "log_uniform" and values[0] <= 0:
                raise UserError(f"sweep.space.{name}.log_uniform: low must be above 0, not "
                                f"{values[0]}")
            if kind == "int" and (not isinstance(step, int) or step < 1):
                raise UserError(f"sweep.space.{name}.step: a positive integer, not {step!r}")
        checked[name] = (kind, values, step)
    return checked


def extremes(kind, values, step):
    """The values of a parameter the project's checks see before any trial: the ends of a
    range (an int range's highest point on its grid), every choice."""
    if kind == "choice":
        return list(values)
    if kind == "int":
        return [values[0], values[0] + (values[1] - values[0]) // step * step]
    return list(values)


def grid_points(kind, values, step):
    if kind == "choice":
        return list(values)
    if kind == "int":
        return list(range(values[0], values[1] + 1, step))
    return None


def suggest(trial, name, kind, values, step):
    """The trial's value of one parameter (the stored one for a trial taken up again)."""
    if kind == "log_uniform":
        return trial.suggest_float(name, values[0], values[1], log=True)
    if kind == "uniform":
        return trial.suggest_float(name, values[0], values[1])
    if kind == "int":
        return trial.suggest_int(name, values[0], values[1], step=step)
    return trial.suggest_categorical(name, values)


def check_config_of(recipe, where):
    """Runs train.py's checks (parse_config, check_config) on a recipe; a UserError names
    ``where``. Returns ``(config, explicit)``."""
    with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as f:
        yaml.safe_dump(recipe, f)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config, explicit = parse_config(["--config", f.name])
            check_config(config)
        return config, explicit
    except UserError as e:  # (the file checked is a copy: not named)
        message = str(e).replace(f" in {f.name}", "").replace(f.name, "the recipe")
        raise UserError(f"{where}: {message}") from None
    finally:
        os.unlink(f.name)


def fixed_keys(fixed):
    """train.py's flags given after ``--`` as recipe keys with their typed values."""
    if not fixed:
        return {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            config, explicit = parse_config(fixed)
        except UserError as e:
            raise UserError(f"the train.py flags after --: {e}") from None
    bad = [k for k in explicit if k in NOT_SEARCHED]
    if bad:
        raise UserError(f"--{bad[0].replace('_', '-')} after --: the sweep sets it itself")
    return {k: config[k] for k in sorted(explicit)}


def objective_of(section, config):
    """``(metrics.jsonl key, direction)``: the sweep's ``objective`` (default: the task's
    best figure), its direction from the task (a figure where lower is better: minimize),
    or ``direction`` where given."""
    task = tasks.of(config)
    name = section.get("objective", task.best)
    if name is None:
        raise UserError(f"sweep.objective: --task {config['task']} has no figure to follow; "
                        f"name one ({', '.join(task.figures)})")
    figure = str(name).removeprefix("val_")
    if figure not in task.figures:
        raise UserError(f"sweep.objective {name!r}: --task {config['task']} validates "
                        f"{', '.join(task.figures)}")
    lower = task.lower_is_better if figure == task.best else figure.endswith("loss")
    direction = section.get("direction", "minimize" if lower else "maximize")
    if direction not in ("minimize", "maximize"):
        raise UserError(f"sweep.direction {direction!r}: minimize or maximize")
    return f"val_{figure}", direction


# ---------------------------------------------------------------------- the sampler

def trial_seed(seed, number, param=None):
    """The seed of trial ``number``'s sampler (of its parameter ``param``'s draw): from the
    sweep's seed, the number (and the parameter's name) only."""
    key = [int(seed), int(number)] + ([zlib.crc32(param.encode())] if param else [])
    return int(np.random.SeedSequence(key).generate_state(1)[0])


def make_sampler(name, options, seed, grid=None):
    import optuna

    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed, **options)
    if name == "grid":
        return optuna.samplers.GridSampler(grid, seed=seed, **options)
    return optuna.samplers.TPESampler(seed=seed, **{"constant_liar": False, **options})


def per_trial_sampler(name, options, seed, grid=None):
    """An Optuna sampler that hands each trial to a sampler of its own, seeded from
    (``seed``, the trial's number): what it proposes depends on the number and on the
    trials the study holds, not on what this process sampled before (a restarted driver
    proposes the same values); each parameter's draw is seeded from its name too, so a
    trial taken up after its driver died mid-suggest draws the rest as it would have."""
    import optuna

    class PerTrialSampler(optuna.samplers.BaseSampler):
        def __init__(self):
            self.samplers = {}

        def of(self, trial):
            if trial.number not in self.samplers:
                self.samplers.clear()  # one trial at a time per driver
                self.samplers[trial.number] = make_sampler(
                    name, options, trial_seed(seed, trial.number), grid)
            return self.samplers[trial.number]

        def infer_relative_search_space(self, study, trial):
            return self.of(trial).infer_relative_search_space(study, trial)

        def sample_relative(self, study, trial, search_space):
            return self.of(trial).sample_relative(study, trial, search_space)

        def sample_independent(self, study, trial, param_name, param_distribution):
            one = self.of(trial) if name == "grid" else make_sampler(  # each parameter's
                name, options, trial_seed(seed, trial.number, param_name), grid)  # own draw
            return one.sample_independent(study, trial, param_name, param_distribution)

        def before_trial(self, study, trial):
            self.of(trial).before_trial(study, trial)

        def after_trial(self, study, trial, state, values):
            if name != "grid":  # (a grid's stops an optimize loop there is none of: the
                self.of(trial).after_trial(study, trial, state, values)  # sweep counts)

        def reseed_rng(self):
            """Nothing: each trial's sampler is seeded from its number."""

    return PerTrialSampler()


# ---------------------------------------------------------------------- the sweep

class Sweep:
    """One sweep.py process's part of a study: its recipe checked, its trials run."""

    def __init__(self, args, fixed):
        recipe, section = read_recipe(args.recipe)
        self.args, self.python, self.nproc = args, args.python, args.nproc_per_node
        self.space = check_space(section.get("space"))
        self.trials = args.trials or section.get("trials", 20)
        if not isinstance(self.trials, int) or isinstance(self.trials, bool) or \
                self.trials < 1:
            raise UserError(f"sweep.trials {self.trials!r}: a positive integer")
        self.seed = section.get("seed", 0)
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            raise UserError(f"sweep.seed {self.seed!r}: an integer, 0 or more")
        self.sampler = _named(args.sampler or section.get("sampler", "tpe"), SAMPLERS,
                              "sampler")
        pruner = args.pruner or section.get("pruner", "median")
        name, options = _named(pruner, sweep_trial.PRUNERS, "pruner")
        self.pruner = {name: options}
        fixed = fixed_keys(fixed)
        both = sorted(set(fixed) & set(self.space))
        if both:
            raise UserError(f"--{both[0].replace('_', '-')} is both searched (sweep.space) "
                            f"and fixed (after --)")
        self.recipe = {k: v for k, v in {**recipe, **fixed}.items() if k not in NOT_SEARCHED}
        config, _ = check_config_of(self.recipe, f"the recipe {args.recipe!r}")
        for name, (kind, values, step) in self.space.items():  # the checks, at the ends
            for value in extremes(kind, values, step):
                check_config_of({**self.recipe, name: value},
                                f"sweep.space.{name} = {value!r}")
        self.objective, self.direction = objective_of(section, config)
        self.grid = None
        if self.sampler[0] == "grid":
            self.grid = {n: grid_points(*spec) for n, spec in self.space.items()}
            float_ranges = [n for n, points in self.grid.items() if points is None]
            if float_ranges:
                raise UserError(f"sweep.sampler grid: sweep.space.{float_ranges[0]} is a "
                                f"range of floats; a grid takes choice and int")
            self.trials = min(self.trials, math.prod(len(p) for p in self.grid.values()))
        name = os.path.splitext(os.path.basename(args.recipe))[0]
        self.dir = args.sweep_dir or os.path.join("sweeps", name)
        os.makedirs(self.dir, exist_ok=True)
        self.storage = args.storage or \
            "sqlite:///" + os.path.abspath(os.path.join(self.dir, "study.db"))
        self.study_name = os.path.basename(os.path.abspath(self.dir))
        self.definition = {"recipe": self.recipe, "space": section.get("space"),
                           "sampler": list(self.sampler), "seed": self.seed,
                           "pruner": self.pruner, "objective": self.objective,
                           "nproc_per_node": self.nproc}
        self.process_seconds = []  # each trial's process, for the driver's overhead
        self.child = None
        self.signum = None

    # -- the study

    def open_study(self):
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        try:
            storage = sweep_trial.open_storage(self.storage)
        except Exception as e:  # a URL SQLAlchemy cannot open, a driver not installed
            raise UserError(f"--storage {self.storage!r}: {first_line(e)}") from None
        study = optuna.create_study(
            storage=storage, study_name=self.study_name, direction=self.direction,
            load_if_exists=True, pruner=sweep_trial.build_pruner(self.pruner),
            sampler=per_trial_sampler(*self.sampler, self.seed, self.grid))
        held = study.user_attrs.get("sweep")
        if held is None:
            study.set_user_attr("sweep", self.definition)
        elif json.loads(json.dumps(self.definition)) != held:
            changed = next(k for k in self.definition
                           if json.loads(json.dumps(self.definition[k])) != held.get(k))
            raise UserError(f"{self.dir!r} holds a study of another sweep (its {changed} "
                            f"differs: {held.get(changed)!r}); give another --sweep-dir")
        return study

    @contextlib.contextmanager
    def locked(self, name, wait=True):
        """An exclusive lock on ``DIR/name`` (yields its file descriptor, or None when
        ``wait`` is False and another process holds it)."""
        fd = os.open(os.path.join(self.dir, name), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
            except BlockingIOError:
                yield None
                return
            yield fd
        finally:
            os.close(fd)

    def next_trial(self, study, stack):
        """The trial to work next, its lock held (entered in ``stack``): an orphan (a
        running trial no process holds), else a new one while the study has fewer than
        its trials; None when there is nothing left to do here."""
        import optuna

        with self.locked("sweep.lock"):
            trials = study.get_trials(deepcopy=False)
            for t in trials:
                if t.state == optuna.trial.TrialState.RUNNING:
                    fd = stack.enter_context(self.locked(f"trial-{t.number}.lock", wait=False))
                    if fd is not None:
                        print(f"sweep: taking up trial {t.number} where it stopped",
                              flush=True)
                        return optuna.trial.Trial(study, t._trial_id), fd
            if len(trials) >= self.trials:
                return None, None
            trial = study.ask()
            return trial, stack.enter_context(self.locked(f"trial-{trial.number}.lock"))

    def run(self):
        study = self.open_study()
        started = time.monotonic()
        previous = self.forward_signals()
        try:
            while True:
                with contextlib.ExitStack() as stack:
                    trial, fd = self.next_trial(study, stack)
                    if trial is None:
                        break
                    self.run_trial(study, trial, fd)
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        overhead = time.monotonic() - started - sum(self.process_seconds)
        sweep_report.finish(study, self.dir, self.recipe, self.objective, self.direction,
                            overhead, self.process_seconds)
        return 0

    def forward_signals(self):
        """SIGINT, SIGTERM and SIGHUP go on to the trial's process (which saves and
        exits); the driver then stops, the trial left to the next sweep.py."""
        def handler(signum, frame):
            self.signum = signum
            if self.child is not None and self.child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    self.child.send_signal(signum)
            else:
                raise Stopped(f"{signal.Signals(signum).name}: stopped between trials; "
                              f"run the same command to go on", 128 + signum)
        return {s: signal.signal(s, handler)
                for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

    # -- one trial

    def run_trial(self, study, trial, lock_fd):
        import optuna

        params = {name: suggest(trial, name, *spec) for name, spec in self.space.items()}
        run_dir = os.path.join(self.dir, f"trial-{trial.number}")
        os.makedirs(run_dir, exist_ok=True)
        recipe_path = os.path.join(run_dir, "trial.yaml")
        write_yaml(recipe_path, {**self.recipe, **params})
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in params.items())
        print(f"sweep: trial {trial.number} ({shown}) in {run_dir}", flush=True)
        rc, tail, seconds = self.run_process(trial.number, recipe_path, run_dir, lock_fd)
        self.process_seconds.append(seconds)
        storage = study._storage
        frozen = storage.get_trial(trial._trial_id)
        codes = exit_codes(tail) if self.nproc > 1 else [rc]
        pruned_at = frozen.system_attrs.get(sweep_trial.PRUNED_ATTR)
        ended = outcome(rc, codes, pruned_at, self.signum)
        if ended == "pruned":
            study.tell(trial.number, state=optuna.trial.TrialState.PRUNED)
            print(f"sweep: trial {trial.number} pruned at step {pruned_at}", flush=True)
        elif ended == "complete":
            value = final_value(run_dir, self.objective)
            if value is None or value != value:
                storage.set_trial_user_attr(trial._trial_id, "error",
                                            f"no finite {self.objective} in metrics.jsonl")
                study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
                print(f"sweep: trial {trial.number} failed: no finite {self.objective}",
                      flush=True)
            else:
                study.tell(trial.number, value)
                print(f"sweep: trial {trial.number} done: {self.objective} {value:.4g}",
                      flush=True)
        elif ended == "failed":  # train.py's own error line: a loss not finite, a flag
            error = last_error(tail)
            storage.set_trial_user_attr(trial._trial_id, "error", error)
            study.tell(trial.number, state=optuna.trial.TrialState.FAIL)
            print(f"sweep: trial {trial.number} failed: {error}", flush=True)
        else:  # killed (or stopped by a signal): the next sweep.py takes it up
            why = f"signal {self.signum}" if self.signum else describe(rc, codes)
            raise Stopped(f"trial {trial.number}'s process ended ({why}); it resumes from "
                          f"its last checkpoint when this sweep.py runs again",
                          128 + self.signum if self.signum else EXIT_STOPPED)

    def command(self, recipe_path, run_dir):
        train = [TRAIN, "--config", recipe_path, "--run-dir", run_dir, "--resume", "auto"]
        if self.nproc == 1:
            return [self.python, *train]
        return [self.python, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node", str(self.nproc), "--no-python", self.python, *train]

    def run_process(self, number, recipe_path, run_dir, lock_fd):
        """Runs the trial's train.py (or torchrun), its output passed on; returns ``(exit
        code, the output's last lines, seconds)``. The process holds the trial's lock while
        it lives and gets SIGTERM (saves, exits) if this driver dies first."""
        env = {k: v for k, v in os.environ.items() if k not in DISTRIBUTED_ENV}
        env[sweep_trial.ENV] = json.dumps({
            "storage": self.storage, "study": self.study_name, "trial": number,
            "pruner": self.pruner, "objective": self.objective})
        env.setdefault("PYTHONUNBUFFERED", "1")
        started = time.monotonic()
        self.child = subprocess.Popen(
            self.command(recipe_path, run_dir), env=env, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, pass_fds=(lock_fd,), start_new_session=True,
            preexec_fn=_die_with_parent)
        tail = collections.deque(maxlen=200)
        reader = threading.Thread(target=_pass_on, args=(self.child.stdout, tail), daemon=True)
        reader.start()
        while True:
            try:
                rc = self.child.wait()
                break
            except Stopped:  # (raised by the handler only between trials)
                continue
        reader.join()
        self.child = None
        return rc, "".join(tail), time.monotonic() - started


def _die_with_parent():
    """In the trial's process before it starts: SIGTERM when the driver dies (Linux), so a
    killed driver leaves no process behind (the trial saves and exits)."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _pass_on(stream, tail):
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace"))
        with contextlib.suppress(OSError, ValueError):
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
    stream.close()


def outcome(rc, codes, pruned_at, signum=None):
    """How a trial's process ended: ``"pruned"`` (it stopped where the pruner said, at
    ``pruned_at``), ``"complete"``, ``"failed"`` (train.py's own error: every process that
    torchrun lists ended with 1 or 2, or was ended by torchrun after the first) or
    ``"stopped"`` (killed, or a signal the driver passed on: the trial stays RUNNING and
    resumes on the next sweep.py). ``codes``: its processes' exit codes ([rc] for one)."""
    if rc == 0 or (codes and set(codes) <= {sweep_trial.EXIT_PRUNED}):
        return "complete" if pruned_at is None else "pruned"
    if signum is None and codes and set(codes) <= {1, 2, -signal.SIGTERM, 128 + signal.SIGTERM} \
            and {1, 2} & set(codes):
        return "failed"
    return "stopped"


def exit_codes(output):
    """The workers' exit codes torchrun lists when one failed (``exitcode : -9``)."""
    return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", output)]


def describe(rc, codes):
    if rc < 0:
        return signal.Signals(-rc).name
    if codes and codes != [rc]:
        return "its processes' exit codes " + ", ".join(map(str, codes))
    return f"exit code {rc}"


def last_error(output):
    lines = [line.strip() for line in output.splitlines() if "error:" in line]
    return lines[-1][lines[-1].index("error:"):] if lines else "no error line"


def first_line(e):
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def final_value(run_dir, key):
    """The objective of a finished trial: its last validation's value (metrics.jsonl)."""
    value = None
    with contextlib.suppress(OSError), open(os.path.join(run_dir, "metrics.jsonl")) as f:
        for line in f:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if key in record and record[key] is not None:
                    value = float(record[key])
    return value


def write_yaml(path, recipe):
    """Writes a recipe atomically (a killed driver leaves the old file or the new)."""
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        yaml.safe_dump(recipe, f, sort_keys=False)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())

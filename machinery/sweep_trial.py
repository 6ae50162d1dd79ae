"""The trial's side of sweep.py: a train.py that sweep.py started for one trial of an Optuna
study reports each validation's figure to the study and stops where the study's pruner says.

sweep.py passes the trial in the environment (``SWEEP_TRIAL``: JSON with the storage, the
study's name, the trial's number, the pruner and the objective's metrics.jsonl key); outside
a sweep the variable is unset and both hooks below return at once, without a collective.

train.py calls ``reported`` after each epoch's validation, ``pruned`` at the top of each
epoch and ``exit_code`` at its end. Process 0 alone talks to the study; its answer is
broadcast over the host group, so every process of a torchrun trial stops at the same step
(the epoch's end, after its one save, last.pt). A step's value is reported once: a resumed
trial that validates a step again finds it in the study. A decision to prune is recorded in
the study (the trial's system attribute ``PRUNED_ATTR``) before the epoch's save, so a
trial killed after it and resumed stops at that step again, whether its last.pt was written
before the kill or not; a decision to go on is not recorded: asked again, the pruner gives
the same answer (it reads the finished trials only). A pruned train.py exits with
``EXIT_PRUNED`` (one process; 0 under torchrun, see ``exit_code``).
"""

import json
import os

import torch
import torch.distributed as dist

ENV = "SWEEP_TRIAL"
EXIT_PRUNED = 4  # (3 is the watchdog's hung process)
PRUNED_ATTR = "sweep:pruned_step"
PRUNERS = ("median", "hyperband", "none")

_decided = {}  # step -> whether the trial stops there (this process; shared by every rank)
_opened = {}   # the study and trial id, opened once per process (process 0)
_world = {}    # "size": the trial's number of processes


def settings():
    """The trial sweep.py runs in this process (a dict), or None outside a sweep."""
    raw = os.environ.get(ENV)
    return json.loads(raw) if raw else None


def open_storage(spec):
    """Optuna's storage for ``spec``: an SQLAlchemy URL (``sqlite:///sweeps/x/study.db``,
    ``postgresql://...``) or the path of a journal file (Optuna's JournalStorage: a file
    that several machines on one file system can share)."""
    import optuna

    if "://" in spec:
        return optuna.storages.RDBStorage(spec)
    from optuna.storages.journal import JournalFileBackend

    return optuna.storages.JournalStorage(JournalFileBackend(spec))


def build_pruner(spec):
    """An Optuna pruner from the sweep's ``pruner``: a name of ``PRUNERS``, or a mapping of
    one name to its keyword arguments (``{median: {n_startup_trials: 2}}``)."""
    import optuna

    name, options = (spec, {}) if isinstance(spec, str) else next(iter(spec.items()))
    options = dict(options or {})
    if name == "median":
        return optuna.pruners.MedianPruner(**options)
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner(**options)
    return optuna.pruners.NopPruner(**options)


class _Trial:
    """The study and this trial, as process 0 of a trial sees them."""

    def __init__(self, s):
        import optuna

        self.storage = open_storage(s["storage"])
        self.study = optuna.load_study(study_name=s["study"], storage=self.storage,
                                       pruner=build_pruner(s["pruner"]),
                                       sampler=optuna.samplers.RandomSampler(0))
        study_id = self.storage.get_study_id_from_name(s["study"])
        self.id = self.storage.get_trial_id_from_study_id_trial_number(study_id, s["trial"])

    def pruned_at(self):
        """The step at which the pruner stopped this trial, or None."""
        return self.storage.get_trial_system_attrs(self.id).get(PRUNED_ATTR)

    def report(self, step, value):
        """Reports ``value`` at ``step`` (once) and asks the pruner; returns whether to
        stop, the decision recorded in the study when it is yes."""
        if self.pruned_at() is not None:  # decided before a kill: the same answer
            return self.pruned_at() == step
        trial = self.storage.get_trial(self.id)
        if step not in trial.intermediate_values:
            self.storage.set_trial_intermediate_value(self.id, step, value)
            trial = self.storage.get_trial(self.id)
        prune = self.study.pruner.prune(self.study, trial)
        if prune:
            self.storage.set_trial_system_attr(self.id, PRUNED_ATTR, step)
        return bool(prune)


def _trial(s):
    if "trial" not in _opened:
        _opened["trial"] = _Trial(s)
    return _opened["trial"]


def _share(flag, procs):
    """Process 0's ``flag``, on every process (a broadcast over the host group)."""
    if procs.world_size == 1:
        return flag
    tensor = torch.tensor([int(flag)])
    dist.broadcast(tensor, 0, group=procs.host_group)
    return bool(tensor[0])


def reported(procs, step, figures):
    """After the validation at optimizer step ``step`` (``figures``: its metrics.jsonl
    keys): process 0 reports the objective to the study and asks the pruner; every process
    learns the answer, which ``pruned`` gives at the top of the next epoch. Returns
    ``figures``."""
    s = settings()
    if s is None:
        return figures
    _world["size"] = procs.world_size
    prune = False
    if procs.rank == 0:
        value = float(figures.get(s["objective"], float("nan")))  # missing: NaN, pruned
        prune = _trial(s).report(step, value)
    _decided[step] = _share(prune, procs)
    return figures


def pruned(procs, step, epoch_samples):
    """Whether the trial stops here, at the top of an epoch: the pruner decided so at the
    validation of ``step`` (this process, or before a kill: the study says). Only where an
    epoch ended (``epoch_samples`` 0): a trial resumed from the checkpoint taken before that
    epoch's validation validates again first."""
    s = settings()
    if s is None or step == 0 or epoch_samples:
        return False
    _world["size"] = procs.world_size
    if step not in _decided:  # a resumed trial: its epoch was validated before the kill
        _decided[step] = _share(procs.rank == 0 and _trial(s).pruned_at() == step, procs)
    if _decided[step] and procs.rank == 0:
        print(f"pruned: sweep.py's pruner ({', '.join(s['pruner'])}) stopped trial "
              f"{s['trial']} at step {step}", flush=True)
    return _decided[step]


def exit_code():
    """A run's exit code when it ended without an error: ``EXIT_PRUNED`` when the pruner
    stopped a run of one process, else 0. Under torchrun a pruned process exits with 0: a
    process that exits with another code makes torchrun end the others with SIGTERM, maybe
    before process 0's last writes (sweep.py reads the prune from the study)."""
    return EXIT_PRUNED if any(_decided.values()) and _world.get("size", 1) == 1 else 0

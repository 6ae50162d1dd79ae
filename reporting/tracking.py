"""MLflow tracking (``--mlflow [URI]``): the run recorded in an MLflow tracking store.

``open_tracker`` opens (or, after a resume, reopens) the MLflow run on process 0; ``RunLog``
forwards to the ``Tracker`` what it writes to TensorBoard and metrics.jsonl:

    params      the resolved config (config.yaml's keys), values as text; a value longer
                than ``PARAM_LIMIT`` characters is cut and ends in "... (truncated)"
    metrics     each metrics.jsonl record's numbers under its keys (train_loss, val_loss,
                val_acc, lr, samples_per_sec, ...) and each log step's ``train/*`` scalars
                (train/loss, train/lr, ...), all at step = the optimizer step
    artifacts   config.yaml and summary.txt, when the run starts (again after a resume)
    tags        run_dir and, at the end, best_checkpoint (the absolute path of best.pt)

The experiment is the dataset's name (``cifar10``, ``synthetic``, ...), or
``$MLFLOW_EXPERIMENT_NAME``; the run is named after the run directory. Without a URI,
``--mlflow`` records where MLflow itself does by default (since 3.7): its SQLite store
``mlflow.db`` in the working directory, artifacts in ``./mlruns`` (``local_store``); the
resolved URI is what the config keeps, so a resume from another directory finds the same
store. ``file://`` URIs and plain directories are MLflow's file store, as before; a plain
path ending in ``.db`` is a SQLite store.

The MLflow run id is kept in every checkpoint (``RUN_ID_KEY``): a resumed or requeued run
continues the same MLflow run, but only in the run directory that owns it (the checkpoint
lies in its ``checkpoints/``). A fork (``--resume OTHER_RUN/checkpoints/X.pt --run-dir NEW``)
starts a new MLflow run, tagged with its parent (``parent_run_id``, and MLflow's
``mlflow.parentRunId`` where the parent is in the same store), and says so in its one line.
A finished run (and an LR range test) ends FINISHED, one stopped by a signal KILLED, one that
ended with an error line FAILED (a resume sets it RUNNING again). ``--preflight`` alone
records no run (it trains nothing); ``--preflight train`` records the run it trains.

MLflow is imported only when ``--mlflow`` is on. A store that cannot be reached or that
refuses a call is one ``warning:`` line, and the run goes on without MLflow; its HTTP calls
are not retried and time out after ``HTTP_TIMEOUT_S`` seconds (unless the environment sets
``MLFLOW_HTTP_REQUEST_MAX_RETRIES`` / ``MLFLOW_HTTP_REQUEST_TIMEOUT``).
"""

import contextlib
import importlib.util
import logging
import os
import pathlib
import sys
import time
import urllib.parse

from machinery import files, runtime
from ops import first_sentence
from reporting import metrics
from reporting.runlog import NOT_SAVED_IN_CONFIG

RUN_ID_KEY = "mlflow_run_id"  # the checkpoint dict's key
PARENT_KEY = "mlflow_parent_run_id"  # a fork's parent: in the resumed state only (owned)
PARENT_TAG = "parent_run_id"
DB_NAME = "mlflow.db"  # a bare --mlflow: MLflow's own default store, in the working directory
LOCAL = "local"  # config["mlflow"] of a bare --mlflow
PARAM_LIMIT = 500  # characters of a param value; older servers accept this much too
TRUNCATED = "... (truncated)"
ARTIFACTS = ("config.yaml", "summary.txt")
LOG_STEP_PREFIX = metrics.TRAIN_LOSS.split("/")[0] + "/"  # "train/": train.log_train's tags
BATCH = 100  # params, tags or metrics in one call (MLflow's limit for params and tags)
HTTP_TIMEOUT_S = 10


def local_store():
    """The store of a bare --mlflow: MLflow's default, ``sqlite:///<cwd>/mlflow.db`` (its
    artifacts go to ``./mlruns``), so ``mlflow ui`` started here opens it as it is."""
    return "sqlite:///" + os.path.abspath(DB_NAME)


def tracking_uri(value, run_dir=None):
    """The tracking URI of ``--mlflow VALUE``, absolute wherever it names a local file:
    ``local_store`` for a bare flag, a plain path as a ``file://`` URI (a ``.db`` file as
    ``sqlite:///``), a ``sqlite:///`` URI with a relative path made absolute, any other
    URI as given. ``run_dir`` is not used (kept for callers)."""
    if value == LOCAL:
        return local_store()
    scheme = urllib.parse.urlparse(value).scheme
    if not scheme and value != "databricks":
        if value.endswith(".db"):
            return "sqlite:///" + os.path.abspath(value)
        return pathlib.Path(os.path.abspath(value)).as_uri()
    if scheme == "sqlite" and value.startswith("sqlite:///") and value != "sqlite:///" \
            and not value.startswith("sqlite:////") and ":memory:" not in value:
        return "sqlite:///" + os.path.abspath(value[len("sqlite:///"):])
    return value


def resolved(config):
    """``config`` with ``mlflow`` as ``tracking_uri`` resolves it (None stays None): the
    config saved in the run directory and its checkpoints names the store itself, so a
    resume started from another working directory records into the same one."""
    if not config.get("mlflow"):
        return config
    return {**config, "mlflow": tracking_uri(config["mlflow"])}


def owned(saved, resume_path, run_dir):
    """The resumed state as the MLflow side of a resume into ``run_dir`` sees it.

    An MLflow run is continued only by the run directory that owns it: one whose
    ``checkpoints/`` holds the file resumed from. A fork (``--resume A/checkpoints/X.pt
    --run-dir B``) gets the run id under ``PARENT_KEY`` instead: B records a new run,
    tagged with A's as its parent, and never writes into A's.

    Args:
        saved: the checkpoint resumed from, or None.
        resume_path: its file.
        run_dir: the run directory this run writes.

    Returns:
        ``saved``, or a copy with ``RUN_ID_KEY`` moved to ``PARENT_KEY``.
    """
    if saved is None or RUN_ID_KEY not in saved:
        return saved
    here = os.path.realpath(os.path.join(run_dir, "checkpoints"))
    if os.path.realpath(os.path.dirname(os.path.abspath(resume_path))) == here:
        return saved
    forked = dict(saved)
    forked[PARENT_KEY] = forked.pop(RUN_ID_KEY)
    return forked


def experiment_name(config):
    """The experiment runs are recorded in: ``$MLFLOW_EXPERIMENT_NAME``, else the dataset."""
    return os.environ.get("MLFLOW_EXPERIMENT_NAME") or config["dataset"]


def params_of(config):
    """The config as MLflow params: config.yaml's keys, values as text, cut to
    ``PARAM_LIMIT`` characters (the cut says so)."""
    params = {}
    for key, value in config.items():
        if key in NOT_SAVED_IN_CONFIG:
            continue
        text = files.printable(str(value))  # a --data-dir not in UTF-8: escaped
        if len(text) > PARAM_LIMIT:
            text = text[:PARAM_LIMIT - len(TRUNCATED)] + TRUNCATED
        params[key] = text
    return params


def run_id(tracker, saved):
    """The MLflow run id every checkpoint keeps: the tracker's, else the one of the
    checkpoint resumed from (kept while MLflow is off or down), else None."""
    if tracker is not None and tracker.run_id:
        return tracker.run_id
    return saved.get(RUN_ID_KEY) if saved else None


def open_tracker(config, run_dir, saved=None, enabled=True):
    """The MLflow run of this training, opened; None without --mlflow or off process 0.

    Args:
        config: the resolved config (``config["mlflow"]``: None, ``"local"`` or a URI).
        run_dir: the run directory.
        saved: the checkpoint resumed from, or None: its ``RUN_ID_KEY`` is the run to
            continue, its ``PARENT_KEY`` (``owned``: a fork) the parent of a new run.
        enabled: False on every process but the main one.

    Returns:
        A ``Tracker`` (disabled, after one warning, where MLflow failed), or None (also
        for ``--preflight`` alone, which trains nothing: review 6's F10).
    """
    if not enabled or not config.get("mlflow"):
        return None
    if config.get("preflight") == "only":  # it trains nothing: no run left RUNNING (F10)
        runtime.main_print("mlflow: --preflight alone records no MLflow run")
        return None
    tracker = Tracker(tracking_uri(config["mlflow"]), run_dir)
    tracker.start(config, saved.get(RUN_ID_KEY) if saved else None,
                  saved.get(PARENT_KEY) if saved else None)
    return tracker


def sqlite_path(uri):
    """The file of a ``sqlite:///`` URI, or None (another store)."""
    return uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None


def unwritable(path):
    """Why the SQLite store ``path`` cannot be written, or None: checked before MLflow
    opens it, whose engine retries an unwritable file for about 50 s (round 5's F6)."""
    if os.path.exists(path):
        return None if os.access(path, os.R_OK | os.W_OK) else f"{path} is not writable"
    parent = os.path.dirname(path) or "."
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)  # (MLflow makes the missing folders)
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot create {path}: {parent} is not writable"
    return None


@contextlib.contextmanager
def _quiet_database_setup(uri):
    """MLflow's SQL store logs its schema migrations (INFO lines on stderr, the first time
    some seconds): one line of ours instead, where the SQLite file is new. The store is
    opened under an exclusive lock of its folder (``flock``), so that runs started at
    once on a new file do not both create its tables (one of them would record nothing:
    round 5's F5); the lock is the folder's, no file is left behind."""
    path = sqlite_path(uri)
    if path and not os.path.exists(path):
        runtime.main_print(f"mlflow: creating the tables of a new store {path} (once: "
                           f"some seconds)")
    loggers = [logging.getLogger(name) for name in ("mlflow.store.db.utils", "alembic")]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)  # (its retries' warnings: our one line says why)
    with contextlib.ExitStack() as held:
        if path:
            held.enter_context(_folder_lock(os.path.dirname(path) or "."))
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


@contextlib.contextmanager
def _folder_lock(folder):
    """An exclusive ``flock`` of ``folder`` (made if missing) while the block runs; none
    where the platform or the file system has none."""
    try:
        import fcntl

        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # (releases the lock)


def reason(error):
    """Why an MLflow call failed, in a few words: the network's or the file system's error
    at the root of the chain ("Connection refused"), else the first sentence of MLflow's."""
    root, depth = error, 0
    while (root.__cause__ or root.__context__) is not None and depth < 20:
        root, depth = root.__cause__ or root.__context__, depth + 1
    return first_sentence(root if isinstance(root, OSError) else error)


class Tracker:
    """One MLflow run, written by process 0; every call is a no-op once MLflow failed.

    Args:
        uri: the tracking URI.
        run_dir: the run directory (its artifacts, best.pt).
    """

    def __init__(self, uri, run_dir):
        self.uri, self.run_dir = uri, run_dir
        self.client, self.run_id = None, None

    def start(self, config, resume_id=None, parent_id=None):
        """Reopens run ``resume_id`` (a resumed run), or creates a run (tagged with
        ``parent_id``, a fork's parent); logs the params."""
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(HTTP_TIMEOUT_S))
        if urllib.parse.urlparse(self.uri).scheme == "file":  # in maintenance mode since
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3.7: allowed
        try:
            from mlflow.tracking import MlflowClient
        except ImportError:
            self._warn("MLflow is not installed (pip install -r requirements.txt)")
            return
        missing = [name for name in ("sqlalchemy", "alembic")
                   if importlib.util.find_spec(name) is None]
        if self.uri.startswith("sqlite:") and missing:  # (MLflow's words: its registry)
            self._warn(f"its SQLite store needs {' and '.join(missing)}, which are not "
                       f"installed (pip install -r requirements.txt)")
            return
        path = sqlite_path(self.uri)
        if path and unwritable(path):  # at once, not after MLflow's retries
            self._warn(unwritable(path))
            return
        try:  # the store is opened here: an unknown scheme, a file store refused
            with _quiet_database_setup(self.uri):
                self.client = MlflowClient(tracking_uri=self.uri)
                self.client.search_experiments(max_results=1)  # a new SQLite store: built
        except Exception as e:
            self._warn(reason(e))
            return
        self._call(self._start, config, resume_id, parent_id)

    def _start(self, config, resume_id, parent_id=None):
        from mlflow.exceptions import MlflowException

        run, existing, continuing, forked = None, {}, False, ""
        if resume_id:
            try:
                run = self.client.get_run(resume_id)
            except MlflowException as e:
                if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                    raise
                runtime.main_print(f"mlflow: the checkpoint's run {resume_id} is not in "
                                   f"{self.uri}: starting a new MLflow run")
        name = experiment_name(config)
        if run is None:
            tags = {"run_dir": os.path.abspath(self.run_dir), "mlflow.source.name": "train.py"}
            if parent_id:
                tags.update(self._parent_tags(parent_id))
                forked = f", forked from run {parent_id} (tag {PARENT_TAG}): the checkpoint " \
                    f"is another run directory's"
            run = self.client.create_run(
                self._experiment_id(name), run_name=os.path.basename(
                    os.path.normpath(self.run_dir)), tags=tags)
        else:
            self.client.update_run(run.info.run_id, status="RUNNING")
            existing, continuing = run.data.params, True
        self.run_id = run.info.run_id
        self._log_params(params_of(config), existing)
        how = "continuing" if continuing else "recording"
        if self.uri.startswith("file:"):
            look = f"; look with: MLFLOW_ALLOW_FILE_STORE=true mlflow ui " \
                f"--backend-store-uri {self.uri}"
        elif self.uri.startswith("sqlite:"):
            look = f"; look with: mlflow ui --backend-store-uri {self.uri}"
        elif self.uri.startswith(("http:", "https:")):  # the server's UI
            look = f"; look at {self.uri.rstrip('/')}/#/experiments/" \
                f"{run.info.experiment_id}/runs/{self.run_id}"
        else:
            look = ""
        runtime.main_print(f"mlflow: {how} run {self.run_id} (experiment {name!r}) in "
                           f"{self.uri}{forked}{look}")

    def _parent_tags(self, parent_id):
        """A fork's tags: ``parent_run_id``, and ``mlflow.parentRunId`` (the UI nests it
        under its parent) where the parent is a run of this store."""
        from mlflow.exceptions import MlflowException

        tags = {PARENT_TAG: parent_id}
        with contextlib.suppress(MlflowException):
            self.client.get_run(parent_id)
            tags["mlflow.parentRunId"] = parent_id
        return tags

    def _experiment_id(self, name):
        from mlflow.exceptions import MlflowException

        experiment = self.client.get_experiment_by_name(name)
        if experiment is not None:
            return experiment.experiment_id
        try:
            return self.client.create_experiment(name)
        except MlflowException:  # another run created it at the same moment
            experiment = self.client.get_experiment_by_name(name)
            if experiment is None:
                raise
            return experiment.experiment_id

    def _log_params(self, params, existing):
        """The params not yet in the run; an MLflow param cannot change, so one a resume
        overrode becomes the tag ``override.<key>``."""
        from mlflow.entities import Param, RunTag

        new = [Param(k, v) for k, v in params.items() if k not in existing]
        changed = [RunTag(f"override.{k}", v) for k, v in params.items()
                   if k in existing and existing[k] != v]
        for i in range(0, len(new), BATCH):
            self.client.log_batch(self.run_id, params=new[i:i + BATCH])
        for i in range(0, len(changed), BATCH):
            self.client.log_batch(self.run_id, tags=changed[i:i + BATCH])

    def scalars(self, values, step):
        """A log step's training scalars (``train/*``: loss, lr, ...); other tags are
        dropped (validation and speed arrive with the epoch's record)."""
        self._metrics({k: v for k, v in values.items() if k.startswith(LOG_STEP_PREFIX)},
                      step)

    def epoch(self, record):
        """One metrics.jsonl record, its figures at its optimizer step."""
        self._metrics({k: v for k, v in record.items() if k != "step"}, record["step"])

    def artifacts(self):
        """config.yaml and summary.txt of the run directory (those that exist)."""
        paths = [os.path.join(self.run_dir, name) for name in ARTIFACTS]
        self._call(lambda: [self.client.log_artifact(self.run_id, p) for p in paths
                            if os.path.exists(p)])

    def close(self, status):
        """Ends the run with ``status``: FINISHED, KILLED (a signal) or FAILED (an error
        line); a resume continues a KILLED or FAILED run. The tag best_checkpoint names
        best.pt where there is one."""
        best = os.path.abspath(os.path.join(self.run_dir, "checkpoints", "best.pt"))

        def end():
            if os.path.exists(best):
                self.client.set_tag(self.run_id, "best_checkpoint", best)
            self.client.set_terminated(self.run_id, status)

        self._call(end)

    def _metrics(self, values, step):
        if self.client is None:
            return
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(k, float(v), now, int(step)) for k, v in values.items()
                 if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if batch:
            self._call(self.client.log_batch, self.run_id, metrics=batch)

    def _call(self, call, *args, **kwargs):
        """Calls MLflow; a failure disables the tracker after one warning."""
        if self.client is None:  # off: MLflow failed before
            return
        try:
            call(*args, **kwargs)
        except Exception as e:  # any failure of the store: the run does not depend on it
            self._warn(reason(e))

    def _warn(self, why):
        self.client = None
        runtime.say(f"warning: MLflow ({self.uri}): {why}; training goes on without "
                    f"recording in MLflow", file=sys.stderr)

"""Two torchrun worker processes kept up for the whole test session, each run a fresh fork.

A torchrun of two processes costs about 8 s of CPU on this machine before its first step
(torchrun and each worker import torch and train.py: 3.3 s a process), and the suite
launched over forty. ``helpers.torchrun(args)`` (a run expected to succeed, two processes,
train.py or a ``write_launcher`` patch) sends its run here instead: one ``torchrun
--standalone --nproc_per_node 2`` per test process (started at its first run, ended with
the session) whose workers (tests/torchrun_worker.py) import train.py once, then for
each run fork a child that

* runs the launcher's patch (if any), then ``train.main(args)`` with ``sys.argv`` as
  train.py would have it, its stdout and stderr in a file of its own;
* has the test's environment at the run (os.environ, as a launch then would; what a
  module reads from it at import was read when the pool started);
* joins a process group of its own: a store prefix of its own
  (``TORCHELASTIC_RESTART_COUNT`` 1000, 1001...: as a torchrun restart's round,
  machinery/elastic.py);
* ends with train.main's exit code (``os._exit`` after the exit handlers).

Each run is a new process with torchrun's environment (RANK, WORLD_SIZE, the agent's
store), the state of a process that imported train.py and did nothing else, as a
launch's worker is. What a pool cannot show stays a real torchrun of its own
(``helpers.start_torchrun``): torchrun's report of its workers' exit codes, a signal to a
worker, torchrun's own flags (``--max-restarts``), another number of processes.
"""

import atexit
import contextlib
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torchrun_worker.py")

GRACE_S = 30  # one process ended with an error: the time the other has to end too


class Pool:
    """``Pool(root, env).run(args, patch, env, timeout)``: ``(exit code, output)``, as a
    launch of its own would give (the output: process 0's, then process 1's; ``None``
    and what there is when the run did not end in time: the pool is gone then)."""

    nproc = 2

    def __init__(self, root, env):
        self.dir = tempfile.mkdtemp(prefix="torchrun-pool-")
        self.log = open(os.path.join(self.dir, "torchrun.log"), "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc_per_node", str(self.nproc), WORKER, self.dir, str(os.getpid()), root],
            cwd=root, env=env, stdout=self.log, stderr=subprocess.STDOUT)
        self.jobs = 0

    def alive(self):
        return self.proc.poll() is None

    def run(self, args, patch, env, timeout):
        n, self.jobs = self.jobs, self.jobs + 1
        path = os.path.join(self.dir, f"job-{n}.json")
        with open(path + ".tmp", "w") as f:
            json.dump({"args": [str(a) for a in args], "patch": patch or "", "env": env}, f)
        os.replace(path + ".tmp", path)
        done = [os.path.join(self.dir, f"job-{n}.rank{r}.done") for r in range(self.nproc)]
        deadline, failed_at = time.monotonic() + timeout, None
        while not all(os.path.exists(d) for d in done):
            codes = [_read(d) for d in done if os.path.exists(d)]
            if failed_at is None and any(codes):
                failed_at = time.monotonic()
            if not self.alive() or time.monotonic() > deadline or (
                    failed_at is not None and time.monotonic() - failed_at > GRACE_S):
                self.close(kill=True)
                return None, self.output(n) + self.agent_output()
            time.sleep(0.02)
        codes = [_read(d) for d in done]
        return next((c for c in codes if c), 0), self.output(n)

    def output(self, n):
        out = []
        for rank in range(self.nproc):
            with contextlib.suppress(OSError), open(
                    os.path.join(self.dir, f"job-{n}.rank{rank}.log"), errors="replace") as f:
                out.append(f.read())
        return "".join(out)

    def agent_output(self):
        with contextlib.suppress(OSError), open(self.log.name, errors="replace") as f:
            return "\ntorchrun (the pool's): " + f.read()[-3000:]
        return ""

    def close(self, kill=False):
        if self.alive() and not kill:
            path = os.path.join(self.dir, f"job-{self.jobs}.json")
            with open(path + ".tmp", "w") as f:
                json.dump(None, f)
            os.replace(path + ".tmp", path)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        if self.alive():
            kill_tree(self.proc.pid)
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def _read(path):
    with open(path) as f:
        return int(f.read())


def kill_tree(pid):
    """SIGKILL to ``pid`` and every process below it (torchrun's workers run in sessions of
    their own, so a process group would miss them)."""
    pending, pids = [pid], []
    while pending:  # the whole tree first: nothing re-parented meanwhile
        kids = children(pending.pop())
        pids += kids
        pending += kids
    for p in [*pids, pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGKILL)


def children(pid):
    """The pids of ``pid``'s child processes."""
    paths = glob.glob(f"/proc/{pid}/task/*/children")
    if not paths:  # kernels without /proc/.../children
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]
    kids = []
    for path in paths:
        with contextlib.suppress(OSError), open(path) as f:
            kids += [int(p) for p in f.read().split()]
    return kids


_pool = None


def run(root, env, args, patch=None, timeout=300):
    """A run in this test process's pool (started on first use, again after a failure)."""
    global _pool
    if _pool is None or not _pool.alive():
        _pool = Pool(root, env)
        atexit.register(_pool.close)
    return _pool.run(args, patch, env, timeout)

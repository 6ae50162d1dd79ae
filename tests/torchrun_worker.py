"""A worker of the tests' torchrun pool (tests/torchrun_pool.py starts ``torchrun
--standalone --nproc_per_node 2 tests/torchrun_worker.py QUEUE PARENT ROOT``).

It imports train.py from ROOT once, then for each job ``QUEUE/job-<n>.json`` (``None``:
the pool ends) forks a child that runs it (``run_job``) and writes the child's exit code
to ``QUEUE/job-<n>.rank<RANK>.done`` (whole: written, then renamed). It ends when the test
process PARENT is gone.
"""

import atexit
import contextlib
import itertools
import json
import os
import sys
import time
import traceback

TORCHRUN_ENV = {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                "MASTER_PORT"}


def next_job(path, parent):
    """The job at ``path`` once it is there (None: the pool ends); exits when the test
    process ``parent`` is gone."""
    while not os.path.exists(path):
        try:
            os.kill(parent, 0)  # the test process is gone: so is the pool
        except ProcessLookupError:
            sys.exit(0)
        time.sleep(0.01)
    with open(path) as f:
        return json.load(f)


def run_job(job, n, queue, root, rank):
    """In the forked child: the test's environment at the run, then torchrun's own (and a
    process group of its own: round 1000 + n), the launcher's patch, then
    ``train.main(args)``; its output in ``QUEUE/job-<n>.rank<RANK>.log``. Ends with
    train.main's exit code after the exit handlers; never returns."""
    import train
    from machinery import checkpoint

    code = 1
    try:
        fd = os.open(os.path.join(queue, f"job-{n}.rank{rank}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1), os.dup2(fd, 2), os.close(fd)
        mine = {k: v for k, v in os.environ.items() if k in TORCHRUN_ENV
                or k.startswith(("TORCHELASTIC_", "GROUP_", "ROLE_"))}
        os.environ.clear()  # the test's environment at the run, then torchrun's own
        os.environ.update({**job["env"], **mine})
        # A group of its own, in a round no restart of a job reaches (a launcher patch
        # may wait for round 3).
        os.environ["TORCHELASTIC_RESTART_COUNT"] = str(1000 + n)
        sys.argv = [os.path.join(root, "train.py"), *job["args"]]
        exec(job["patch"], {"__name__": "__main__", "os": os, "sys": sys,
                            "train": train, "checkpoint": checkpoint})
        code = train.main(job["args"])
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        with contextlib.suppress(BaseException):
            atexit._run_exitfuncs()
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def main(queue, parent, root):
    rank = os.environ["RANK"]
    for n in itertools.count():
        path = os.path.join(queue, f"job-{n}.json")
        job = next_job(path, parent)
        if job is None:
            sys.exit(0)
        sys.stdout.flush(), sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the run, in a process of its own
            run_job(job, n, queue, root, rank)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with open(path + f".rank{rank}.tmp", "w") as f:
            f.write(str(status))
        os.replace(path + f".rank{rank}.tmp", os.path.join(queue, f"job-{n}.rank{rank}.done"))


if __name__ == "__main__":
    queue, parent, root = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    sys.path[0] = root  # (the project, not tests/: train.py and its modules)
    import train  # noqa: F401  (once, in the worker: each job's fork has it)
    main(queue, parent, root)

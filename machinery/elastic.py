"""torchrun's restarts: joining this round's process group, and the lock of a restarted job.

``torchrun --max-restarts K`` starts a new group of processes when one of them dies. The
new group shares the torchrun agent's store with the group before it (the same
``MASTER_ADDR:MASTER_PORT``), where the old round's keys are still set: gloo would read
the dead processes' addresses there and fail with "Connection refused", and a barrier
would count the old round's arrivals. So each round works under a prefix of its own
(``round_prefix``), and its processes wait for each other in Python, answering signals
(``join_process_group``), before the process group is made.

A restarted group's process 0 takes over the run directory's lock from the round before
it, of the same job (``earlier_round_of_this_job``); any other run is still refused.
"""

import contextlib
import datetime
import os
import signal
import threading
import time

import torch.distributed as dist

from ops import STOP_SIGNALS, Interrupted, RunFailed, first_sentence

JOIN_TIMEOUT = 1800.0  # seconds: torch's own default for a process group
POLL = 0.05            # seconds between two looks at the store while waiting


def restart_count():
    """The round of this torchrun job: 0 first, then 1 after the first restart..."""
    try:
        return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    except ValueError:
        return 0


def round_prefix():
    """The store prefix of this round's keys; rounds share the agent's store."""
    return f"styleguide/round-{restart_count()}"


def job():
    """``{"run_id", "restart"}`` of the torchrun job this process belongs to, or None
    outside torchrun (or without a run id)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if not run_id or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    return {"run_id": run_id, "restart": restart_count()}


def earlier_round_of_this_job(holder):
    """Whether a run-directory lock's record ``holder`` was taken by process 0 of an
    earlier round of this process's torchrun job: torchrun ends a round's processes before
    it starts the next, so its lock is left over, whatever the host."""
    mine, theirs = job(), holder.get("job") if isinstance(holder, dict) else None
    return (mine is not None and isinstance(theirs, dict)
            and theirs.get("run_id") == mine["run_id"]
            and isinstance(theirs.get("restart"), int) and theirs["restart"] < mine["restart"])


def join_process_group(backend, rank, world_size, stop=None, device=None,
                       timeout=JOIN_TIMEOUT, collective_timeout=None):
    """``dist.init_process_group`` over this round's store, once every process is there.

    The processes first wait for each other in Python, polling the store, so that a stop
    signal (torchrun's SIGTERM when another process died) ends the wait at once with
    ``ops.Interrupted``; the process group is made only once all of them have arrived,
    and for that short call a stop signal ends the process (nothing is written yet).

    Args:
        backend: "gloo" or "nccl".
        rank, world_size: this process's place.
        stop: returns the number of a stop signal received, or None
            (``StopRequest.pending``); None: the wait cannot be interrupted.
        device: this process's device; under NCCL it is bound to the group at once
            (``device_id``), so its barriers need not guess it (torch warns) and NCCL
            connects now.
        timeout: seconds to wait for the others before ``RunFailed``.
        collective_timeout: the group's timeout for a collective, seconds (None: torch's;
            ``watchdog.collective_timeout``).
    """
    bound = {"device_id": device} if backend == "nccl" and device is not None else {}
    if collective_timeout is not None:
        bound["timeout"] = datetime.timedelta(seconds=collective_timeout)
    if "MASTER_ADDR" not in os.environ or "MASTER_PORT" not in os.environ:
        dist.init_process_group(backend, **bound)  # another launcher: torch's rendezvous
        return
    deadline = time.monotonic() + timeout
    store = dist.PrefixStore(round_prefix(), _connect(rank, world_size, stop, deadline))
    try:
        arrived = store.add("arrived", 1)
        while arrived < world_size:
            _check(stop, deadline, f"only {arrived} of the run's {world_size} processes "
                                   f"started within {timeout:.0f} s")
            time.sleep(POLL)
            arrived = store.add("arrived", 0)
    except RuntimeError as e:  # the agent (its store) is gone
        raise RunFailed(f"process {rank} lost the run's store while waiting for the other "
                        f"processes ({first_sentence(e)})") from None
    with _signals_end_the_process():
        try:
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                    **bound)
        except RuntimeError as e:
            if dist.is_initialized():
                raise
            raise RunFailed(f"process {rank} could not join the other processes of the run "
                            f"({first_sentence(e)})") from None


def _connect(rank, world_size, stop, deadline):
    """The store torchrun names in MASTER_ADDR/MASTER_PORT: the agent's own
    (TORCHELASTIC_USE_AGENT_STORE), else one that process 0 serves. Connecting is retried
    in short tries, so that a stop signal is answered while process 0 is not up yet."""
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    serve = rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"
    while True:
        try:
            store = dist.TCPStore(host, port, world_size, is_master=serve,
                                  timeout=datetime.timedelta(seconds=2),
                                  wait_for_workers=False, multi_tenant=serve)
            store.set_timeout(datetime.timedelta(seconds=JOIN_TIMEOUT))
            return store
        except RuntimeError as e:
            if serve:  # the port is taken: nothing to wait for
                raise RunFailed(f"process 0 cannot serve the run's store at {host}:{port} "
                                f"({first_sentence(e)})") from None
            _check(stop, deadline, f"the run's store at {host}:{port} did not answer "
                                   f"({first_sentence(e)})")


def _check(stop, deadline, why):
    """Raises ``Interrupted`` for a stop signal, ``RunFailed`` (saying ``why``) past the
    deadline."""
    if stop is not None and stop() is not None:
        raise Interrupted(stop(), "while waiting for the other processes of the run")
    if time.monotonic() > deadline:
        raise RunFailed(f"{why}; the checkpoints are intact: continue with --resume auto")


@contextlib.contextmanager
def _signals_end_the_process():
    """The stop signals take their default action (the process ends) inside the block: a
    call that blocks in C++ never returns to the Python handler that only records them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {signum: signal.signal(signum, signal.SIG_DFL) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in old.items():
            signal.signal(signum, handler)

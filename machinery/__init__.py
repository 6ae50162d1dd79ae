"""The loop's machinery: how a run runs, whatever is trained.

    engine.py       the training step (a generator), evaluation, the run state, timing
    meters.py       the step's counters on the device, the log window read from them
    checkpoint.py   the checkpoint file: checksummed, written in the background, safe loads
    saving.py       the training checkpoint: what a run saves, the Saver, what a resume restores
    checksum.py     the checkpoint's checksum
    runtime.py      torchrun processes, devices, signals, output
    hardware.py     autocast dtypes, peak TFLOP/s and FLOPs, memory, seeds
    elastic.py      torchrun's restarts: joining a round, the job's lock
    watchdog.py     --hang-timeout: a step that stopped
    files.py        atomic writes, fsync helpers, writable probes, outputs checked up front
    ledger.py       --sample-ledger: each step's samples, the permutation check
    verify_resume.py  --verify-resume: a run stopped, resumed and compared in fresh processes
    preflight.py    --preflight: every stage of a run once before its first step, put back

Imports only torch, the standard library and ops.py.
"""

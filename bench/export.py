"""What each export format costs and gives: file size, CPU samples/s, accuracy.

    python bench/export.py                             # simple_cnn and resnet18, 1 thread
    python bench/export.py --threads 2 --seconds 2     # torch's and onnxruntime's threads
    python bench/export.py --networks simple_cnn --steps 20    # a quick look

For each network: a short train.py run on the synthetic 32x32 set (--samples training
images, --steps optimizer steps at batch 64, Adam), then test.py --export of its last
checkpoint to .pt2, .ts and .onnx, and test.py --export .onnx --quantize int8 (static:
QDQ, per-channel weights, --calibration-samples training images). Each of eager (the
checkpoint's network, float32), .pt2 (torch.export.load(...).module()), .ts (frozen,
then torch.jit.optimize_for_inference when loaded), .onnx and int8 .onnx (onnxruntime,
CPUExecutionProvider) is loaded with test.py's own loaders and measured the same way:

* size: the file (eager: its state_dict as torch.save writes it);
* samples/s at batch 1 and 64 on the CPU: test.py's samples_per_second (one warm-up
  batch, then the median batch time over at least --seconds and 5 batches, random
  inputs), with --threads for torch and onnxruntime alike;
* accuracy on the synthetic validation split (--samples / 5 images), test.py's
  evaluation (engine.evaluate) of each file.

The table is printed as Markdown for bench/README.md. This prints figures; it asserts
nothing.
"""

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import platform
import sys
import tempfile

from common import ROOT  # noqa: I001

HERE = os.path.dirname(os.path.abspath(__file__))
# bench/checkpoint.py is named like the project's checkpoint module (which train.py and
# test.py import): keep this directory off the import path.
sys.path[:] = [ROOT] + [p for p in sys.path if os.path.abspath(p or ".") != HERE]

import torch  # noqa: E402

import export  # noqa: E402
import train  # noqa: E402
from config import with_defaults  # noqa: E402
from pipeline import data  # noqa: E402
from tasks.classification import Classification  # noqa: E402

FORMATS = (("eager", None), (".pt2", ".pt2"), (".ts", ".ts"), (".onnx", ".onnx"),
           ("int8 .onnx", ".onnx"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--networks", default="simple_cnn,resnet18",
                   help="comma-separated networks.py names")
    p.add_argument("--samples", type=int, default=5000,
                   help="synthetic training images (validation: a fifth as many)")
    p.add_argument("--steps", type=int, default=12, help="training steps at batch 64 "
                   "(few enough that resnet18 is not yet at 100%%)")
    p.add_argument("--calibration-samples", type=int, default=256,
                   help="--quantize int8's calibration images")
    p.add_argument("--batches", default="1,64", help="comma-separated batch sizes timed")
    p.add_argument("--seconds", type=float, default=1.0,
                   help="time each (file, batch size) for at least this long")
    p.add_argument("--threads", type=int, default=1, help="CPU threads for torch and "
                   "onnxruntime (0: torch's default)")
    p.add_argument("--dir", default=None, help="where to train and export; default: a "
                   "temporary directory, removed at the end")
    return p.parse_args(argv)


def load_test_py():
    spec = importlib.util.spec_from_file_location("project_test", os.path.join(ROOT, "test.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def quietly(fn, *args):
    """Runs fn with its stdout captured; returns (result, captured text)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = fn(*args)
    return result, out.getvalue()


def train_run(network, run_dir, args):
    argv = ["--dataset", "synthetic", "--network", network, "--synthetic-size",
            str(args.samples), "--image-size", "32", "--batch-size", "64", "--epochs", "1",
            "--max-steps", str(args.steps), "--optimizer", "adam", "--lr", "1e-3",
            "--warmup-epochs", "0", "--num-workers", "0", "--device", "cpu",
            "--log-every", "1000000", "--run-dir", run_dir]
    code, _ = quietly(train.main, argv)
    if code != 0:
        sys.exit(f"training {network} failed (exit {code})")
    return os.path.join(run_dir, "checkpoints", "last.pt")


def export_all(test_py, ckpt, stem, args):
    """test.py --export for .pt2, .ts, .onnx (+ --quantize int8); returns the JSON report of
    the ONNX export and the files."""
    files = {}
    for suffix in (".pt2", ".ts"):
        files[suffix] = f"{stem}{suffix}"
        code, _ = quietly(test_py.main, ["--checkpoint", ckpt, "--device", "cpu",
                                         "--num-workers", "0", "--export", files[suffix]])
        assert code == 0, f"export {suffix} failed"
    files[".onnx"] = f"{stem}.onnx"
    files["int8 .onnx"] = export.int8_path(files[".onnx"])
    report_path = f"{stem}.json"
    code, _ = quietly(test_py.main, [
        "--checkpoint", ckpt, "--device", "cpu", "--num-workers", "0", "--export",
        files[".onnx"], "--quantize", "int8", "--calibration-samples",
        str(args.calibration_samples), "--json", report_path])
    assert code == 0, "export .onnx --quantize int8 failed"
    with open(report_path) as f:
        return json.load(f), files


def measure(test_py, network, ckpt, files, batches):
    state = test_py.load_training_checkpoint(ckpt)
    config = with_defaults(state["config"])
    _, val_set = data.build_datasets(config)
    net = test_py.load_network(state, config, val_set, ckpt)
    shape = (val_set.in_channels, val_set.image_size, val_set.image_size)
    loaders = {suffix: load for suffix, (_, load) in export.EXPORTERS.items()}
    rows = []
    for name, suffix in FORMATS:
        if suffix is None:
            run, size = (lambda x: net(x)), test_py.weights_bytes(net)
        else:
            run, size = loaders[suffix](files[name]), os.path.getsize(files[name])
        result = test_py.evaluate_exported(run, val_set, 64, 0,
                                           Classification(val_set.num_classes))
        speeds = [test_py.samples_per_second(run, shape, b) for b in batches]
        rows.append((network, name, size, speeds, result["acc"], result["count"]))
    return rows


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    test_py = load_test_py()
    test_py.THROUGHPUT_SECONDS = args.seconds
    print(f"# {platform.machine()} {platform.processor() or ''}, {os.cpu_count()} cores, "
          f"{torch.get_num_threads()} threads; torch {torch.__version__}, onnxruntime "
          f"{importlib.import_module('onnxruntime').__version__}, python "
          f"{platform.python_version()}; {datetime.date.today()}; load average "
          f"{os.getloadavg()[0]:.1f}")
    rows, notes = [], []
    with contextlib.ExitStack() as stack:
        where = args.dir or stack.enter_context(tempfile.TemporaryDirectory())
        for network in args.networks.split(","):
            ckpt = train_run(network, os.path.join(where, f"run-{network}"), args)
            report, files = export_all(test_py, ckpt, os.path.join(where, network), args)
            export = report["export"]
            notes.append(f"{network}: trained {args.steps} steps, eager val accuracy "
                         f"{report['accuracy']:.4f}; int8 quantization took "
                         f"{export['quantize_seconds']:.2f} s ({export['calibration_samples']}"
                         f" calibration images); fp32 ONNX max abs difference "
                         f"{export['max_abs_diff']:.2g}")
            rows += measure(test_py, network, ckpt, files, batches)
            print(f"# {notes[-1]}", flush=True)
    head = " | ".join(f"samples/s batch {b}" for b in batches)
    print(f"\n| network | format | size | {head} | accuracy |")
    print("|---|---|---|" + "---|" * len(batches) + "---|")
    eager = {}
    for network, name, size, speeds, acc, count in rows:
        base = eager.setdefault(network, (size, speeds))
        cells = " | ".join(f"{s:,.0f} ({s / b:.2f}x)" if name != "eager" else f"{s:,.0f}"
                           for s, b in zip(speeds, base[1]))
        ratio = "" if name == "eager" else f" ({size / base[0]:.2f}x)"
        print(f"| {network} | {name} | {size / 2**20:.2f} MiB{ratio} | {cells} | "
              f"{acc:.4f} ({round(acc * count)}/{count}) |")


if __name__ == "__main__":
    main()

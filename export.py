"""Export a trained network for inference, check the file, quantize it, open it again.

``export_network`` writes a network as ``.pt2`` (torch.export), ``.ts`` (frozen
TorchScript) or ``.onnx`` (input ``images``, output ``logits``), always with a dynamic
batch dimension: to a temporary file next to OUT, loaded back and compared with the eager
network on random inputs of several batch sizes (EXPORT_BATCHES); only a file that
matches replaces OUT, so OUT is never half-written or wrong. Every file carries what
evaluating it needs (``export_metadata``: the dataset, image size, classes and
normalisation, as ONNX metadata_props or a ``metadata.json`` extra file in .pt2/.ts), so
``open_exported`` and test.py's ``--model`` evaluate it later without the checkpoint.

``quantize`` writes an int8 copy of an ONNX file with onnxruntime.quantization (static:
QDQ, per-channel int8 weights, uint8 activations calibrated on training images; or
dynamic), checked to run in a fresh session before it replaces an older one.

test.py is the command line over this module: it evaluates the checkpoint, calls
``export_network`` and ``quantize``, and evaluates what they wrote.
"""

import contextlib
import functools
import importlib.util
import io
import json
import logging
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings

import torch

from machinery import files, weights_file
from machinery.files import OutputError, output_failed  # noqa: F401 (export.OutputError)
from machinery.runtime import say, shown
from ops import UserError
from pipeline import data, presets, sample_transforms, timm_hub

EXPORT_KINDS = {".pt2": "torch.export", ".ts": "frozen TorchScript", ".onnx": "ONNX",
                ".safetensors": weights_file.KIND}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
EXPORT_BATCHES = (2, 1, 5)  # traced with the first; checked at the others (1: no specialising)
EXPORT_RTOL, EXPORT_ATOL = 1e-4, 1e-4  # float32 graph rewrites (conv-BN folding) stay far below
QUANTIZE_KINDS = {"int8": "static int8 (QDQ, per-channel int8 weights, uint8 activations "
                          "calibrated on training images)",
                  "int8-dynamic": "dynamic int8 (per-channel int8 weights, activations "
                                  "quantized at run time)"}
CALIBRATION_SAMPLES = 256   # --calibration-samples default
CALIBRATION_BATCH = 32      # images per calibration batch (MinMax: the batching changes nothing)
METADATA_FILE = "metadata.json"  # the extra file of .pt2 and .ts that holds the metadata
STORED_CONFIG = ("task", "network", "dataset", "data_dir", "seed", "batch_size", "synthetic_size",
                 "crop_pct", "pretrained")  # (the last two: how photos are cropped)
INPUT_NAME, OUTPUT_NAME = "images", "logits"
GENERATOR_NAMES = ("latents", "images")  # a generator's input and output (ONNX), by default


class QuantizationError(Exception):
    """onnxruntime could not quantize the network, or its int8 file does not run; exit 1."""


THROUGHPUT_BATCH = 64       # samples/s are measured at this batch size, on the CPU
THROUGHPUT_SECONDS = 0.5    # ... for at least this long and THROUGHPUT_MIN_BATCHES batches
THROUGHPUT_MIN_BATCHES = 5

def int8_path(path):
    """Where --quantize writes: next to OUT, ``model.onnx`` -> ``model.int8.onnx``."""
    root, ext = os.path.splitext(path)
    return f"{root}.int8{ext}"


def check_onnx_installed(what):
    missing = [m for m in ONNX_PACKAGES if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"{what} needs {', '.join(missing)}, not installed here: "
                        f"pip install onnx onnxscript onnxruntime (or pip install -r "
                        f"requirements.txt)")


def _error_line(error):
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else 'no message'}"


@contextlib.contextmanager
def _torchscript_quietly():
    # TorchScript is deprecated upstream and says so at every call; the help text says it
    # once. Other warnings (TracerWarning: a trace that may not generalise) stay visible.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`torch\.jit\.", category=FutureWarning)
        yield


def _batch_dim():
    return torch.export.Dim("batch", min=1)


def _not_about_the_pt2_name(record):
    # torch.export.save logs that a path should end in .pt2; a staging file's does not.
    return not record.getMessage().startswith("Expect archive file to be a file ending in")


def _inputs(example):
    """``example`` as a tuple of inputs, and their dynamic batch (one ``Dim``, shared)."""
    example = example if isinstance(example, tuple) else (example,)
    batch = _batch_dim()
    return example, tuple({0: batch} for _ in example)


def _save_pt2(net, example, path, metadata):
    example, dynamic = _inputs(example)
    program = torch.export.export(net, example, dynamic_shapes=dynamic)
    logger = logging.getLogger("torch.export.pt2_archive._package")
    logger.addFilter(_not_about_the_pt2_name)
    try:
        torch.export.save(program, path, extra_files={METADATA_FILE: json.dumps(metadata)})
    finally:
        logger.removeFilter(_not_about_the_pt2_name)


def _load_pt2(path, extra_files=None):
    return torch.export.load(path, extra_files=extra_files).module()


def _save_ts(net, example, path, metadata):
    # torch.jit.freeze inlines the weights and runs the frozen-graph optimisations
    # (conv-BN folding...). torch.jit.optimize_for_inference is applied when loading
    # (_load_ts): it bakes in this machine's MKLDNN build, and a module it has converted
    # cannot be serialised (upstream says so; its file does not load back).
    with _torchscript_quietly():
        frozen = torch.jit.freeze(torch.jit.trace(net, example))
        torch.jit.save(frozen, path, _extra_files={METADATA_FILE: json.dumps(metadata)})


def _load_ts(path, extra_files=None):
    with _torchscript_quietly():
        module = torch.jit.load(path, map_location="cpu", _extra_files=extra_files or {})
        return torch.jit.optimize_for_inference(module)


def _save_onnx(net, example, path, metadata, names=(INPUT_NAME, OUTPUT_NAME)):
    """``names``: the inputs' names, then the output's."""
    example, dynamic = _inputs(example)
    with warnings.catch_warnings():  # several inputs share the batch Dim, as they should
        warnings.filterwarnings("ignore", message="# The axis name: batch will not be used")
        program = torch.onnx.export(net, example, dynamo=True, verbose=False,
                                    input_names=list(names[:-1]), output_names=[names[-1]],
                                    dynamic_shapes=dynamic)
    program.model.metadata_props.update(metadata)
    program.save(path, external_data=False)


def _onnx_session(path):
    """An onnxruntime CPU session with as many threads as torch uses (a fair comparison)."""
    import onnxruntime

    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3  # errors only
    return onnxruntime.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _onnx_runner(session):
    names = [i.name for i in session.get_inputs()]
    return lambda *x: torch.from_numpy(session.run(
        None, {name: v.contiguous().numpy() for name, v in zip(names, x)})[0])


def load_onnx(path):
    return _onnx_runner(_onnx_session(path))


EXPORTERS = {".pt2": (_save_pt2, _load_pt2), ".ts": (_save_ts, _load_ts),
             ".onnx": (_save_onnx, load_onnx),
             ".safetensors": (weights_file.save, weights_file.load)}  # (no code when read)


def normalisation(config):
    """The ``normalize`` entry of a run's metadata: ``{"mean", "std"}``, or None (photos:
    the pretrained weights' own, presets.preset)."""
    if presets.is_photo(config):
        p = presets.preset(config)
        return {"mean": list(p["mean"]), "std": list(p["std"])}
    stats = sample_transforms.STATS.get(config["dataset"])
    return None if stats is None else {"mean": list(stats[0]), "std": list(stats[1])}


def preprocessing(config):
    """How an image becomes the input, for whoever serves the file (``preprocess``)."""
    size = config["image_size"]
    if presets.is_photo(config):
        p = presets.preset(config)
        return (f"resize the short side to {presets.stored_side(size, config['crop_pct'])} "
                f"({p['interpolation'].value}, aspect kept), then crop the centre "
                f"{size}x{size}")
    return f"resize to {size}x{size}" if config["dataset"] in sample_transforms.FOLDERS else \
        "as the dataset's images are"


def export_metadata(config, val_set, state, source):
    """What evaluating the artifact needs, stored in it: ONNX metadata_props (strings).

    ``training_config`` (JSON: network, dataset, data_dir, seed, batch_size, image size,
    channels, classes count), ``classes`` (JSON list, in label order), ``normalize`` (JSON
    ``{"mean", "std"}``, or null where the dataset is not normalised), ``input``,
    ``output`` (plain text for whoever serves the file), ``quantization`` and ``source``.
    """
    stored = {key: config[key] for key in STORED_CONFIG if key in config}
    if config["dataset"] != "synthetic":
        stored.pop("synthetic_size", None)
    stored.update(image_size=val_set.image_size, in_channels=val_set.in_channels,
                  num_classes=val_set.num_classes)
    normalize = normalisation(config)
    side, channels = val_set.image_size, val_set.in_channels
    scaling = ("pixels scaled to [0, 1], then (x - mean) / std per channel (see normalize)"
               if normalize else "as the dataset makes them (not normalised)")
    return {"training_config": json.dumps(stored), "classes": json.dumps(val_set.classes),
            "normalize": json.dumps(normalize),
            "input": f"{INPUT_NAME}: float32 (batch, {channels}, {side}, {side}), {scaling}",
            "preprocess": preprocessing(config),
            "output": f"{OUTPUT_NAME}: float32 (batch, {val_set.num_classes}); the argmax "
                      f"indexes classes",
            "quantization": "none",
            "source": json.dumps({"checkpoint": source, "epoch": state.get("epoch"),
                                  "step": state.get("step")}),
            **({"data_config": json.dumps(timm_hub.data_config(config))}
               if timm_hub.is_timm(config["network"]) else {})}


def generator_metadata(config, state, source, weights, described):
    """What a generator's artifact stores (``export_metadata``'s keys for a generator):
    ``training_config`` (the run's identity and what rebuilds the network), ``input``,
    ``output``, ``weights`` (``ema`` or ``raw``), ``quantization`` and ``source``.
    ``described``: the task's ``(config keys that rebuild it, its input, its output)``
    (its ``exported``'s)."""
    keys, given, made = described
    stored = {key: config[key] for key in (*STORED_CONFIG, *keys) if key in config}
    return {"training_config": json.dumps(stored), "input": given, "output": made,
            "weights": weights, "quantization": "none",
            "source": json.dumps({"checkpoint": source, "epoch": state.get("epoch"),
                                  "step": state.get("step")})}


def export_network(net, path, suffix, sample_shape, metadata=None, names=None):
    """Writes ``net`` as an inference artifact and checks it against the eager network.

    The artifact goes to a temporary file in OUT's directory, is loaded back and run on
    random inputs of several batch sizes; it replaces OUT (atomic rename) only when every
    output matches the eager network within EXPORT_RTOL/EXPORT_ATOL. On any failure the
    temporary file is removed and an existing OUT is left as it was. (.pt2 and .ts are
    serialised into memory first where Linux allows: see _staging_file.)

    Args:
        net: the network in eval mode, on the CPU, float32, contiguous.
        path: OUT.
        suffix: ``.pt2``, ``.ts`` or ``.onnx``.
        sample_shape: shape of one input sample, e.g. ``(3, 32, 32)`` (a generator's:
            ``(latent_dim,)``, drawn from N(0, 1) as latents are), or a list of them for
            a network of several inputs (each drawn from N(0, 1), one batch size).
        metadata: strings stored in the artifact (export_metadata), or None.
        names: an ONNX file's input names and output name (default ``images``,
            ``logits``; a generator's: GENERATOR_NAMES).

    Returns:
        ``(ok, max_abs_diff)``.

    Raises:
        OutputError: writing the file failed (a full disk).
    """
    save, load = EXPORTERS[suffix]
    if suffix == ".onnx" and names is not None:
        save = functools.partial(_save_onnx, names=names)
    g = torch.Generator().manual_seed(0)
    shapes = sample_shape if isinstance(sample_shape, list) else [sample_shape]
    inputs = [tuple(torch.randn(n, *s, generator=g) for s in shapes) for n in EXPORT_BATCHES]
    check = {}

    def write_and_check(tmp):  # raises _Mismatch so that atomic_write keeps OUT as it was
        with torch.no_grad():
            with _staging_file(suffix) as staged:
                save(net, inputs[0], staged or tmp, metadata or {})
                if staged:
                    with open(staged, "rb") as src, open(tmp, "wb") as dst:
                        shutil.copyfileobj(src, dst)
            reloaded = load(tmp)
            ok, worst = True, 0.0
            for x in inputs:
                want, got = net(*x), reloaded(*x)
                same_shape = tuple(got.shape) == tuple(want.shape)
                ok = ok and same_shape and torch.allclose(got, want, EXPORT_RTOL, EXPORT_ATOL)
                worst = max(worst, float((got - want).abs().max()) if same_shape else math.inf)
        check["worst"] = worst
        if not ok:
            raise _Mismatch

    try:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        files.atomic_write(path, write_and_check, mode=None)
    except _Mismatch:
        return False, check["worst"]
    except OSError as e:
        raise output_failed("--export", path, e) from None
    return True, check["worst"]


class _Mismatch(Exception):
    """The exported artifact's outputs differ from the eager network's."""


@contextlib.contextmanager
def _staging_file(suffix):
    """The path of an anonymous in-memory file for torch's own writers (.pt2, .ts), or None.

    Those writers abort the whole process (a C++ error thrown in a destructor) when the
    disk fills up under them; written to memory first, the artifact reaches the disk
    through Python, whose OSError becomes one ``error:`` line. None where there is no
    memfd (not Linux): the artifact is then written in place.
    """
    fd = None
    if suffix in (".pt2", ".ts") and hasattr(os, "memfd_create") and \
            os.path.isdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            fd = os.memfd_create("test.py-export")
    try:
        yield None if fd is None else f"/proc/self/fd/{fd}"
    finally:
        if fd is not None:
            os.close(fd)


def open_exported(path, suffix):
    """Loads a file written by --export, for the CPU.

    Returns:
        ``(run, metadata, sample_shape, outputs)``: a callable on float32 batches, the
        metadata stored at export (a dict of strings; empty when there is none), and the
        input's ``(C, H, W)`` and the number of outputs where the file states them (ONNX,
        None otherwise or where a dimension is dynamic).
    """
    if not os.path.isfile(path):
        raise UserError(f"--model {path!r} does not exist" if not os.path.exists(path)
                        else f"--model {path!r} is not a file")
    shape = outputs = None
    try:
        if suffix == ".onnx":
            session = _onnx_session(path)
            inputs = session.get_inputs()
            if len(inputs) != 1 or len(session.get_outputs()) != 1:
                raise ValueError(f"{len(inputs)} inputs and {len(session.get_outputs())} "
                                 f"outputs, not one of each")
            dims = inputs[0].shape[1:]
            shape = tuple(dims) if all(isinstance(d, int) for d in dims) else None
            out = session.get_outputs()[0].shape
            outputs = out[1] if len(out) == 2 and isinstance(out[1], int) else None
            return (_onnx_runner(session), dict(session.get_modelmeta().custom_metadata_map),
                    shape, outputs)
        extra = {METADATA_FILE: ""}
        if suffix == ".pt2":
            # torch.export.load logs a traceback before raising on a file that is no .pt2
            with _logger_silenced("torch.export"):
                module = _load_pt2(path, extra)
        else:
            module = EXPORTERS[suffix][1](path, extra)  # .ts, .safetensors
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"--model {path!r} cannot be loaded as {EXPORT_KINDS[suffix]} "
                        f"({_error_line(e)})") from None
    text = extra[METADATA_FILE]
    text = text.decode() if isinstance(text, bytes) else text
    try:
        metadata = json.loads(text) if text else {}
    except ValueError:
        metadata = None
    if not isinstance(metadata, dict):
        raise UserError(f"--model {path!r}: its {METADATA_FILE} is not a JSON object")
    return (lambda x: module(x)), metadata, shape, outputs


@contextlib.contextmanager
def _logger_silenced(name):
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        logger.setLevel(level)


def stored_value(metadata, key, path, default=None):
    """A JSON value of the metadata, or ``default`` when absent; UserError when unreadable."""
    if key not in metadata:
        return default
    try:
        return json.loads(metadata[key])
    except (TypeError, ValueError):
        raise UserError(f"--model {path!r}: its metadata {key!r} is not JSON "
                        f"({shown(metadata[key])})") from None


def check_exported_data(path, metadata, val_set, config, shape):
    """The data must be what the file at ``path`` was exported for: its input ``shape``,
    its classes and its normalisation (``config``'s); a mismatch (a wrong --data-dir or
    --dataset) is a UserError."""
    if "normalize" in metadata:
        stored, now = stored_value(metadata, "normalize", path), normalisation(config)
        if stored != now:
            raise UserError(f"--model {path!r} was exported for inputs {_normalised(stored)}; "
                            f"--dataset {config['dataset']} {_normalised(now, 'them ')}")
    have = (val_set.in_channels, val_set.image_size, val_set.image_size)
    if shape is not None and tuple(shape) != have:
        raise UserError(f"--model {path!r} takes {_shape(shape)} images; the data gives "
                        f"{_shape(have)} (check --dataset and --image-size)")
    classes = stored_value(metadata, "classes", path)
    if classes is not None and classes != val_set.classes:
        raise UserError(f"--model {path!r} was exported for the classes {_names(classes)}; "
                        f"the data has {_names(val_set.classes)} (check --data-dir)")


def _normalised(stats, them=""):
    if not isinstance(stats, dict):
        return "not normalised" if them == "" else "does not normalise"
    return f"normalise{'s ' + them if them else 'd '}with mean {stats.get('mean')}, std " \
           f"{stats.get('std')}"


def _shape(shape):
    return "x".join(str(d) for d in shape)


def _names(names, limit=6):
    shown = ", ".join(str(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def calibration_set(train_set, samples, seed):
    """``samples`` training images (all of them if fewer), chosen by ``seed`` alone."""
    order = torch.randperm(len(train_set), generator=torch.Generator().manual_seed(seed))
    return torch.utils.data.Subset(train_set, order[:samples].tolist())


def quantize(fp32_path, out_path, kind, calibration, num_workers, metadata):
    """Writes an int8 copy of the ONNX file ``fp32_path`` to ``out_path`` with
    onnxruntime.quantization, atomically, after checking that it runs.

    The fp32 file is pre-processed first (quant_pre_process: shape inference and graph
    optimisation; skipped with a warning where it fails). ``int8``: static quantization in
    QDQ format, per-channel symmetric int8 weights, asymmetric uint8 activations whose
    ranges (MinMax) come from running ``calibration`` (a dataset): onnxruntime's "U8S8"
    (resnet18 on an AVX512-VNNI CPU: 3.4x the samples/s of int8 activations, which were
    no faster than float32). ``int8-dynamic``: per-channel int8 weights, activations
    quantized at run time. The result is loaded in a fresh
    onnxruntime session and run at several batch sizes before it replaces ``out_path``.

    Args:
        fp32_path: the checked fp32 ONNX file.
        out_path: where the int8 file goes.
        kind: ``int8`` or ``int8-dynamic``.
        calibration: the calibration images (``int8``), or None.
        num_workers: DataLoader workers for the calibration images.
        metadata: the fp32 file's metadata; ``quantization`` is replaced.

    Returns:
        ``(seconds, metadata)``: the time quantization took (pre-processing included, the
        calibration images' loading too) and the metadata stored in the int8 file.

    Raises:
        QuantizationError: onnxruntime failed, or its file does not run.
        OutputError: writing failed (a full disk); a previous file at ``out_path`` is kept.
    """
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    flag = f"--quantize {kind}"
    if kind == "int8":
        method = (f"int8 static: QDQ, per-channel int8 weights, uint8 activations calibrated "
                  f"(MinMax) on {len(calibration)} training images")
    else:
        method = "int8 dynamic: per-channel int8 weights, activations quantized at run time"
    metadata = dict(metadata, quantization=method)
    start = time.perf_counter()
    try:
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".tmp-", dir=os.path.dirname(
                os.path.abspath(out_path))) as work:
            source = os.path.join(work, "preprocessed.onnx")
            try:
                quant_pre_process(fp32_path, source)
            except OSError:
                raise
            except Exception as e:
                say(f"warning: onnxruntime's quant_pre_process failed ({_error_line(e)}); "
                    f"quantizing the exported file as it is", file=sys.stderr)
                source = fp32_path
            quantized = os.path.join(work, "int8.onnx")
            _run_quantizer(source, quantized, kind, calibration, num_workers, fp32_path)
            model = onnx.load(quantized)
            seconds = time.perf_counter() - start
            _set_metadata(model, metadata)
            files.atomic_write(out_path, lambda tmp: _save_and_try(model, tmp, flag),
                                    mode=None)
    except OSError as e:
        raise output_failed(flag, out_path, e) from None
    return seconds, metadata


def _calibration_reader(loader):
    """onnxruntime's CalibrationDataReader over a loader's images."""
    from onnxruntime import quantization as ortq

    class Reader(ortq.CalibrationDataReader):
        def __init__(self):
            self.batches = iter(loader)

        def get_next(self):
            batch = next(self.batches, None)
            return None if batch is None else {INPUT_NAME: batch[0].contiguous().numpy()}

    return Reader()


def _run_quantizer(source, quantized, kind, calibration, num_workers, fp32_path):
    """onnxruntime's static (calibrated) or dynamic quantization of ``source``."""
    from onnxruntime import quantization as ortq

    loader = None
    try:
        if kind == "int8":
            loader = data.build_loader(calibration, batch_size=CALIBRATION_BATCH,
                                       num_workers=num_workers)
            ortq.quantize_static(source, quantized, _calibration_reader(loader),
                                 quant_format=ortq.QuantFormat.QDQ, per_channel=True,
                                 activation_type=ortq.QuantType.QUInt8,
                                 weight_type=ortq.QuantType.QInt8,
                                 calibrate_method=ortq.CalibrationMethod.MinMax)
        else:
            ortq.quantize_dynamic(source, quantized, per_channel=True,
                                  weight_type=ortq.QuantType.QInt8)
    except (OSError, UserError):
        raise
    except Exception as e:
        remedy = "; try --quantize int8-dynamic" if kind == "int8" else ""
        raise QuantizationError(f"--quantize {kind}: onnxruntime could not quantize "
                                f"{fp32_path} ({_error_line(e)}){remedy}; {fp32_path} is "
                                f"written") from None
    finally:
        if loader is not None:
            data.shutdown_loader(loader)


def _set_metadata(model, metadata):
    """Puts ``metadata`` into an ONNX model's metadata_props (replacing equal keys)."""
    for prop in model.metadata_props:
        if prop.key in metadata:
            prop.value = metadata[prop.key]
    known = {prop.key for prop in model.metadata_props}
    for key, value in metadata.items():
        if key not in known:
            model.metadata_props.add(key=key, value=value)


def _save_and_try(model, path, flag):
    """Saves the int8 model to ``path`` and runs it in a fresh session at several batch
    sizes; raises QuantizationError when it does not load or gives the wrong shapes."""
    import onnx

    onnx.save(model, path)
    try:
        session = _onnx_session(path)
        run = _onnx_runner(session)
        classes = session.get_outputs()[0].shape[1]
        shape = session.get_inputs()[0].shape[1:]
        g = torch.Generator().manual_seed(0)
        for n in EXPORT_BATCHES:
            out = run(torch.randn(n, *shape, generator=g))
            if tuple(out.shape) != (n, classes) or not bool(torch.isfinite(out).all()):
                raise ValueError(f"batch {n} gave {tuple(out.shape)} outputs, "
                                 f"{'' if torch.isfinite(out).all() else 'not '}finite")
    except Exception as e:
        raise QuantizationError(f"{flag}: the int8 file does not run in onnxruntime "
                                f"({_error_line(e)}); nothing was written") from None


# ------------------------------------------------------ an exported file, measured

def samples_per_second(run, sample_shape, batch=THROUGHPUT_BATCH):
    """CPU throughput of ``run`` on random float32 batches of ``batch``: batch / the median
    time of a batch, over at least THROUGHPUT_MIN_BATCHES batches and THROUGHPUT_SECONDS,
    after one warm-up batch."""
    x = torch.randn(batch, *sample_shape, generator=torch.Generator().manual_seed(0))
    times = []
    with torch.no_grad():
        run(x)
        start = time.perf_counter()
        while len(times) < THROUGHPUT_MIN_BATCHES or \
                time.perf_counter() - start < THROUGHPUT_SECONDS:
            began = time.perf_counter()
            run(x)
            times.append(time.perf_counter() - began)
    return batch / statistics.median(times)


def weights_bytes(net):
    """The size of the network's state_dict saved with torch.save (the eager 'file')."""
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)
    return buffer.tell()


def size_text(n):
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def measured(report, size, speed, reference=None, file=None):
    """A row of the comparison: the report's metrics, the file and its size, samples/s and
    the accuracy delta against ``reference`` (the eager row)."""
    row = {"file": file, "bytes": size, "samples_per_sec": speed,
           **{k: report[k] for k in ("loss", "accuracy", "per_class", "confusion", "count")
              if k in report}}
    row["accuracy_delta"] = 0.0 if reference is None else \
        report["accuracy"] - reference["accuracy"]
    return row


def format_comparison(rows, batch):
    """The comparison as text: size, loss, accuracy, delta, samples/s; per-class accuracy."""
    width = max(len(name) for name in rows)
    lines = [f"the exported files evaluated on the validation split (onnxruntime, CPU) next "
             f"to the eager network; samples/s on the CPU at batch {batch}, "
             f"{torch.get_num_threads()} threads:",
             f"  {'':<{width}}  {'size':>10}  {'loss':>7}  {'accuracy':>8}  {'delta':>7}  "
             f"{'samples/s':>10}"]
    for name, row in rows.items():
        delta = "-" if row is next(iter(rows.values())) else f"{row['accuracy_delta']:+.4f}"
        lines.append(f"  {name:<{width}}  {size_text(row['bytes']):>10}  {row['loss']:7.4f}  "
                     f"{row['accuracy']:8.4f}  {delta:>7}  {row['samples_per_sec']:10.1f}")
    classes = list(next(iter(rows.values()))["per_class"])
    cw = max(len(c) for c in classes)
    cols = [max(len(name), 6) for name in rows]
    lines.append("  per-class accuracy:")
    lines.append(f"  {'':<{cw}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(rows, cols)))
    for c in classes:
        cells = [row["per_class"][c] for row in rows.values()]
        lines.append(f"  {c:<{cw}}  " + "  ".join(
            f"{'-' if v is None else f'{v:.4f}':>{w}}" for v, w in zip(cells, cols)))
    return "\n".join(lines)

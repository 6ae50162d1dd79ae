"""config.py: every bad flag value, from the command line or a YAML recipe, is one
``error:`` line and exit code 2; every check has a case of its own here, so deleting any
one of them fails a test."""

import os
import sys

import pytest
import torch
import yaml
from helpers import ROOT, tiny_args

import config
import tasks
import train
from config import build_parser, check_config, merge_resumed_config, parse_config

FLOATS = ["lr", "momentum", "weight_decay", "label_smoothing", "grad_clip", "warmup_epochs",
          "unfreeze_lr_scale"]
BILLION_LAUGHS = "\n".join(
    ['freeze: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]'] +
    [f"{k}: &{k} [{','.join(['*' + p] * 9)}]" for p, k in zip("abcdefgh", "bcdefghi")])


def flag(key):
    return "--" + key.replace("_", "-")


@pytest.fixture(autouse=True)
def no_mps(monkeypatch):
    """The same answers on every machine: MPS is taken only where it exists."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.delenv("RANK", raising=False)


def run(argv, capsys):
    """train.main's exit code and its stderr lines; no traceback anywhere."""
    code = train.main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, err.strip().splitlines()


def assert_one_error(code, err, message):
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error:") and message in err[0], err
    assert len(err[0]) < 300  # values are shortened, not printed whole


# ------------------------------------------------------------------ command line

CLI_ERRORS = [
    # the checks that were there before
    (["--dataset", "nope"], "unknown dataset 'nope'"),
    (["--network", "nope"], "unknown network 'nope'"),
    (["--batch-size", "0"], "--batch-size must be at least 1 (got 0)"),
    (["--virtual-batch-size", "20"], "--virtual-batch-size 20 must be a multiple of "
                                     "--batch-size 16"),
    (["--epochs", "0"], "--epochs must be at least 1 (got 0)"),
    (["--epochs", "0", "--max-steps", "5"], "--epochs must be at least 1 (got 0)"),
    (["--epochs", "-1"], "--epochs must be at least 1 (got -1)"),
    (["--num-workers", "-1"], "--num-workers must not be negative (got -1)"),
    (["--prefetch", "-1"], "--prefetch must not be negative"),
    (["--prefetch", "2"], "--prefetch with --num-workers 0 would augment in a thread"),
    (["--no-augment", "--random-erase", "0.5"], "they need --augment"),
    (["--max-steps", "-1"], "--max-steps must not be negative"),
    (["--ckpt-every-steps", "-1"], "--ckpt-every-steps must not be negative"),
    (["--keep-last", "-1"], "--keep-last must not be negative"),
    (["--unfreeze-at", "-1"], "--unfreeze-at must not be negative"),
    (["--eval-every", "0"], "--eval-every must be at least 1"),
    (["--log-every", "0"], "--log-every must be at least 1"),
    (["--max-nonfinite", "0"], "--max-nonfinite must be at least 1"),
    (["--unfreeze-at", "2"], "--unfreeze-at needs --freeze"),
    (["--resume", "auto", "--run-dir", ""], "--resume auto needs --run-dir"),
    # ranges
    (["--virtual-batch-size", "-32"], "--virtual-batch-size must not be negative"),
    (["--synthetic-size", "0"], "--synthetic-size must be at least 1 (got 0)"),
    (["--image-size", "0"], "--image-size must be in [4, 4096] (got 0)"),
    (["--image-size", "-3"], "--image-size must be in [4, 4096] (got -3)"),
    (["--image-size", "3"], "--image-size must be in [4, 4096] (got 3)"),
    (["--image-size", "100000"], "--image-size must be in [4, 4096] (got 100000)"),
    (["--num-classes", "1"], "--num-classes must be in [2, 100000] (got 1)"),
    (["--num-classes", "200000", "--synthetic-size", "300000"],
     "--num-classes must be in [2, 100000] (got 200000)"),
    (["--num-classes", "100000"], "--num-classes 100000 is more than --synthetic-size 64"),
    (["--num-classes", "65"], "--num-classes 65 is more than --synthetic-size 64"),
    (["--synthetic-size", "100000", "--image-size", "1024"],
     "--synthetic-size 100000 with --image-size 1024 needs 1406.2 GiB of memory"),
    (["--lr", "-1"], "--lr must not be negative (got -1.0)"),
    (["--momentum", "-0.1"], "--momentum must be in [0, 1) (got -0.1)"),
    (["--momentum", "1"], "--momentum must be in [0, 1) (got 1.0)"),
    (["--weight-decay", "-0.1"], "--weight-decay must not be negative"),
    (["--label-smoothing", "1"], "--label-smoothing must be in [0, 1) (got 1.0)"),
    (["--label-smoothing", "-0.1"], "--label-smoothing must be in [0, 1)"),
    (["--grad-clip", "-1"], "--grad-clip must not be negative"),
    (["--warmup-epochs", "-1"], "--warmup-epochs must not be negative"),
    (["--unfreeze-lr-scale", "-1"], "--unfreeze-lr-scale must not be negative"),
    (["--seed", "-1"], "--seed must be in [0, 2147483647] (got -1)"),
    (["--seed", str(2**32)], f"--seed must be in [0, 2147483647] (got {2**32})"),
    # devices
    (["--device", "meta"], "--device must be auto, cpu, cuda or cuda:N (got 'meta')"),
    (["--device", "mps"], "--device must be auto, cpu, cuda or cuda:N (got 'mps')"),
    (["--device", "cuda:x"], "(got 'cuda:x')"),
    (["--device", "cuda:01"], "(got 'cuda:01')"),
    (["--device", "banana"], "(got 'banana')"),
    # argparse's own (types, choices, missing values)
    (["--epochs", "12.7"], "invalid int value: '12.7'"),
    (["--optimizer", "lion"], "invalid choice"),
    (["--config"], "--config: expected one argument"),
] + [([f"{flag(key)}={value}"], f"{flag(key)} must be a finite number (got {value})")
     for key in FLOATS for value in ("nan", "inf", "-inf")]


@pytest.mark.parametrize("extra, message", CLI_ERRORS,
                         ids=[" ".join(extra) for extra, _ in CLI_ERRORS])
def test_bad_flag_is_one_error_line_and_exit_2(tmp_path, capsys, extra, message):
    assert_one_error(*run(tiny_args(tmp_path / "run", *extra), capsys), message)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------------- YAML

YAML_ERRORS = [
    # types: null, lists, strings for booleans, true for numbers, fractions for ints
    ("epochs: null", "recipe.yaml: --epochs must be int, not None"),
    ("lr: [1, 2]", "recipe.yaml: --lr must be float, not [1, 2]"),
    ("epochs: [1]", "recipe.yaml: --epochs must be int, not [1]"),
    ("lr: {a: 1}", "recipe.yaml: --lr must be float, not {'a': 1}"),
    ("lr: true", "recipe.yaml: --lr must be float, not True"),
    ("lr: fast", "recipe.yaml: --lr must be float, not 'fast'"),
    ("lr: 1" + "0" * 400, "recipe.yaml: --lr must be float, not 1000"),
    ('augment: "no"', "recipe.yaml: --augment must be true or false, not 'no'"),
    ('nesterov: "false"', "recipe.yaml: --nesterov must be true or false, not 'false'"),
    ("compile: 1", "recipe.yaml: --compile must be true or false, not 1"),
    ("deterministic: null", "recipe.yaml: --deterministic must be true or false, not None"),
    ("epochs: true", "recipe.yaml: --epochs must be int, not True"),
    ("batch_size: 12.7", "recipe.yaml: --batch-size must be int, not 12.7"),
    ("epochs: 12.0", "recipe.yaml: --epochs must be int, not 12.0"),
    ("epochs: many", "recipe.yaml: --epochs must be int, not 'many'"),
    ("epochs: '12.7'", "recipe.yaml: --epochs must be int, not '12.7'"),
    ("freeze: [1, 2]", "recipe.yaml: --freeze must be a list of strings, not [1, 2]"),
    ("freeze: null", "recipe.yaml: --freeze must be a list of strings, not None"),
    ("freeze: {a: 1}", "recipe.yaml: --freeze must be a list of strings"),
    ("dataset: [synthetic]", "recipe.yaml: --dataset must be a string, not ['synthetic']"),
    ("dataset: true", "recipe.yaml: --dataset must be a string, not True"),
    ("device: 1.5", "recipe.yaml: --device must be a string, not 1.5"),
    ("freeze: [" + ", ".join(["x"] * 100) + ", 1]",
     "recipe.yaml: --freeze must be a list of strings, not ['x', 'x'"),
    ("optimizer: lion", "recipe.yaml: --optimizer must be one of ['sgd', 'adam', 'adamw'], "
                        "not 'lion'"),
    ("amp: 16", "recipe.yaml: --amp must be one of"),
    # values: the same checks as on the command line
    # (keys that tiny_args does not set: its flags would override the recipe)
    ("weight_decay: .nan", "--weight-decay must be a finite number (got nan)"),
    ("momentum: .inf", "--momentum must be a finite number (got inf)"),
    ("label_smoothing: '-1'", "--label-smoothing must be in [0, 1) (got -1.0)"),
    ("seed: -5", "--seed must be in [0, 2147483647] (got -5)"),
    # the file itself
    (BILLION_LAUGHS, "is not valid YAML: anchors and aliases (&name, *name) are not allowed "
                     "(line 1, column 9)"),
    ("lr: &x 0.1\nmomentum: *x", "anchors and aliases (&name, *name) are not allowed"),
    ("lr: [1, 2\nepochs: 3", "is not valid YAML: while parsing a flow sequence, expected "
                             "',' or ']', but got ':' (line 2, column 7)"),
    ("lr: 0.1\n\tepochs: 3", "is not valid YAML: while scanning for the next token, found "
                             "character '\\t' that cannot start any token (line 2, column 1)"),
    ("lr: 0.1\x00", "is not valid YAML: unacceptable character #x0000"),
    ("epochs: 1\n---\nepochs: 2", "is not valid YAML: expected a single document in the "
                                  "stream, but found another document (line 2, column 1)"),
    ("[" * 5000, "is not valid YAML: nested too deeply"),
    (b"lr: 0.1\n# caf\xe9\n", "is not UTF-8 text (byte 0xe9 at offset 13)"),
    ("- lr\n- 0.1", "must be a mapping of flag names to values"),
    ("lr: 0.1\nmomentum: 0.8\nlr: 0.5", "is not valid YAML: the key 'lr' is given twice "
                                        "(line 3, column 1)"),
    ("augment: false\naugment: true", "the key 'augment' is given twice"),
    ("learning_rate: 0.1", "unknown key 'learning_rate' in"),
    ("config: other.yaml", "unknown key 'config' in"),
    ("epochs: 1" + "0" * 5000, "is not valid YAML: Exceeds the limit"),
    ("epochs: 2024-13-45", "is not valid YAML: month must be in 1..12"),
    ("epochs: 2024-01-01", "recipe.yaml: --epochs must be int, not datetime.date(2024, 1, 1)"),
] + [(f"{action.dest}: null", f"recipe.yaml: {flag(action.dest)} must be ")
     for action in build_parser()._actions
     if action.default is not None and action.dest not in ("help", "freeze", "deterministic")]


def _yaml_id(text):
    text = text if isinstance(text, str) else text.decode("latin-1")
    return text.replace("\n", " ")[:40]


@pytest.mark.parametrize("text, message", YAML_ERRORS,
                         ids=[_yaml_id(text) for text, _ in YAML_ERRORS])
def test_bad_yaml_is_one_error_line_and_exit_2(tmp_path, capsys, text, message):
    if "Exceeds the limit" in message and not hasattr(sys, "get_int_max_str_digits"):
        pytest.skip("this Python converts integers of any length")
    recipe = tmp_path / "recipe.yaml"
    if isinstance(text, bytes):
        recipe.write_bytes(text)
    else:
        recipe.write_text(text, encoding="utf-8")
    code, err = run(tiny_args(tmp_path / "run", "--config", str(recipe)), capsys)
    assert_one_error(code, err, message)


def test_config_that_is_a_directory_or_missing(tmp_path, capsys):
    code, err = run(tiny_args(tmp_path / "run", "--config", str(tmp_path)), capsys)
    assert_one_error(code, err, f"cannot read config {str(tmp_path)!r}: Is a directory")
    code, err = run(tiny_args(tmp_path / "run", "--config", str(tmp_path / "no.yaml")), capsys)
    assert_one_error(code, err, "cannot read config")


def test_yaml_values_as_a_recipe_may_spell_them(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text('freeze: "features.*"\nlr: 1e-3\nwarmup_epochs: 1\nepochs: "12"\n'
                      "gpus: 0\nnetwork: null\naugment: false\nweight_decay: 0\n")
    c, explicit = parse_config(["--config", str(recipe), "--dataset", "synthetic"])
    assert c["freeze"] == ["features.*"]  # one pattern, not a list of characters
    assert c["lr"] == 0.001 and isinstance(c["lr"], float)  # "1e-3" is a string to YAML
    assert c["warmup_epochs"] == 1.0 and isinstance(c["warmup_epochs"], float)
    assert c["weight_decay"] == 0.0 and isinstance(c["weight_decay"], float)
    assert c["epochs"] == 12 and c["gpus"] == "0" and c["augment"] is False
    assert c["network"] == "simple_cnn"  # null: the default
    check_config(c)
    recipe.write_text("# nothing but a comment\n")
    assert parse_config(["--config", str(recipe)])[1] == set()


@pytest.mark.parametrize("recipe", sorted(os.listdir(os.path.join(ROOT, "configs"))))
def test_every_recipe_passes_the_checks(recipe, capsys):
    c, _ = parse_config(["--config", os.path.join(ROOT, "configs", recipe)])
    check_config(c)
    assert capsys.readouterr().err == ""
    with open(os.path.join(ROOT, "configs", recipe)) as f:  # and its values keep their types
        for key, value in yaml.safe_load(f).items():
            assert c[key] == value and type(c[key]) in (type(value), float), key


# ------------------------------------------------- the resolved config itself

@pytest.mark.parametrize("key, value, message", [
    ("epochs", True, "--epochs must be int, not True"),
    ("epochs", 2.0, "--epochs must be int, not 2.0"),
    ("lr", "0.1", "--lr must be float, not '0.1'"),
    ("lr", float("nan"), "--lr must be a finite number (got nan)"),
    ("freeze", "features.*", "--freeze must be a list of strings, not 'features.*'"),
    ("augment", "no", "--augment must be true or false, not 'no'"),
    ("gpus", 0, "--gpus must be a string, not 0"),
    ("optimizer", "lion", "--optimizer must be one of"),
    ("network", None, "unknown network None"),
    ("image_size", 5000, "--image-size must be in [4, 4096] (got 5000)"),
])
def test_resolved_config_is_checked_too(key, value, message):
    """A config merged from a resumed checkpoint gets no YAML conversions, only checks."""
    c, explicit = parse_config(tiny_args("run"))
    merged = merge_resumed_config({**c, key: value}, c, explicit - {key})
    with pytest.raises(config.UserError) as e:
        check_config(merged)
    assert message in str(e.value)


def test_every_numeric_flag_has_a_range_and_the_defaults_pass(capsys):
    numeric = {a.dest for a in build_parser()._actions if a.type in (int, float)}
    own = {key for task in tasks.built_in() for key in task.ranges}  # the tasks' own flags
    assert numeric == set(config.RANGES) | own and not own & set(config.RANGES)
    check_config(parse_config([])[0])
    check_config(parse_config(["--dataset", "synthetic"])[0])
    assert capsys.readouterr().err == ""


def test_synthetic_limits_apply_to_synthetic_data_only():
    check_config(parse_config(["--num-classes", "1000", "--image-size", "4096"])[0])


def test_boundaries_are_allowed():
    check_config(parse_config(tiny_args(
        "run", "--image-size", "4", "--num-classes", "64", "--momentum", "0", "--seed",
        str(config.MAX_SEED), "--label-smoothing", "0", "--weight-decay", "0",
        "--grad-clip", "0", "--unfreeze-lr-scale", "0", "--num-workers", "0"))[0])
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        check_config(parse_config(tiny_args("run", "--device", device))[0])


def test_mps_only_where_it_is_available(monkeypatch):
    c = parse_config(tiny_args("run", "--device", "mps"))[0]
    with pytest.raises(config.UserError, match="cuda:N \\(got 'mps'\\)"):
        check_config(c)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    check_config(c)
    c["device"] = "meta"
    with pytest.raises(config.UserError, match="cuda:N, or mps \\(got 'meta'\\)"):
        check_config(c)


# --------------------------------------------------------------------- warnings

UNFREEZE_LATE = ("--freeze", "features.*", "--unfreeze-at", "5", "--epochs", "2")
WARNING = "warning: --unfreeze-at 5 is beyond --epochs 2: the frozen parameters stay frozen"


def test_unfreeze_beyond_the_last_epoch_warns_once_and_runs(tmp_path, capsys):
    code = train.main(tiny_args(tmp_path / "run", *UNFREEZE_LATE, network="simple_cnn"))
    out, err = capsys.readouterr()
    assert code == 0, err
    assert [line for line in err.splitlines() if line.startswith(("warning:", "error:"))] == \
        [WARNING + " for the whole run"]
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "last.pt")


def test_the_warning_is_shown_once_per_run_and_only_by_rank_0(capsys, monkeypatch):
    for _ in range(2):  # each run warns once, though check_config runs twice on resume
        c, _ = parse_config(tiny_args("run", *UNFREEZE_LATE))
        check_config(c)
        check_config(dict(c))
        assert capsys.readouterr().err.count("warning:") == 1
    monkeypatch.setenv("RANK", "1")
    check_config(parse_config(tiny_args("run", *UNFREEZE_LATE))[0])
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    check_config(parse_config(tiny_args("run", *UNFREEZE_LATE[:-1], "5"))[0])
    assert capsys.readouterr().err == ""  # epoch 5 of 5 is reached


def test_foreign_flags_are_judged_against_a_resumes_task_each_named_with_its_own(capsys,
                                                                                 tmp_path):
    """Review 6's F7: resuming a pix2pix run with --l1-weight 50 said "--task pix2pix's,
    ignored by --task classification" (the default task's judgement, before the
    checkpoint's task was merged) while applying it; and one task was named the owner of
    every flag."""
    saved, _ = parse_config(["--task", "pix2pix", "--dataset", "synthetic"])
    capsys.readouterr()
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "last.pt").touch()  # a run to resume: its task decides
    resumed, explicit = parse_config(["--resume", "auto", "--run-dir", str(tmp_path),
                                      "--l1-weight", "50", "--sample-steps", "10"])
    assert merge_resumed_config(saved, resumed, explicit)["l1_weight"] == 50
    assert [line for line in capsys.readouterr().err.splitlines() if "warning" in line] == [
        "warning: --sample-steps: --task diffusion's, ignored by --task pix2pix"]
    parse_config(["--task", "segmentation", "--latent-dim", "64", "--sample-steps", "5",
                  "--l1-weight", "3"])
    parse_config(["--fid-samples", "8"])
    parse_config(["--resume", "auto", "--run-dir", str(tmp_path / "new"), "--gan-width", "8"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: --latent-dim (--task gan's), --sample-steps (--task diffusion's), "
        "--l1-weight (--task pix2pix's), ignored by --task segmentation",
        "warning: --fid-samples: --task gan's and --task diffusion's, ignored by --task "
        "classification",  # and --resume auto with nothing to resume: a fresh start
        "warning: --gan-width: --task gan's, ignored by --task classification"]


def test_a_run_dir_whose_name_is_not_utf8_is_refused_in_one_line(tmp_path, capsys):
    """Round 5's F8: TensorBoard's writer encodes its path as UTF-8; a name that is not
    (bytes read with surrogateescape) is refused before anything is created."""
    from helpers import tiny_args

    import train

    run_dir = os.path.join(str(tmp_path), os.fsdecode(b"caf\xe9"))
    assert train.main(tiny_args(run_dir)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --run-dir") and "not UTF-8" in err[0]
    assert os.listdir(tmp_path) == []
    utf8 = tmp_path / "café ✓"  # UTF-8 beyond ASCII trains
    assert train.main(tiny_args(utf8)) == 0

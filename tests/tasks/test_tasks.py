"""The task seam's classification sums: the same figures with a dense confusion matrix
and, beyond tasks.DENSE_CLASSES, with each sample's (label, prediction)."""

import os

import pytest
import torch
from helpers import read_metrics, tiny_args

import tasks
import tasks.classification
import train
from machinery import engine
from reporting import gan_metrics
from tasks import _generative
from tasks.classification import Classification


def _evaluate(monkeypatch, dense_limit, logits, labels, classes):
    monkeypatch.setattr(tasks.classification, "DENSE_CLASSES", dense_limit)
    loop = engine.LoopSettings(device=torch.device("cpu"), show_progress=False)
    batches = list(zip(logits.split(7), labels.split(7)))
    return engine.evaluate(torch.nn.Identity(), batches, loop, Classification(classes))


def test_many_classes_count_the_same_without_a_square_matrix(monkeypatch):
    g = torch.Generator().manual_seed(0)
    classes = 40
    labels = torch.randint(0, classes, (300,), generator=g)
    logits = torch.randn(300, classes, generator=g)
    logits[torch.arange(150), labels[:150]] += 3  # half of them right
    logits[150:200, 7] += 10  # a confused column: many predicted as class 7
    dense = _evaluate(monkeypatch, 2048, logits, labels, classes)
    sparse = _evaluate(monkeypatch, 8, logits, labels, classes)
    assert dense["confusion"].shape == (classes, classes) and sparse["confusion"] is None
    for key in ("loss", "acc", "acc5", "count", "top_confused"):
        assert dense[key] == sparse[key], key
    assert torch.equal(dense["class_total"], sparse["class_total"])
    assert torch.equal(dense["class_correct"], sparse["class_correct"])
    true, pred, count = dense["top_confused"][0]
    assert pred == 7 and count >= 2
    hand = {}
    for y, p in zip(labels.tolist(), logits.argmax(1).tolist()):
        if y != p:
            hand[(y, p)] = hand.get((y, p), 0) + 1
    assert count == max(hand.values()) and hand[(true, pred)] == count


@pytest.mark.parametrize("classes", [12])
def test_a_run_with_more_classes_than_a_picture_lists_the_confused_pairs(
        tmp_path, monkeypatch, classes):
    monkeypatch.setattr(tasks.classification, "PICTURED_CLASSES", 10)  # (100: a person's limit)
    monkeypatch.setattr(tasks.classification, "DENSE_CLASSES", 10)     # (2048: 32 MiB of counts)
    assert train.main(tiny_args(tmp_path, "--num-classes", str(classes), size=96)) == 0
    record = read_metrics(tmp_path)[-1]
    assert len(record["val_class_acc"]) == classes
    pairs = record["val_top_confused"]
    assert pairs and all(t != p and n >= 1 for t, p, n in pairs)
    assert [n for _, _, n in pairs] == sorted((n for _, _, n in pairs), reverse=True)
    from helpers import events

    assert "val/confusion" not in events(tmp_path).Tags()["images"]


def test_under_torchrun_the_pairs_of_every_process_are_counted(tmp_path, monkeypatch):
    """Beyond DENSE_CLASSES each process keeps its shard's pairs; they are gathered, so
    two processes report the class accuracies and pairs of one process."""
    from helpers import FLAGS, torchrun, write_launcher

    from tasks import classification

    args = lambda run: tiny_args(run, *FLAGS, "--num-classes", "12", size=96, batch=8)  # noqa: E731
    launcher = write_launcher(tmp_path / "launch.py", "import tasks.classification\n"
                              "tasks.classification.DENSE_CLASSES = 4")
    torchrun(args(tmp_path / "two"), script=launcher)  # (asserts exit 0)
    monkeypatch.setattr(classification, "DENSE_CLASSES", 4)
    assert not classification.ClassificationEvaluation(12, "cpu").dense  # the pairs' path
    assert train.main(tiny_args(tmp_path / "one", *FLAGS, "--num-classes", "12",
                                size=96, batch=16)) == 0
    one, two = read_metrics(tmp_path / "one")[-1], read_metrics(tmp_path / "two")[-1]
    assert one["val_class_acc"] == pytest.approx(two["val_class_acc"])
    assert one["val_acc"] == pytest.approx(two["val_acc"])


def test_flags_of_another_task_are_named_in_one_warning(capsys, tmp_path):
    """Round 5's F11: a GAN's flags on a segmentation run (or in its recipe) are ignored,
    and one warning says so; on --task gan, or left at their defaults, nothing is said."""
    import config

    recipe = tmp_path / "r.yaml"
    recipe.write_text("latent_dim: 64\n")
    config.parse_config(["--task", "segmentation", "--dataset", "synthetic", "--config",
                         str(recipe), "--d-steps", "3", "--gan-loss", "hinge"])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: --gan-loss, --latent-dim, --d-steps: --task gan's, ignored by "
                   "--task segmentation"]
    config.parse_config(["--task", "gan", "--dataset", "synthetic", "--d-steps", "3"])
    config.parse_config(["--task", "segmentation", "--dataset", "synthetic"])
    assert capsys.readouterr().err == ""


def test_compile_with_the_gradient_penalty_is_refused_in_one_line(monkeypatch, capsys):
    """The CUDA review's H1: the penalty's double backward through a compiled critic
    crashes (aot_autograd has none; the review reproduced it with the CPU's aot_eager
    backend): the pair is refused before anything starts, in one line."""
    import functools

    import torch

    import train

    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile,
                                                            backend="aot_eager"))
    argv = ["--task", "gan", "--dataset", "synthetic", "--synthetic-size", "16",
            "--gan-width", "4", "--latent-dim", "8", "--fid-samples", "2", "--gan-loss",
            "wgan-gp", "--compile", "--max-steps", "1", "--batch-size", "4",
            "--device", "cpu", "--num-workers", "0"]
    assert train.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --compile with --gan-loss wgan-gp")


def test_deterministic_torchvision_segmentation_on_cuda_is_refused_in_one_line(monkeypatch):
    """The CUDA review's H2: torchvision's segmentation networks upsample with a bilinear
    F.interpolate, which has no deterministic CUDA backward; on the CPU, or for unet, the
    flag stays."""
    import torch

    import config
    from ops import UserError

    def checked(*flags):
        c, _ = config.parse_config(["--task", "segmentation", "--dataset", "synthetic",
                                    "--deterministic", *flags])
        config.check_config(c)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(UserError, match="^--deterministic with --network torchvision/"
                                        "lraspp_mobilenet_v3_large on CUDA: its bilinear"):
        checked("--network", "torchvision/lraspp_mobilenet_v3_large")
    checked("--network", "torchvision/lraspp_mobilenet_v3_large", "--device", "cpu")
    checked("--network", "unet")  # its loss is summed per pixel: deterministic on CUDA


def _first_images_worker(rank, world_size, port, out_dir, sizes, n):
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    sent = []
    real_gather = dist.gather_object
    dist.gather_object = lambda obj, *a, **k: (sent.append(len(obj)), real_gather(obj, *a,
                                                                                   **k))[1]
    try:
        start = sum(sizes[:rank])  # the contiguous shards: image i holds the value i
        kept = [torch.arange(start, start + sizes[rank]).float().view(-1, 1, 1, 1)[:n]]
        try:
            first = _generative.first_images(kept, n)
        except tasks.UserError as e:
            first = str(e)
        torch.save({"first": first, "sent": sent}, os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.gather_object = real_gather
        dist.destroy_process_group()


@pytest.mark.parametrize("n, sent", [(5, [3, 2, 0]), (8, [3, 3, 2]), (9, None)])
def test_fids_real_images_reach_process_0_only_and_each_sends_its_share(tmp_path, n, sent):
    """The CUDA review's L6: each process sends only its share of the set's first n
    images, to process 0 alone; a set too small is one error on every process."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_first_images_worker, args=(3, port, str(tmp_path), [3, 3, 2], n),
                       nprocs=3, start_method="fork")
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(3)]
    if sent is None:
        assert [g["first"] for g in got] == ["--fid-samples 9: the validation set has 8 "
                                             "images; lower --fid-samples"] * 3
        return
    assert got[0]["first"].flatten().tolist() == list(range(n))
    assert got[1]["first"] is None and got[2]["first"] is None
    assert [g["sent"] for g in got] == [[s] for s in sent]


def _real_features_worker(rank, world_size, port, out_dir, sizes, n):
    import torch.distributed as dist
    torch.set_num_threads(1)  # a forked OpenMP pool (the test process's, used) can hang
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    sent, extracted = [], []
    real_gather = dist.gather_object
    dist.gather_object = lambda obj, *a, **k: (sent.append(list(obj.shape)),
                                               real_gather(obj, *a, **k))[1]
    try:
        task, _, real = _generation(sum(sizes))
        task.fid_samples = n
        task.features.register_forward_hook(lambda m, i, o: extracted.append(len(i[0])))
        start = sum(sizes[:rank])  # the contiguous shards, each keeping its share of the n
        kept = real[start:start + sizes[rank]][:max(0, n - start)].split(1)  # (a batch each)
        first = _generative.real_features(task, [k for k in kept if len(k)], batch_size=2)
        torch.save({"first": first, "sent": sent, "extracted": extracted},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        dist.gather_object = real_gather
        dist.destroy_process_group()


def test_fids_real_images_are_extracted_where_they_are_and_only_features_travel(tmp_path):
    """The CUDA review's N-L6: each process extracts the features of its own share of the
    first n real images (process 0 none of the others'), and sends process 0 those
    features, never pixels: the same features as one process's."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_real_features_worker, args=(3, port, str(tmp_path), [3, 3, 2], 5),
                       nprocs=3, start_method="fork")
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(3)]
    assert [g["extracted"] for g in got] == [[2, 1], [2], []]  # batches of 2, its own
    assert [g["sent"] for g in got] == [[[3, 6]], [[2, 6]], [[0]]]  # features, not images
    task, _, real = _generation(8)
    assert torch.allclose(got[0]["first"], gan_metrics.extract(task.features, real[:5], 2))
    assert got[1]["first"] is None and got[2]["first"] is None


def _generation(n):
    """A task measuring FID on ``n`` images (tiny classifier features, 6 of them), its
    generated images (a function of the index alone) and its real ones."""
    import types

    from reporting import gan_metrics

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(48, 6), torch.nn.Tanh(),
                              torch.nn.Linear(6, 2))
    features = gan_metrics.ClassifierFeatures(net, 4, 3)
    g = torch.Generator().manual_seed(1)
    fake, real = (torch.rand(n, 3, 4, 4, generator=g) * 2 - 1 for _ in range(2))
    return types.SimpleNamespace(fid_samples=n, features=features, seed=3), fake, real


def _generated_scores_worker(rank, world_size, port, out_dir, n):
    import torch.distributed as dist
    torch.set_num_threads(1)  # a forked OpenMP pool (the test process's, used) can hang
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    from reporting import gan_metrics

    seeds, measure = [], gan_metrics.measure  # S7-17: KID's subsets of the run's seed

    def spy(features, real, fake, seed="not given", *args, **kwargs):
        seeds.append(seed)
        return measure(features, real, fake, 0 if seed == "not given" else seed, *args,
                       **kwargs)

    gan_metrics.measure = spy
    try:
        task, fake, real = _generation(n)
        made = []
        real = gan_metrics.extract(task.features, real, 2) if rank == 0 else None
        scores = _generative.generated_scores(
            task, lambda indices: (made.append(indices.tolist()), fake[indices])[1], real,
            batch_size=2)
        torch.save({"made": made, "scores": scores, "seeds": seeds},
                   os.path.join(out_dir, f"{rank}.pt"))
    finally:
        gan_metrics.measure = measure
        dist.destroy_process_group()


@pytest.mark.parametrize("n, shares", [(7, [[0, 1], [2, 3], [4, 5, 6]]), (2, [[], [0], [1]])])
def test_the_generated_images_are_split_over_the_processes_by_index(tmp_path, n, shares):
    """The CUDA review's M3: each process makes only its share of the images (none where
    there are fewer images than processes), process 0 measures their gathered features:
    one process's FID and KID to rounding, the others get None."""
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_generated_scores_worker, args=(3, port, str(tmp_path), n), nprocs=3,
                       start_method="fork")
    got = [torch.load(tmp_path / f"{r}.pt", weights_only=True) for r in range(3)]
    assert [g["made"] for g in got] == [[share[i:i + 2] for i in range(0, len(share), 2)]
                                        for share in shares]  # a batch at a time (L5)
    task, fake, real = _generation(n)
    alone = gan_metrics.measure(task.features, real, fake, task.seed, 2)
    assert got[0]["scores"] == pytest.approx(alone, rel=1e-4)
    assert got[1]["scores"] is None and got[2]["scores"] is None
    assert [g["seeds"] for g in got] == [[task.seed], [], []]  # process 0 measures, seeded

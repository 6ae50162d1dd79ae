"""--dataset shards (pipeline/shards.py): local shards read by index give an image folder's
samples; shards served over HTTP (a real http.server on 127.0.0.1) are streamed in an order
drawn from (seed, epoch) that any process, any number of processes and any resume
position reads alike; a shard that fails is tried again, then skipped and counted."""

import os
import shutil
import threading
import time

import pytest
import torch
from helpers import make_config, serve, write_sources

from ops import UserError
from pipeline import data, shards


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return write_sources(tmp_path_factory.mktemp("sources"))


@pytest.fixture(scope="module")
def server(sources):
    with serve(sources["shards"]) as server:
        yield f"http://127.0.0.1:{server.server_port}"


def config_for(train, val, **extra):
    return make_config(os.path.dirname(train), "synthetic", dataset="shards", data_dir=train,
                       val_data_dir=val, image_size=16, **extra)


def urls(server, kind, count):
    return f"{server}/{kind}-{{000..{count - 1:03d}}}.tar"


def samples(dataset, keys):
    return [dataset[key] for key in keys]


def assert_same(a, b):
    assert len(a) == len(b)
    for (x0, y0), (x1, y1) in zip(a, b):
        assert torch.equal(x0, x1) and y0 == y1


def test_local_shards_give_the_image_folders_samples_in_its_order(sources, capsys):
    folder = data.build_datasets(make_config(sources["folder"], "synthetic", dataset=(
        "imagefolder"), data_dir=sources["folder"], image_size=16))
    got = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]),
                              log=print)
    out = capsys.readouterr().out
    assert "4 shards, 15 samples, random access" in out and "2 shards, 6 samples" in out
    assert data.shards.own_order(got[0]) is None  # the sampler's own permutation
    for ours, theirs in zip(got, folder):
        keys = [(i, 2) for i in range(len(theirs))]
        assert_same(samples(ours, keys), samples(theirs, keys))
    folder_of_shards = data.build_datasets(config_for(sources["shards"], sources["shards"]))
    assert len(folder_of_shards[0]) == 21  # every .tar of the folder


def test_the_stream_order_is_a_permutation_drawn_from_seed_and_epoch():
    sizes = [4, 4, 4, 3]
    order, shard_order = shards.stream_order(sizes, 5, 0, 3)
    assert sorted(order.tolist()) == list(range(15))
    assert not torch.equal(order, shards.stream_order(sizes, 5, 1, 3)[0])
    assert not torch.equal(order, shards.stream_order(sizes, 6, 0, 3)[0])
    assert torch.equal(order, shards.stream_order(sizes, 5, 0, 3)[0])
    starts = [0, 4, 8, 12, 15]
    read = [i for s in shard_order.tolist() for i in range(starts[s], starts[s + 1])]
    plain, _ = shards.stream_order(sizes, 5, 0, 1)  # a buffer of one: the shards in order
    assert plain.tolist() == read
    for p, index in enumerate(order.tolist()):  # never more than the buffer ahead
        assert read.index(index) <= p + 3


def test_streamed_shards_give_every_process_its_samples_in_the_epochs_order(sources, server,
                                                                          monkeypatch):
    """Two ranks of a global batch of 6, each with its own reader, epoch 1 from sample 5 on
    (a resume), then epoch 2: the samples the local shards give for the same keys; each
    shard opened at most once an epoch (a reader reads in the order, keeps what comes later
    and skips the shards that hold nothing of what is left), at most a buffer's worth of
    samples kept ahead; a request behind the reader reads that one sample."""
    config = config_for(urls(server, "train", 4), urls(server, "val", 2), shuffle_buffer=3)
    streamed, _ = data.build_datasets(config)
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    order = data.shards.own_order(streamed)
    assert order is not None
    opened, open_shard = [], shards.open_shard
    monkeypatch.setattr(shards, "open_shard", lambda url: opened.append(url) or open_shard(url))
    seen = {1: [], 2: []}
    for rank in (0, 1):
        copy = data.build_datasets(config)[0]
        for epoch, start in ((1, 5), (2, 0)):
            sampler = data.EpochBatchSampler(len(streamed), 3, config["seed"], rank=rank,
                                             world_size=2, order=order)
            sampler.set_epoch(epoch, start=start)
            keys = [key for batch in sampler for key in batch]
            seen[epoch] += [k for k, _ in keys]
            opened.clear()
            got = samples(copy, keys)
            assert len(opened) == len(set(opened)) <= 4, opened
            assert len(copy.base._reader.kept) <= 3
            assert_same(got, samples(local, keys))
    for epoch, start in ((1, 5), (2, 0)):  # the two ranks: the rest of the epoch, once
        assert sorted(seen[epoch]) == sorted(order(config["seed"], epoch).tolist()[start:])
    all_keys = [(i, 1) for i in order(config["seed"], 1).tolist()]
    first = streamed[all_keys[-1]]  # out of the order: read alone
    assert_same([first, streamed[all_keys[0]]], samples(local, [all_keys[-1], all_keys[0]]))


def test_validation_shards_stream_in_order(sources, server):
    config = config_for(urls(server, "train", 4), urls(server, "val", 2))
    _, val = data.build_datasets(config)
    _, local = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    assert_same(samples(val, range(6)), samples(local, range(6)))


def test_a_shard_cache_reads_urls_once_then_by_index(sources, server, tmp_path, capsys):
    config = config_for(urls(server, "train", 4), urls(server, "val", 2),
                        shard_cache=str(tmp_path / "cache"))
    train, val = data.build_datasets(config, log=print)
    assert f"random access (cached in {tmp_path / 'cache'} on first read)" in \
        capsys.readouterr().out
    assert len(os.listdir(tmp_path / "cache")) == 6
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    keys = [(i, 1) for i in range(15)]
    assert_same(samples(train, keys), samples(local, keys))


@pytest.fixture
def quick_retries(monkeypatch):
    monkeypatch.setattr(shards, "FIRST_DELAY", 0.05)
    monkeypatch.setattr(shards, "RETRIES", 3)


def test_a_server_that_comes_back_loses_nothing(sources, tmp_path, quick_retries,
                                                monkeypatch, capfd):
    """The server goes away in the middle of an epoch and is back 0.3 s later: the
    tries again get every sample, the same as from the local shards."""
    monkeypatch.setattr(shards, "FIRST_DELAY", 0.2)
    with serve(sources["shards"]) as first:
        port = first.server_port
        config = config_for(urls(f"http://127.0.0.1:{port}", "train", 4),
                            urls(f"http://127.0.0.1:{port}", "val", 2), shuffle_buffer=2)
        train, _ = data.build_datasets(config)
        keys = [(i, 0) for i in train.base.epoch_order(config["seed"], 0).tolist()]
        got = samples(train, keys[:4])
    done = threading.Event()

    def back_later():
        time.sleep(0.3)
        with serve(sources["shards"], port=port):
            done.wait()
    thread = threading.Thread(target=back_later)
    thread.start()
    try:
        got += samples(train, keys[4:])  # (the reader's shard is gone: opened again)
    finally:
        done.set()
        thread.join()
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    assert_same(got, samples(local, keys))
    assert train.unreadable_count() == 0


def test_a_shard_that_stays_unreadable_is_skipped_and_counted(sources, tmp_path,
                                                              quick_retries, capfd):
    """A truncated shard is left out when the set is indexed (its loss named); a shard
    that goes missing later has its samples counted as unreadable and stood in for; more
    than a quarter of the shards missing is one error line."""
    folder = tmp_path / "shards"
    shutil.copytree(sources["shards"], folder)
    with open(folder / "train-001.tar", "r+b") as f:
        f.truncate(700)
    with serve(folder) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        config = config_for(urls(base, "train", 4), urls(base, "val", 2))
        train, _ = data.build_datasets(config)
        assert len(train) == 11  # 15 less the 4 of the truncated shard
        assert "warning: skipping the shard" in capfd.readouterr().err
        (folder / "train-002.tar").unlink()
        keys = [(i, 0) for i in train.base.epoch_order(config["seed"], 0).tolist()]
        got = samples(train, keys)
        assert len(got) == 11 and train.unreadable_count() == 4
        assert "cannot be read" in capfd.readouterr().err
        (folder / "train-003.tar").unlink()
        with pytest.raises(UserError, match="3 of the 4 shards of --data-dir .* cannot be "
                                            "read"):
            data.build_datasets(config)


def test_a_member_that_is_not_an_image_is_replaced_and_counted(sources, tmp_path, capfd):
    import webdataset

    with webdataset.TarWriter(str(tmp_path / "t.tar")) as tar:
        tar.write({"__key__": "a", "png": b"not a png", "cls": b"0"})
        tar.write({"__key__": "b", "jpg": open(os.path.join(sources["folder"], "train", "a",
                                                            "0.jpg"), "rb").read(),
                   "json": b'{"label": 1}'})
    train, _ = data.build_datasets(config_for(str(tmp_path / "t.tar"), str(tmp_path / "t.tar")))
    assert train.base.targets == [0, 1]
    assert train.base[0][1] == 1 and train.unreadable_count() == 1
    assert "skipping unreadable image sample 0 of" in capfd.readouterr().err


@pytest.mark.parametrize("member, words", [
    ({"png": b"x"}, "has no .cls or .json label"),
    ({"png": b"x", "cls": b"cat"}, "has a label that is not a number"),
    ({"png": b"x", "cls": b"-1"}, r"label -1 is not one of the 1 classes"),
])
def test_bad_labels_are_one_line(tmp_path, member, words):
    import webdataset

    with webdataset.TarWriter(str(tmp_path / "t.tar")) as tar:
        tar.write({"__key__": "a", **member})
    with pytest.raises(UserError, match=words):
        data.build_datasets(config_for(str(tmp_path / "t.tar"), str(tmp_path / "t.tar")))


def test_what_names_no_shards_is_one_line(sources, tmp_path):
    (tmp_path / "empty").mkdir()
    for train, val, words in ((sources["train_shards"], "", "needs --val-data-dir"),
                              (str(tmp_path / "empty"), "x", "holds no .tar shards"),
                              (str(tmp_path / "no-{0..1}.tar"), "x", "no such shard"),
                              ("a-{0..1.tar", "x", "cannot expand the shard pattern")):
        with pytest.raises(UserError, match=words):
            data.build_datasets(config_for(train, val))


def test_the_retries_wait_longer_each_time_and_stop(monkeypatch):
    waits = []
    monkeypatch.setattr(time, "sleep", waits.append)
    calls = []

    def fails():
        calls.append(1)
        raise ConnectionResetError("gone")
    with pytest.raises(shards.ShardFault, match="gone .after 6 tries"):
        shards.retried("u", fails)
    assert len(calls) == 6 and waits == [0.5, 1.0, 2.0, 4.0, 8.0]
    assert shards.retried("u", lambda: 7) == 7


def test_a_process_keeps_few_shards_open(sources, monkeypatch):
    monkeypatch.setattr(shards, "OPEN_SHARDS", 2)
    train, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    keys = [(i, 1) for i in (0, 5, 9, 13, 1, 14)]  # shards 0, 1, 2, 3, 0, 3
    first = samples(train, keys)
    assert list(train.base._open) == [0, 3]  # the two read last
    assert_same(first, samples(train, keys))


def test_a_connection_cut_in_the_middle_of_a_shard_continues_where_it_stopped(
        sources, quick_retries, capfd):
    """A server that sends half of each shard the first time it is asked for it, then
    closes the connection: each shard is opened again and read on from the sample where it
    stopped, and every sample is the local shards' one."""
    import functools
    import http.server

    cut = set()

    class Cutting(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def copyfile(self, source, outputfile):
            data = source.read()
            if self.path in cut or not self.path.startswith("/train"):
                outputfile.write(data)
                return
            cut.add(self.path)
            outputfile.write(data[:len(data) // 2])
            self.close_connection = True

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Cutting, directory=sources["shards"]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{server.server_port}"
        config = config_for(urls(base, "train", 4), urls(base, "val", 2), shuffle_buffer=2)
        cut.update(f"/train-{s:03d}.tar" for s in range(4))  # (the count reads them whole)
        train, _ = data.build_datasets(config)
        cut.clear()
        keys = [(i, 0) for i in train.base.epoch_order(config["seed"], 0).tolist()]
        got = samples(train, keys)
    finally:
        server.shutdown()
        server.server_close()
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    assert_same(got, samples(local, keys))
    assert len(cut) == 4 and train.unreadable_count() == 0
    assert capfd.readouterr().err.count("trying again from there") == 4


def test_the_shard_cache_tells_two_shards_of_one_name_apart(sources, tmp_path):
    for place, count in (("a", 1), ("b", 2)):
        (tmp_path / place).mkdir()
        shutil.copy(os.path.join(sources["shards"], f"train-00{count - 1}.tar"),
                    tmp_path / place / "x.tar")
    with serve(tmp_path) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        train, val = data.build_datasets(config_for(
            f"{base}/a/x.tar", f"{base}/b/x.tar", shard_cache=str(tmp_path / "cache")))
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    for i in range(4):  # b/x.tar is the second training shard, not a/x.tar again
        (image, label), (then, then_label) = val.base[i], local.base[4 + i]
        assert label == then_label and image.tobytes() == then.tobytes()
    assert train.base[0][0].tobytes() == local.base[0][0].tobytes()


def test_a_shard_the_cache_cannot_fetch_is_skipped_with_one_line(sources, tmp_path,
                                                                 quick_retries, capfd):
    folder = tmp_path / "served"
    shutil.copytree(sources["shards"], folder)
    (folder / "train-003.tar").unlink()
    with serve(folder) as server:
        base = f"http://127.0.0.1:{server.server_port}"
        train, _ = data.build_datasets(config_for(urls(base, "train", 4), urls(base, "val", 2),
                                                  shard_cache=str(tmp_path / "cache")))
    assert len(train) == 12 and len(os.listdir(tmp_path / "cache")) == 5
    assert "warning: skipping the shard" in capfd.readouterr().err


def test_a_resume_at_a_shards_last_sample_reads_on_from_that_shard(sources, server,
                                                                   monkeypatch):
    """A buffer of one (the shards in their drawn order): resumed at the last sample of the
    first shard, the reader opens that shard (not every other one looking for it), then
    each of the others once."""
    config = config_for(urls(server, "train", 4), urls(server, "val", 2), shuffle_buffer=1)
    streamed, _ = data.build_datasets(config)
    local, _ = data.build_datasets(config_for(sources["train_shards"], sources["val_shards"]))
    order, shard_order = streamed.base.stream_order(config["seed"], 1)
    start = streamed.base.sizes[shard_order[0]] - 1  # the first shard's last sample
    opened, open_shard = [], shards.open_shard
    monkeypatch.setattr(shards, "open_shard", lambda url: opened.append(url) or open_shard(url))
    keys = [(i, 1) for i in order.tolist()[start:]]
    assert_same(samples(streamed, keys), samples(local, keys))
    assert opened == [streamed.base.paths[s] for s in shard_order.tolist()]  # in order


def test_the_classes_are_counted_on_both_splits(sources, tmp_path):
    """A class only the validation shards hold still has its place (the network's outputs,
    test.py's per-class report)."""
    import webdataset

    image = open(os.path.join(sources["folder"], "train", "a", "0.jpg"), "rb").read()
    for name, labels in (("t", (0, 1)), ("v", (2,))):
        with webdataset.TarWriter(str(tmp_path / f"{name}.tar")) as tar:
            for i, label in enumerate(labels):
                tar.write({"__key__": f"{i}", "jpg": image, "cls": str(label).encode()})
    train, val = data.build_datasets(config_for(str(tmp_path / "t.tar"),
                                                str(tmp_path / "v.tar")))
    assert train.classes == val.classes == ["0", "1", "2"] and train.num_classes == 3


def test_a_download_cut_short_is_no_cached_shard(sources, tmp_path, quick_retries):
    """The shard cache: a server that sends half a shard, then closes, twice: the third
    try's whole copy is what is kept, never a truncated one."""
    import functools
    import http.server

    tries = []

    class Cutting(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def copyfile(self, source, outputfile):
            data = source.read()
            tries.append(self.path)
            if tries.count(self.path) <= 2:
                data = data[:len(data) // 2]
                self.close_connection = True
            outputfile.write(data)

    server = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(Cutting, directory=sources["shards"]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        path = shards.cached_copy(f"http://127.0.0.1:{server.server_port}/train-000.tar",
                                  str(tmp_path / "cache"))
    finally:
        server.shutdown()
        server.server_close()
    with open(os.path.join(sources["shards"], "train-000.tar"), "rb") as f:
        assert open(path, "rb").read() == f.read()
    assert len(tries) == 3

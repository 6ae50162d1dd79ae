"""TensorBoard's first screen, opened in a real (headless) browser: the loss and accuracy
curves come first and open, the final metrics are in HPARAMS only (issue 20, item 7).
Needs Chromium (apt-get install chromium); skipped without it."""

import importlib.util
import os

import pytest
from helpers import ROOT, tiny_args
from PIL import Image

spec = importlib.util.spec_from_file_location("screenshot",
                                              os.path.join(ROOT, "docs", "screenshot.py"))
screenshot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(screenshot)

pytestmark = pytest.mark.skipif(screenshot.chromium() is None, reason="needs chromium")


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    import train

    run_dir = tmp_path_factory.mktemp("run")
    assert train.main(tiny_args(run_dir, "--ema-decay", "0.9", "--grad-clip", "1",
                                epochs=2)) == 0
    return run_dir


def test_time_series_opens_on_train_and_val(finished_run):
    groups = screenshot.page_groups(finished_run)
    assert groups[:2] == [("train", True), ("val", True)], groups  # open, at the top
    assert not [name for name, is_open in groups[2:] if is_open], groups
    assert "hparam" not in [name for name, _ in groups]
    assert "z_perf" in [name for name, _ in groups]


def test_screenshot_is_the_page_as_a_browser_shows_it(finished_run, tmp_path):
    out = screenshot.screenshot(finished_run, tmp_path / "page.png")
    picture = Image.open(out)
    assert picture.format == "PNG" and picture.size == screenshot.WINDOW
    assert len(picture.convert("RGB").getcolors(1 << 20)) > 50  # a page, not a blank

"""The picture in README's "Looking at a run": TensorBoard's first screen on a real run.

    python docs/screenshot.py                  # trains a small run, writes docs/tensorboard.png
    python docs/screenshot.py --run-dir runs/x --out /tmp/x.png   # any finished run

Starts TensorBoard on the run directory and opens its Time Series page in headless
Chromium (Debian's ``chromium`` package: ``apt-get install chromium``), which writes a PNG
of what a person sees first. ``page_groups`` reads the same page's DOM: the groups in
the order shown and whether each is open (tests/reporting/test_screenshot.py checks them).
"""

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WINDOW = (1400, 1500)
# The run of the picture: ten classes learnt slowly enough that every curve moves, an EMA
# (seconds on a CPU).
RECIPE = ["--dataset", "synthetic", "--synthetic-size", "1000", "--image-size", "16",
          "--network", "mlp", "--epochs", "8", "--batch-size", "32", "--optimizer", "sgd",
          "--lr", "0.0005", "--momentum", "0.5", "--ema-decay", "0.99", "--log-every", "5",
          "--num-workers", "0", "--device", "cpu"]
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                  "--no-first-run", "--disable-background-networking",
                  "--disable-component-update", "--disable-sync", "--hide-scrollbars",
                  "--enable-unsafe-swiftshader"]  # WebGL in software: the charts draw


def chromium():
    """The path of a Chromium (or Chrome) binary, or None."""
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    return None


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TensorBoard:
    """``tensorboard --logdir run_dir`` on a free local port, while in the ``with``."""

    def __init__(self, run_dir):
        self.run_dir, self.port = run_dir, _free_port()
        self.url = f"http://127.0.0.1:{self.port}/"

    def __enter__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tensorboard.main", "--logdir", str(self.run_dir),
             "--port", str(self.port), "--host", "127.0.0.1", "--reload_interval", "0"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # up when it lists the run's scalars
            try:
                with urllib.request.urlopen(self.url + "data/plugin/scalars/tags",
                                            timeout=2) as reply:
                    if b"loss" in reply.read():
                        return self
            except OSError:
                pass
            time.sleep(0.5)
        self.__exit__()
        raise RuntimeError(f"TensorBoard did not come up on {self.url}")

    def __exit__(self, *exc):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _browse(url, *action, wait_ms=30000):
    """Headless Chromium on ``url`` after ``wait_ms`` of the page's own time."""
    with tempfile.TemporaryDirectory() as profile:
        proc = subprocess.run(
            [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}",
             f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--virtual-time-budget={wait_ms}",
             *action, url], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"chromium failed: {proc.stderr[-500:]}")
    return proc.stdout


def screenshot(run_dir, out):
    """Writes a PNG of the Time Series page of ``run_dir`` as a browser first shows it."""
    with TensorBoard(run_dir) as board:
        # SVG charts: headless Chromium takes the picture before WebGL ones have drawn
        _browse(board.url + "?forceSVG=true#timeseries",
                f"--screenshot={os.path.abspath(out)}")
    return out


def page_groups(run_dir):
    """The Time Series page's groups, top to bottom: ``[(name, is_open), ...]``."""
    with TensorBoard(run_dir) as board:
        dom = _browse(board.url + "#timeseries", "--dump-dom")
    # each group's header: its title, then its icon: expand_less when open, else expand_more
    found = re.findall(r'class="group-title" title="([^"]*)">.{0,600}?'
                       r'svgicon="expand_(less|more)_24px"', dom)
    return [(name, icon == "less") for name, icon in found]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", default=None, help="a finished run (default: train one)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "tensorboard.png"))
    args = p.parse_args(argv)
    if chromium() is None:
        print("error: no chromium here: apt-get install chromium", file=sys.stderr)
        return 2
    run_dir = args.run_dir
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="screenshot-run-")
        subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *RECIPE,
                        "--run-dir", run_dir], check=True, cwd=ROOT)
    print(f"groups: {page_groups(run_dir)}")
    print(f"wrote {screenshot(run_dir, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

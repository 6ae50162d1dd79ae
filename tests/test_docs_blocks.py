"""Runs the ```python examples of docs/blocks.md, so the documentation stays correct."""

import re
import runpy
from pathlib import Path

DOC = Path(__file__).resolve().parents[1] / "docs" / "blocks.md"


def test_blocks_doc_examples_run(tmp_path, capsys):
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
    assert len(blocks) >= 3  # discriminator, GAN losses, perceptual loss
    # One script, so later examples use the names earlier ones defined, as a reader would.
    script = tmp_path / "blocks_examples.py"
    script.write_text("\n".join(blocks))
    runpy.run_path(str(script), run_name="__main__")
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "torch.Size([4, 1, 8, 8])"
    assert printed[-1].endswith(" 0.0")


def test_readme_python_examples_run(tmp_path, capsys):
    readme = (DOC.parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    assert blocks
    script = tmp_path / "readme_examples.py"
    script.write_text("\n".join(blocks))
    runpy.run_path(str(script), run_name="__main__")
    assert capsys.readouterr().out.splitlines()[-1] == "True 0.0"

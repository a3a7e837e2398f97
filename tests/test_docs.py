"""Every command in the README and docs/ runs as written: the ```sh blocks, in order per file,
from a copy of the repository's layout (the demo files, configs/) in a temporary folder. ```text
blocks hold what needs downloads, the bench extra, a long run or the user's own files."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def sh_blocks(page: Path) -> list[str]:
    return re.findall(r"^```sh\n(.*?)^```$", page.read_text(), flags=re.S | re.M)


def test_the_pages_have_commands():
    assert len(sh_blocks(ROOT / "README.md")) >= 4
    assert all(ROOT.joinpath("docs", name).exists() for name in ("README.md", "verify.md", "quantize.md"))


@pytest.mark.parametrize("page", [p for p in PAGES if sh_blocks(p)], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_commands_run_as_written(tmp_path, page):
    # the package itself (its demo files; and `python -` from here imports it, not a shadow)
    (tmp_path / "qtool").symlink_to(ROOT / "qtool", target_is_directory=True)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for block in sh_blocks(page):
        result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, f"{page.name}:\n{block}\n{result.stderr[-2000:]}"

"""Installing crossover the way a user does: `pip install .` (or from an sdist) builds the
native fast path in pip's isolated build environment, and the extras never move an
installed Horovod or framework."""

from __future__ import annotations

import json
import subprocess
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.conftest import PY, REPO


@pytest.fixture(scope="module")
def source_tree(tmp_path_factory) -> Path:
    """The project's files as a fresh clone has them (no build outputs, no compiled
    module lying in the tree to be picked up)."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    dest = tmp_path_factory.mktemp("src")
    for name in files:
        src = REPO / name
        if src.is_file() and not name.startswith("third_party/"):
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
    return dest


def test_an_sdist_built_with_default_isolation_holds_the_native_module(source_tree, tmp_path):
    subprocess.run([PY, "setup.py", "-q", "sdist", "-d", str(tmp_path / "sdist")],
                   cwd=source_tree, check=True, capture_output=True, timeout=300)
    (sdist,) = (tmp_path / "sdist").glob("crossover-*.tar.gz")
    names = tarfile.open(sdist).getnames()
    for needed in ("CMakeLists.txt", "native/table.hpp", "native/module.cpp"):
        assert any(n.endswith(needed) for n in names), needed
    # pip's default: an isolated build environment with only the build requirements
    res = subprocess.run([PY, "-m", "pip", "wheel", str(sdist), "--no-deps", "-w",
                          str(tmp_path / "wheel")], capture_output=True, text=True,
                         timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "not building the native fast path" not in res.stderr + res.stdout
    (wheel,) = (tmp_path / "wheel").glob("crossover-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("crossover/_native.") and n.endswith(".so") for n in names), names
    assert "crossover/launch/inject/sitecustomize.py" in names
    assert "crossover/hooks/torch.py" in names


def test_the_extras_leave_an_installed_horovod_and_frameworks_alone(source_tree, tmp_path):
    """This environment holds Horovod, torch, tf_keras and lightning: installing the
    extras into it must add crossover and nothing else (no rebuild of Horovod)."""
    report = tmp_path / "report.json"
    res = subprocess.run([PY, "-m", "pip", "install", "--dry-run", "--no-index",
                          "--no-build-isolation", "--quiet", "--report", str(report),
                          ".[torch,tensorflow,lightning,plot]"],
                         cwd=source_tree, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    installs = [item["metadata"]["name"] for item in json.loads(report.read_text())["install"]]
    assert installs == ["crossover"], installs

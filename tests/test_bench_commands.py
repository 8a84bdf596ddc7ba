"""The benchmarks' commands as the docs give them: every module and file they name exists,
every module imports without touching sys.path, and every option a documented command
passes is one its parser accepts."""

from __future__ import annotations

import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from functools import cache

import pytest

from tests.conftest import PY, REPO

DOCS = [REPO / "README.md", REPO / "DEVELOPERS.md", REPO / "bench/README.md",
        *sorted((REPO / "docs").glob("*.md"))]
#: `-m bench.area.script` and what follows it up to the end of the inline code or line
MODULE_CALL = re.compile(r"-m (bench(?:\.\w+)+)([^`\n]*(?:\n[^`\n]*){0,3}?)(?=`|$)", re.M)
#: a script the docs name (results they name may be the ones a GPU run writes: the links
#: among them are checked by test_docs)
BENCH_FILE = re.compile(r"\bbench/[\w./-]+\.(?:py|sh|cpp)\b")
OPTION = re.compile(r"(?<![\w-])--[a-z][\w-]*")


def bench_modules() -> list[str]:
    return sorted(".".join(p.relative_to(REPO).with_suffix("").parts)
                  for p in (REPO / "bench").rglob("*.py") if p.name != "__init__.py")


def documented_calls() -> list[tuple[str, str, str]]:
    """(doc, module, the options after it) of every documented `-m bench...` call."""
    calls = []
    for doc in DOCS:
        for m in MODULE_CALL.finditer(doc.read_text()):
            calls.append((doc.name, m.group(1), m.group(2)))
    return calls


def test_the_docs_name_bench_modules_and_files_that_exist():
    modules, missing = set(bench_modules()), []
    for doc, module, _ in documented_calls():
        if module not in modules:
            missing.append(f"{doc}: -m {module}")
    for doc in DOCS:
        for name in BENCH_FILE.findall(doc.read_text()):
            if not (REPO / name).exists():
                missing.append(f"{doc.name}: {name}")
    assert len(documented_calls()) >= 20, "the docs' bench commands went missing"
    assert not missing, "\n".join(missing)


def test_no_bench_module_edits_sys_path():
    edits = [str(p.relative_to(REPO)) for p in (REPO / "bench").rglob("*.py")
             if "sys.path" in p.read_text()]
    assert not edits, edits


def test_every_bench_module_imports():
    """Imported as the docs run them: as modules from the repository root."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    res = subprocess.run([PY, "-c", code, *bench_modules()], cwd=REPO, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


@cache
def help_text(module: str) -> str:
    res = subprocess.run([PY, "-m", module, "--help"], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, f"{module} --help: {res.stderr[-2000:]}"
    return res.stdout


def parses_arguments(module: str) -> bool:
    return "argparse" in (REPO / (module.replace(".", "/") + ".py")).read_text()


def test_every_documented_option_is_one_the_benchmark_accepts():
    calls = [(doc, module, args) for doc, module, args in documented_calls()
             if parses_arguments(module)]
    modules = sorted({module for _, module, _ in calls})
    with ThreadPoolExecutor(2) as pool:  # two cores: each --help imports torch
        helps = dict(zip(modules, pool.map(help_text, modules), strict=True))
    stale = [f"{doc}: -m {module} {option}" for doc, module, args in calls
             for option in OPTION.findall(args) if option not in helps[module]]
    assert not stale, "documented options the benchmark does not take:\n" + "\n".join(stale)


@pytest.mark.parametrize("module", ["bench.colocation.pair_noise"])
def test_a_benchmark_without_its_input_says_what_to_give(module, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    res = subprocess.run([PY, "-m", module, str(bad)], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode != 0 and "bad.json" in res.stderr


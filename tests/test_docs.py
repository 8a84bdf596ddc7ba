"""The manual stays true: README's commands run as written, docs/configuration.md is
the code's, links resolve, README stays short, and no file speaks of how it was made."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PY, REPO

sys.path.insert(0, str(REPO / "scripts"))
import configuration_doc  # noqa: E402

DOCS = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
#: A fenced block preceded by this comment is not run (the comment says why).
NOT_RUN = "<!-- not run:"


def code_blocks(path: Path) -> list[tuple[str, str, bool]]:
    """(language, code, runs) of every fenced block of a markdown file."""
    blocks, lines = [], path.read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            runs = i > 0 and not lines[i - 1].startswith(NOT_RUN)
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            blocks.append((lang, "\n".join(lines[i + 1:end]), runs))
            i = end
        i += 1
    return blocks


def test_readme_is_at_most_15_kb():
    assert len((REPO / "README.md").read_bytes()) <= 15_000


def test_configuration_doc_is_generated_from_the_code():
    current = (REPO / "docs/configuration.md").read_text()
    assert current == configuration_doc.render(), \
        "docs/configuration.md is stale: run .venv/bin/python scripts/configuration_doc.py"


def test_every_flag_and_variable_is_in_the_configuration_doc():
    """The generator's own completeness: a flag it dropped would pass the test above."""
    from crossover import environment as E
    from crossover.__main__ import build_parser
    from crossover.launch.cli import PLUGIN_FLAGS

    text = (REPO / "docs/configuration.md").read_text()
    for name in [*PLUGIN_FLAGS, *E.VARS]:
        assert f"`{name}`" in text, name
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for command, subparser in sub.choices.items():
        assert f"### `crossover {command}`" in text
        for action in subparser._actions:
            if action.help == argparse.SUPPRESS:  # hidden: parts of crossover call them
                continue
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}`" in text, (command, option)


# the words of a development diary, spelled so that this file does not match itself
HISTORY = re.compile("|".join([
    r"\b(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
    r"twelfth|[a-z]+teenth|twentieth|twenty-[a-z]+|thirtieth)\s+" + "sess" + "ion",
    "sess" + r"ion \d+", r"\biss" + r"ue #?\d+", r"\bscr" + "atch", "final" + " code",
]), re.IGNORECASE)


def project_files() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    return [REPO / name for name in tracked if not name.startswith("third_party/")
            and (REPO / name).is_file()]


def test_no_file_speaks_of_how_the_project_was_made():
    found = []
    for path in project_files():
        if path.suffix in (".png", ".so", ".patch") or path == Path(__file__):
            continue
        found += [f"{path.relative_to(REPO)}: {m.group(0)!r}"
                  for m in HISTORY.finditer(path.name + "\n" + path.read_text(errors="replace"))]
    assert not found, "\n".join(found)


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_local_links_resolve(doc):
    for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        path = (doc.parent / target.split("#")[0]).resolve()
        assert path.exists(), f"{doc.name} links to {target}, which does not exist"


def test_readme_commands_run_as_written(tmp_path):
    """Every bash and python block of README.md that is not marked `not run` runs here,
    in a runtime directory of its own (a daemon it starts is stopped after)."""
    blocks = [(lang, code) for lang, code, runs in code_blocks(REPO / "README.md")
              if runs and lang in ("bash", "python")]
    assert len(blocks) >= 3, "README's runnable blocks went missing"
    env = dict(os.environ, CROSSOVER_RUNTIME_DIR=str(tmp_path / "run"),
               PATH=f"{Path(PY).parent}{os.pathsep}{os.environ['PATH']}")
    try:
        for lang, code in blocks:
            cmd = ["bash", "-euo", "pipefail", "-c", code] if lang == "bash" else [PY, "-c", code]
            res = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True,
                                 timeout=400)
            assert res.returncode == 0, f"{code}\n--- exit {res.returncode}:\n" \
                                        f"{res.stdout[-2000:]}\n{res.stderr[-3000:]}"
    finally:
        subprocess.run([PY, "-m", "crossover", "stop", "--force"], env=env, timeout=60,
                       capture_output=True)

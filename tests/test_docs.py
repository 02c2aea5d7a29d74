"""What the pages promise a reader: every path README.md and docs/ name is in the repository, every section a
reference quotes (BENCHMARKS.md, "Set-up time") is a heading of that page, BENCHMARKS.md is today's figures read in
minutes (the history in bench/HISTORY.md), the README's first screen says where ddpipe runs and what `make repro`
gives, and `make test` installs no system package: only `make system-deps` does, as root, and CI calls it."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.conftest import ROOT

BENCHMARKS, HISTORY = ROOT / "BENCHMARKS.md", ROOT / "bench" / "HISTORY.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), BENCHMARKS, ROOT / "RELIABILITY.md",
         ROOT / "deploy" / "README.md"]
# A path under one of the repository's own folders (what the pipeline writes lives elsewhere: data/, models/, ...);
# a <placeholder> in it stands for any name
PATH = re.compile(r"(?<![\w./-])((?:src|tests|bench|deploy|docs|stages|\.ci)/[\w.*/<>-]*[\w*>])")
LINK = re.compile(r"\]\(([^)\s]+)\)")
# Paths a page may name that a fresh clone does not hold yet, and why
NOT_IN_A_CLONE = {
    "bench/results": "where the bench scripts append their figures (bench/common.py, RESULTS): git-ignored, made by "
                     "the first run",
}
# A reference to a section: BENCHMARKS.md, "A" (and "B"), as a link or not, across lines and comment markers
REFERENCE = re.compile(r'(BENCHMARKS(?:\.md)?|bench/HISTORY\.md)(?:\]\([^)]*\))?,?\s+"([^"]+)"((?:\s+and\s+"[^"]+")*)')
SYSTEM_PACKAGES = {"dataset-fashion-mnist", "chromium", "slurm-wlm", "slurmctld", "slurmd", "munge", "postgresql",
                   "openssh-server", "qemu-user", "podman", "runc"}


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _exists(path: str) -> bool:
    pattern = re.sub(r"<[^>]*>", "*", path)
    return any(ROOT.glob(pattern)) if "*" in pattern else (ROOT / path).exists()


def test_every_path_the_readme_and_docs_name_exists() -> None:
    """deploy/k8s/..., src/ddpipe/..., tests/..., bench/... in a page's text, code blocks included, and every relative
    link: a reader who follows one finds the file."""
    missing = []
    for page in PAGES:
        text = page.read_text()
        for match in PATH.finditer(text):
            path = match.group(1)
            if not any(path == d or path.startswith(d + "/") for d in NOT_IN_A_CLONE) and not _exists(path):
                missing.append(f"{page.relative_to(ROOT)}:{_line(text, match.start())}: {path}")
        for match in LINK.finditer(text):
            target = match.group(1).split("#")[0]
            if target and not re.match(r"[a-z]+:", target) and not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)}:{_line(text, match.start())}: link {target}")
    assert missing == []


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def test_every_section_a_reference_quotes_is_a_heading_of_its_page() -> None:
    """Code comments, docstrings and pages cite figures as BENCHMARKS.md, "Set-up time" (or bench/HISTORY.md, ...):
    each quoted name starts a heading of that page, and each BENCHMARKS.md#anchor is one."""
    pages = {"BENCHMARKS": BENCHMARKS, "BENCHMARKS.md": BENCHMARKS, "bench/HISTORY.md": HISTORY}
    code = [p for d in ("src", "tests", "bench", "stages", "deploy") for p in sorted((ROOT / d).rglob("*.py"))]
    sources = [*PAGES, ROOT / "Makefile", ROOT / ".ci" / "run", *code]
    broken, found = [], 0
    for source in (s for s in sources if s != Path(__file__)):  # this file's own examples apart
        text = source.read_text()
        flat = re.sub(r"[ \t]*\n[ \t]*(?:#+[ \t]*)?", " ", text)  # continuation lines, comment markers dropped
        for match in REFERENCE.finditer(flat):
            names = [match.group(2), *re.findall(r'"([^"]+)"', match.group(3))]
            headings = _headings(pages[match.group(1)])
            for name in names:
                found += 1
                if not any(h.startswith(name) for h in headings):
                    broken.append(f"{source.relative_to(ROOT)}: {match.group(1)}, {name!r}")
        for anchor in re.findall(r"BENCHMARKS\.md#([\w-]+)", text):
            if anchor not in {_slug(h) for h in _headings(BENCHMARKS)}:
                broken.append(f"{source.relative_to(ROOT)}: BENCHMARKS.md#{anchor}")
    assert broken == [] and found >= 20, (broken, found)


def _sections(page: Path) -> dict[str, str]:
    """Each ``## `` section of ``page`` by its heading, with its subsections."""
    parts = re.split(r"^## (.+)$", page.read_text(), flags=re.MULTILINE)
    return dict(zip(parts[1::2], parts[2::2]))


def test_the_benchmarks_page_is_todays_figures_read_in_minutes() -> None:
    """At most 250 lines: each section a figure of today with its date, the machine it was measured on (one of the
    page's named CPU kinds, or the GPU) and a command to measure it again; every earlier figure in bench/HISTORY.md."""
    text = BENCHMARKS.read_text()
    assert len(text.splitlines()) <= 250, len(text.splitlines())
    assert "](bench/HISTORY.md)" in text and HISTORY.is_file()
    machines = re.findall(r"^\| \*\*([\w-]+)\*\* \|", text, flags=re.MULTILINE)
    assert {"EPYC-BF16", "Xeon-AMX", "H200"} <= set(machines), machines
    command = re.compile(r"`(?:python|make|dvc|git|uv|UV_\w+=|CI=|rm|mlflow) [^`]*`")
    for heading, body in _sections(BENCHMARKS).items():
        assert re.search(r"\b20\d\d-\d\d-\d\d\b", body), f"{heading!r}: no date"
        assert any(m in body for m in machines), f"{heading!r}: no machine"
        assert command.search(body), f"{heading!r}: no command"


def test_the_readme_first_screen_says_where_it_runs_and_what_make_repro_gives() -> None:
    """Its first 25 lines: Linux, and `make repro`'s time and accuracies as BENCHMARKS.md's section gives them; and
    it names `make system-deps`, which installs the system packages `make test` only checks."""
    readme = (ROOT / "README.md").read_text()
    first = "\n".join(readme.splitlines()[:25])
    assert "Linux" in first and "make system-deps" in readme
    (quote,) = [p for p in first.split("\n\n") if '"What `make repro` gives"' in p]
    quote = quote[quote.index("`make repro`"):quote.index('"What `make repro` gives"')]
    section = _sections(BENCHMARKS)["What `make repro` gives"]
    figures = re.findall(r"\b\d+\.\d+\b", quote)
    assert len(figures) >= 4 and [f for f in figures if f not in section] == [], figures


def test_make_test_installs_no_system_package_and_names_what_installs_them() -> None:
    """`make test` (and test-fast, test-slurm) runs no apt-get; a missing package is named with the tests that skip
    and `make system-deps`, the one target that installs them all, which CI runs while the venv is made."""
    planned = subprocess.run(["make", "-n", "test", "test-fast", "test-slurm"], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)
    assert planned.returncode == 0, planned.stderr
    assert "apt-get" not in planned.stdout and "system-deps" in planned.stdout
    said = subprocess.run(["make", "-s", "system-check", "FASHION_DIR=/nonexistent"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert said.returncode == 0, said.stderr
    assert "dataset-fashion-mnist not installed: the tests that run the pipeline" in said.stdout
    assert "'make system-deps', as root, installs them" in said.stdout
    makefile = (ROOT / "Makefile").read_text()
    listed = re.search(r"^SYSTEM_PACKAGES := ((?:.*\\\n)*.*)$", makefile, flags=re.MULTILINE)[1]
    assert set(listed.replace("\\", " ").split()) == SYSTEM_PACKAGES
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make system-deps > .ci-apt.log 2>&1 &" in ci and "apt-get install" not in ci

"""The documentation holds together: README.md and docs/ link only to files that exist (and to
headings that exist), every page is in the site's nav, the experiment logs are dated pages listed in
docs/results/index.md, the pages keep the markers the benchmark scripts write tables between, and
CI runs the test command README.md documents. Text only: no torch, no mkdocs (CI's `mkdocs build
--strict` checks the site itself)."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
# [text](target) and ![alt](target), the target up to a space, a quote or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\((?P<target>[^)\s\"']+)(?:\s+\"[^\"]*\")?\)")


def prose(text: str) -> str:
    """The page without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slugs(page: Path) -> set[str]:
    """The ids a heading gets: the site's (Python-Markdown's toc) and GitHub's."""
    found = set()
    for line in prose(page.read_text()).splitlines() + re.findall(r"^#+ .*$", page.read_text(), re.M):
        m = re.match(r"^#{1,6} +(.+?) *#*$", line)
        if not m:
            continue
        title = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", r"\1", m.group(1))
        ascii_title = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
        found.add(re.sub(r"[-\s]+", "-", re.sub(r"[^\w\s-]", "", ascii_title).strip().lower()))
        found.add(re.sub(r" ", "-", re.sub(r"[^\w\- ]", "", title.strip().lower())))
    return found


def links(page: Path) -> list[tuple[str, str]]:
    """(target, anchor) of every relative link of a page."""
    out = []
    for m in LINK.finditer(prose(page.read_text())):
        target = m.group("target")
        if re.match(r"^[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        out.append((path, anchor))
    return out


@pytest.mark.parametrize("page", [ROOT / "README.md", *PAGES], ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page):
    broken = []
    for path, anchor in links(page):
        target = (page.parent / path).resolve() if path else page
        if not target.exists() or not target.is_relative_to(ROOT):
            broken.append(f"{path}: no such file in the repository")
        elif anchor and target.suffix == ".md" and anchor not in slugs(target):
            broken.append(f"{path}#{anchor}: no such heading")
    assert broken == []


def test_the_check_finds_broken_links(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n[ok](page.md#title) [gone](nope.md) `[code](nope.md)`\n\n```\n[x](y.md)\n```\n")
    assert links(page) == [("page.md", "title"), ("nope.md", "")]
    assert "title" in slugs(page)


def test_no_page_links_outside_the_repository():
    for page in [ROOT / "README.md", *PAGES]:
        assert "shared/" not in page.read_text(), page


def test_every_page_is_in_the_site_nav():
    nav = (ROOT / "mkdocs.yml").read_text().split("\nnav:", 1)[1]
    listed = set(re.findall(r"(?:^|\s)([\w./-]+\.md)\s*$", nav, re.M))
    assert listed == {str(p.relative_to(DOCS)) for p in PAGES}


def test_results_pages_are_dated_and_listed():
    index = (DOCS / "results" / "index.md").read_text()
    for page in (DOCS / "results").glob("*.md"):
        if page.name == "index.md":
            continue
        assert re.fullmatch(r"20\d\d-\d\d-\d\d-[a-z0-9-]+\.md", page.name), page.name
        assert f"]({page.name})" in index, f"{page.name} is not listed in docs/results/index.md"


# page -> the markers a benchmark script writes between (the script, the start marker's text)
MARKERS = {
    "docs/fidelity-smollm2.md": [
        ("benchmarks/long_context.py", "<!-- long-context: python benchmarks/long_context.py -->"),
        ("benchmarks/long_context.py", "<!-- /long-context -->"),
        ("benchmarks/retrieval_windows.py", "<!-- retrieval-windows: python benchmarks/retrieval_windows.py -->"),
        ("benchmarks/retrieval_windows.py", "<!-- /retrieval-windows -->"),
    ],
    "docs/fidelity.md": [
        (
            "benchmarks/fidelity.py",
            "<!-- memories: further runs, each with its command; kept when fidelity.py rewrites the page -->",
        ),
        ("benchmarks/fidelity.py", "<!-- /memories -->"),
        ("benchmarks/fidelity.py", "<!-- per-head: written by benchmarks/per_head.py -->"),
        ("benchmarks/fidelity.py", "<!-- /per-head -->"),
    ],
}


@pytest.mark.parametrize("page", sorted(MARKERS))
def test_pages_keep_the_markers_scripts_write_between(page):
    text = (ROOT / page).read_text()
    for script, marker in MARKERS[page]:
        assert marker in (ROOT / script).read_text(), f"{script} no longer writes {marker}"
        assert text.count(marker) == 1, f"{page}: {marker} missing or repeated"


def test_ci_runs_the_test_command_readme_documents():
    readme = (ROOT / "README.md").read_text()
    section = re.search(r"^## Tests\n(.*?)(?=^## |\Z)", readme, flags=re.S | re.M).group(1)
    command = re.search(r"^```bash\n(.*?)\n```", section, flags=re.S | re.M).group(1).strip()
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert command in ci


def test_readme_stays_the_front_door():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 150

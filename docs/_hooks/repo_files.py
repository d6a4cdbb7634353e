"""mkdocs hook: pages may link to files of the repository outside docs/.

The pages are written to be read in the repository too, so a plot or a script is linked by its
path from the page (``../benchmarks/results/fidelity.png``), and the benchmark scripts write such
links into the pages they generate. mkdocs only knows the files under docs/, so on its own it
reports those links as broken and the site would miss the plots. This hook adds every repository
file that a page links to the site under ``repo/`` (``repo/benchmarks/results/fidelity.png``) and
points the link there. A link to a file that does not exist is left alone, so ``mkdocs build
--strict`` still fails on it; so does a link to a directory (link a file, or name it in a code
span).
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
PREFIX = "repo"
# an inline link or image target: ](path) or ](path#anchor), up to a space, a quote or the parenthesis
LINK = re.compile(r"(\]\()(?P<target>[^)\s#\"']+)(?P<rest>[^)]*\))")
FENCE = re.compile(r"^\s*(```|~~~)")


def _outside_target(page_uri: str, target: str) -> str | None:
    """The repository path (posix, from the root) a relative link of the page names, when that
    is an existing file outside docs/ (not a markdown page: those are left to fail); else None."""
    if "://" in target or target.startswith(("/", "mailto:")):
        return None
    path = Path(posixpath.normpath(posixpath.join(posixpath.dirname(f"docs/{page_uri}"), target)))
    if path.parts[:1] in (("docs",), ("..",)) or path.suffix == ".md" or not (ROOT / path).is_file():
        return None
    return path.as_posix()


def _lines_outside_fences(markdown: str):
    inside = False
    for line in markdown.splitlines(keepends=True):
        if FENCE.match(line):
            inside = not inside
            yield line, True
        else:
            yield line, inside


def _rewrite(markdown: str, page_uri: str, found: set[str]) -> str:
    out = []
    for line, fenced in _lines_outside_fences(markdown):
        if not fenced:

            def repl(m: re.Match) -> str:
                repo_path = _outside_target(page_uri, m["target"])
                if repo_path is None:
                    return m.group(0)
                found.add(repo_path)
                link = posixpath.relpath(f"{PREFIX}/{repo_path}", posixpath.dirname(page_uri) or ".")
                return m.group(1) + link + m["rest"]

            line = LINK.sub(repl, line)
        out.append(line)
    return "".join(out)


def on_files(files: Files, config) -> Files:
    """Add the repository files the pages link to, before mkdocs validates any link."""
    found: set[str] = set()
    for file in list(files):
        if file.src_uri.endswith(".md") and file.abs_src_path:
            _rewrite(Path(file.abs_src_path).read_text(encoding="utf-8"), file.src_uri, found)
    for repo_path in sorted(found):
        files.append(File.generated(config, f"{PREFIX}/{repo_path}", abs_src_path=str(ROOT / repo_path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    return _rewrite(markdown, page.file.src_uri, set())

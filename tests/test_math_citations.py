"""Every "math.md §<title>" the code and docs cite names a section of docs/math.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MATH = ROOT / "docs" / "math.md"
SOURCES = ["rnnify", "tests", "docs", "benchmarks", "examples", "README.md"]


def sections() -> list[str]:
    return [m.group(1).strip() for m in re.finditer(r"^##+ (.+)$", MATH.read_text(), re.MULTILINE)]


def citations() -> list[tuple[str, str]]:
    """``(file:line, text after the §)`` for each § that follows a mention of math.md."""
    found = []
    paths = [p for name in SOURCES for p in ([ROOT / name] if (ROOT / name).is_file() else (ROOT / name).rglob("*"))]
    for path in sorted(p for p in paths if p.suffix in (".py", ".md") and p not in (MATH, Path(__file__))):
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "math.md" in line:
                for m in re.finditer(r"§([^§]*)", line[line.index("math.md") :]):
                    found.append((f"{path.relative_to(ROOT)}:{number}", m.group(1)))
    return found


def resolves(text: str, titles: list[str]) -> bool:
    """The citation starts with a title and the title ends there (not a longer word or name)."""
    return any(text.startswith(t) and not text[len(t) : len(t) + 1].isalnum() for t in titles)


def test_citations_name_sections_of_math_md():
    titles = sections()
    cited = citations()
    assert len(cited) >= 17
    assert [(where, text) for where, text in cited if not resolves(text, titles)] == []


def test_the_check_rejects_numbers_and_unknown_titles():
    titles = sections()
    assert resolves("Linear attention and ", titles)
    assert not resolves("2 (S_t = S_{t-1} + ...)", titles)
    assert not resolves("Linear attentions", titles)
    assert not resolves("Softmax", titles)


def test_no_link_leaves_the_repository():
    for path in (ROOT / "docs").glob("*.md"):
        assert "shared/" not in path.read_text(), path

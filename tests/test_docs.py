"""The README stays a five-minute read and the docs it leads to stay reachable and unbroken.

README.md holds what the product is, the two commands, one figure, an experiment file at a glance
and links; everything else lives in docs/. These tests keep it that way: the README's size, its
opening commands (CI runs the test command from there), a direct link from the README to every page
written by hand, and every relative link or image in README.md and docs/ resolving to a file, with
any `#anchor` naming a heading of the target as GitHub slugs it. Plain text processing: no Ray, no
torch.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_BYTES = 10 * 1024

# What benchmarks/common.py's write_page puts under the title of a page it generates: such a page is a
# benchmark's output, linked from the hand-written page that explains it rather than from the README.
GENERATED_MARK = "Regenerate it with the same command; do not edit it."

FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
# [text](target "title") and ![alt](target); text may hold one level of brackets and wrap lines.
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(\S+)", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t]*#*[ \t]*$", re.M)


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def documents() -> list[Path]:
    return [README, *pages()]


def prose(path: Path) -> str:
    """The file's text with fenced code blocks and code spans blanked out: links in code are not links."""
    text = FENCE.sub("", path.read_text(encoding="utf-8"))
    return CODE_SPAN.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its text lowercased, punctuation other than '-' and '_' dropped,
    spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors by its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading's anchor, repeated headings numbered as GitHub does (-1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    for _, text in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(text)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> list[str]:
    """Relative link and image targets of a Markdown file (web and mail addresses left out)."""
    text = prose(path)
    targets = [t.strip("<>") for t in LINK.findall(text)] + REF_DEF.findall(text)
    return [t for t in targets if not re.match(r"[a-zA-Z][a-zA-Z0-9+.-]*:", t)]


def resolve(source: Path, target: str) -> tuple[Path, str]:
    path, _, anchor = target.partition("#")
    return (source if not path else (source.parent / path).resolve()), anchor


def written_by_a_benchmark(path: Path) -> bool:
    """A docs page one of benchmarks/*.py writes (it names the page), absent until that benchmark runs."""
    name = path.relative_to(REPO).as_posix()
    return path.parent == DOCS and any(name in script.read_text(encoding="utf-8")
                                       for script in (REPO / "benchmarks").glob("*.py"))


def generated(path: Path) -> bool:
    return GENERATED_MARK in path.read_text(encoding="utf-8")


def linked_pages(source: Path) -> set[Path]:
    return {p for p, _ in (resolve(source, t) for t in links(source)) if p.suffix == ".md" and p != source}


def test_readme_is_a_five_minute_read():
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size} bytes, over {README_MAX_BYTES}: move the section that grew into a page of docs/ "
        "and link it from the README's Documentation list")


def test_readme_opens_with_the_two_commands():
    """CI and newcomers take the commands from the README's first block, right under the title."""
    text = README.read_text(encoding="utf-8")
    assert re.match(r"# [^\n]+\n\n```\nmake quickstart [^\n]*\nmake test [^\n]*\n```\n", text), (
        "README.md must open with its title and then the block of `make quickstart` and `make test`")


def test_every_page_is_linked_from_the_readme():
    """A hand-written page needs a link in the README itself; a page a benchmark generates needs one from
    a page the README links (the page that explains those figures)."""
    direct = linked_pages(README)
    reachable = direct | {p for page in direct if page.exists() for p in linked_pages(page)}
    missing = [p.relative_to(REPO).as_posix() for p in pages()
               if p not in direct and not (generated(p) and p in reachable)]
    assert not missing, f"docs pages the README does not link: {missing}; add each to its Documentation list"


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_page_opens_with_a_title_and_what_it_covers(page):
    paragraphs = [p.strip() for p in page.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    assert paragraphs and paragraphs[0].startswith("# ") and "\n" not in paragraphs[0], f"{page.name}: first line is not a '# Title'"
    assert len(paragraphs) > 1 and paragraphs[1][0] not in "#|`-!<", (
        f"{page.name}: the title should be followed by a sentence saying what the page covers")


@pytest.mark.parametrize("doc", documents(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_relative_links_and_anchors_resolve(doc):
    broken = []
    for target in links(doc):
        path, anchor = resolve(doc, target)
        if not path.exists():
            if not (written_by_a_benchmark(path) and not anchor):
                broken.append(f"{target}: no such file")
        elif not path.is_relative_to(REPO):
            broken.append(f"{target}: outside the repository")
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(f"{target}: no heading '#{anchor}' in {path.relative_to(REPO).as_posix()}")
    assert not broken, f"{doc.relative_to(REPO).as_posix()}: broken links: {broken}"


def test_link_checker_sees_what_it_should(tmp_path):
    """The checker itself: GitHub's slugs, links in code ignored, images and wrapped links found."""
    assert slug("ZeRO and FSDP: memory per worker") == "zero-and-fsdp-memory-per-worker"
    assert slug("Measured: `benchmarks/tensor_parallel.py`") == "measured-benchmarkstensor_parallelpy"
    assert slug("Checkpoints, failures and resuming") == "checkpoints-failures-and-resuming"
    page = tmp_path / "p.md"
    page.write_text("# A\n\n## A\n\nsee [how it is\ncounted](x.md#how) and ![fig](f.png \"t\")\n\n"
                    "`[not](code.md)`\n\n```\n[nor](fenced.md)\n# not a heading\n```\n[web](https://x.org/a.md)\n")
    assert links(page) == ["x.md#how", "f.png"]
    assert anchors(page) == {"a", "a-1"}


def test_the_readme_shows_each_benchmarks_verdict():
    """Each block of the README's Targets holds the one line its benchmark wrote: the page it measured
    and whether the target was met (benchmarks/common.py's write_page writes it; empty means the
    benchmark has not run since the block was added)."""
    text = README.read_text(encoding="utf-8")
    blocks = re.findall(r"<!-- target ([\w-]+) -->\n(.*?)<!-- /target -->", text, re.S)
    assert {name for name, _ in blocks} >= {"overhead", "goodput-search"}, blocks
    for name, body in blocks:
        assert re.fullmatch(rf"- \[[^\]]+\]\(docs/{name}\.md\): .*\*\*(met|NOT met)\*\*.*\n", body), (name, body)

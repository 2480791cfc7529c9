"""The manual (README.md and docs/ outside docs/records/) carries no provenance: no commit stamps
("commit 1a2b3c4", or a bare short hash in running text) and no "issue N" references. Where a
number was measured (machine, commit, command) is a dated record under docs/records/."""
import pathlib
import re

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
COMMIT_STAMP = re.compile(r"\bcommits?\b:?\s+`?[0-9a-f]{7,40}\b", re.I)
# 7-40 hex digits with a digit and a letter among them: a commit hash (a digest prefix is written
# in a code span, `896eb6cc…`, which the check leaves out with every code span and block).
BARE_HASH = re.compile(r"(?<![\w/.#-])(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,40}(?![\w/…-])")
ISSUE_REF = re.compile(r"\bissues?[\s-]+#?\d+", re.I)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def manual_files() -> list[pathlib.Path]:
    """README.md and every markdown file of docs/ but the records."""
    docs = [p for p in sorted((REPO / "docs").rglob("*.md")) if "records" not in p.relative_to(REPO / "docs").parts]
    return [REPO / "README.md", *docs]


def provenance(text: str) -> list[str]:
    """Each commit stamp, bare hash and issue reference of a markdown text, with its line number."""
    found, stamped = [], []
    prose = CODE.sub(lambda m: re.sub(r"[^\n]", " ", m.group()), text)  # same line numbers
    for pattern, source in ((COMMIT_STAMP, text), (ISSUE_REF, text), (BARE_HASH, prose)):
        for m in pattern.finditer(source):
            if pattern is COMMIT_STAMP:
                stamped.append(range(m.start(), m.end()))
            elif pattern is BARE_HASH and any(m.start() in span for span in stamped):
                continue  # the hash of a commit stamp found above
            found.append(f"line {source.count(chr(10), 0, m.start()) + 1}: {m.group()!r}")
    return found


def test_the_manual_carries_no_commit_stamps_or_issue_numbers():
    problems = {str(p.relative_to(REPO)): found for p in manual_files() if (found := provenance(p.read_text()))}
    assert not problems, f"move provenance to a dated record under docs/records/: {problems}"


@pytest.mark.parametrize("text, n", [("measured at commit 49a58f9 on the VM", 1), ("commits fc772a2 (runs)", 1),
                                     ("run again at e5e51b1 (after 6f3290c)", 2), ("see issue 31 item 4", 1),
                                     ("Issue-16 code", 1), ("the digest `896eb6cc…`", 0), ("digest 0ec545b8…", 0),
                                     ("1000000 steps, 2026-12-05, deadbeef", 0), ("ab23604", 1),
                                     ("```\ngit checkout 1a2b3c4d\n```", 0), ("see docs/records/x.md#a1b2c3d", 0)])
def test_provenance_finds_stamps_hashes_and_issues(text, n):
    assert len(provenance(text)) == n, provenance(text)


def test_every_record_is_dated_and_the_index_links_it():
    records = REPO / "docs" / "records"
    index = (records / "README.md").read_text()
    for p in sorted(records.glob("*.md")):
        if p.name in ("README.md", "benchmarks.md", "results.md"):  # the index, and two logs of many campaigns
            continue
        assert re.match(r"\d{4}-\d{2}-\d{2}-[a-z0-9-]+\.md$", p.name), f"{p.name}: name it YYYY-MM-DD-<campaign>.md"
        assert f"({p.name})" in index, f"docs/records/README.md does not link {p.name}"


LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_every_relative_link_of_the_docs_resolves():
    """Links between pages (and to repository files) survive moves: each relative link of README.md
    and docs/ (records included) names an existing file or folder."""
    broken = []
    for page in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:
        prose = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in LINK.findall(prose):
            path = target.split("#")[0]
            if not path or re.match(r"[a-z]+:", path):  # an anchor on the page, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, broken

"""The docs stay true to the code: the generated configuration page is current, and every relative link in README.md
and docs/*.md resolves to a file and, with a #anchor, to a heading of that file."""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import gen_config_docs  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks, with inline code spans blanked out."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", "``", line))
    return out


def slug(heading: str) -> str:
    """GitHub's heading anchor: lowercase, punctuation other than - and _ dropped, each space a -."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip())  # code spans keep their text
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links keep their text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page, duplicates numbered -1, -2, ... as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(pages: list[Path]) -> list[str]:
    """`page: target (why)` for each relative link that points at no file or no heading."""
    bad = []
    for page in pages:
        for line in prose_lines(page.read_text()):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http(s), mailto, ...
                    continue
                path, _, anchor = target.partition("#")
                dest = (page.parent / path).resolve() if path else page
                if not dest.exists():
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
                elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                    bad.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {dest.name})")
    return bad


def test_configuration_page_is_generated_from_the_config():
    """docs/configuration.md equals what scripts/gen_config_docs.py writes from sage_grpo/config.py.

    Seen failing when the help text of `--eta` was changed in sage_grpo/config.py, and when the default of
    `--clip_range` was changed, without re-running the script; `gen_config_docs.py --check` then exits 1."""
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == gen_config_docs.render(), (
        "docs/configuration.md is out of date with sage_grpo/config.py: run python scripts/gen_config_docs.py")


def test_check_mode_exits_1_on_a_stale_page(tmp_path, capsys):
    """--check is 0 on the generated page and 1, with the command to run, on a stale one."""
    page = tmp_path / "configuration.md"
    page.write_text(gen_config_docs.render())
    assert gen_config_docs.main(["--check", "--out", str(page)]) == 0
    page.write_text(gen_config_docs.render().replace("| `--eta` |", "| `--etaa` |"))
    assert gen_config_docs.main(["--check", "--out", str(page)]) == 1
    assert "run python scripts/gen_config_docs.py" in capsys.readouterr().out


def test_generated_cells_escape_pipes_and_html():
    """A `|` in a help text would split the table row; `<name>` outside code would vanish as an HTML tag."""
    assert gen_config_docs._cell("KL(p || q) of val/<name> and `a|b <c>`") == (
        "KL(p \\|\\| q) of val/&lt;name&gt; and `a\\|b <c>`")


def test_slugs_follow_githubs_rules():
    assert slug("The demo's training: world_size inside a calibrated trust region") == (
        "the-demos-training-world_size-inside-a-calibrated-trust-region")
    assert slug("Evaluation table (Table 2): `scripts/score_videos.py`") == (
        "evaluation-table-table-2-scriptsscore_videospy")
    assert anchors("# A\n## A\n```\n# A\n```\n### A") == {"a", "a-1", "a-2"}


def test_every_relative_link_resolves():
    """Every relative link (and image) in README.md and docs/*.md names an existing file, and a #anchor names a
    heading of the target page. Links inside fenced code blocks and http(s) links are ignored.

    Seen failing when a link was changed to docs/scalingg.md (no such file) and to
    docs/scaling.md#multi-node-launch (no such heading)."""
    assert len(PAGES) > 5
    assert broken_links(PAGES) == []


def test_the_link_check_finds_what_it_should(tmp_path, monkeypatch):
    """The checker itself: a missing file, a missing anchor and a good anchor; code blocks are skipped."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "b.md").write_text("# Title\n## Two words: here\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#two-words-here) [self](#top) [gone](c.md) [bad](b.md#nope)\n# Top\n"
                    "```\n[in code](missing.md)\n```\n`[inline](missing.md)` [web](https://x.y/z.md)\n")
    assert broken_links([page]) == ["a.md: c.md (no such file)", "a.md: b.md#nope (no heading #nope in b.md)"]


def test_the_readme_is_a_front_page():
    """README.md stays a front page (at most 250 lines); the measurements live in docs/. Seen failing at 361 lines,
    with the demo's numbers and the world model's tables on it."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, len(lines)


def status_cells(text: str) -> list[str]:
    """The cells of the README's status table, links rendered as their text."""
    table = text[text.index("## Status: what ran where"):text.index("## Measured on a GPU")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("|---")]
    return [re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", cell).strip() for row in rows
            for cell in row.strip("| ").split(" | ")]


def denials_of_a_gpu_run(text: str) -> list[str]:
    """Sentences that say nothing ran on a GPU ("no run ... on a GPU", "none of ... on a GPU")."""
    sentences = re.split(r"(?<=[.;:])\s", re.sub(r"\s+", " ", text))
    return [s for s in sentences if re.search(r"\b(no run|none|nothing)\b", s, re.I) and re.search(r"\bon a GPU\b", s)]


def test_the_front_page_says_once_what_ran_on_a_gpu():
    """README.md says in one sentence what ran where and keeps each status cell to a line (details live in docs/).
    Seen failing when the opening and the quick start said that nothing had run on a GPU while the GPU block showed
    the H200 run, and when the world model's status cell ran to ten lines."""
    text = (ROOT / "README.md").read_text()
    block = text[text.index("<!-- gpu_check:begin -->"):text.index("<!-- gpu_check:end -->")]
    if "GPU: " in block:  # a measured GPU block
        assert denials_of_a_gpu_run(text) == []
    long = [cell for cell in status_cells(text) if len(cell) > 100]
    assert long == [], long


def test_the_front_page_checks_find_what_they_should():
    assert denials_of_a_gpu_run("Fine. No run with the real weights or on a GPU has happened yet. Not yet timed on a "
                                "GPU.") == ["No run with the real weights or on a GPU has happened yet."]
    text = ("## Status: what ran where\n| part | CPU |\n|---|---|\n| [a](b.md) | " + "x" * 101 + " |\n"
            "## Measured on a GPU\n")
    assert status_cells(text) == ["part", "CPU", "a", "x" * 101]


# Words about how the project was made, not about the product; absolute paths of one machine.
INTERNAL = re.compile(r"this stop|the issue|issue's|(?<!torchrun )\bagents\b|\bsessions?\b|last digit|of this project|"
                      r"/work/|/home/|/root/", re.I)


def test_the_docs_speak_of_the_product_only():
    """README.md and docs/*.md say nothing about how the project was made (no "this stop", "the issue", "agents",
    "session", "to the last digit", "the machine of this project") and name no absolute path of one machine; test
    names and test files appear only in docs/development.md, the page of which test guards what. Seen failing on
    docs/world_model.md's "other agents' test runs" and "/work/scratch/...", and on docs/rewards.md's test file."""
    bad = []
    for page in PAGES:
        text = re.sub(r"\s+", " ", page.read_text())  # a phrase may wrap over two lines
        found = list(INTERNAL.finditer(text))
        if page.name != "development.md":
            found += re.finditer(r"\btests?/\w+|\btest_\w+", text)
        bad += [f"{page.relative_to(ROOT)}: ...{text[max(m.start() - 30, 0):m.end() + 10]}..." for m in found]
    assert bad == [], "\n".join(bad)

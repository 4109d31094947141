"""The docs cannot drift: generated pages are current, every option is documented, every link lands.

- docs/benchmarks.md and the README's demo table are what scripts/gen_benchmarks.py writes from
  bench/results/*.json (the command a maintainer types after a bench: ``python scripts/gen_benchmarks.py``);
- every option of every ``shardtune`` command (walked from the real argparse parser) appears as
  ``--flag`` in a code span of README.md or docs/*.md;
- every relative link between those pages points at a file that exists, and at a heading that exists
  when it has a #anchor;
- the README stays a front door: short, and without measurements typed into its body.

Each check is also run on a small broken input, so that it is seen to fail.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GENERATOR = ROOT / "scripts" / "gen_benchmarks.py"
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.S | re.M)
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def doc_pages(root: Path = ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


# ---- generated pages -----------------------------------------------------------------------------

def generator(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(GENERATOR), *args], capture_output=True, text=True, timeout=120)


def test_benchmarks_page_and_demo_table_are_current():
    done = generator("--check")
    assert done.returncode == 0, done.stderr + "\nrun: python scripts/gen_benchmarks.py"


def test_check_fails_when_a_result_changes(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(ROOT / "bench" / "results", results)
    speed = results / "speed-80m.json"
    data = json.loads(speed.read_text())
    data["jobs"][0]["tokens_per_second"] += 1.0
    speed.write_text(json.dumps(data))
    done = generator("--check", "--results", str(results))
    assert done.returncode == 1
    assert "benchmarks.md is stale" in done.stderr

    demo = results / "demo-zarnovia-bf16.json"  # the README's table comes from these
    shutil.copy(ROOT / "bench" / "results" / "speed-80m.json", speed)
    data = json.loads(demo.read_text())
    data["after"]["contains_match"] = 0.5
    demo.write_text(json.dumps(data))
    done = generator("--check", "--results", str(results))
    assert done.returncode == 1 and "README.md is stale" in done.stderr


def test_every_table_says_machine_dtype_and_command(tmp_path):
    results = tmp_path / "results"
    results.mkdir()
    old = json.loads((ROOT / "bench" / "results" / "speed-80m.json").read_text())
    new = dict(old, machine={"cpu": "Test CPU 9000", "cores": 16, "isa": ["avx2"], "gpus": [], "torch": "2.13.0"},
               command="python bench/speed.py --size 80m --jobs small", commit="abc1234", date="2026-12-01")
    (results / "speed-old.json").write_text(json.dumps(old))
    (results / "speed-new.json").write_text(json.dumps(new))
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    assert generator("--results", str(results), "--page", str(page), "--readme", str(readme)).returncode == 0
    text = page.read_text()
    sections = text.split("### ")[1:]
    assert len(sections) == 2
    for section in sections:
        for line in ("- machine: ", "- dtype: fp32", "- command: "):
            assert line in section, (line, section[:300])
    new_part, old_part = sections  # in file-name order
    assert "machine: not recorded" in old_part and "command: not recorded; from the file's fields: " \
        "`python bench/speed.py --size 80m --dtype fp32" in old_part
    assert "Test CPU 9000; 16 cores" in new_part and "`python bench/speed.py --size 80m --jobs small`" in new_part


# ---- every option documented ---------------------------------------------------------------------

def parser_options(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()) -> dict[str, str]:
    """Every long option of the parser and all its subparsers -> the command it belongs to. The
    ``--no-x`` half of an on/off option is left out: the docs state that rule once."""
    found: dict[str, str] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                for flag, where in parser_options(sub, (*path, name)).items():
                    found.setdefault(flag, where)
            continue
        negated = isinstance(action, argparse.BooleanOptionalAction)
        for flag in action.option_strings:
            if flag.startswith("--") and flag != "--help" and not (negated and flag.startswith("--no-")):
                found.setdefault(flag, " ".join(path) or "shardtune")
    return found


def code_text(markdown: str) -> str:
    """The text of every fenced block and inline code span: where a flag counts as mentioned."""
    blocks = FENCE.findall(markdown)
    return "\n".join([*blocks, *CODE_SPAN.findall(FENCE.sub("", markdown))])


def undocumented(options: dict[str, str], markdown: str) -> list[str]:
    code = code_text(markdown)
    return [f"{flag} ({where})" for flag, where in sorted(options.items())
            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", code)]


def all_docs_text() -> str:
    return "\n".join(p.read_text() for p in doc_pages())


def test_every_cli_option_is_in_the_docs():
    from shardtune.cli import build_parser

    options = parser_options(build_parser())
    assert {"--model", "--json", "--overwrite", "--answers", "--top-p", "--resume"} <= set(options)
    missing = undocumented(options, all_docs_text())
    assert not missing, "options not mentioned as `--flag` in README.md or docs/*.md: " + ", ".join(missing)
    assert "`--no-`" in all_docs_text(), "the rule for --no-X options is stated nowhere"


def test_an_undocumented_option_is_found():
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    p = sub.add_parser("finetune")
    p.add_argument("--lora-r")
    p.add_argument("--lora", action=argparse.BooleanOptionalAction)
    q = sub.add_parser("eval")
    q.add_argument("--answers", action="store_true")
    options = parser_options(parser)
    assert options == {"--lora-r": "finetune", "--lora": "finetune", "--answers": "eval"}
    text = "Use `--lora-r R` and `--lora`.\n\nThe --answers flag in prose is not a mention.\n"
    assert undocumented(options, text) == ["--answers (eval)"]
    assert undocumented(options, text + "```\nshardtune eval --answers\n```\n") == []
    # a longer flag does not count for a shorter one
    assert undocumented({"--lora": "finetune"}, "`--lora-r`") == ["--lora (finetune)"]


# ---- links ---------------------------------------------------------------------------------------

def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading: its text
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", markdown)):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(pages: list[Path]) -> list[str]:
    broken = []
    for page in pages:
        text = CODE_SPAN.sub("", FENCE.sub("", page.read_text()))
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest.read_text()):
                broken.append(f"{page.name}: {target} (no heading #{anchor} in {dest.name})")
    return broken


def test_links_between_pages_land():
    pages = doc_pages()
    assert len(pages) > 10
    assert not broken_links(pages)


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Page A\n\n## The `--flag`: on/off\n\n```\n# not a heading\n```\n")
    readme = tmp_path / "README.md"
    readme.write_text("[ok](docs/a.md) [ok](docs/a.md#the---flag-onoff) [web](https://example.com/x.md)\n"
                      "[gone](docs/b.md) [bad anchor](docs/a.md#not-a-heading) `[in code](docs/c.md)`\n")
    assert broken_links([readme]) == ["README.md: docs/b.md (no such file)",
                                      "README.md: docs/a.md#not-a-heading (no heading #not-a-heading in a.md)"]


# ---- the README is a front door ------------------------------------------------------------------

MEASUREMENT = re.compile(r"\d(?:[\d.,]*\d)?\s?(?:%|MB|GB|GiB|MiB|KiB|tokens/s|s\b|min\b|×)")


def measurements_in_body(readme: str) -> list[str]:
    """Numbers with a unit in the README, outside fenced blocks and the generated demo table."""
    body = re.sub(r"<!-- BEGIN demo results.*?<!-- END demo results -->", "", readme, flags=re.S)
    return MEASUREMENT.findall(FENCE.sub("", body))


def test_readme_is_short_and_holds_no_typed_measurements():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250
    assert measurements_in_body(readme) == [], "measurements belong in bench/results and docs/benchmarks.md"
    assert measurements_in_body("the fine-tune took 174 s at 204 tokens/s, 0% → 83%") == ["174 s", "204 tokens/s",
                                                                                         "0%", "83%"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))

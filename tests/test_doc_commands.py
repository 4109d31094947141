"""Every ``shardtune`` command the docs show in a code block still works as shown.

- every one parses with the real command-line parser (a renamed flag or command breaks it here);
- every ``shardtune plan`` command runs, and every ``shardtune finetune`` command whose files are in
  the repository is checked and planned up to the start of its workers, in a folder holding the
  repository's ``examples/`` and a stand-in for the demo's model (``models/smollm2-135m``: a tiny
  random Llama, tests/tiny.py), since downloading it is not the suite's business (the Llama-3-70B
  commands plan from the repository's own ``examples/llama3-70b/config.json``, as documented);
- a command in a synopsis (``DIR``, ``[the flags of finetune]``) is a pattern, not a command; an
  optional ``[--flag VALUE]`` is taken as given.

Each check also runs on a small broken page, so that it is seen to fail.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from shardtune import cli

from tiny import make_model

ROOT = Path(__file__).resolve().parent.parent


def doc_commands(pages: list[Path]) -> list[tuple[str, str]]:
    """(page, command) for each ``shardtune …`` line in a fenced code block, continuation lines joined."""
    found = []
    for page in pages:
        inside, block = False, []
        for line in page.read_text().splitlines():
            if line.lstrip().startswith("```"):
                if inside:
                    text = "\n".join(block).replace("\\\n", " ")
                    found += [(page.name, c.strip()) for c in text.splitlines() if c.strip().startswith("shardtune ")]
                inside, block = not inside, []
            elif inside:
                block.append(line)
    return found


def argv_of(command: str) -> list[str] | None:
    """The arguments of a documented command; None for a synopsis (placeholders, not values)."""
    if re.search(r"\[(?!--)", command) or re.search(r"\b[A-Z]{3,}\b", command):
        return None
    return shlex.split(command.replace("[", " ").replace("]", " "))[1:]


COMMANDS = [(page, command) for page, command in doc_commands([ROOT / "README.md", *sorted(ROOT.glob("docs/*.md"))])
            if argv_of(command) is not None]


def test_the_docs_show_commands_and_plan_ones_among_them():
    assert len(COMMANDS) >= 10
    assert {argv_of(c)[0] for _, c in COMMANDS} >= {"finetune", "plan", "export", "eval"}


@pytest.mark.parametrize("page,command", COMMANDS, ids=[f"{p}:{c[10:40]}" for p, c in COMMANDS])
def test_every_documented_command_parses(page, command):
    try:
        cli.build_parser().parse_args(argv_of(command))
    except SystemExit as stop:
        pytest.fail(f"{page}: `{command}` is refused by the parser (exit {stop.code})")


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory) -> Path:
    """A working folder with the repository's examples and a stand-in for the demo's model."""
    root = tmp_path_factory.mktemp("docs-cwd")
    (root / "examples").symlink_to(ROOT / "examples", target_is_directory=True)
    make_model(root / "models" / "smollm2-135m", "llama", tied=True)  # SmolLM2 ties its embeddings too
    return root


def _runnable(argv: list[str], cwd: Path) -> bool:
    """The command's input files are in the sandbox (a finetune on pairs.jsonl of one's own is not)."""
    paths = [v for flag, v in zip(argv, argv[1:]) if flag in ("--model", "--data", "--val-data", "--config")]
    return all((cwd / p).exists() for p in paths)


RUN = [(p, c) for p, c in COMMANDS if argv_of(c)[0] in ("plan", "finetune")]


@pytest.mark.parametrize("page,command", RUN, ids=[f"{p}:{c[10:40]}" for p, c in RUN])
def test_documented_plan_and_finetune_commands_run(page, command, sandbox, monkeypatch, capsys):
    import shardtune.launch

    argv = argv_of(command)
    if argv[0] == "finetune" and not _runnable(argv, sandbox):
        pytest.skip(f"{page}: its input files are the reader's own ({command})")
    assert argv[0] == "finetune" or _runnable(argv, sandbox), f"{page}: `{command}` names a file the repo lacks"
    launched = []

    def launch(cfg, plan, asked=None):  # preflight passed: the workers would start now
        launched.append(plan)
        return {}

    monkeypatch.setattr(shardtune.launch, "launch", launch)
    monkeypatch.chdir(sandbox)
    code = cli.main(argv)
    err = capsys.readouterr().err
    assert code == 0, f"{page}: `{command}` ended with exit {code}:\n{err[-2000:]}"
    assert argv[0] == "plan" or len(launched) == 1


def test_a_broken_documented_command_is_found(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n\n```bash\nshardtune plan --model m \\\n  --nproc 2 --no-such-flag 3\n```\n\n"
                    "```\nshardtune plan --model DIR [the flags of finetune]\n```\n")
    (found,) = [argv_of(c) for _, c in doc_commands([page]) if argv_of(c) is not None]
    assert found == ["plan", "--model", "m", "--nproc", "2", "--no-such-flag", "3"]
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(found)

"""Reward functions: loaded from files, modules and built-in names; called as TRL calls them; their failures named.

What a user relies on: a function written for TRL's GRPOTrainer works unchanged; a spec that does not load is
refused at once, naming the file, module or name; a function that raises or answers wrongly stops the run
(a ShardtuneError, exit 2) naming the function and the prompt at fault; None means "not applicable".
"""

from __future__ import annotations

import math
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from shardtune.errors import ShardtuneError
from shardtune.train.rewards import (
    BUILTINS,
    RewardError,
    RewardFunction,
    RewardLog,
    completions_for,
    load_rewards,
    score,
    weights_of,
)

PROMPTS = ["What is 2+2?", "What is 3+3?", "Name a colour."]
COMPLETIONS = ["4", "The answer is 6.", "<think>hmm</think>blue"]
IDS = [[52], [84, 104, 101, 32, 97, 110, 115], [60, 116, 104, 105, 110, 107, 62, 98]]
FIELDS = {"answer": ["4", "6", "red"], "topic": ["math", "math", "art"]}


def write(path: Path, text: str) -> Path:
    path.write_text(textwrap.dedent(text))
    return path


def scores(specs: list[str], completions=COMPLETIONS, prompts=PROMPTS, ids=IDS, fields=FIELDS, **kw) -> list[list]:
    out = score(load_rewards(specs), prompts, completions, ids, fields, **kw)
    return [[None if math.isnan(v) else v for v in row] for row in out.tolist()]


def test_builtins_score_as_documented():
    got = scores(["exact_match", "contains", "format=^<think>.*</think>", "length=4", "contains=topic"])
    assert got == [[1.0, 1.0, 0.0, 0.0, 0.0],
                   [0.0, 1.0, 0.0, -0.75, 0.0],
                   [0.0, 0.0, 1.0, -1.0, 0.0]]
    # a number inside a longer one is not a match, a word at a sentence's end is
    assert scores(["contains"], ["14 or 1.4", "66", "red."])[:3] == [[0.0], [0.0], [1.0]]
    assert set(BUILTINS) == {"exact_match", "contains", "format", "length"}


def test_conversational_completions_reach_the_functions_as_message_lists(tmp_path):
    """As TRL: for message-list prompts each completion is [{"role": "assistant", "content": ...}]; TRL's own
    think_format_reward (module:name) and the built-ins read them unchanged."""
    prompts = [[{"role": "user", "content": p}] for p in PROMPTS]
    completions = completions_for(prompts, COMPLETIONS)
    assert completions[0] == [{"role": "assistant", "content": "4"}] and completions_for(PROMPTS, ["a"]) == ["a"]
    got = scores(["trl.rewards:think_format_reward", "exact_match"], completions, prompts)
    assert got == [[0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]


def test_a_trl_style_function_from_a_file_gets_prompts_completions_ids_and_fields(tmp_path):
    path = write(tmp_path / "my_rewards.py", """
        import math
        def graded(prompts, completions, completion_ids, answer, topic, trainer_state, log_metric, **kwargs):
            log_metric("seen", len(prompts))
            return [None if t == "art" else float(a in c) + trainer_state.global_step
                    for c, a, t in zip(completions, answer, topic)]
        def length_only(completions, **kwargs):
            return [len(c) for c in completions]
    """)
    log = RewardLog()
    got = scores([f"{path}:graded", f"{path}:length_only"], step=10, log=log)
    assert got == [[11.0, 1.0], [11.0, 16.0], [None, 22.0]]
    assert dict(log.metrics) == {"seen": [3.0]}
    functions = load_rewards([f"{path}:graded", "exact_match", "exact_match=topic"], [1.0, 0.5, 2])
    assert [f.name for f in functions] == ["graded", "exact_match", "exact_match_2"]  # apart in the metrics
    assert weights_of(functions).tolist() == [1.0, 0.5, 2.0]


def test_answers_in_any_numeric_form_are_read_and_none_is_nan():
    def mixed(prompts, completions, **kwargs):
        return [True, np.float32(0.5), None]

    def as_tensor(prompts, completions, **kwargs):
        return torch.tensor([1, 2, 3])

    async def slow(prompts, completions, **kwargs):
        return np.array([0.25, 0.5, 0.75])

    out = score([RewardFunction("mixed", mixed), RewardFunction("t", as_tensor), RewardFunction("a", slow)],
                PROMPTS, COMPLETIONS, IDS)
    assert out[:, 0].tolist()[:2] == [1.0, 0.5] and math.isnan(out[2, 0])
    assert out[:, 1].tolist() == [1.0, 2.0, 3.0]
    assert out[:, 2].tolist() == [0.25, 0.5, 0.75]


@pytest.mark.parametrize("body,expected", [
    ("return [1.0, 2.0]", r"'bad' \(--reward .*:bad\) returned 2 rewards for 3 completions"),
    ("return 1.0", "returned a float, not a list of one reward per completion"),
    ("return [1.0, 'six', 0.0]", r"returned str 'six' as the reward of completion #1, not a number or None\n"
                                 r"  on prompt #1: 'What is 3\+3\?'"),
    ("return [1.0, 0.0, float('nan')]", r"returned nan .*return None for a completion the function does not apply"),
    ("return [float('inf')] * 3", r"returned inf"),
    ("return [[1.0]] * 3", r"returned list \[1.0\] as the reward of completion #0"),
    # finite in Python, beyond float32 (rewards are float32, as in TRL): refused, not a crash in the tensor
    ("return [0.0, -1e39, 0.0]", r"returned -1e\+39 \(beyond float32's range, ±3.403e\+38\) as the reward of "
                                 r"completion #1"),
    ("return [10 ** 400] * 3", r"returned 1000.* \(beyond a float's range\) as the reward of completion #0"),
])
def test_a_wrong_answer_stops_the_run_naming_the_function_and_prompt(tmp_path, body, expected):
    path = write(tmp_path / "r.py", f"def bad(prompts, completions, **kwargs):\n    {body}\n")
    with pytest.raises(RewardError, match=expected) as err:
        scores([f"{path}:bad"])
    assert isinstance(err.value, ShardtuneError) and err.value.exit_code == 2


def test_a_function_that_raises_is_named_with_the_prompt_it_fails_on(tmp_path):
    path = write(tmp_path / "r.py", """
        def fragile(prompts, completions, answer, **kwargs):
            return [float(int(c) == int(a)) for c, a in zip(completions, answer)]
    """)
    with pytest.raises(RewardError) as err:
        scores([f"{path}:fragile"], sources=["train.jsonl record 7", "train.jsonl record 8", "train.jsonl record 9"])
    message = str(err.value)
    assert "reward function 'fragile'" in message and f"{path}:3: ValueError: invalid literal" in message
    assert "on train.jsonl record 8: 'What is 3+3?'" in message  # found by scoring one completion at a time


def test_a_function_that_cannot_take_trls_arguments_is_named_with_them(tmp_path):
    path = write(tmp_path / "r.py", """
        def narrow(completions):
            return [0.0] * len(completions)
    """)
    with pytest.raises(RewardError) as err:
        scores([f"{path}:narrow"])
    message = str(err.value)
    assert "reward function 'narrow'" in message and "got an unexpected keyword argument 'prompts'" in message
    assert "def narrow(prompts, completions, **kwargs)" in message
    assert "(keyword arguments: answer, completion_ids, completions, log_extra" in message
    assert "rewards.py" not in message


def test_a_function_that_calls_sys_exit_is_named_instead_of_ending_the_process(tmp_path):
    path = write(tmp_path / "r.py", """
        import sys
        def quits(prompts, completions, **kwargs):
            sys.exit(0)
    """)
    with pytest.raises(RewardError) as err:
        scores([f"{path}:quits"])
    assert "reward function 'quits'" in str(err.value) and "SystemExit: 0" in str(err.value)
    assert "on prompt #0: 'What is 2+2?'" in str(err.value)


def test_a_missing_record_field_is_named():
    with pytest.raises(RewardError, match=r"exact_match=solution: the records have no field 'solution' "
                                          r"\(they have: answer, topic\)"):
        scores(["exact_match=solution"])
    with pytest.raises(RewardError, match="field named 'completion_ids'"):
        scores(["exact_match"], fields={"answer": ["4"] * 3, "completion_ids": [1, 2, 3]})


def test_specs_that_do_not_load_are_refused_naming_them(tmp_path, monkeypatch):
    good = write(tmp_path / "good.py", "def ok(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n"
                                       "LIMIT = 3\n")
    write(tmp_path / "broken.py", "def f(:\n    pass\n")
    write(tmp_path / "failing.py", "import math\nx = 1 / 0\n")
    write(tmp_path / "needs.py", "import not_a_real_package_xyz\n")
    write(tmp_path / "exits.py", "import sys\nsys.exit(0)\n")  # exit 0, or its own code, with no word: no
    write(tmp_path / "exits_mod.py", "import sys\nsys.exit(4)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cases = {
        f"{tmp_path}/nope.py:f": f"reward file \\(--reward .*\\) {tmp_path}/nope.py does not exist",
        f"{good}:missing": r"good.py has no 'missing' \(its functions: ok\)",
        f"{good}:LIMIT": "good.py:LIMIT is a int, not a function",
        f"{tmp_path}/broken.py:f": r"broken.py:1: syntax error",
        f"{tmp_path}/failing.py:f": r"running .*failing.py failed: .*failing.py:2: ZeroDivisionError",
        f"{tmp_path}/exits.py:f": r"running .*exits.py failed: .*exits.py:2: SystemExit: 0",
        "exits_mod:f": r"importing exits_mod failed: .*exits_mod.py:2: SystemExit: 4",
        "needs:f": "importing 'needs' needs the module 'not_a_real_package_xyz', which is not installed$",
        "no_such_module_abc:f": "no module named 'no_such_module_abc' on the Python path",
        "good:ok(": "'ok\\(' is not a Python name",
        "exact_match:answer": "the built-in exact_match takes its argument after '=': exact_match=answer",
        "exact:answer": r"no module named 'exact' .*, or the built-in exact_match=\.\.\.\)",
        "reward_of_mine": "not a reward; give path/to/file.py:name, module:name or a built-in",
        "format": "the built-in format needs an argument: format=VALUE",
        "format=(unclosed": "format=\\(unclosed: not a valid regular expression",
        "length=zero": "length=zero: give the number of completion tokens",
    }
    for spec, expected in cases.items():
        with pytest.raises(RewardError, match=expected):
            load_rewards([spec])
    assert load_rewards(["good:ok"])[0].name == "ok"
    with pytest.raises(RewardError, match="--reward-weights has 1 weights for 2 --reward functions"):
        load_rewards(["exact_match", "contains"], [1.0])
    with pytest.raises(RewardError, match="--reward-weights: nan is not a finite number"):
        load_rewards(["exact_match"], [float("nan")])
    with pytest.raises(RewardError, match="needs at least one --reward"):
        load_rewards([])


def test_a_file_loads_once_under_one_name_in_every_process(tmp_path):
    """Workers load the same file again: the module gets the same name everywhere (pickle finds it)."""
    path = write(tmp_path / "r.py", "calls = []\ndef f(prompts, completions, **kw):\n    return [0.0] * len(prompts)\n")
    a, b = load_rewards([f"{path}:f"])[0].fn, load_rewards([f"{path}:f"])[0].fn
    assert a is b and a.__module__.startswith("shardtune_reward_")


def test_the_demo_rewards_grade_the_sum_and_the_bare_number_format():
    """examples/grpo_rewards.py (the GRPO demo's): the last number of the answer must be the sum, so a model
    restating the sum is right and one that stops mid-sentence is not; number_only wants the number alone."""
    demo = Path(__file__).resolve().parents[1] / "examples" / "grpo_rewards.py"
    prompts = [[{"role": "user", "content": "What is 18 + 46? Answer with the number only."}]] * 5
    texts = ["64", "18 + 46 = 64", "18 + 46 = 63", "To solve this, we need to add 18 and 46,", "64."]
    got = scores([f"{demo}:correct_answer", f"{demo}:number_only"], completions_for(prompts, texts), prompts,
                 [[1]] * 5, {"answer": ["64"] * 5})
    assert got == [[1.0, 1.0], [1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]


def test_worker_path_names_the_folder_of_a_module_found_through_sys_path_only(tmp_path, monkeypatch):
    """A notebook's ``sys.path.append("src")`` does not reach the fresh workers: the folder a ``module:name`` spec's
    package is found in through it is named for their PYTHONPATH, imported or not yet; an installed package's,
    a file's function's and a built-in's are not, nor one the workers find by themselves."""
    import importlib
    import sys

    from shardtune.train.rewards import worker_path

    (tmp_path / "src" / "nb_only_pkg").mkdir(parents=True)
    write(tmp_path / "src" / "nb_only_pkg" / "__init__.py", "")
    write(tmp_path / "src" / "nb_only_pkg" / "scores.py", """
        def score(prompts, completions, **fields):
            return [1.0] * len(completions)
    """)
    write(tmp_path / "src" / "nb_only_module.py", "def score(prompts, completions, **fields):\n    return [1.0]\n")
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.delitem(sys.modules, "nb_only_pkg", raising=False)
    monkeypatch.chdir(tmp_path)  # the working directory is on a worker's path: src/ is not
    others = ["format=x:y", "exact_match", "shardtune.train.rewards:completion_text",
              f"{tmp_path / 'src' / 'nb_only_module.py'}:score"]
    assert worker_path(["nb_only_pkg.scores:score", *others]) == [str(tmp_path / "src")]  # not imported yet
    assert worker_path(["nb_only_module:score"]) == [str(tmp_path / "src")]
    importlib.import_module("nb_only_pkg.scores")
    assert worker_path(["nb_only_pkg.scores:score"]) == [str(tmp_path / "src")]
    assert worker_path(others) == []
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "src"))  # found by the workers themselves
    assert worker_path(["nb_only_pkg.scores:score", "nb_only_module:score"]) == []
    monkeypatch.delitem(sys.modules, "nb_only_pkg.scores")
    monkeypatch.delitem(sys.modules, "nb_only_pkg")


def test_what_functions_log_is_merged_as_trl_merges_it_and_a_bad_value_is_blamed_on_its_line(tmp_path):
    """log_metric's values: the mean of every rank's; log_extra's columns: every rank's rows in order (None where a
    rank gave none or the wrong count). A non-number given to log_metric names the user's line, not ours."""
    ranks = [RewardLog(), RewardLog()]
    ranks[0].metrics["m"] += [1.0, 2.0]
    ranks[1].metrics["m"] += [6.0]
    ranks[0].extra["c"] += ["a", "b"]
    ranks[1].extra["c"] += ["only one"]  # of 2 rows
    assert RewardLog.merged(ranks, [2, 2]) == ({"m": 3.0}, {"c": ["a", "b", None, None]})
    path = write(tmp_path / "logs.py", """
        def f(prompts, completions, log_metric, **kwargs):
            log_metric("m", "abc")
            return [0.0] * len(prompts)
    """)
    with pytest.raises(RewardError, match=r"logs.py:3: TypeError: log_metric\('m', \.\.\.\): 'abc' is not a number"):
        scores([f"{path}:f"])


def test_a_module_of_the_working_directory_is_found_as_the_workers_find_it(tmp_path, monkeypatch):
    """`shardtune` (a console script) has its own folder on sys.path, not the working directory, where the
    workers (``python -m``) find a package: ``mypkg.rew:ok`` from there loads, not 'mypkg is not installed'."""
    import sys

    (tmp_path / "mypkg").mkdir()
    write(tmp_path / "mypkg" / "__init__.py", "")
    write(tmp_path / "mypkg" / "rew.py", "def ok(prompts, completions, **kw):\n    return [1.0] * len(prompts)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    assert load_rewards(["mypkg.rew:ok"])[0].name == "ok"
    assert sys.path[-1] == str(tmp_path)  # after everything else: nothing installed is shadowed
    with pytest.raises(RewardError, match="no module named 'elsewhere' on the Python path"):
        load_rewards(["elsewhere:ok"])

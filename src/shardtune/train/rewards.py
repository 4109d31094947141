"""Reward functions for GRPO: loaded by name, called with TRL's convention, their answers checked.

A reward function is what TRL's ``GRPOTrainer`` takes, so users bring theirs unchanged::

    def my_reward(prompts, completions, completion_ids, **fields) -> list[float | None]

``prompts`` and ``completions`` hold one entry per completion (a prompt repeated once per completion of its
group); completions are strings, or for conversational prompts (message lists) one-message lists
``[{"role": "assistant", "content": text}]``. ``completion_ids`` are the completions' token ids. ``fields``
are the records' other fields, each a list aligned with the completions (e.g. ``answer``), plus TRL's
``trainer_state`` (``.global_step``), ``log_metric(name, value)`` and ``log_extra(column, values)``.
``None`` means "not applicable to this completion"; async functions are awaited.

``--reward SPEC`` names one function (the option repeats, ``--reward-weights`` weighs them):
  path/to/file.py:name   a function defined in a Python file (run in every process that scores)
  package.module:name    a function of an importable module
  exact_match[=FIELD]    built-in: 1 if the completion, stripped, equals the record's FIELD (default answer)
  contains[=FIELD]       built-in: 1 if FIELD's value occurs in the completion as a whole word or number
  format=REGEX           built-in: 1 if REGEX matches somewhere in the completion (re.search, DOTALL)
  length=TOKENS          built-in: -(tokens beyond TOKENS) / TOKENS, 0 up to TOKENS

Answers: one per completion; ``None``, ``int``, ``float``, numpy / torch scalars and ``bool`` (1.0 / 0.0, as
TRL reads them) are accepted. NaN and ±inf are refused (a NaN is usually a bug such as 0/0; ``None`` is the
way to say "not applicable"), as are values beyond float32's range (rewards are float32, as in TRL) and
anything else. A function that raises, answers with the wrong count or
with a refused value stops the run (RewardError, exit 2) naming the function and the prompt at fault; when
it raised on a batch, it is called again one completion at a time to find the prompt it fails on.
"""

from __future__ import annotations

import asyncio
import difflib
import functools
import hashlib
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import re
import subprocess
import sys
import traceback
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from shardtune.errors import ShardtuneError, check_path
from shardtune.train.data.prompts import RESERVED, reserved_field_refusal


class RewardError(ShardtuneError):
    """A reward function that cannot be loaded, or that failed or answered wrongly; names it and the prompt."""


@dataclass(frozen=True)
class RewardFunction:
    name: str  # as in metrics: rewards/<name>/mean
    fn: Callable[..., Any]
    weight: float = 1.0
    spec: str = ""  # what the user wrote


# ---------------------------------------------------------------------------------------------- built-ins


def completion_text(completion: str | list[dict]) -> str:
    """A completion's text: the string itself, or the content of its (last) assistant message."""
    if isinstance(completion, str):
        return completion
    content = completion[-1].get("content", "") if completion else ""
    if isinstance(content, list):  # content blocks
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


def _field_values(fields: dict, name: str, builtin: str, n: int) -> list:
    if name not in fields:
        have = sorted(k for k in fields if k not in RESERVED)
        raise RewardError(f"reward {builtin}={name}: the records have no field {name!r} "
                          f"(they have: {', '.join(have) or 'none but the prompt'})")
    return list(fields[name])[:n]


def _exact_match(field_name: str) -> Callable[..., list[float | None]]:
    def exact_match(prompts, completions, **fields):
        values = _field_values(fields, field_name, "exact_match", len(completions))
        return [None if v is None else float(completion_text(c).strip() == str(v).strip())
                for c, v in zip(completions, values)]
    return exact_match


def _contains(field_name: str) -> Callable[..., list[float | None]]:
    def contains(prompts, completions, **fields):
        values = _field_values(fields, field_name, "contains", len(completions))
        out: list[float | None] = []
        for c, v in zip(completions, values):
            if v is None or not str(v).strip():
                out.append(None)
                continue
            # Not inside a longer word or number: "12" is not in "123", "1.25" nor "-12"
            value = str(v).strip()
            before = r"(?<![\w.\-])" if value[0].isdigit() else r"(?<!\w)"
            pattern = rf"{before}{re.escape(value)}(?!\w|\.\d)"
            out.append(float(re.search(pattern, completion_text(c)) is not None))
        return out
    return contains


def _format(pattern: str) -> Callable[..., list[float]]:
    try:
        compiled = re.compile(pattern, re.DOTALL)
    except re.error as err:
        raise RewardError(f"reward format={pattern}: not a valid regular expression: {err}") from None

    def format(prompts, completions, **fields):  # noqa: A001 - the metric name users see
        return [float(compiled.search(completion_text(c)) is not None) for c in completions]
    return format


def _length(target: str) -> Callable[..., list[float]]:
    try:
        tokens = int(target)
    except ValueError:
        tokens = 0
    if tokens <= 0:
        raise RewardError(f"reward length={target}: give the number of completion tokens allowed "
                          f"without penalty, a positive integer (e.g. length=200)")

    def length(prompts, completions, completion_ids, **fields):
        return [-max(0, len(ids) - tokens) / tokens for ids in completion_ids]
    return length


#: short name -> (factory from its argument, the argument when none is given; None: one is required)
BUILTINS: dict[str, tuple[Callable[[str], Callable[..., Any]], str | None]] = {
    "exact_match": (_exact_match, "answer"),
    "contains": (_contains, "answer"),
    "format": (_format, None),
    "length": (_length, None),
}


# ---------------------------------------------------------------------------------------------- loading


def _load_file(path_text: str, attr: str, spec: str) -> Any:
    path = check_path(path_text, f"reward file (--reward {spec})", error=RewardError)
    if path.suffix != ".py":
        raise RewardError(f"--reward {spec}: {path} is not a Python file (.py)")
    # A stable name, the same in every process: pickle finds a function by its module's name
    module_name = "shardtune_reward_" + hashlib.sha1(str(path.resolve()).encode()).hexdigest()[:12]
    if module_name in sys.modules:
        module = sys.modules[module_name]
    else:
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        assert loader_spec is not None and loader_spec.loader is not None
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[module_name] = module  # dataclasses and pickling look their module up here
        try:
            loader_spec.loader.exec_module(module)
        except SyntaxError as err:
            del sys.modules[module_name]
            raise RewardError(f"--reward {spec}: {err.filename}:{err.lineno}: syntax error: {err.msg}") from None
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's file (sys.exit too): say where it failed
            del sys.modules[module_name]
            raise RewardError(f"--reward {spec}: running {path} failed: {_where(err, path)}") from None
    return _attribute(module, attr, spec, str(path))


def _load_module(module_name: str, attr: str, spec: str) -> Any:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        missing = err.name or module_name
        top, here = module_name.split(".")[0], Path.cwd()
        if missing == top and str(here) not in sys.path and ((here / top).is_dir() or (here / f"{top}.py").is_file()):
            # the workers start as `python -m`, which finds the working directory's modules; the `shardtune`
            # script's own path has its folder instead: the working directory, after everything else
            sys.path.append(str(here))
            return _load_module(module_name, attr, spec)
        close = difflib.get_close_matches(module_name, BUILTINS, n=1, cutoff=0.6)
        builtin = f", or the built-in {close[0]}=..." if close else ""
        hint = (f"no module named {module_name!r} on the Python path (a file is given as path/to/file.py:name"
                f"{builtin})" if missing == module_name else
                f"importing {module_name!r} needs the module {missing!r}, which is not installed")
        raise RewardError(f"--reward {spec}: {hint}") from None
    except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's module (sys.exit too): say where it failed
        raise RewardError(f"--reward {spec}: importing {module_name} failed: {_where(err, None)}") from None
    return _attribute(module, attr, spec, module_name)


def _attribute(module: Any, attr: str, spec: str, where: str) -> Any:
    if not attr or not attr.isidentifier():
        raise RewardError(f"--reward {spec}: {attr!r} is not a Python name; write {where}:FUNCTION_NAME")
    if not hasattr(module, attr):
        defined = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                         and getattr(v, "__module__", None) == module.__name__)
        raise RewardError(f"--reward {spec}: {where} has no {attr!r}"
                          + (f" (its functions: {', '.join(defined)})" if defined else ""))
    fn = getattr(module, attr)
    if not callable(fn):
        raise RewardError(f"--reward {spec}: {where}:{attr} is a {type(fn).__name__}, not a function")
    return fn


_PACKAGE = str(Path(__file__).resolve().parents[1])  # shardtune's own files


def _where(err: BaseException, path: Path | None) -> str:
    """``File:line: Type: message`` of the innermost frame in the user's code (else the innermost one)."""
    frames = traceback.extract_tb(err.__traceback__)
    # a check of ours the user's code called (log_metric's) is not where it went wrong
    mine = [f for f in frames if path is not None and Path(f.filename) == path] or \
        [f for f in frames if not f.filename.startswith(_PACKAGE)] or frames
    place = f"{mine[-1].filename}:{mine[-1].lineno}: " if mine else ""
    return f"{place}{type(err).__name__}: {err}"


def spec_of(reward: Any) -> Any:
    """``reward`` as ``--reward`` takes it: a function object (the Python API's ``reward=[fn]``, as TRL's
    ``reward_funcs``) named by where fresh worker processes can load it (nothing is pickled to them), a function
    of a package's module as ``package.module:name`` (``worker_path`` makes its package found there as here), of
    a top-level module's file as ``path/to/file.py:name``; a SPEC string, or anything else, as it is. A function
    those processes could not load by name (one defined in a notebook cell or a script's ``__main__``, inside
    another function, a lambda, a ``functools.partial``, a callable object) is refused, RewardError naming it
    and saying what to do."""
    if isinstance(reward, str) or not callable(reward):
        return reward
    shown = getattr(reward, "__qualname__", None) or callable_name(reward)
    module = sys.modules.get(getattr(reward, "__module__", None) or "")
    name = getattr(reward, "__name__", "")
    file = getattr(module, "__file__", None) if module is not None else None
    if not inspect.isfunction(reward) and not inspect.iscoroutinefunction(reward):
        why = f"a {type(reward).__name__}, not a function defined in a module"
    elif name != shown or not name.isidentifier() or (module is not None and getattr(module, name, None) is not reward):
        why = "not a module-level function of its module (a lambda, or defined inside another function)"
    elif module is None or module.__name__ == "__main__" or not file:
        why = "defined in a notebook or the script that runs, which the workers cannot import"
    elif module.__package__:
        return f"{module.__name__}:{name}"
    else:
        return f"{Path(file).resolve()}:{name}"
    raise RewardError(f"reward {shown}: {why}; the workers are fresh processes that load a reward function by name: "
                      f"put it in a .py file (in a notebook, a cell starting with %%writefile rewards.py) and give "
                      f"reward=['rewards.py:{name if name.isidentifier() else 'NAME'}'], or import it from there")


def worker_path(specs: Sequence[str]) -> list[str]:
    """The folders fresh workers must have on their path to import the modules of the ``module:name`` specs
    among ``specs`` from where this process finds them, where a fresh interpreter started here (same executable,
    environment and working directory) would not find them there by itself: a package a notebook found through
    its own ``sys.path.append("src")``, named by ``spec_of`` or written by hand. Empty when it would (installed,
    on PYTHONPATH, in the working directory) or no spec names a module."""
    folders: dict[str, tuple[str, list[str]]] = {}  # top-level name -> (its folder, where it lies) as found here
    for spec in specs:
        target = _module_target(spec)
        top = target.split(".")[0] if target else ""
        try:  # an imported module's own spec; else found on this process's path, none of its code run
            found = importlib.util.find_spec(top) if top.isidentifier() else None
        except (ImportError, ValueError):
            found = None
        where = _locations(found.submodule_search_locations, found.origin if found.has_location else None) \
            if found else []
        if where:
            folders[top] = (os.path.dirname(where[0]), where)
    if not folders:
        return []
    probe = ("import importlib.util as u, json, sys\n"
             "found = {n: u.find_spec(n) for n in sys.argv[1:]}\n"
             "print(json.dumps({n: [list(s.submodule_search_locations or []), s.origin if s.has_location else None]"
             " if s else [None, None] for n, s in found.items()}))")
    done = subprocess.run([sys.executable, "-c", probe, *folders], capture_output=True, text=True, check=False)
    there = json.loads(done.stdout) if done.returncode == 0 else {}
    return list(dict.fromkeys(folder for top, (folder, where) in folders.items()
                              if _locations(*there.get(top, [None, None])) != where))


def _locations(search: Sequence[str] | None, origin: str | None) -> list[str]:
    """Where a module found by ``importlib.util.find_spec`` lies (real paths): a package's folders (``search``),
    else its file (``origin``); [] when it was not found or has no file."""
    return [os.path.realpath(p) for p in (list(search or []) or ([origin] if origin else []))]


def _module_target(spec: Any) -> str | None:
    """The module a ``module:name`` SPEC names; None for a file's function, a built-in or anything else."""
    if not isinstance(spec, str) or spec.strip().partition("=")[0] in BUILTINS:
        return None
    target, colon, _ = spec.strip().rpartition(":")
    return target if colon and target and not _names_a_file(target) else None


def _names_a_file(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def callable_name(fn: Callable) -> str:
    """The name metrics use (TRL's): a function's ``__name__``, through ``functools.partial``, else the class's."""
    while isinstance(fn, functools.partial):
        fn = fn.func
    return getattr(fn, "__name__", type(fn).__name__)


def load_reward(spec: str) -> tuple[str, Callable[..., Any]]:
    """(name, function) of one ``--reward`` SPEC; RewardError naming SPEC when it cannot be loaded."""
    spec = spec.strip()
    head, eq, arg = spec.partition("=")
    if head in BUILTINS:
        factory, default = BUILTINS[head]
        if not eq and default is None:
            raise RewardError(f"--reward {spec}: the built-in {head} needs an argument: {head}=VALUE")
        return head, factory(arg if eq else default)  # type: ignore[arg-type]
    target, colon, attr = spec.rpartition(":")
    if not colon or not target:
        raise RewardError(f"--reward {spec!r}: not a reward; give path/to/file.py:name, module:name or a built-in "
                          f"({', '.join(BUILTINS)})")
    if target in BUILTINS:  # the file:name colon where the built-ins take '='
        raise RewardError(f"--reward {spec}: the built-in {target} takes its argument after '=': {target}={attr}")
    if _names_a_file(target):
        fn = _load_file(target, attr, spec)
    else:
        fn = _load_module(target, attr, spec)
    return callable_name(fn), fn


def load_rewards(specs: Sequence[str], weights: Sequence[float] | None = None) -> list[RewardFunction]:
    """Every ``--reward`` with its ``--reward-weights`` entry (default 1 each); run it before any worker
    starts, so that a missing file, module or name is reported at once. Names shared by two functions get
    ``_2``, ``_3``... so that their metrics stay apart."""
    if not specs:
        raise RewardError("--objective grpo needs at least one --reward (path/to/file.py:name, module:name or "
                          f"a built-in: {', '.join(BUILTINS)})")
    if weights is not None and len(weights) != len(specs):
        raise RewardError(f"--reward-weights has {len(weights)} weights for {len(specs)} --reward functions; "
                          "give one weight per function")
    for w in weights or ():
        if isinstance(w, bool) or not isinstance(w, numbers.Real) or not math.isfinite(w):
            raise RewardError(f"--reward-weights: {w!r} is not a finite number")
    out: list[RewardFunction] = []
    seen: dict[str, int] = defaultdict(int)
    for i, spec in enumerate(specs):
        name, fn = load_reward(spec)
        seen[name] += 1
        if seen[name] > 1:
            name = f"{name}_{seen[name]}"
        out.append(RewardFunction(name, fn, float(weights[i]) if weights is not None else 1.0, spec))
    return out


# ---------------------------------------------------------------------------------------------- scoring


@dataclass
class RewardLog:
    """What reward functions logged through ``log_metric`` / ``log_extra`` while scoring one batch (TRL's):
    numbers to average into the step's metrics, and columns of one value per completion for its samples."""

    metrics: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    extra: dict[str, list[Any]] = field(default_factory=lambda: defaultdict(list))

    @staticmethod
    def merged(logs: Sequence[RewardLog], rows: Sequence[int]) -> tuple[dict[str, float], dict[str, list[Any]]]:
        """Every rank's logs (in rank order; ``rows``: each rank's completions) as TRL merges them: each metric the
        mean of every value any rank logged, each column every rank's values in row order (a rank that logged
        none of a column, or not one value a completion, gives None for each of its rows)."""
        values = {name: [x for log in logs for x in log.metrics.get(name, [])]
                  for name in sorted({name for log in logs for name in log.metrics})}
        metrics = {name: sum(v) / len(v) for name, v in values.items() if v}
        columns = {column: [x for log, n in zip(logs, rows)
                            for x in (log.extra[column] if len(log.extra.get(column, [])) == n else [None] * n)]
                   for column in sorted({column for log in logs for column in log.extra})}
        return metrics, columns


def is_conversational(prompt: str | list[dict]) -> bool:
    """Whether a prompt is a message list (TRL then hands reward functions message-list completions)."""
    return isinstance(prompt, list)


def completions_for(prompts: Sequence[str | list[dict]], texts: Sequence[str]) -> list[str | list[dict]]:
    """The completions as reward functions receive them: the texts, or for conversational prompts one
    assistant message each, as TRL (``[{"role": "assistant", "content": text}]``)."""
    return [[{"role": "assistant", "content": t}] if is_conversational(p) else t for p, t in zip(prompts, texts)]


def describe_prompt(prompt: str | list[dict], limit: int = 80) -> str:
    """A prompt in a line: its text (a conversation: its last message's), shortened to ``limit`` characters."""
    text = completion_text(prompt) if not isinstance(prompt, str) else prompt
    text = " ".join(text.split())
    return repr(text if len(text) <= limit else text[:limit - 1] + "…")


def prompt_at(source: str, prompt: str | list[dict]) -> str:
    """Where a prompt comes from and its text, as error messages and warnings name it."""
    return f"{source}: {describe_prompt(prompt)}"


def _call(fn: Callable, kwargs: dict) -> Any:
    out = fn(**kwargs)
    if inspect.isawaitable(out):
        out = asyncio.run(_await(out))
    return out


async def _await(awaitable: Any) -> Any:
    return await awaitable


def _as_list(out: Any) -> list | None:
    if isinstance(out, torch.Tensor):
        return out.detach().cpu().reshape(-1).tolist() if out.dim() <= 1 else None
    if hasattr(out, "tolist") and getattr(out, "ndim", 1) == 1:  # numpy arrays
        return out.tolist()
    return list(out) if isinstance(out, (list, tuple)) else None


#: the largest reward float32 holds
FLOAT32_MAX = torch.finfo(torch.float32).max


def _value(x: Any) -> float | None | str:
    """The reward as a float, None, or a string saying why it is refused."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    elif hasattr(x, "item") and getattr(x, "shape", None) == ():  # numpy scalars
        x = x.item()
    if isinstance(x, bool):
        return float(x)
    if not isinstance(x, numbers.Real):
        return f"{type(x).__name__} {x!r:.60}"
    try:
        v = float(x)
    except OverflowError:
        return f"{x!r:.60} (beyond a float's range)"
    if not math.isfinite(v):
        return f"{v} (return None for a completion the function does not apply to)"
    if abs(v) > FLOAT32_MAX:  # rewards are held in float32, as in TRL
        return f"{v:g} (beyond float32's range, ±{FLOAT32_MAX:.4g})"
    return v


def _takes(fn: Callable, kwargs: dict, label: str) -> None:
    """Refuse, naming it, a function whose signature cannot take TRL's keyword arguments (else the TypeError of
    the call would point into this file)."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        signature.bind(**kwargs)
    except TypeError as err:
        raise RewardError(f"{label} cannot take the arguments reward functions get ({err}): define it as "
                          f"def {getattr(fn, '__name__', 'reward')}(prompts, completions, **kwargs), TRL's "
                          f"convention (keyword arguments: {', '.join(sorted(kwargs))})") from None


def _row_kwargs(kwargs: dict, i: int) -> dict:
    return {k: (v[i:i + 1] if isinstance(v, list) else v) for k, v in kwargs.items()}


def _failing_row(fn: Callable, kwargs: dict, n: int) -> int | None:
    """The first completion ``fn`` raises on when called on it alone; None when each one passes alone."""
    for i in range(n):
        try:
            _call(fn, _row_kwargs(kwargs, i))
        except (Exception, SystemExit):  # noqa: BLE001 - looking for the row, whatever it raises
            return i
    return None


def score(rewards: Sequence[RewardFunction], prompts: Sequence[str | list[dict]],
          completions: Sequence[str | list[dict]], completion_ids: Sequence[Sequence[int]],
          fields: dict[str, Sequence[Any]] | None = None, step: int = 0,
          log: RewardLog | None = None, sources: Sequence[str] | None = None) -> torch.Tensor:
    """(completions, functions) float32 rewards, NaN where a function answered None (TRL's layout).

    ``fields``: the records' other fields, one value per completion. ``sources``: where each completion's
    prompt comes from, for error messages (e.g. ``train.jsonl record 17``; default ``prompt #i``).
    """
    n = len(completions)
    if len(prompts) != n or len(completion_ids) != n:
        raise ValueError(f"{len(prompts)} prompts, {n} completions and {len(completion_ids)} id lists")
    fields = {k: list(v) for k, v in (fields or {}).items() if k not in ("prompt", "completion")}
    if (refused := reserved_field_refusal(fields)) is not None:
        raise RewardError(refused)
    log = log if log is not None else RewardLog()

    def log_metric(name: str, value: float) -> None:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise TypeError(f"log_metric({name!r}, ...): {value!r} is not a number") from None
        log.metrics[str(name)].append(number)

    kwargs = dict(prompts=list(prompts), completions=list(completions),
                  completion_ids=[list(ids) for ids in completion_ids], **fields,
                  trainer_state=SimpleNamespace(global_step=step), log_metric=log_metric,
                  log_extra=lambda column, values: log.extra[str(column)].extend(values))

    def where(i: int) -> str:
        return prompt_at(sources[i] if sources is not None else f"prompt #{i}", prompts[i])

    out = torch.empty(n, len(rewards), dtype=torch.float32)
    for j, reward in enumerate(rewards):
        label = f"reward function {reward.name!r}" + (f" (--reward {reward.spec})" if reward.spec else "")
        _takes(reward.fn, kwargs, label)
        try:
            answer = _call(reward.fn, kwargs)
        except RewardError:
            raise
        except (Exception, SystemExit) as err:  # noqa: BLE001 - the user's function (sys.exit too): named
            row = _failing_row(reward.fn, kwargs, n)
            at = f"on {where(row)}" if row is not None else f"on a batch of {n} (each completion alone passes)"
            raise RewardError(f"{label} raised {_where(err, None)}\n  {at}") from None
        values = _as_list(answer)
        if values is None:
            raise RewardError(f"{label} returned a {type(answer).__name__}, not a list of one reward per "
                              f"completion (on {n} completions, the first {where(0)})")
        if len(values) != n:
            raise RewardError(f"{label} returned {len(values)} rewards for {n} completions (one per completion; "
                              f"the first {where(0)})")
        for i, x in enumerate(values):
            v = _value(x)
            if isinstance(v, str):
                raise RewardError(f"{label} returned {v} as the reward of completion #{i}, not a number or None\n"
                                  f"  on {where(i)}")
            out[i, j] = math.nan if v is None else v
    return out


def unscored(rewards: Sequence[RewardFunction], table: torch.Tensor, where: Callable[[int], str], what: str,
             why: str) -> torch.Tensor:
    """(completions,) True where every function answered None for the completion of ``table`` (``score``'s):
    it has no reward. None of them scored is no measure at all: RewardError, naming ``what`` they are, the
    first one's prompt (``where(0)``) and ``why`` that stops the command."""
    none = torch.isnan(table).all(dim=1)
    if len(none) and bool(none.all()):
        names = ", ".join(repr(r.name) for r in rewards)
        raise RewardError(f"no completion of {what} got a reward: every reward function ({names}) answered None "
                          f"(not applicable) for each of its {len(none)} completions, the first on {where(0)}. "
                          f"{why}: give a reward function that scores these prompts")
    return none


def check_in_float32(rewards: Sequence[RewardFunction], table: torch.Tensor, totals: torch.Tensor, what: str,
                     spread: float | None = None) -> None:
    """Weighted rewards ``totals`` (of the scored completions of ``table``, ``score``'s) whose sum, or ``spread``
    when given, overflows float32 (TRL's dtype for them) measure and teach nothing: RewardError naming ``what`` they
    are, the largest answer, the functions and their weights."""
    if bool(torch.isfinite(totals).all()) and (spread is None or math.isfinite(spread)):
        return
    largest = table.nan_to_num(0.0).abs().max().item()
    names = ", ".join(repr(r.name) for r in rewards)
    weights = ",".join(f"{r.weight:g}" for r in rewards)
    raise RewardError(f"the rewards of {what} overflow float32 (TRL's dtype for them) once weighted, summed or "
                      f"squared for their spread: the largest answer is {largest:g} (functions {names}, weights "
                      f"{weights}); scale them down")


def weights_of(rewards: Sequence[RewardFunction]) -> torch.Tensor:
    return torch.tensor([r.weight for r in rewards], dtype=torch.float32)

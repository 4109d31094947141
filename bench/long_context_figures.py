"""The figures and verdicts of bench/long_context.py, from its rows: standard library only.

A row is one job: ``recipe`` (shardtune, trl, hf, fsdp2, packed, ref, verify), ``tokens`` (the length of
each row a process computes), ``peak_mb`` (per process, RssAnon+RssShmem sampled from outside), for
shardtune's rows ``summary_peak_mb`` (its own train peak per rank), ``tokens_per_second`` and ``plan``
(`shardtune plan --json`'s prediction). MB are 2^20 bytes, KB 2^10, as shardtune prints them.
"""

from __future__ import annotations

import math
from typing import Any

KB, MB = 1024, 1024 * 1024
#: every kind of row, in the order the bench runs and shows them
RECIPES = ("shardtune", "trl", "hf", "fsdp2", "packed", "ref", "verify")
#: the rows whose peak against the length makes a line (one record per process, unpacked)
LINES = ("shardtune", "fsdp2", "trl", "hf")

Row = dict[str, Any]


def ok(rows: list[Row], recipe: str) -> list[Row]:
    """The rows of one recipe that ran, by length."""
    return sorted((r for r in rows if r.get("recipe") == recipe and not r.get("error") and r.get("peak_mb")),
                  key=lambda r: r["tokens"])


def order(row: Row) -> tuple[int, int]:
    return RECIPES.index(row["recipe"]), row["tokens"]


def sampled(row: Row) -> float:
    return max(row["peak_mb"])


def summary(row: Row) -> float | None:
    return max(row["summary_peak_mb"]) if row.get("summary_peak_mb") else None


def line(rows: list[Row], peak=sampled) -> dict | None:
    """Peak against tokens through the two longest rows: MB at the longer one and bytes per extra token."""
    points = [(r["tokens"], peak(r)) for r in rows if peak(r) is not None]
    if len(points) < 2:
        return None
    (t1, p1), (t2, p2) = points[-2:]
    return {"between": [t1, t2], "peak_mb": [p1, p2], "bytes_per_token": (p2 - p1) * MB / (t2 - t1)}


def longest_fit(fit: dict | None, budget_mb: float) -> int | None:
    """Where the line reaches the budget (None: no line, or memory that does not grow)."""
    if fit is None or fit["bytes_per_token"] <= 0:
        return None
    t2, p2 = fit["between"][1], fit["peak_mb"][1]
    return int(t2 + (budget_mb - p2) * MB / fit["bytes_per_token"])


def reach(rows: list[Row], budget_mb: float) -> tuple[int | None, str]:
    """The longest context within the budget and how it was found: between the two measured rows whose
    peaks straddle the budget when they do (a peak need not grow in a line, and extrapolating from the two
    longest rows, both over the budget, could answer less than a row that fitted), else the line through
    the two longest rows."""
    points = [(r["tokens"], sampled(r)) for r in rows]
    over = next((i for i, (_, p) in enumerate(points) if p > budget_mb), None)
    if over is None or len(points) < 2:
        return longest_fit(line(rows), budget_mb), "the measured line"
    if over == 0:
        return None, f"over the budget already at {points[0][0]} tokens, the shortest row"
    (t1, p1), (t2, p2) = points[over - 1], points[over]
    return int(t1 + (budget_mb - p1) * (t2 - t1) / (p2 - p1)), f"between the measured rows of {t1} and {t2} tokens"


def derive(rows: list[Row], floor: dict | None, budget_mb: float, speed_tokens: int,
           plan_longest: dict | None = None) -> dict:
    """Every derived figure: slopes, the floor's multiple, longest fits, speed against the reference,
    packed against unpacked, the planner's errors."""
    out: dict[str, Any] = {"budget_mb": budget_mb, "slopes": {}, "longest_fit": {}}
    floor_bpt = (floor or {}).get("bytes_per_token")
    for recipe in LINES:
        fit = line(ok(rows, recipe))
        if fit is None:
            continue
        entry = {**fit, "kb_per_token": fit["bytes_per_token"] / KB}
        if floor_bpt:
            entry["over_floor"] = fit["bytes_per_token"] / floor_bpt
        own = line(ok(rows, recipe), summary)
        if own is not None:
            entry["summary_kb_per_token"] = own["bytes_per_token"] / KB
        out["slopes"][recipe] = entry
        tokens, how = reach(ok(rows, recipe), budget_mb)
        out["longest_fit"][recipe] = {"tokens": tokens, "from": how}
    if plan_longest and plan_longest.get("tokens"):
        measured = out["longest_fit"].get("shardtune", {}).get("tokens")
        out["longest_fit"]["shardtune"] = {"tokens": plan_longest["tokens"],
                                           "from": "shardtune plan --seq-len max", "plan": plan_longest,
                                           "measured_line_tokens": measured}
        if measured and (trl := out["longest_fit"].get("trl", {}).get("tokens")):
            out["measured_line_ratio_vs_trl"] = measured / trl
    ours, trl = (out["longest_fit"].get(k, {}).get("tokens") for k in ("shardtune", "trl"))
    if ours and trl:
        out["longest_ratio_vs_trl"] = ours / trl
    verify = ok(rows, "verify")
    if verify:
        v = verify[-1]
        out["verify"] = {"tokens": v["tokens"], "peak_mb": sampled(v), "summary_peak_mb": summary(v),
                         "fits": sampled(v) <= budget_mb}
    out["speed"] = _speed(rows, speed_tokens)
    out["packed"] = _packed(rows)
    out["planner"] = [_planner(r) for r in rows if not r.get("error") and r.get("peak_mb")
                      and isinstance((r.get("plan") or {}).get("peak_mb"), (int, float))]
    return out


def _planner(row: Row) -> dict:
    """The plan's peak against the train peak shardtune measured itself (what the planner predicts; the
    sampled peak also holds loading), or the sampled one where the row has none."""
    measured = summary(row) or sampled(row)
    predicted = row["plan"]["peak_mb"]
    return {"recipe": row["recipe"], "tokens": row["tokens"], "predicted_mb": predicted, "measured_mb": measured,
            "measured_by": "summary train_peak_mb" if summary(row) else "sampled",
            "error": (predicted - measured) / measured}


def _at(rows: list[Row], recipe: str, tokens: int) -> Row | None:
    return next((r for r in ok(rows, recipe) if r["tokens"] == tokens), None)


def _speed(rows: list[Row], tokens: int) -> dict:
    ours, ref = _at(rows, "shardtune", tokens), _at(rows, "ref", tokens)
    out: dict[str, Any] = {"tokens": tokens}
    if ours:
        out["tokens_per_second"] = ours.get("tokens_per_second")
    if ref:
        out.update(ref_tokens_per_second=ref.get("tokens_per_second"), ref=ref.get("ref"))
    if ours and ref and ours.get("tokens_per_second") and ref.get("tokens_per_second"):
        out["ratio"] = ours["tokens_per_second"] / ref["tokens_per_second"]
    return out


def _packed(rows: list[Row]) -> list[dict]:
    out = []
    for p in ok(rows, "packed"):
        plain = _at(rows, "shardtune", p["tokens"])
        entry = {"tokens": p["tokens"], "records_per_row": p.get("records_per_row"), "peak_mb": sampled(p),
                 "unpacked_peak_mb": sampled(plain) if plain else None}
        if plain:
            entry["ratio"] = sampled(p) / sampled(plain)
        out.append(entry)
    return out


def _check(what: str, value: float, op: str, target: float, unit: str = "") -> str:
    good = value <= target if op == "<=" else value >= target
    return f"{what}: {value:.2f}{unit} {op} {target}{unit}: {'met' if good else 'NOT met'}"


def verdicts(fig: dict, floor: dict | None, layers: int, dtype: str) -> list[str]:
    """One line per target of issue 32 that the rows allow judging: met or NOT met, never a failure."""
    lines = []
    for recipe in ("shardtune", "fsdp2"):
        s = fig["slopes"].get(recipe)
        if s and "over_floor" in s:
            lines.append(_check(f"peak per extra token, {recipe}, as a multiple of the floor "
                                f"({floor['bytes_per_token'] / KB:.1f} KB/token; {s['kb_per_token']:.1f} KB/token "
                                f"between {s['between'][0]} and {s['between'][1]} tokens)", s["over_floor"], "<=", 1.5))
        if s and recipe == "shardtune" and layers == 4 and dtype == "fp32":
            lines.append(_check("peak per extra token, shardtune, 4-layer fp32 shape", s["kb_per_token"], "<=", 80,
                                " KB/token"))
    if "longest_ratio_vs_trl" in fig:
        ours, trl = fig["longest_fit"]["shardtune"], fig["longest_fit"]["trl"]
        lines.append(_check(f"longest context within {fig['budget_mb']:.0f} MB, shardtune ({ours['tokens']}, from "
                            f"{ours['from']}) / TRL ({trl['tokens']}, from {trl['from']})",
                            fig["longest_ratio_vs_trl"], ">=", 8))
        if "measured_line_ratio_vs_trl" in fig:
            lines.append(_check(f"longest context within {fig['budget_mb']:.0f} MB, both from their measured lines, "
                                f"shardtune ({ours['measured_line_tokens']}) / TRL ({trl['tokens']})",
                                fig["measured_line_ratio_vs_trl"], ">=", 8))
    v = fig.get("verify")
    if v:
        lines.append(f"shardtune at {v['tokens']} tokens: peak {v['peak_mb']:.0f} MB within {fig['budget_mb']:.0f} "
                     f"MB: {'met' if v['fits'] else 'NOT met'}")
    sp = fig.get("speed") or {}
    if "ratio" in sp:
        lines.append(_check(f"tokens/s at {sp['tokens']} tokens, shardtune / {sp.get('ref')} "
                            f"({sp['tokens_per_second']:.1f} / {sp['ref_tokens_per_second']:.1f})",
                            sp["ratio"], ">=", 0.9))
    for p in fig.get("packed") or []:
        if "ratio" in p:
            lines.append(_check(f"peak of {p['records_per_row']} records packed in one row of {p['tokens']} tokens "
                                f"/ one record of {p['tokens']}", p["ratio"], "<=", 1.1))
    for p in fig.get("planner") or []:
        good = abs(p["error"]) <= 0.10
        lines.append(f"planner {p['recipe']} at {p['tokens']} tokens: {p['predicted_mb']:.0f} MB vs measured "
                     f"{p['measured_mb']:.0f} ({p['measured_by']}, {p['error']:+.1%}) within 10%: "
                     f"{'met' if good else 'NOT met'}")
    return lines


def _num(value: Any, fmt: str = ".0f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def table(rows: list[Row]) -> list[str]:
    """The rows, as the bench prints them."""
    lines = [f"{'recipe':<10} {'ranks':>5} {'tokens':>7} {'rec/row':>7} {'peak MB':>9} {'summary MB':>10} "
             f"{'tokens/s':>9} {'plan MB':>8} {'plan err':>8}"]  # plan err: against the summary peak
    for r in sorted(rows, key=order):
        head = f"{r['recipe']:<10} {r.get('ranks', 1):>5} {r['tokens']:>7} {r.get('records_per_row', 1):>7}"
        if r.get("error"):
            lines.append(f"{head} FAILED: {str(r['error']).strip().splitlines()[-1][:80]}")
            continue
        plan = r.get("plan") or {}
        err = _planner(r)["error"] if isinstance(plan.get("peak_mb"), (int, float)) else None
        lines.append(f"{head} {_num(sampled(r)):>9} {_num(summary(r)):>10} {_num(r.get('tokens_per_second'), '.1f'):>9}"
                     f" {_num(plan.get('peak_mb')):>8} {_num(err, '+.1%') if err is not None else '-':>8}")
    return lines


def figure_lines(fig: dict, floor: dict | None) -> list[str]:
    """The derived figures, as the bench prints them."""
    lines = []
    if floor:
        lines.append(f"floor: {floor['bytes_per_token'] / KB:.1f} KB/token = {floor['how']}")
    for recipe, s in fig["slopes"].items():
        over = f", {s['over_floor']:.2f}x the floor" if "over_floor" in s else ""
        own = f" (shardtune's own peaks: {s['summary_kb_per_token']:.1f})" if "summary_kb_per_token" in s else ""
        lines.append(f"{recipe}: {s['kb_per_token']:.1f} KB per extra token between {s['between'][0]} and "
                     f"{s['between'][1]} tokens{own}{over}")
    for recipe, f in fig["longest_fit"].items():
        tokens = _num(f["tokens"], "d") if f["tokens"] is not None else "none" if "over" in f["from"] else "unbounded"
        line_too = f"; the measured line: {f['measured_line_tokens']}" if f.get("measured_line_tokens") else ""
        lines.append(f"{recipe}: longest context within {fig['budget_mb']:.0f} MB per process: {tokens} tokens "
                     f"({f['from']}{line_too})")
    return lines

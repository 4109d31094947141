"""bench/context_parallel.py's longest-context figures (no model runs): read off the measured peaks point to
point, interpolated between the rows around the budget, extrapolated only past the longest row and then said."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import context_parallel as cpb  # noqa: E402


def test_longest_within_interpolates_between_the_rows_around_the_budget():
    points = [(4096, 600.0), (8192, 800.0), (16384, 1000.0)]
    assert cpb.longest_within(points, 700.0) == (6144.0, 1.0)
    assert cpb.longest_within(points[::-1], 900.0) == (12288.0, 1.0)  # any order
    assert cpb.longest_within(points, 1200.0) == (24576.0, 1.5)  # past the longest row: how far, said
    assert cpb.longest_within(points, 500.0) is None  # below the shortest row: no figure made up
    assert cpb.longest_within(points[:1], 700.0) is None


def test_figures_take_each_cp1_peak_as_a_budget():
    rows = [{"row": f"cp {cp}", "kind": "cp", "context_parallel": cp, "tokens": t, "peak_mb": m}
            for cp, t, m in [(1, 4096, 600.0), (1, 8192, 900.0), (2, 8192, 600.0), (2, 16384, 1000.0),
                             (4, 16384, 700.0), (4, 32768, 850.0)]]
    rows.append({"row": "cp 4", "kind": "cp", "context_parallel": 4, "tokens": 65536, "error": "killed"})
    figs = cpb.figures(rows, None)
    assert figs["budget_mib"] == 900.0  # CP 1's peak at its longest row
    at_8k = figs["by_budget"][1]
    assert at_8k["cp1_tokens"] == 8192 and at_8k["longest_tokens"] == {1: 8192, 2: 14336, 4: 38229}
    assert at_8k["longest_ratio"][2] == pytest.approx(14336 / 8192)
    assert at_8k["extrapolated"][2] == 1.0 and at_8k["extrapolated"][4] == pytest.approx(1.17)
    assert 4 not in figs["by_budget"][0]["longest_tokens"]  # 600 MiB lies below CP 4's shortest row

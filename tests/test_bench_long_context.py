"""bench/long_context.py's figures and verdicts, and their table in docs/benchmarks.md (no model runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import long_context_figures as lcf  # noqa: E402

FLOOR = {"bytes_per_token": 40 * 1024, "how": "4 layers x 576 hidden x 4 B + one layer's set"}


def row(recipe: str, tokens: int, peak: float, **more) -> dict:
    return {"recipe": recipe, "tokens": tokens, "ranks": 1, "records_per_row": 1, "peak_mb": [peak], **more}


ROWS = [
    row("shardtune", 2048, 1000.0, summary_peak_mb=[900.0], tokens_per_second=10.0),
    row("shardtune", 4096, 1100.0, summary_peak_mb=[1000.0], tokens_per_second=9.5,
        plan={"strategy": "single", "peak_mb": 1050.0}),
    row("shardtune", 8192, 0.0, error="killed"),  # a failed row makes no point of the line
    row("trl", 2048, 3000.0), row("trl", 4096, 4000.0),
    row("ref", 4096, 2000.0, tokens_per_second=10.0, ref="9975824"),
    row("packed", 4096, 1250.0, records_per_row=4),
]


def test_slopes_fits_and_verdicts():
    fig = lcf.derive(ROWS, FLOOR, 4096.0, 4096)
    ours = fig["slopes"]["shardtune"]
    assert ours["between"] == [2048, 4096] and ours["kb_per_token"] == 100 * 1024 / 2048  # 50 KB a token
    assert ours["over_floor"] == 50 / 40 and ours["summary_kb_per_token"] == 50
    assert fig["slopes"]["trl"]["kb_per_token"] == 500
    assert fig["longest_fit"]["shardtune"]["tokens"] == 4096 + int(2996 * 1024 / 50)
    assert fig["longest_fit"]["trl"]["tokens"] == 4096 + int(96 * 1024 / 500)
    assert fig["speed"]["ratio"] == 0.95 and fig["packed"][0]["ratio"] == 1250 / 1100
    lines = lcf.verdicts(fig, FLOOR, layers=4, dtype="fp32")
    verdict = {line.split(":")[0].split(" (")[0]: line.rsplit(": ", 1)[1] for line in lines}
    assert verdict == {"peak per extra token, shardtune, as a multiple of the floor": "met",
                       "peak per extra token, shardtune, 4-layer fp32 shape": "met",
                       "longest context within 4096 MB, shardtune": "met",
                       "tokens/s at 4096 tokens, shardtune / 9975824": "met",
                       "peak of 4 records packed in one row of 4096 tokens / one record of 4096": "NOT met",
                       "planner shardtune at 4096 tokens": "met"}, lines
    assert any("FAILED: killed" in line for line in lcf.table(ROWS))


def test_the_planner_answer_wins_and_a_flat_line_fits_anything():
    fig = lcf.derive(ROWS, FLOOR, 4096.0, 4096, plan_longest={"tokens": 20000, "key": "max_seq_len"})
    assert fig["longest_fit"]["shardtune"]["tokens"] == 20000 and fig["longest_ratio_vs_trl"] == 20000 / 4292
    line_fit = 4096 + int(2996 * 1024 / 50)  # the measured line's answer stays beside the plan's, judged too
    assert fig["longest_fit"]["shardtune"]["measured_line_tokens"] == line_fit
    assert fig["measured_line_ratio_vs_trl"] == line_fit / 4292
    assert any(f"both from their measured lines, shardtune ({line_fit}) / TRL (4292)" in t and t.endswith(": met")
               for t in lcf.verdicts(fig, FLOOR, 4, "fp32"))
    flat = [row("hf", 2048, 900.0), row("hf", 4096, 900.0)]
    assert lcf.derive(flat, None, 4096.0, 4096)["longest_fit"]["hf"]["tokens"] is None


def test_a_budget_between_two_rows_is_read_between_them_not_off_the_last_two():
    # TRL's peak at 4k and 8k both exceed 4 GiB and barely differ: the line through them would land far
    # below 2k, a length that fitted; the answer lies between the rows that straddle the budget
    rows = [row("trl", 2048, 3072.0), row("trl", 4096, 5120.0), row("trl", 8192, 5200.0)]
    fit = lcf.derive(rows, None, 4096.0, 8192)["longest_fit"]["trl"]
    assert fit == {"tokens": 3072, "from": "between the measured rows of 2048 and 4096 tokens"}
    too_big = lcf.derive([row("hf", 2048, 5000.0), row("hf", 4096, 6000.0)], None, 4096.0, 8192)
    assert too_big["longest_fit"]["hf"]["tokens"] is None


def test_the_benchmarks_page_shows_the_rows_and_the_targets(tmp_path):
    fig = lcf.derive(ROWS, FLOOR, 4096.0, 4096)
    data = {"layers": 4, "dtype": "fp32", "lora": "r16 alpha 32 all-linear", "steps": 2, "rows": ROWS,
            "shape": {"hidden_size": 576, "vocab_size": 49152}, "figures": fig, "floor": FLOOR,
            "targets": lcf.verdicts(fig, FLOOR, 4, "fp32"), "command": "python bench/long_context.py",
            "machine": {"cpu": "Test CPU", "cores": 2, "isa": ["avx2"], "gpus": [], "torch": "2.13.0"}}
    results = tmp_path / "results"
    results.mkdir()
    (results / "long-context-4l.json").write_text(json.dumps(data))
    page, readme = tmp_path / "benchmarks.md", tmp_path / "README.md"
    readme.write_text((ROOT / "README.md").read_text())
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_benchmarks.py"), "--results", str(results),
                           "--page", str(page), "--readme", str(readme)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    text = page.read_text()
    assert "## Long context against TRL and transformers: bench/long_context.py" in text
    assert "No table layout is known" not in text
    assert "| shardtune | 1 | 4096 | 1 | 1100 | 1000 | 9.5 | 1050 |" in text
    assert "| shardtune | 50 | 50 | 2048 – 4096 | 1.25 | 65454 | the measured line |" in text
    assert "- peak of 4 records packed in one row of 4096 tokens / one record of 4096: 1.14 <= 1.1: NOT met" in text

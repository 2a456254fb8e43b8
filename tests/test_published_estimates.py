"""scripts/published_estimates.py: the estimate beside published measured throughputs (docs/estimates.md)."""
from __future__ import annotations

import pytest

from scripts import published_estimates as pe


def test_each_row_sets_the_estimate_beside_the_published_rate(monkeypatch: pytest.MonkeyPatch) -> None:
    bert = [r for r in pe.ROWS if r.name.startswith("BERT")]   # the two the homework compares
    monkeypatch.setattr(pe, "ROWS", tuple(bert))
    text = pe.table()
    rows = [line for line in text.splitlines() if line.startswith("| BERT")]
    assert len(rows) == 2
    estimates = []
    for line, row in zip(rows, bert):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == str(row.batch) and cells[2] == "CS-2 (WSE-2)"
        estimate = float(cells[4].replace(",", ""))
        assert cells[6].startswith(f"{row.measured:,.2f} [1]")
        assert float(cells[7]) == pytest.approx(row.measured / estimate, abs=0.006)
        estimates.append(estimate)
    assert estimates[1] > estimates[0]          # a bigger batch amortizes the weights streamed
    assert "[1] ALCF" in text

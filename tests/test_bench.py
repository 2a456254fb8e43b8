"""scripts/bench.py --quick: the smoke test of the benchmark (structure and sane numbers, no timings)."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def _positive_finite(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@pytest.mark.cluster
def test_quick_bench_writes_rows_and_verdicts(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run([sys.executable, str(REPO / "scripts" / "bench.py"), "--quick", "--json", str(out)],
                            capture_output=True, text=True, timeout=600, cwd=REPO)
    assert result.returncode == 0, result.stderr[-2000:]
    got = json.loads(out.read_text())
    assert got["preset"] == "tiny" and got["steps"] >= 4
    names = [row["name"] for row in got["rows"]]
    assert names == ["cpu", "weight_streaming_1wse", "ws_1wse_float16"]
    for row in got["rows"]:
        for key in ("samples_per_sec", "ratio_vs_baseline", "flops_per_sec"):
            assert _positive_finite(row[key]), (row["name"], key, row.get(key))
        if row["name"] != "cpu":
            assert _positive_finite(row["weight_bytes_per_step"]), row
            assert _positive_finite(row["weight_stream_bytes_per_sec"]), row
    # 16-bit weights stream half the bytes of float32 ones
    rows = {row["name"]: row for row in got["rows"]}
    assert rows["ws_1wse_float16"]["weight_bytes_per_step"] * 2 == rows["weight_streaming_1wse"]["weight_bytes_per_step"]
    [verdict] = got["verdicts"]
    assert verdict["row"] == "ws_1wse_float16" and verdict["baseline"] == "weight_streaming_1wse"
    assert _positive_finite(verdict["ratio"]) and verdict["target_ratio"] == 0.9
    assert verdict["met"] == (verdict["ratio"] >= 0.9)
    assert "verdict" in result.stdout and ("met" in result.stdout or "missed" in result.stdout)

"""scripts/batch_study.py: the homework's batch sizes, estimated beside measured.

The study's runs themselves take minutes (scripts/batch_study.py runs them); here the compile
each run has is made for BERT at batch 512 and 2048, and the table is checked to put the
compile's estimate beside the measured rate it is given.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from cs_runtime.compiler.stage import compile_model
from cs_runtime.config import params_from_dict
from cs_runtime.run_args import RunArgs
from examples.bert.run import model_fn
from scripts import batch_study


def compiled_estimate(tmp_path: Path, batch: int) -> dict:
    params = params_from_dict(batch_study.study_params("bert", batch, samples=4096, eval_samples=512))
    model_dir = tmp_path / f"bert_{batch}"
    compile_model(model_fn(params), RunArgs("train", "p.yaml", params, str(model_dir), None, False, True))
    return batch_study.planned_rates(model_dir)


def test_the_table_sets_the_estimate_beside_the_measured_rate(tmp_path: Path) -> None:
    rows = []
    for batch, measured in ((512, 40.0), (2048, 55.0)):
        rates = compiled_estimate(tmp_path, batch)
        assert rates["execution_strategy"] == "weight_streaming"   # the mode the study runs
        assert rates["system"] == "CS-2 (WSE-2)" and rates["second_system"] == "CS-3 (WSE-3)"
        rows.append({"model": "bert", "batch_size": batch, "steps": 4096 // batch, **rates,
                     "samples_per_sec": measured, "step_time_s": batch / measured, "final_train_loss": 7.0,
                     "eval_loss": 7.1, "eval_accuracy": 0.01, "weight_bytes_per_step": 1,
                     "grad_bytes_per_step": 1})
    # A bigger batch amortizes the weights streamed per step: the estimate rises with it.
    assert rows[1]["estimated_samples_per_sec"] > rows[0]["estimated_samples_per_sec"]
    args = argparse.Namespace(samples=4096, num_csx=1, eval_samples=512)
    text = batch_study.table(rows, args)
    header = next(line for line in text.splitlines() if line.startswith("| model"))
    assert "estimated samples/sec CS-2 (WSE-2)" in header and "measured samples/sec (emulator)" in header
    for r in rows:
        line = next(line for line in text.splitlines() if line.startswith(f"| bert | {r['batch_size']} |"))
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert float(cells[3].replace(",", "")) == round(r["estimated_samples_per_sec"])
        assert float(cells[5]) == r["samples_per_sec"]
        assert float(cells[6]) == float(f"{r['samples_per_sec'] / r['estimated_samples_per_sec']:.2e}")

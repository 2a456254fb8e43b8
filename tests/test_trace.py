"""The timeline (--trace): spans, their wire format, and the merged trace file of real runs."""
from __future__ import annotations

import json
import subprocess
import sys
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from cs_runtime import spans, trace
from cs_runtime.wire.protocol import Message, Msg, ProtocolError, decode, encode
from tests.cluster_utils import FC_MNIST, assert_matches_oracle, run_cpu, run_wse, tool, write_params

LAYERS = 3   # SMALL_PARAMS: hidden_sizes [64, 32] + the output layer


# ---------------------------------------------------------------- unit
@pytest.fixture
def recorder():
    trace.RECORDER.reset(True)
    yield trace.RECORDER
    trace.RECORDER.reset(False)


def test_span_records_nothing_when_off():
    trace.RECORDER.reset(False)
    with trace.span("fwd", step=1, layer=2):
        pass
    assert trace.RECORDER.take() == []
    assert trace.span("a") is trace.span("b")   # one shared do-nothing object: no allocation per site


def test_span_records_name_step_layer_and_duration(recorder):
    with trace.span("fwd", step=4, layer=1):
        t_inside = trace.now_ns()
    (name, start, dur, step, layer), = recorder.take()
    assert (name, step, layer) == ("fwd", 4, 1)
    assert start <= t_inside <= start + dur


def test_span_is_recorded_when_its_body_raises(recorder):
    with pytest.raises(KeyError):
        with trace.span("update", step=0, layer=0):
            raise KeyError("x")
    assert [s[0] for s in recorder.take()] == ["update"]


def test_recorder_caps_its_spans(recorder, monkeypatch):
    monkeypatch.setattr(spans, "MAX_SPANS", 3)   # the recorder's module
    for i in range(5):
        recorder.add("s", i, i + 1)
    assert len(recorder.spans) == 3 and recorder.dropped == 2


def test_trace_message_round_trip(recorder):
    for i in range(4):
        recorder.add("send_fwd" if i % 2 else "fwd", 1000 + i, 1500 + i, step=i, layer=i % 3)
    spans = list(recorder.spans)
    msg = trace.reply(Message(Msg.GET_TRACE), "wse", 1, received_ns=7)
    got = decode(encode(msg))
    assert got.meta["role"] == "wse" and got.meta["rank"] == 1 and got.meta["recv_ns"] == 7
    assert trace.unpack_spans(got.meta["names"], got.arrays) == spans
    assert recorder.spans == []      # handed over


def trace_frames(names=("fwd",), **arrays):
    """A TRACE message's frames with the given arrays replacing the valid ones."""
    good = {"name": np.zeros(2, np.int32), "start_ns": np.arange(2, dtype=np.int64),
            "dur_ns": np.ones(2, np.int64), "step": np.zeros(2, np.int64), "layer": np.zeros(2, np.int64)}
    good.update(arrays)
    good = {k: v for k, v in good.items() if v is not None}
    meta = {"role": "wse", "rank": 0, "names": list(names), "dropped": 0, "clock": "", "recv_ns": 1, "send_ns": 2}
    return encode(Message(Msg.TRACE, meta=meta, arrays=good))


@pytest.mark.parametrize("bad, why", [
    ({"name": np.array([0, 5], np.int32)}, "names no listed name"),
    ({"name": np.array([0, -1], np.int32)}, "names no listed name"),
    ({"dur_ns": np.array([1, -4], np.int64)}, "negative duration"),
    ({"step": np.zeros(3, np.int64)}, "differ in length"),
    ({"start_ns": np.arange(2, dtype=np.float32)}, "must be 1-D int64"),
    ({"layer": np.zeros((2, 1), np.int64)}, "must be 1-D int64"),
    ({"layer": None}, "arrays must be"),
])
def test_bad_trace_messages_are_refused(bad, why):
    with pytest.raises(ProtocolError, match=why):
        decode(trace_frames(**bad))


def test_trace_names_are_checked():
    decode(trace_frames())   # the valid one passes
    with pytest.raises(ProtocolError, match="names must be"):
        decode(trace_frames(names=("x" * 65,)))
    with pytest.raises(ProtocolError, match="names must be"):
        decode(trace_frames(names=(3,)))


def test_layer_grad_norms_must_be_numbers():
    ok = Message(Msg.STEP_DONE, meta={"grad_norm": 1.0, "layer_grad_norms": [0.5, 2]})
    assert decode(encode(ok)).meta["layer_grad_norms"] == [0.5, 2]
    for bad in (["1.0"], [True], "0.5"):
        with pytest.raises(ProtocolError, match="layer_grad_norms"):
            decode(encode(Message(Msg.STEP_DONE, meta={"grad_norm": 1.0, "layer_grad_norms": bad})))
    named = Message(Msg.STEP_DONE, meta={"grad_norm": 1.0, "param_grad_norms": {"fc.weight": 0.5, "fc.bias": 2}})
    assert decode(encode(named)).meta["param_grad_norms"] == {"fc.weight": 0.5, "fc.bias": 2}
    for bad in ({"w": "1.0"}, {"w": True}, [0.5]):
        with pytest.raises(ProtocolError, match="param_grad_norms"):
            decode(encode(Message(Msg.STEP_DONE, meta={"grad_norm": 1.0, "param_grad_norms": bad})))
        with pytest.raises(ProtocolError, match="param_norms"):
            decode(encode(Message(Msg.STEP_DONE, meta={"grad_norm": 1.0, "param_norms": bad})))


def test_clock_offset_recovers_a_skewed_clock():
    # The remote clock reads 5 s ahead; 300 us each way and 100 us of work in between.
    skew, t0 = 5_000_000_000, 1_000_000
    t1 = t0 + 300_000 + skew
    t2 = t1 + 100_000
    t3 = t2 - skew + 300_000
    assert trace.clock_offset(t0, t1, t2, t3) == skew
    # Asymmetric paths (100 us out, 500 us back): off by half the difference, within half the round trip.
    t1 = t0 + 100_000 + skew
    t2 = t1
    t3 = t2 - skew + 500_000
    assert abs(trace.clock_offset(t0, t1, t2, t3) - skew) <= (t3 - t0) // 2
    if trace.clock_id():
        # The same kernel's clock: exactly 0 (here the paths are asymmetric, so the estimate is 200 us off) ...
        t1, t3 = t0 + 100_000, t0 + 600_000
        assert trace.clock_offset(t0, t1, t1, t3) == -200_000
        assert trace.clock_offset(t0, t1, t1, t3, remote_clock=trace.clock_id()) == 0
        # ... unless the round trip proves it is another clock (a time namespace on the same kernel).
        assert trace.clock_offset(t0, t1 + skew, t1 + skew, t3, remote_clock=trace.clock_id()) == skew - 200_000


def test_chrome_events_rows_and_alignment():
    chief = trace.ProcessTrace("chief", [("train_step", 1_000_000, 50_000, 0, -1)])
    wse = trace.ProcessTrace("wse0", [("fwd", 2_010_000, 10_000, 0, 0)], offset_ns=1_000_000)
    events = trace.chrome_events([wse, chief])
    rows = {e["args"]["name"]: e["pid"] for e in events if e["name"] == "process_name"}
    assert list(rows) == ["chief", "wse0"]
    spans = {e["name"]: e for e in events if e["ph"] == "X"}
    assert spans["train_step"]["ts"] == 0 and spans["train_step"]["dur"] == 50.0
    assert spans["fwd"]["ts"] == 10.0 and spans["fwd"]["pid"] == rows["wse0"]
    assert spans["fwd"]["args"] == {"step": 0, "layer": 0} and spans["train_step"]["args"] == {"step": 0}


# ---------------------------------------------------------------- whole runs
SVG = "{http://www.w3.org/2000/svg}"


def load_trace(model_dir):
    doc = json.loads((model_dir / "trace.json").read_text())
    events = doc["traceEvents"]
    rows = {}
    for e in events:
        if e["ph"] == "M" and e["name"] == "process_name":
            assert e["args"]["name"] not in rows.values(), f"two rows named {e['args']['name']}"
            rows[e["pid"]] = e["args"]["name"]
    spans: dict[str, list[dict]] = {name: [] for name in rows.values()}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and isinstance(e["ts"], (int, float))
            spans[rows[e["pid"]]].append(e)
    for row in spans.values():
        row.sort(key=lambda e: e["ts"])
    return doc, spans


def keyed(events, name):
    return {(e["args"]["step"], e["args"].get("layer", -1)): e for e in events if e["name"] == name}


def test_weight_streaming_trace(tmp_path, oracle):
    params = oracle[0]
    result = run_wse(params, tmp_path / "ws", "train", num_csx=2, extra_launcher=("--trace",))
    assert result.returncode == 0, result.stdout + result.stderr
    assert_matches_oracle(tmp_path / "ws", oracle)          # tracing changes no number
    path = tmp_path / "ws" / "trace.json"
    lines = result.stdout.splitlines()
    assert any(l.startswith(f"| Trace: {path} (") for l in lines), result.stdout[-2000:]
    assert f"| Timeline: {path} (https://ui.perfetto.dev)" in lines   # and again in the run's summary
    doc, spans = load_trace(tmp_path / "ws")
    assert set(spans) == {"chief", "worker0", "worker1", "memoryx", "swarmx", "wse0", "wse1"}
    # One measured step drawn for a login node: a bar per span of the last step, named as in the trace.
    drawn = [r.get("data-span") for r in ET.parse(tmp_path / "ws" / "timeline.svg").iter(f"{SVG}rect")
             if r.get("data-span")]
    start = next(e["ts"] for e in spans["chief"] if e["name"] == "train_step" and e["args"]["step"] == 99)
    assert sorted(drawn) == sorted(e["name"] for row in spans.values() for e in row
                                   if e["args"].get("step") == 99 and e["ts"] >= start)
    steps = 100
    every = [(s, l) for s in range(steps) for l in range(LAYERS)]
    for wse in ("wse0", "wse1"):
        fwd = [(e["args"]["step"], e["args"]["layer"]) for e in spans[wse] if e["name"] == "fwd"]
        assert fwd == every                                     # every layer of every step, in order
        bwd = [(e["args"]["step"], e["args"]["layer"]) for e in spans[wse] if e["name"] == "bwd"]
        assert bwd == [(s, l) for s in range(steps) for l in reversed(range(LAYERS))]
    # A send per group of layers (protocol.layer_groups), named by its first layer; the last
    # group goes once, forward and at once backward. These three small layers are one group.
    sends = {**keyed(spans["memoryx"], "send_fwd"), **keyed(spans["memoryx"], "send_fwd_bwd")}
    firsts = sorted({layer for _, layer in sends})
    assert firsts == [0] and set(sends) == {(s, 0) for s in range(steps)}
    assert not keyed(spans["memoryx"], "send_bwd")             # one group: no backward message of its own
    updates = keyed(spans["memoryx"], "update")
    assert set(updates) == set(every)
    tolerance_us = 1000.0   # the clocks of one host are one clock; 1 ms covers the rounding and a remote estimate
    for wse in ("wse0", "wse1"):
        fwd, bwd = keyed(spans[wse], "fwd"), keyed(spans[wse], "bwd")
        for step, layer in every:
            # MemoryX sends layer l's group before the WSE computes layer l, and updates
            # layer l only after every WSE's backward of it.
            group = (step, max(f for f in firsts if f <= layer))
            assert sends[group]["ts"] <= fwd[(step, layer)]["ts"] + tolerance_us, (step, layer)
            assert (bwd[(step, layer)]["ts"] + bwd[(step, layer)]["dur"]
                    <= updates[(step, layer)]["ts"] + tolerance_us), (step, layer)
    assert len(keyed(spans["swarmx"], "reduce_grads")) == steps * len(firsts)   # a GRADS a group
    assert {e["args"]["step"] for e in spans["chief"] if e["name"] == "train_step"} == set(range(steps))
    assert {e["name"] for e in spans["worker0"]} >= {"make_batch", "send_batch"}
    assert len(keyed(spans["wse0"], "input_wait")) == steps
    # On one host every process reads the chief's clock; the round-trip estimate is within half the round trip.
    for name, info in doc["otherData"]["processes"].items():
        if name != "chief":
            assert info["same_clock"] and info["offset_us"] == 0
            assert abs(info["estimated_offset_us"]) <= info["round_trip_us"] / 2 + 1, name


@pytest.mark.cluster
def test_cpu_trace_is_one_row(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 4, "log_steps": 2, "checkpoint_steps": 0, "seed": 3})
    untraced = run_cpu(params, tmp_path / "cpu", "train_and_eval", timeout=120)
    assert untraced.returncode == 0 and not (tmp_path / "cpu" / "trace.json").exists()   # off by default
    result = subprocess.run([tool("csrun_cpu"), "--trace", sys.executable, FC_MNIST, "--mode", "train",
                             "--params", str(params), "--model_dir", str(tmp_path / "traced")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    _, spans = load_trace(tmp_path / "traced")
    assert list(spans) == ["chief"]
    row = spans["chief"]
    for name in ("fwd", "update"):
        assert [(e["args"]["step"], e["args"]["layer"]) for e in row if e["name"] == name] == \
            [(s, l) for s in range(4) for l in range(LAYERS)]
    steps = keyed(row, "train_step")
    for e in row:
        if e["name"] in ("fwd", "bwd", "update"):   # nested in their step's span
            outer = steps[(e["args"]["step"], -1)]
            assert outer["ts"] <= e["ts"] and e["ts"] + e["dur"] <= outer["ts"] + outer["dur"] + 0.01


@pytest.mark.cluster
def test_no_trace_without_the_flag(tmp_path):
    params = write_params(tmp_path, runconfig={"max_steps": 3, "log_steps": 3, "checkpoint_steps": 0, "seed": 3,
                                               "execution_strategy": "weight_streaming"})
    result = run_wse(params, tmp_path / "ws")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "ws" / "trace.json").exists()
    assert "| Trace:" not in result.stdout

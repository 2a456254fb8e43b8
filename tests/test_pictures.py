"""The pictures (cs_runtime/compiler/pictures.py): what each draws, read back from the SVG written.

    python -m pytest tests/test_pictures.py -q

Each picture is parsed as XML and its shapes checked against the plan or trace it was drawn
from; `layout` then lays the picture out as a renderer would (every shape's and text's box, text
at the font's width) and checks that nothing falls off the canvas and no two texts overlap.
No SVG renderer is needed.
"""
from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from cs_runtime import trace
from cs_runtime.compiler import pictures
from cs_runtime.compiler.planner import Target, make_plan
from cs_runtime.compiler.report import pictures_of
from cs_runtime.compiler.stage import compile_model, runnable
from cs_runtime.config import params_from_dict
from cs_runtime.numerics.model import transformer_spec
from cs_runtime.run_args import RunArgs

SVG = "{http://www.w3.org/2000/svg}"


def gpt(layers: int = 6):
    return transformer_spec("gpt", style="gpt2", vocab_size=500, max_len=64, hidden_size=64, num_layers=layers,
                            num_heads=2, ffn_features=256, dropout=0.1, attn_dropout=0.1, eps=1e-5)


def plan_of(spec, strategy: str, **target) -> dict:
    params = params_from_dict({"runconfig": {"execution_strategy": strategy}})
    return make_plan(runnable(spec), params, "train", Target(**target)).to_dict()


def layout(svg: str) -> ET.Element:
    """The picture as a renderer lays it out: every box on the canvas, no texts over each other."""
    root = ET.fromstring(svg)
    width, height = float(root.get("width")), float(root.get("height"))
    boxes = []
    for el in root.iter():
        if el.tag == SVG + "rect":
            x, y, w, h = (float(el.get(k)) for k in ("x", "y", "width", "height")) \
                if el.get("x") is not None else (0.0, 0.0, float(el.get("width")), float(el.get("height")))
            assert 0 <= x and x + w <= width + 0.5 and 0 <= y and y + h <= height + 0.5, ET.tostring(el)[:200]
        elif el.tag == SVG + "text" and el.text:
            size = float(el.get("font-size", pictures.FONT_PX))
            w = pictures.CHAR_PX * size / pictures.FONT_PX * len(el.text)
            x, y = float(el.get("x")), float(el.get("y"))
            x = {"middle": x - w / 2, "end": x - w}.get(el.get("text-anchor"), x)
            assert x >= 0 and x + w <= width + 0.5 and y - size >= 0 and y <= height, el.text
            boxes.append((x, y - size, x + w, y, el.text))
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            overlap = a[0] < b[2] - 0.5 and b[0] < a[2] - 0.5 and a[1] < b[3] - 0.5 and b[1] < a[3] - 0.5
            assert not overlap, f"texts over each other: {a[4]!r} and {b[4]!r}"
    return root


def test_wafer_of_30_plus_kernels_is_grouped_by_block_with_a_legend_that_fits() -> None:
    plan = plan_of(gpt(6), "pipelined")
    kernels = plan["kernels"]
    assert len(kernels) >= 30
    root = layout(pictures.render_wafer(plan))
    drawn = [r for r in root.iter(SVG + "rect") if r.get("data-kernel")]
    assert [r.get("data-kernel") for r in drawn] == [k["name"] for k in kernels]
    # The wafer as the plan places it: x and width in proportion to the kernel's columns.
    scale = pictures.WAFER_PX / plan["grid"]["cols"]
    for r, k in zip(drawn, kernels):
        assert float(r.get("x")) == pytest.approx(pictures.MARGIN + k["rect"]["x"] * scale, abs=0.06)
    # One colour family per block: a block's kernels are its colour or its lighter shade, and
    # the next block's colour differs.
    blocks = pictures.groups_of(kernels, "layer")
    fills = {r.get("data-kernel"): r.get("fill") for r in drawn}
    for b, (name, idx) in enumerate(blocks):
        base = pictures.PALETTE[b % len(pictures.PALETTE)]
        assert {fills[kernels[i]["name"]] for i in idx} <= {base, pictures.shade(base, 1)}
    legend = [t.text for t in root.iter(SVG + "text") if t.text and ". " in t.text and "kernel(s)" in t.text]
    assert len(legend) == len(blocks) and legend[0].startswith(f"1. {blocks[0][0]}:")


def test_wafer_draws_each_replica() -> None:
    plan = plan_of(gpt(2), "pipelined", multireplica=True)
    assert plan["num_replicas"] == 2
    root = layout(pictures.render_wafer(plan))
    drawn = [r for r in root.iter(SVG + "rect") if r.get("data-kernel")]
    assert len(drawn) == 2 * len(plan["kernels"])
    half = pictures.MARGIN + pictures.WAFER_PX / 2
    assert all(float(r.get("x")) < half for r in drawn[:len(plan["kernels"])])
    assert all(float(r.get("x")) >= half - 0.1 for r in drawn[len(plan["kernels"]):])


def test_one_weight_streaming_step_unit_by_unit() -> None:
    plan = plan_of(gpt(6), "weight_streaming")
    assert pictures.render_wafer(plan) is None
    svg = pictures_of(plan)["streaming.svg"]
    root = layout(svg)
    bars = [(r.get("data-unit"), r.get("data-phase"), float(r.get("x")), float(r.get("width")))
            for r in root.iter(SVG + "rect") if r.get("data-phase")]
    units = pictures.groups_of(plan["kernels"], "layer")
    names = [name for name, _ in units]
    forward = [b for b in bars if b[1] == "forward"]
    backward = [b for b in bars if b[1] == "backward"]
    # Forward unit by unit, then backward in reverse, one after another on the wafer.
    assert [b[0] for b in forward] == names and [b[0] for b in backward] == names[::-1]
    slots = forward + backward
    assert all(a[2] < b[2] and a[2] + a[3] <= b[2] + 1.2 for a, b in zip(slots, slots[1:]))  # 1 px at least
    # Weights in for each pass of a unit with weights, gradients out after its backward; no more.
    weighted = {name for name, idx in units if any(plan["kernels"][i]["weight_bytes"] for i in idx)}
    assert sorted(b[0] for b in bars if b[1] == "weights in") == sorted(2 * list(weighted))
    assert sorted(b[0] for b in bars if b[1] == "gradients out") == sorted(weighted)
    # The bytes said are the plan's.
    first = next(name for name in names if name in weighted)
    nbytes = sum(plan["kernels"][i]["weight_bytes"] for i in dict(units)[first])
    assert f"{first} weights in: {pictures.fmt_bytes(nbytes)}" in svg


def traced(steps: int = 3) -> list[trace.ProcessTrace]:
    ms = 1_000_000
    chief = trace.ProcessTrace("chief", [("train_step", s * 10 * ms, 9 * ms, s, -1) for s in range(steps)])
    wse = trace.ProcessTrace("wse0", [(phase, s * 10 * ms + (1 + 2 * k + (4 if phase == "bwd" else 0)) * ms,
                                       ms, s, k if phase == "fwd" else 1 - k)
                                      for s in range(steps) for phase in ("fwd", "bwd") for k in range(2)])
    mx = trace.ProcessTrace("memoryx", [("update", s * 10 * ms + 8 * ms, ms // 2, s, 0) for s in range(steps)])
    # An input worker makes each step's batch a step ahead: before the step starts.
    worker = trace.ProcessTrace("worker0", [("make_batch", (s - 1) * 10 * ms + 2 * ms, ms, s, -1)
                                            for s in range(1, steps)])
    return [chief, wse, mx, worker]


def test_timeline_draws_the_last_step_from_the_trace_written(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.write_chrome_trace(path, traced())
    written = pictures.write_timeline(path)
    assert written == tmp_path / "timeline.svg"
    root = layout(written.read_text())
    doc = json.loads(path.read_text())
    expected = [e for e in doc["traceEvents"] if e["ph"] == "X" and e["args"]["step"] == 2
                and e["name"] != "make_batch"]   # made during step 1: not part of step 2's picture
    bars = [r for r in root.iter(SVG + "rect") if r.get("data-span")]
    assert sorted(r.get("data-span") for r in bars) == sorted(e["name"] for e in expected)
    # Widths in proportion to the measured durations; the step spans the chart.
    scale = pictures.TIMELINE_PX / 9000.0   # the step's spans cover 9 ms (in us)
    drawn = sorted((r.get("data-span"), float(r.get("width"))) for r in bars)
    measured = sorted((e["name"], e["dur"] * scale) for e in expected)
    assert [n for n, _ in drawn] == [n for n, _ in measured]
    assert [w for _, w in drawn] == pytest.approx([w for _, w in measured], abs=0.02)
    title = next(root.iter(SVG + "text")).text
    assert title.startswith("step 2, measured: 9 ms, 3 processes") and "1 earlier spans" in title


def test_no_steps_no_timeline(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    trace.write_chrome_trace(path, [trace.ProcessTrace("chief", [("setup", 0, 5, -1, -1)])])
    assert pictures.write_timeline(path) is None and not (tmp_path / "timeline.svg").exists()


@pytest.mark.parametrize("strategy, picture, stale", [("pipelined", "wafer.svg", "streaming.svg"),
                                                       ("weight_streaming", "streaming.svg", "wafer.svg")])
def test_compile_only_writes_the_picture_of_the_mode(tmp_path: Path, strategy: str, picture: str,
                                                     stale: str) -> None:
    model = tmp_path / "model"
    (model / "compile").mkdir(parents=True)
    (model / "compile" / stale).write_text("<svg/>")   # a picture of another mode, from an earlier run
    params = params_from_dict({"runconfig": {"execution_strategy": strategy}})
    compile_model(gpt(2), RunArgs("train", "p.yaml", params, str(model), None, False, True))
    layout((model / "compile" / picture).read_text())
    assert not (model / "compile" / stale).exists()


def rasterize(svg: str):
    """The picture's shapes painted in document order, as a renderer paints them (Pillow)."""
    image_module = pytest.importorskip("PIL.Image", reason="painting the pictures needs Pillow")
    from PIL import ImageDraw
    root = ET.fromstring(svg)
    image = image_module.new("RGB", (int(float(root.get("width"))), int(float(root.get("height")))), "white")
    draw = ImageDraw.Draw(image)
    for el in root.iter():
        if el.tag == SVG + "rect" and el.get("x") is not None:
            x, y, w, h = (float(el.get(k)) for k in ("x", "y", "width", "height"))
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill=el.get("fill"))
        elif el.tag == SVG + "line":
            draw.line([float(el.get(k)) for k in ("x1", "y1", "x2", "y2")], fill=el.get("stroke"))
    return image, root


def _hex(rgb: tuple) -> str:
    return "#" + "".join(f"{c:02x}" for c in rgb[:3])


@pytest.mark.parametrize("picture", ["wafer", "streaming", "timeline"])
def test_painted_every_shape_shows_its_own_colour(tmp_path: Path, picture: str) -> None:
    """Rendered once: each kernel, slot or span is seen (its centre has its colour, nothing
    painted over it)."""
    if picture == "wafer":
        svg = pictures.render_wafer(plan_of(gpt(6), "pipelined"))
    elif picture == "streaming":
        svg = pictures_of(plan_of(gpt(6), "weight_streaming"))["streaming.svg"]
    else:
        trace.write_chrome_trace(tmp_path / "trace.json", traced())
        svg = pictures.write_timeline(tmp_path / "trace.json").read_text()
    image, root = rasterize(svg)
    shapes = [r for r in root.iter(SVG + "rect") if r.get("data-kernel") or r.get("data-phase") or r.get("data-span")]
    seen = 0
    for r in shapes:
        x, y, w, h = (float(r.get(k)) for k in ("x", "y", "width", "height"))
        if w >= 3 and h >= 3:   # a sliver is left to its tooltip
            assert _hex(image.getpixel((int(x + w / 2), int(y + h / 2)))) == r.get("fill"), ET.tostring(r)[:120]
            seen += 1
    assert seen >= len(shapes) // 2

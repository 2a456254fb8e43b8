"""Tests for cs_runtime.protocol (encode/decode, validation) and transport.Endpoint.

    python -m pytest tests/test_protocol.py -q

Every malformed message must end in a ProtocolError that says what is wrong,
never in another exception, an allocation the header asked for, or a state
change in the receiver.
"""
from __future__ import annotations

import logging
import re
import tokenize
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cs_runtime.wire import protocol
from cs_runtime.wire.protocol import (
    ALL_REDUCE_ARRAY,
    ALLOWED_DTYPES,
    FRONT_DOOR,
    MAX_DIMS,
    MAX_HEADER_BYTES,
    META_SCHEMA,
    PROTOCOL_VERSION,
    ZERO_COPY_THRESHOLD,
    JobSettings,
    Message,
    Msg,
    ProtocolError,
    SETTINGS_ARRAY,
    SPAN_ARRAYS,
    STEPS_AHEAD,
    array_bytes,
    burst,
    decode,
    encode,
    unburst,
)
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.numerics.optim import OptimizerSpec
from cs_runtime.wire.transport import Endpoint

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------

def _sample_value(typ):
    """A value of the type META_SCHEMA asks for (a tuple means any of them)."""
    if isinstance(typ, tuple):
        typ = typ[-1]  # (int, float): take float, ints are covered elsewhere
    return {str: "x", int: 3, float: 0.5, bool: True, dict: {"k": 1}, list: [1, "a"]}[typ]


# Front-door fields have a fixed shape as well as a type.
FRONT_DOOR_SAMPLES = {"name": "wsjob-1", "owner": "ab" * 32, "labels": {"k": "v"}, "keys": {}, "phase": "QUEUED",
                      "user": "u", "num_csx": 1}


# LOAD_MODEL's spec is the job's settings (protocol.JobSettings), checked field by field.
SETTINGS = JobSettings(mlp_spec("m", [4, 3, 2], "relu", 0.0), OptimizerSpec("sgd", momentum=0.9), seed=1)


def raw_load_model(spec: dict) -> Message:
    """A LOAD_MODEL whose settings array holds `spec` as it is: what a peer of another mind could send."""
    return Message(Msg.LOAD_MODEL, arrays={SETTINGS_ARRAY: np.frombuffer(msgpack.packb(spec), np.uint8)})


def minimal_meta(mtype: Msg) -> dict:
    meta = {key: _sample_value(typ) for key, typ in META_SCHEMA[mtype].items()}
    if mtype == Msg.LOAD_MODEL:
        meta["spec"] = SETTINGS.to_meta()   # the wire form, as a raw header would carry it
    if mtype in FRONT_DOOR:
        meta.update({k: v for k, v in FRONT_DOOR_SAMPLES.items() if k in meta})
    return meta


def header(mtype: Msg = Msg.GRADS, **overrides) -> dict:
    h = {"t": mtype.value, "v": PROTOCOL_VERSION, "job": "job1", "step": 2, "layer": 0,
         "meta": minimal_meta(mtype), "arrays": []}
    h.update(overrides)
    return h


def pack(h) -> bytes:
    return msgpack.packb(h, use_bin_type=True)


def sample_array(dtype: str, shape: tuple) -> np.ndarray:
    n = int(np.prod(shape))
    if dtype == "bool":
        return (np.arange(n) % 3 == 0).reshape(shape)
    return (np.arange(n) % 251).astype(dtype).reshape(shape)


def reject(frames, *words):
    """decode(frames) raises ProtocolError whose message contains every word."""
    with pytest.raises(ProtocolError) as info:
        decode(frames)
    text = str(info.value)
    for word in words:
        assert word in text, f"{word!r} not in {text!r}"
    return text


# --------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------

@pytest.mark.parametrize("mtype", list(Msg))
def test_every_type_round_trips_with_minimal_meta(mtype):
    meta, arrays = minimal_meta(mtype), {"a": np.arange(4, dtype=np.float32)}
    if mtype == Msg.LOAD_MODEL:   # a sender hands encode the typed settings; decode hands them back
        meta["spec"] = SETTINGS
    if mtype == Msg.TRACE:   # its names and span arrays are checked too (tests/test_trace.py)
        meta["names"] = ["fwd"]
        arrays = {name: np.zeros(4, dtype) for name, dtype in SPAN_ARRAYS.items()}
    if mtype == Msg.ALL_REDUCE:   # one float64 vector of sums (below)
        arrays = {ALL_REDUCE_ARRAY: np.arange(4, dtype=np.float64)}
    msg = Message(mtype, job="j", step=7, layer=3, meta=meta, arrays=arrays)
    out = decode(encode(msg))
    assert out.type is mtype
    assert (out.job, out.step, out.layer, out.meta) == ("j", 7, 3, msg.meta)
    for name, arr in arrays.items():
        np.testing.assert_array_equal(out.arrays[name], arr)


@pytest.mark.parametrize("arrays, layer", [({ALL_REDUCE_ARRAY: np.zeros(3, np.float32)}, 0),
                                           ({ALL_REDUCE_ARRAY: np.zeros((2, 3))}, 0),
                                           ({ALL_REDUCE_ARRAY: np.zeros(3), "b": np.zeros(3)}, 0),
                                           ({ALL_REDUCE_ARRAY: np.zeros(3)}, -1)])
def test_an_all_reduce_is_one_float64_vector_of_a_numbered_collective(arrays, layer):
    reject(encode(Message(Msg.ALL_REDUCE, job="j", step=1, layer=layer, arrays=arrays)), "all_reduce")


def test_meta_schema_covers_every_type():
    assert set(META_SCHEMA) == set(Msg)


@pytest.mark.parametrize("dtype", sorted(ALLOWED_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3), (0, 4), (2, 1, 3)])
def test_every_dtype_and_shape_round_trips(dtype, shape):
    arr = sample_array(dtype, shape)
    out = decode(encode(Message(Msg.GRADS, arrays={"g": arr}))).arrays["g"]
    assert out.dtype == np.dtype(dtype)
    assert out.shape == shape
    np.testing.assert_array_equal(out, arr)


def test_several_arrays_keep_order_names_and_values():
    arrays = {"w": np.ones((2, 2), np.float32), "b": np.zeros(2, np.float64),
              "y": np.array([1, 2], np.int64), "scalar": np.array(4.5, np.float16)}
    out = decode(encode(Message(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays=arrays)))
    assert list(out.arrays) == list(arrays)
    for name in arrays:
        np.testing.assert_array_equal(out.arrays[name], arrays[name])
    assert array_bytes(out) == sum(a.nbytes for a in arrays.values())


def test_non_contiguous_and_big_endian_arrays_arrive_with_their_values():
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    big_endian = np.arange(5, dtype=">i4")
    out = decode(encode(Message(Msg.GRADS, arrays={"t": base.T, "s": base[:, ::2],
                                                   "be": big_endian})))
    np.testing.assert_array_equal(out.arrays["t"], base.T)
    np.testing.assert_array_equal(out.arrays["s"], base[:, ::2])
    np.testing.assert_array_equal(out.arrays["be"], big_endian)


def test_large_array_is_sent_zero_copy_and_small_one_as_bytes():
    big = np.random.default_rng(0).standard_normal((128, 128)).astype(np.float32)   # one full frame
    assert big.nbytes >= ZERO_COPY_THRESHOLD and big.nbytes <= protocol.MAX_FRAME_BYTES
    small = np.arange(10, dtype=np.float32)
    frames = encode(Message(Msg.GRADS, arrays={"big": big, "small": small}))
    assert frames[1] is big or np.shares_memory(frames[1], big)  # the array's own buffer
    assert isinstance(frames[2], bytes)
    out = decode(frames)
    np.testing.assert_array_equal(out.arrays["big"], big)
    np.testing.assert_array_equal(out.arrays["small"], small)


def test_an_array_over_the_frame_cap_travels_in_full_frames_and_arrives_whole():
    cap = protocol.MAX_FRAME_BYTES
    big = np.random.default_rng(1).standard_normal(cap // 4 * 2 + 1000).astype(np.float32)   # 2 full + a bit
    after = np.arange(3, dtype=np.int64)
    frames = encode(Message(Msg.GRADS, arrays={"big": big, "after": after}))
    sizes = [memoryview(f).nbytes for f in frames[1:]]
    assert sizes == [cap, cap, big.nbytes - 2 * cap, after.nbytes]
    assert all(np.shares_memory(np.frombuffer(f, np.uint8), big) for f in frames[1:3])   # zero-copy views
    out = decode([bytes(f) for f in frames])
    np.testing.assert_array_equal(out.arrays["big"], big)
    np.testing.assert_array_equal(out.arrays["after"], after)
    assert not out.arrays["big"].flags.writeable


def test_split_arrays_with_frames_of_the_wrong_sizes_are_refused():
    cap = protocol.MAX_FRAME_BYTES
    h = pack(header(arrays=[["a", "uint8", [2 * cap]]]))
    decode([h, bytes(cap), bytes(cap)])
    reject([h, bytes(cap)], "1 arrays in 2 frames", "1 frames follow")
    reject([h, bytes(cap - 1), bytes(cap + 1)], "frame has", f"header says {2 * cap}")
    reject([h, bytes(cap), bytes(cap), bytes(1)], "3 frames follow")


def test_decoded_arrays_are_read_only():
    big = np.ones(ZERO_COPY_THRESHOLD, np.float32)
    out = decode(encode(Message(Msg.GRADS, arrays={"big": big, "small": np.ones(3)})))
    for arr in out.arrays.values():
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[...] = 0
    assert big.flags.writeable and (big == 1).all()  # the sender's array is untouched


def test_an_array_in_a_misaligned_frame_arrives_aligned_so_products_keep_their_bits():
    """ZeroMQ hands small frames over as views into its receive buffer, at any byte offset.
    numpy computes a product of a misaligned operand without BLAS (other float32 bits), so a
    decoded array is aligned whatever its frame's address."""
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((32, 32)).astype(np.float32), rng.standard_normal((16, 32)).astype(np.float32)
    frames = encode(Message(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays={"w": w}))
    stream = bytearray(len(frames[1]) + 1)
    stream[1:] = frames[1]
    misaligned = memoryview(stream)[1:]
    assert not np.frombuffer(misaligned, np.float32).flags.aligned
    out = decode([frames[0], misaligned]).arrays["w"]
    assert out.flags.aligned and not out.flags.writeable
    np.testing.assert_array_equal(x @ out.T, x @ w.T)


def test_encode_refuses_disallowed_dtypes():
    for bad in (np.array([object()], dtype=object), np.array(["hello"]), np.array([1 + 2j])):
        with pytest.raises(ProtocolError, match="not allowed"):
            encode(Message(Msg.GRADS, arrays={"bad": bad}))


# --------------------------------------------------------------------------
# rejections: each a ProtocolError that says what is wrong
# --------------------------------------------------------------------------

def test_reject_empty_message():
    reject([], "empty")


def test_reject_not_msgpack():
    reject([b"\xc1\xc1\xc1"], "msgpack")
    reject([pack(header()) + b"trailing"], "msgpack")


def test_reject_header_not_a_map():
    reject([pack([1, 2, 3])], "not a map")
    reject([pack("grads")], "not a map")


def test_reject_oversized_header():
    h = header(meta={"filler": "x" * (MAX_HEADER_BYTES + 10)})
    reject([pack(h)], "header", "cap")


def test_reject_wrong_version():
    reject([pack(header(v=PROTOCOL_VERSION + 1))], "version", str(PROTOCOL_VERSION + 1))


def test_reject_unknown_type():
    reject([pack(header(t="format_disk"))], "unknown message type", "format_disk")


@pytest.mark.parametrize("key,value", [("t", 5), ("v", "1"), ("v", True), ("job", None),
                                       ("step", True), ("step", 1.0), ("layer", "0"),
                                       ("meta", []), ("arrays", {})])
def test_reject_bad_header_field(key, value):
    reject([pack(header(**{key: value}))], repr(key))


@pytest.mark.parametrize("key", ["t", "v", "job", "step", "layer", "meta", "arrays"])
def test_reject_missing_header_field(key):
    h = header()
    del h[key]
    reject([pack(h)], repr(key), "missing")


@pytest.mark.parametrize("mtype", [m for m in Msg if META_SCHEMA[m]])
def test_reject_missing_meta_field(mtype):
    for key in META_SCHEMA[mtype]:
        meta = minimal_meta(mtype)
        del meta[key]
        reject([pack(header(mtype, meta=meta))], mtype.value, repr(key))


@pytest.mark.parametrize("mtype,key,value", [
    (Msg.HEARTBEAT, "rank", "1"),
    (Msg.HEARTBEAT, "rank", 1.0),
    (Msg.HEARTBEAT, "rank", True),          # bool is an int subclass: still refused
    (Msg.BATCH, "global_batch", False),
    (Msg.LOSS, "count", True),
    (Msg.LOSS, "loss", True),               # numeric field: bool refused too
    (Msg.TRAIN_STEP, "lr", "0.1"),
    (Msg.STATUS, "ok", 1),                  # bool field: an int is not a bool
    (Msg.REGISTER, "endpoints", []),
    (Msg.PLAN, "phases", {}),
    (Msg.ACK, "what", None),
])
def test_reject_wrong_typed_meta_field(mtype, key, value):
    meta = minimal_meta(mtype)
    meta[key] = value
    reject([pack(header(mtype, meta=meta))], mtype.value, repr(key), "wrong type")


def test_load_model_settings_round_trip_and_parse_to_the_same_settings():
    settings = JobSettings(mlp_spec("m", [4, 3, 2], "tanh", 0.1),
                           OptimizerSpec("adam", betas=(0.8, 0.99), exclude_bias_and_norm=True), seed=5,
                           execution_strategy="pipelined", replicas=2, max_gradient_norm=1.5,
                           loss_scaling="dynamic", trace=True)
    out = decode(encode(Message(Msg.LOAD_MODEL, meta={"spec": settings})))
    assert out.meta["spec"] == settings
    assert settings.pipelined and settings.skips_nonfinite


def test_load_model_settings_larger_than_a_header_travel_in_their_array():
    # A 12-block transformer's program outgrows the 64 KB header cap; the settings must not.
    wide = mlp_spec("m", [4] + [3] * 3000 + [2], "relu", 0.0)
    settings = JobSettings(wide, OptimizerSpec("sgd"), seed=1)
    frames = encode(Message(Msg.LOAD_MODEL, meta={"spec": settings}))
    assert len(frames[0]) < MAX_HEADER_BYTES < len(msgpack.packb(settings.to_meta()))
    assert decode(frames).meta["spec"] == settings


@pytest.mark.parametrize("settings_array", [None, np.zeros(4, np.float32), np.frombuffer(b"\xc1", np.uint8),
                                            np.frombuffer(msgpack.packb([1, 2]), np.uint8)])
def test_reject_load_model_without_well_formed_settings(settings_array):
    arrays = {} if settings_array is None else {SETTINGS_ARRAY: settings_array}
    frames = [pack(header(Msg.LOAD_MODEL, meta={},
                          arrays=[[n, a.dtype.name, list(a.shape)] for n, a in arrays.items()])),
              *[a.tobytes() for a in arrays.values()]]
    reject(frames, "load_model")


@pytest.mark.parametrize("key,value", [
    ("seed", "1"), ("seed", True), ("replicas", 0), ("execution_strategy", None), ("loss_scaling", "x"),
    ("max_gradient_norm", -1.0), ("trace", 1), ("optimizer", {"kind": "rmsprop"}),
    ("optimizer", {"kind": "sgd", "lr": 0.1}), ("optimizer", {"kind": "adam", "betas": [0.9]}),
    ("optimizer", {"kind": "adamw", "exclude_bias_and_norm": 1}),
    ("optimizer", {"kind": "adam", "nesterov": True}), ("optimizer", {"kind": "sgd", "nesterov": True}),
    ("optimizer", {"kind": "sgd", "momentum": 0.9, "nesterov": True, "dampening": 0.1}),
    ("optimizer", {"kind": "sgd", "nesterov": "yes"}),
    ("model", {"name": "m"}), ("model", {"name": "m", "layers": [{"name": "fc0", "op": "dense"}]}),
    ("model", {"name": "m", "layers": [{"name": "fc0", "op": "dense", "in_features": "4", "out_features": 2}]}),
    ("model", {"name": "m", "layers": [{"name": "fc0", "op": "dense", "in_features": -4, "out_features": 2}]}),
])
def test_reject_load_model_settings_naming_the_field(key, value):
    reject(encode(raw_load_model({**SETTINGS.to_meta(), key: value})), "load_model", repr(key))


def test_load_model_settings_defaults_fill_what_is_absent():
    spec = {"model": SETTINGS.model.to_dict(), "optimizer": {"kind": "sgd"}, "seed": 3}
    settings = decode(encode(raw_load_model(spec))).meta["spec"]
    assert (settings.execution_strategy, settings.replicas, settings.max_gradient_norm, settings.loss_scaling,
            settings.trace) == ("weight_streaming", 1, None, "none", False)


def test_numeric_meta_accepts_int_and_float():
    for lr in (1, 0.25):
        frames = [pack(header(Msg.TRAIN_STEP, meta={"lr": lr}))]
        assert decode(frames).meta["lr"] == lr


@pytest.mark.parametrize("dtype", ["object", "<U5", "O", "complex128", "float32 ", "V8", ""])
def test_reject_disallowed_dtype(dtype):
    reject([pack(header(arrays=[["a", dtype, [2]]])), b"\0" * 16], "'a'", "dtype", "not allowed")


def test_reject_byte_size_mismatch():
    reject([pack(header(arrays=[["w", "float32", [3]]])), b"\0" * 8],
           "'w'", "8 bytes", "12")
    reject([pack(header(arrays=[["w", "float64", [2, 2]]])), b"\0" * 40], "40", "32")


def test_reject_negative_dims():
    reject([pack(header(arrays=[["w", "float32", [2, -1]]])), b""], "'w'", "shape", "-1")


def test_reject_non_int_dims():
    for shape in ([2.0], [True], ["2"], [None]):
        reject([pack(header(arrays=[["w", "uint8", shape]])), b"\0\0"], "'w'", "shape")


def test_reject_too_many_dims():
    shape = [1] * (MAX_DIMS + 1)
    reject([pack(header(arrays=[["w", "uint8", shape]])), b"\0"], "'w'", "dims", str(MAX_DIMS))
    ok = decode([pack(header(arrays=[["w", "uint8", [1] * MAX_DIMS]])), b"\0"])
    assert ok.arrays["w"].shape == (1,) * MAX_DIMS


def test_reject_malformed_array_spec():
    for spec in (["w", "float32"], "w", ["w", "float32", 3], [1, "float32", [1]]):
        reject([pack(header(arrays=[spec])), b"\0" * 4], "array spec")


def test_reject_frame_count_mismatch():
    h = pack(header(arrays=[["a", "uint8", [1]], ["b", "uint8", [1]]]))
    reject([h, b"\0"], "2 arrays", "1 frames")
    reject([h, b"\0", b"\0", b"\0"], "2 arrays", "3 frames")
    reject([pack(header()), b"stray"], "0 arrays", "1 frames")


def test_reject_too_many_arrays(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_ARRAYS", 2)
    specs = [[f"a{i}", "uint8", [1]] for i in range(3)]
    reject([pack(header(arrays=specs)), b"\0", b"\0", b"\0"], "3 arrays", "cap")


# --------------------------------------------------------------------------
# array tables over a header (a model's worth of arrays)
# --------------------------------------------------------------------------

def many_arrays(count: int) -> dict:
    """`count` tiny arrays with names as long as a deep model's optimizer slots."""
    return {f"encoder.layers.{i}.self_attention.in_proj_weight.exp_avg_sq": np.full((2, 3), i, np.float32)
            for i in range(count)}


def test_a_message_of_thousands_of_arrays_round_trips_with_its_table_in_frames_of_its_own():
    arrays = many_arrays(2500)
    frames = encode(Message(Msg.STATE, job="job1", step=3, arrays=arrays))
    tables = msgpack.unpackb(frames[0])["tables"]
    assert tables >= 3 and len(frames) == 1 + tables + len(arrays)
    assert all(len(f) <= protocol.MAX_FRAME_BYTES for f in frames[:1 + tables])
    got = decode(frames)
    assert list(got.arrays) == list(arrays) and got.step == 3
    np.testing.assert_array_equal(np.stack(list(got.arrays.values())), np.stack(list(arrays.values())))


def test_a_load_model_whose_table_outgrows_a_header_arrives_with_its_settings():
    arrays = many_arrays(1500)
    frames = encode(Message(Msg.LOAD_MODEL, meta={"spec": SETTINGS}, arrays=arrays))
    assert msgpack.unpackb(frames[0])["tables"] >= 2
    got = decode(frames)
    assert got.meta["spec"] == SETTINGS and list(got.arrays) == list(arrays)


def test_a_small_message_keeps_its_table_in_the_header():
    frames = encode(Message(Msg.GRADS, arrays=many_arrays(3)))
    assert "tables" not in msgpack.unpackb(frames[0]) and len(frames) == 4


def table_message(count: int = 1500) -> list:
    return encode(Message(Msg.STATE, job="job1", arrays=many_arrays(count)))


def with_header(frames: list, **changes) -> list:
    return [pack({**msgpack.unpackb(frames[0]), **changes}), *frames[1:]]


@pytest.mark.parametrize("tables, words", [
    (0, ["'tables'"]), (-1, ["'tables'"]), (True, ["'tables'"]), ("2", ["'tables'"]),
    (protocol.MAX_TABLE_FRAMES + 1, ["'tables'", str(protocol.MAX_TABLE_FRAMES)]),
    (1, ["frames follow"]),   # a table frame too few: the rest of the table is read as arrays
])
def test_a_bad_table_count_is_refused(tables, words):
    reject(with_header(table_message(), tables=tables), *words)


def test_a_table_count_beyond_the_frames_that_came_is_refused_before_one_is_read():
    frames = table_message()
    count = msgpack.unpackb(frames[0])["tables"]
    reject(frames[:count], "'tables'")


def test_a_table_beside_the_headers_own_list_is_refused():
    reject(with_header(table_message(), arrays=[["a", "uint8", [1]]]), "'arrays' empty")


@pytest.mark.parametrize("frame, words", [
    (b"\xc1", ["array table frame", "not valid msgpack"]),
    (pack({"a": 1}), ["not a non-empty list"]),
    (pack([]), ["not a non-empty list"]),
    (b"\0" * (MAX_HEADER_BYTES + 1), ["array table frame", "exceeds"]),
    (pack([["a", "complex64", [1]]]), ["complex64", "not allowed"]),
])
def test_a_malformed_or_oversized_table_frame_is_refused(frame, words):
    frames = table_message()
    reject([frames[0], frame, *frames[2:]], *words)


def test_a_table_over_the_array_cap_is_refused_before_the_next_frame_is_read(monkeypatch):
    frames = table_message()
    monkeypatch.setattr(protocol, "MAX_ARRAYS", 10)
    reject(frames, "over 10 arrays")


def test_a_table_beyond_its_caps_is_refused_by_its_sender(monkeypatch):
    monkeypatch.setattr(protocol, "MAX_TABLE_FRAMES", 1)
    with pytest.raises(protocol.MessageTooLarge, match="over the cap of 1 frames"):
        table_message()
    with pytest.raises(protocol.MessageTooLarge, match="frame cap"):
        encode(Message(Msg.GRADS, arrays={"n" * MAX_HEADER_BYTES: np.zeros(1, np.float32)}))


def test_reject_array_over_cap_without_allocating(monkeypatch):
    cap = 1024
    monkeypatch.setattr(protocol, "MAX_ARRAY_BYTES", cap)

    def no_array(*args, **kwargs):
        raise AssertionError("an array was built for a message over the cap")

    monkeypatch.setattr(np, "frombuffer", no_array)
    # 129 float64 = 1032 bytes > cap; every dim is within the cap on its own.
    reject([pack(header(arrays=[["w", "float64", [129]]])), b""], "'w'", "1032 bytes", "cap")
    reject([pack(header(arrays=[["w", "float32", [32, 32]]])), b""], "'w'", "cap")
    # A single dim beyond the cap is refused as a shape.
    reject([pack(header(arrays=[["w", "uint8", [cap + 1]]])), b""], "'w'", "shape")


def test_reject_huge_declared_shape_whose_product_overflows_int64():
    # 3 dims of 2**31: 2**93 bytes. An int64 product wraps to 0 and would match an
    # empty frame; the check must be exact.
    big = protocol.MAX_ARRAY_BYTES
    reject([pack(header(arrays=[["w", "uint8", [big, big, big]]])), b""], "'w'", "cap")
    reject([pack(header(arrays=[["w", "uint8", [big] * MAX_DIMS]])), b""], "'w'", "cap")


def test_empty_and_zero_dim_arrays_are_accepted_at_the_limits():
    h = pack(header(arrays=[["e", "float32", [0, protocol.MAX_ARRAY_BYTES]],
                            ["s", "int64", []]]))
    out = decode([h, b"", np.int64(9).tobytes()])
    assert out.arrays["e"].shape == (0, protocol.MAX_ARRAY_BYTES)
    assert out.arrays["s"].shape == () and int(out.arrays["s"]) == 9


# --------------------------------------------------------------------------
# property-based: nothing but ProtocolError, ever
# --------------------------------------------------------------------------

FUZZ = settings(max_examples=75, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def decode_or_protocol_error(frames) -> None:
    try:
        decode(frames)
    except ProtocolError:
        pass


msgpack_leaves = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1)
                  | st.floats(allow_nan=True) | st.text(max_size=12) | st.binary(max_size=12))
msgpack_values = st.recursive(
    msgpack_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=10)
frames_after = st.lists(st.binary(max_size=64), max_size=4)


@FUZZ
@given(st.binary(max_size=256), frames_after)
def test_fuzz_arbitrary_bytes(raw, rest):
    decode_or_protocol_error([raw, *rest])


@FUZZ
@given(msgpack_values, frames_after)
def test_fuzz_arbitrary_msgpack_headers(value, rest):
    decode_or_protocol_error([pack(value), *rest])


dims = st.integers(-3, 2**40) | st.sampled_from([0, 1, 2, 2**31, 2**31 - 1, 2**63, 2**64 - 1])
array_specs = st.lists(
    st.one_of(
        st.tuples(st.text(max_size=4), st.sampled_from(sorted(ALLOWED_DTYPES) + ["object", "<U5", "xx"]),
                  st.lists(dims, max_size=MAX_DIMS + 2)).map(list),
        msgpack_values),
    max_size=4)


@FUZZ
@given(st.sampled_from([m.value for m in Msg] + ["nope"]),
       st.sampled_from([PROTOCOL_VERSION, PROTOCOL_VERSION, 0, True]),
       st.one_of(st.builds(dict), st.dictionaries(st.text(max_size=12), msgpack_values, max_size=6),
                 msgpack_values),
       array_specs, frames_after, st.data())
def test_fuzz_structured_headers(mtype, version, meta, specs, rest, data):
    h = {"t": mtype, "v": version, "job": "j", "step": 1, "layer": 0, "meta": meta, "arrays": specs}
    if isinstance(meta, dict) and mtype in {m.value for m in Msg} and data.draw(st.booleans()):
        meta.update(minimal_meta(Msg(mtype)))  # often make the meta valid to get deeper
    decode_or_protocol_error([pack(h), *rest])


def _valid_frames(seed: int) -> list:
    rng = np.random.default_rng(seed)
    arrays = {"x": rng.standard_normal((3, 4)).astype(np.float32),
              "y": rng.integers(0, 10, 3), "s": np.array(True)}
    frames = encode(Message(Msg.BATCH, job="j", step=1, meta=minimal_meta(Msg.BATCH), arrays=arrays))
    return [bytes(f) if not isinstance(f, bytes) else f for f in frames]


@FUZZ
@given(st.integers(0, 3), st.data())
def test_fuzz_truncated_valid_messages(seed, data):
    frames = _valid_frames(seed)
    decode(frames)  # the untouched message is valid
    which = data.draw(st.integers(0, len(frames) - 1))
    cut = data.draw(st.integers(0, max(0, len(frames[which]) - 1)))
    truncated = list(frames)
    truncated[which] = frames[which][:cut]
    with pytest.raises(ProtocolError):
        decode(truncated)
    keep = data.draw(st.integers(0, len(frames) - 1))
    with pytest.raises(ProtocolError):
        decode(frames[:keep])


# --------------------------------------------------------------------------
# Endpoint over real ZeroMQ sockets
# --------------------------------------------------------------------------

@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


@pytest.fixture
def curve_pair(ctx):
    """(server, client, keys): a CURVE ROUTER and a DEALER connected to it, of job1."""
    from cs_runtime.wire import auth
    folder = auth.create_job_dir()
    keys = auth.load_keys(str(folder))
    server = Endpoint(ctx, zmq.ROUTER, "server", job="job1", keys=keys)
    client = Endpoint(ctx, zmq.DEALER, "client", job="job1", keys=keys)
    try:
        client.connect(server.bind("127.0.0.1"))
        yield server, client, keys
    finally:
        client.close()
        server.close()
        auth.stop_authenticator(ctx)
        auth.remove_job_dir(folder)


def test_endpoint_round_trip_over_tcp_zero_copy(ctx):
    server = Endpoint(ctx, zmq.ROUTER, "server", job="job1")
    client = Endpoint(ctx, zmq.DEALER, "client", job="job1")
    try:
        client.sock.setsockopt(zmq.IDENTITY, b"wse0")
        client.connect(server.bind("127.0.0.1"))
        big = np.random.default_rng(1).standard_normal((256, 256)).astype(np.float32)
        client.send(Message(Msg.GRADS, step=4, layer=1, arrays={"weight": big, "bias": big[0]}))
        got = server.recv(timeout_ms=5000)
        assert got is not None
        identity, msg = got
        assert identity == b"wse0" and msg.job == "job1" and (msg.step, msg.layer) == (4, 1)
        np.testing.assert_array_equal(msg.arrays["weight"], big)
        np.testing.assert_array_equal(msg.arrays["bias"], big[0])
        assert not msg.arrays["weight"].flags.writeable
        assert not msg.arrays["bias"].flags.writeable
        assert client.bytes_sent == server.bytes_received == big.nbytes + big[0].nbytes
        # and back, routed by identity
        server.send(Message(Msg.ACK, meta={"what": "grads"}), identity)
        _, ack = client.recv(timeout_ms=5000)
        assert ack.type is Msg.ACK and ack.meta == {"what": "grads"}
    finally:
        client.close()
        server.close()


def test_endpoint_carries_arrays_of_many_frames_under_curve_within_the_frame_cap(curve_pair):
    """Each frame, CURVE's wrapping included, fits the socket's MAXMSGSIZE (else libzmq
    drops the connection silently and the message never comes)."""
    server, client, _ = curve_pair
    big = np.random.default_rng(2).standard_normal(protocol.MAX_FRAME_BYTES // 4 * 3 - 5).astype(np.float32)
    client.send(Message(Msg.GRADS, step=1, layer=0, arrays={"weight": big}))
    got = server.recv(timeout_ms=5000)
    assert got is not None, "the split array never arrived"
    np.testing.assert_array_equal(got[1].arrays["weight"], big)


def test_a_header_over_the_cap_is_refused_by_its_sender_naming_the_peer_and_the_limit(ctx, caplog):
    """A header no receiver takes (a state of some 1,500 named arrays) is one clear error where it is sent,
    not a 'bad message' at the peer (or, over its frame cap, a connection dropped without a word)."""
    server = Endpoint(ctx, zmq.ROUTER, "memoryx", job="job1")
    client = Endpoint(ctx, zmq.DEALER, "chief->memoryx", job="job1")
    try:
        address = server.bind("127.0.0.1")
        client.connect(address)
        fits = Message(Msg.HEARTBEAT, meta={"role": "chief", "rank": 0, "filler": "x" * (MAX_HEADER_BYTES - 200)})
        too_big = Message(Msg.HEARTBEAT, meta={"role": "chief", "rank": 0, "filler": "x" * MAX_HEADER_BYTES})
        with pytest.raises(protocol.MessageTooLarge) as refused:
            client.send(too_big)
        line = str(refused.value)
        assert line.startswith(f"chief->memoryx: cannot send to {address}: a heartbeat message's header is ")
        assert f"over the {MAX_HEADER_BYTES}-byte cap every receiver enforces" in line and "\n" not in line
        client.send(fits)   # just under the cap: delivered, and nothing was logged as bad
        with caplog.at_level(logging.WARNING, logger="cs_runtime.wire.transport"):
            identity, msg = server.recv(timeout_ms=5000)
        assert len(msg.meta["filler"]) == MAX_HEADER_BYTES - 200 and client.bytes_sent == 0
        assert "dropped bad message" not in caplog.text
        with pytest.raises(protocol.MessageTooLarge, match=f"memoryx: cannot send to {identity.hex()}: "):
            server.send(too_big, identity)
    finally:
        client.close()
        server.close()


def test_endpoint_recv_times_out(ctx):
    ep = Endpoint(ctx, zmq.PULL, "idle")
    try:
        ep.bind("127.0.0.1")
        assert ep.recv(timeout_ms=10) is None
    finally:
        ep.close()


def test_endpoint_drops_bad_messages_logs_once_per_sender(ctx, caplog):
    server = Endpoint(ctx, zmq.ROUTER, "server", job="job1")
    server.sock.bind("inproc://bad-senders")
    senders = {}
    for name in (b"alice", b"bob"):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, name)
        s.setsockopt(zmq.LINGER, 0)
        s.connect("inproc://bad-senders")
        senders[name] = s
    try:
        good = encode(Message(Msg.HEARTBEAT, job="job1", meta={"role": "wse", "rank": 0}))
        senders[b"alice"].send_multipart([b"\xc1 not msgpack"])
        senders[b"alice"].send_multipart([pack(header(t="nope", job="job1"))])
        senders[b"bob"].send_multipart([pack([1, 2])])
        senders[b"alice"].send_multipart(good)
        with caplog.at_level(logging.WARNING, logger="cs_runtime.wire.transport"):
            got = server.recv(timeout_ms=5000)
            assert got is not None
            identity, msg = got
            assert identity == b"alice" and msg.type is Msg.HEARTBEAT  # bob's bad one came first
            senders[b"bob"].send_multipart(good)
            identity, msg = server.recv(timeout_ms=5000)
            assert identity == b"bob" and msg.meta == {"role": "wse", "rank": 0}
        warnings = [r.getMessage() for r in caplog.records if "dropped bad message" in r.getMessage()]
        assert len(warnings) == 2, warnings  # alice twice, bob once: one line each
        assert any(b"alice".hex() in w and "msgpack" in w for w in warnings)
        assert any(b"bob".hex() in w and "not a map" in w for w in warnings)
        assert server.bytes_received == 0
    finally:
        for s in senders.values():
            s.close(linger=0)
        server.close()


def test_endpoint_drops_messages_of_another_job(ctx, caplog):
    pull = Endpoint(ctx, zmq.PULL, "pull", job="job1")
    push = Endpoint(ctx, zmq.PUSH, "push", job="job2")
    try:
        push.connect(pull.bind("127.0.0.1"))
        push.send(Message(Msg.LOSS, meta={"loss": 1.5, "count": 4}))         # job2: dropped
        push.send(Message(Msg.LOSS, job="job1", meta={"loss": 2.5, "count": 4}))
        with caplog.at_level(logging.WARNING, logger="cs_runtime.wire.transport"):
            _, msg = pull.recv(timeout_ms=5000)
        assert msg.job == "job1" and msg.meta["loss"] == 2.5
        assert any("job2" in r.getMessage() for r in caplog.records)
        assert pull.recv(timeout_ms=10) is None
    finally:
        push.close()
        pull.close()


# --------------------------------------------------------------------------
# no pickle anywhere in the product
# --------------------------------------------------------------------------

FORBIDDEN_NAMES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "recv_pyobj", "send_pyobj"}


def _code_tokens(path: Path):
    """NAME and OP tokens of a Python file (comments and docstrings excluded)."""
    with path.open("rb") as f:
        return [t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)]


def test_no_pickle_in_product_code():
    """Like `grep -rn pickle`, minus prose that says pickle is not used and
    `allow_pickle=False`: no pickle module, no pyobj send/recv, no allow_pickle=True."""
    files = [p for d in ("cs_runtime", "chief", "worker", "wse", "scripts")
             for p in sorted((REPO / d).rglob("*.py"))]
    assert len(files) > 10
    offences = []
    for path in files:
        toks = _code_tokens(path)
        for i, tok in enumerate(toks):
            if tok.string in FORBIDDEN_NAMES:
                offences.append(f"{path.relative_to(REPO)}:{tok.start[0]}: {tok.string}")
            if (tok.string == "allow_pickle" and i + 2 < len(toks)
                    and toks[i + 1].string == "=" and toks[i + 2].string != "False"):
                offences.append(f"{path.relative_to(REPO)}:{tok.start[0]}: allow_pickle={toks[i + 2].string}")
        text = path.read_text()
        for word in ("recv_pyobj", "send_pyobj", "import pickle", "from pickle"):
            if word in text:
                offences.append(f"{path.relative_to(REPO)}: {word}")
    assert not offences, offences


def test_no_pickle_check_catches_a_pickle_user(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""pickle in a docstring is fine"""\nimport pickle\nx = sock.recv_pyobj()\n')
    names = {t.string for t in _code_tokens(bad)}
    assert {"pickle", "recv_pyobj"} <= names
    ok = tmp_path / "ok.py"
    ok.write_text('"""no pickle here"""\n# nor pickle here\nnp.load(p, allow_pickle=False)\n')
    assert not {t.string for t in _code_tokens(ok)} & FORBIDDEN_NAMES


# --------------------------------------------------------------------------
# BATCH: one feature array, or one per model input by name
# --------------------------------------------------------------------------

def _batch(arrays: dict, rows: int = 3, fmt: str | None = None) -> Message:
    meta = {"stream": "train", "global_batch": 6, "row_start": 3, "row_stop": 3 + rows}
    if fmt:
        meta["format"] = fmt
    return decode(encode(Message(Msg.BATCH, step=1, meta=meta, arrays=arrays)))


def test_a_batch_of_named_features_round_trips_each_array_as_it_was():
    from cs_runtime.numerics.precision import encode_arrays
    ids, mask = np.arange(12, dtype=np.int32).reshape(3, 4), np.ones((3, 4), bool)
    x = {"input_ids": ids, "attention_mask": mask, "pixels": np.full((3, 2), 0.5, np.float32)}
    y = np.array([1, 2, 3])
    arrays = protocol.batch_arrays(x, y)
    assert sorted(arrays) == ["x.attention_mask", "x.input_ids", "x.pixels", "y"]
    for fmt in (None, "bfloat16"):   # 16-bit: floats as bit patterns, ids and masks as they are
        msg = _batch(encode_arrays(arrays, fmt) if fmt else arrays, fmt=fmt)
        features, labels = protocol.batch_features(msg, protocol.float_arrays(msg))
        assert set(features) == set(x) and np.array_equal(labels, y)
        for name in x:
            assert features[name].dtype == x[name].dtype
            np.testing.assert_array_equal(features[name], x[name])
    one = _batch(protocol.batch_arrays(ids, y))
    features, _ = protocol.batch_features(one)
    assert isinstance(features, np.ndarray) and np.array_equal(features, ids)


@pytest.mark.parametrize("arrays,match", [
    ({"x": np.zeros((3, 2))}, "no labels array"),
    ({"x": np.zeros((3, 2)), "x.a": np.zeros((3, 2)), "y": np.zeros(3)}, "not both"),
    ({"y": np.zeros(3)}, "either x or x.<feature name>"),
    ({"x.a": np.zeros((3, 2)), "w": np.zeros(3), "y": np.zeros(3)}, "expected y and either"),
    ({"x.1a": np.zeros((3, 2)), "y": np.zeros(3)}, "Python identifiers"),
    ({"x.a": np.zeros((2, 2)), "y": np.zeros(3)}, "array 'x.a' has 2 rows, the shard 3"),
    ({"x.a": np.zeros(()), "y": np.zeros(3)}, "array 'x.a' has no rows"),
])
def test_a_batch_whose_arrays_break_the_contract_is_refused_naming_why(arrays, match):
    with pytest.raises(ProtocolError, match=re.escape(match)):
        protocol.batch_features(_batch(arrays))


def test_a_feature_name_that_is_no_identifier_is_refused_before_it_is_sent():
    with pytest.raises(ValueError, match="feature name 'a b' is not a Python identifier"):
        protocol.batch_arrays({"a b": np.zeros(3)}, np.zeros(3))


# --------------------------------------------------------------------------
# decode(into=...): multi-frame arrays joined into buffers the receiver keeps
# --------------------------------------------------------------------------

def _split(nbytes_extra: int = 1000, seed: int = 3) -> np.ndarray:
    """A float32 array over two frames (two full, and a bit)."""
    n = (2 * protocol.MAX_FRAME_BYTES + nbytes_extra) // 4
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


class Kept:
    """An `into` that hands out one buffer per name and records what it was asked."""

    def __init__(self, **buffers):
        self.buffers, self.asked = buffers, []

    def __call__(self, mtype, step, layer, name, dtype, shape):
        self.asked.append((mtype, step, layer, name, dtype))
        return self.buffers.get(name)


def test_a_split_array_is_joined_into_the_receivers_buffer_bit_for_bit():
    big, small = _split(), np.arange(5, dtype=np.float32)
    frames = encode(Message(Msg.WEIGHTS, step=4, layer=2, meta={"phase": "fwd"}, arrays={"w": big, "b": small}))
    kept = Kept(w=np.full_like(big, np.nan), b=np.zeros(5, np.float32))
    out = decode([bytes(f) for f in frames], into=kept)
    assert kept.asked == [(Msg.WEIGHTS, 4, 2, "w", "float32")]   # one-frame arrays stay views on their frame
    assert np.shares_memory(out.arrays["w"], kept.buffers["w"]) and not out.arrays["w"].flags.writeable
    assert kept.buffers["w"].tobytes() == big.tobytes()
    np.testing.assert_array_equal(out.arrays["b"], small)
    assert (kept.buffers["b"] == 0).all()
    # the same buffer serves the next message: no fresh memory, the new bytes
    again = _split(seed=4)
    decode(encode(Message(Msg.WEIGHTS, step=5, layer=2, meta={"phase": "fwd"}, arrays={"w": again, "b": small})),
           into=kept)
    assert kept.buffers["w"].tobytes() == again.tobytes()


def test_into_declining_or_a_type_not_streamed_gets_a_fresh_buffer():
    big = _split()
    kept = Kept()
    out = decode(encode(Message(Msg.GRADS, arrays={"w": big})), into=kept)
    assert kept.asked == [(Msg.GRADS, -1, -1, "w", "float32")] and out.arrays["w"].tobytes() == big.tobytes()
    buffer = np.zeros_like(big)
    kept = Kept(w=buffer)
    out = decode(encode(Message(Msg.STATE, arrays={"w": big})), into=kept)   # not in KEPT_TYPES
    assert kept.asked == [] and not np.shares_memory(out.arrays["w"], buffer) and (buffer == 0).all()


@pytest.mark.parametrize("bad", [
    np.zeros(10, np.float32),                                     # the wrong shape
    np.zeros((2 * protocol.MAX_FRAME_BYTES + 1000) // 4, np.int32),   # the wrong dtype
    np.zeros((2 * protocol.MAX_FRAME_BYTES + 1000) // 2, np.float32)[::2],   # not contiguous
    "not an array",
])
def test_a_destination_that_does_not_fit_the_header_refuses_the_message_before_any_copy(bad):
    big = _split()
    innocent = np.zeros_like(big)
    kept = Kept(first=innocent, w=bad)
    frames = encode(Message(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays={"first": big, "w": big}))
    with pytest.raises(ProtocolError, match="does not fit the receiver's buffer"):
        decode(frames, into=kept)
    assert (innocent == 0).all()     # the array before it was not joined either


def test_a_read_only_destination_is_refused():
    big = _split()
    buffer = np.zeros_like(big)
    buffer.flags.writeable = False
    with pytest.raises(ProtocolError, match="does not fit"):
        decode(encode(Message(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays={"w": big})), into=Kept(w=buffer))


def test_bad_sizes_another_job_or_a_bad_reference_are_refused_before_a_byte_is_copied(tmp_path):
    cap = protocol.MAX_FRAME_BYTES
    buffer = np.zeros(2 * cap, np.uint8)
    kept = Kept(a=buffer)
    h = pack(header(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays=[["a", "uint8", [2 * cap]]]))
    for frames in ([h, b"\1" * (cap - 1), b"\1" * (cap + 1)], [h, b"\1" * cap]):
        with pytest.raises(ProtocolError):
            decode(frames, into=kept)
    with pytest.raises(ProtocolError, match="this is job"):
        decode([h, b"\1" * cap, b"\1" * cap], into=kept, job="job2")
    # a framed array to keep, then a shared-memory reference this socket cannot follow
    h = pack(header(Msg.WEIGHTS, meta={"phase": "fwd"},
                    arrays=[["a", "uint8", [2 * cap]], ["r", "float32", [4], "cs-job1-x-1", 0]]))
    with pytest.raises(ProtocolError, match="shared-memory reference"):
        decode([h, b"\1" * cap, b"\1" * cap], into=kept)
    assert kept.asked == [] and not buffer.any()
    decode([pack(header(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays=[["a", "uint8", [2 * cap]]])),
            b"\1" * cap, b"\2" * cap], into=kept, job="job1")
    assert (buffer[:cap] == 1).all() and (buffer[cap:] == 2).all()


def test_endpoint_recv_joins_into_kept_buffers_under_curve(curve_pair):
    server, client, keys = curve_pair
    big = _split(nbytes_extra=12)
    buffer = np.empty_like(big)
    client.send(Message(Msg.GRADS, step=1, layer=0, arrays={"weight": big}))
    got = server.recv(timeout_ms=5000, into=lambda *_header: buffer)
    assert got is not None, "the split array never arrived"
    assert np.shares_memory(got[1].arrays["weight"], buffer) and buffer.tobytes() == big.tobytes()
    assert got[1].job == "job1" and server.last_user == keys.client_public.decode()


def test_a_forwarder_validates_a_streamed_message_without_building_its_arrays():
    big = _split()
    frames = encode(Message(Msg.WEIGHTS, step=1, layer=3, meta={"phase": "bwd"}, arrays={"w": big}))
    msg = decode(frames, build=False, into=Kept(w=np.zeros(3)))   # into is not even asked
    assert (msg.type, msg.step, msg.layer, msg.meta, msg.arrays) == (Msg.WEIGHTS, 1, 3, {"phase": "bwd"}, {})
    with pytest.raises(ProtocolError, match="frame has"):
        decode([frames[0], frames[1], bytes(frames[2])[:-4], frames[3]], build=False)
    # other types are built as ever (their checks need the arrays)
    assert "w" in decode(encode(Message(Msg.STATE, arrays={"w": big})), build=False).arrays


def test_a_big_endian_destination_is_refused():
    big = _split()
    with pytest.raises(ProtocolError, match="does not fit"):
        decode(encode(Message(Msg.WEIGHTS, meta={"phase": "fwd"}, arrays={"w": big})),
               into=Kept(w=np.zeros(big.shape, ">f4")))


@pytest.mark.parametrize("fmt", ["float32", "bfloat16"])
def test_kept_buffers_hold_a_models_parameters_in_the_dtypes_that_travel(fmt):
    """The WSE's weights and MemoryX's gradients are joined into these: one buffer per
    (layer, parameter, dtype), the same every message; None for anything else."""
    from dataclasses import replace
    spec = replace(mlp_spec("m", [6, 4, 3], "relu", 0.0), precision=fmt)
    kept = protocol.KeptBuffers(spec)
    storage = "float32" if fmt == "float32" else "uint16"
    shape = spec.layers[1].param_shapes()["weight"]
    first = kept.get(1, "weight", storage, shape)
    assert first.shape == shape and first.dtype == np.dtype(storage) and first.flags.writeable
    assert kept.get(1, "weight", storage, shape) is first                       # kept, not made again
    assert kept.get(1, "weight", "float32", shape).dtype == np.float32          # float32 always travels
    assert kept.get(1, "weight", "int64", shape) is None                        # no other dtype
    assert kept.get(1, "no_such_param", storage, shape) is None
    assert kept.get(2, "weight", storage, shape) is None and kept.get(-1, "weight", storage, shape) is None
    assert kept.get(1, "weight", storage, (shape[0] + 1, shape[1])) is None     # not the parameter's shape


def test_once_per_sender_lines_are_bounded_in_memory_and_in_log(caplog):
    """A stranger reconnecting is a new sender each time: 5000 of them leave at most KEPT senders
    kept and PER_WINDOW lines (plus one sum-up line when the next window opens)."""
    from cs_runtime.wire.transport import SenderLog
    ctx = zmq.Context()
    endpoint = Endpoint(ctx, zmq.ROUTER, "target", "job")
    try:
        with caplog.at_level(logging.INFO, logger="cs_runtime.wire.transport"):
            for sender in range(5000):
                endpoint.warn_once(sender.to_bytes(4, "big"), "garbage")
            endpoint.warn_once((4999).to_bytes(4, "big"), "garbage")   # known: said already
            assert len(endpoint.sender_log.named) == SenderLog.KEPT
            assert len(caplog.records) == SenderLog.PER_WINDOW
            endpoint.sender_log.window_start -= SenderLog.WINDOW_S   # the next window
            endpoint.note_undelivered(b"\x01", "an answer", "the peer has disconnected")
        assert "4980 more such WARNING lines" in caplog.records[-2].getMessage()
        assert "not delivered" in caplog.records[-1].getMessage()
    finally:
        endpoint.close()
        ctx.destroy(linger=0)


def test_the_handshake_gate_admits_a_budget_of_frames_and_never_cuts_a_connection_past_our_greeting():
    import socket
    from cs_runtime.wire import gate
    from cs_runtime.wire.transport import CONTROL_MAX_FRAME, CURVE_FRAME_OVERHEAD
    from cs_runtime.wire.protocol import MAX_FRAME_BYTES
    # Every socket's frames are a header's at most: one cap, a stranger's frame 64 KiB at most.
    assert MAX_FRAME_BYTES == CONTROL_MAX_FRAME == 64 * 1024
    assert gate.young_limits(MAX_FRAME_BYTES + CURVE_FRAME_OVERHEAD) == (7, 3)
    assert gate.young_limits(4 * 2**20) == (gate.MIN_YOUNG, gate.MIN_YOUNG)
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as peer:
        accepted, _ = server.accept()
        with accepted:
            accepted.sendall(bytes(gate.GREETING_BYTES))
            assert peer.recv(4096) and not gate._past_greeting(accepted)   # only a greeting: may be cut
            accepted.sendall(b"W")                                         # a WELCOME under way: never
            assert gate._past_greeting(accepted)
            # The gate looks at libzmq's own descriptor and gives it back open: the connection goes on.
            with gate._borrowed(accepted.fileno(), socket.AF_INET) as conn:
                assert conn.getpeername() == peer.getsockname()
            accepted.sendall(b"still open")
            assert peer.recv(4096).endswith(b"still open")


# ------------------------------------------------------------ layer groups
MIB = protocol.GROUP_LAYER_BYTES


def test_small_layers_in_a_row_are_grouped_and_a_big_one_goes_alone():
    groups = protocol.layer_groups([803_840, 131_584, 5_160])          # the small preset: one group
    assert groups == [range(0, 3)]
    groups = protocol.layer_groups([6 * MIB, 16 * MIB, 16 * MIB, 82_000])   # every big layer alone
    assert groups == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    # small layers around a big one; a group stops at GROUP_BYTES
    groups = protocol.layer_groups([10, 2 * MIB, 20, 30, MIB - 1, MIB - 1, MIB - 1, MIB - 1, MIB - 1])
    assert groups == [range(0, 1), range(1, 2), range(2, 7), range(7, 9)]
    assert sum(len(g) for g in groups) == 9 and protocol.layer_groups([]) == []


def test_a_group_travels_in_one_message_and_comes_apart_as_it_was_sent():
    layers = {2: {"weight": np.arange(6, dtype=np.float32).reshape(2, 3), "bias": np.ones(3, np.float32)},
              3: {},                                                     # a layer without parameters
              4: {"ln/weight": np.full(4, 2, np.float32)}}               # a parameter name with a slash
    msg = decode(encode(protocol.group_message(Msg.GRADS, 7, layers, {"format": "float32"})))
    assert msg.layer == 2 and msg.meta["layers"] == 3 and msg.step == 7
    got = protocol.layer_arrays(msg)
    assert [index for index, _ in got] == [2, 3, 4]
    for index, arrays in got:
        assert arrays.keys() == layers[index].keys()
        for name, arr in arrays.items():
            np.testing.assert_array_equal(arr, layers[index][name])
    single = protocol.group_message(Msg.WEIGHTS, 7, {5: layers[2]}, {"phase": "fwd"})
    assert "layers" not in single.meta and single.layer == 5 and single.arrays is layers[2]
    assert protocol.layer_arrays(decode(encode(single)))[0][0] == 5


@pytest.mark.parametrize("layer,count,name,why", [
    (0, 2, "2/weight", "names no layer of the group 0..1"),      # past the group
    (3, 2, "2/weight", "names no layer of the group 3..4"),      # before it
    (0, 2, "weight", "names no layer"),                          # no layer index
    (0, 2, "01/weight", "names no layer"),                       # not as group_message writes it
    (0, 2, "1/", "names no layer"),                              # no parameter
    (0, 1, "0/weight", "a group of 1 layers"),                   # a group is 2 or more
    (-1, 2, "0/weight", "a group of 2 layers from layer -1"),
])
def test_a_group_whose_arrays_do_not_fit_its_layers_is_refused(layer, count, name, why):
    msg = Message(Msg.GRADS, step=1, layer=layer, meta={"layers": count}, arrays={name: np.ones(2, np.float32)})
    with pytest.raises(ProtocolError, match=re.escape(why)):
        decode(encode(msg))


def test_only_weights_and_grads_come_in_groups():
    msg = Message(Msg.LOSS, step=1, meta={"loss": 1.0, "count": 2, "layers": 2})
    with pytest.raises(ProtocolError, match="a group of 2 layers"):
        decode(encode(msg))


def test_a_burst_is_one_message_that_gives_back_each_step():
    """protocol.burst: steps' TRAIN_STEPs (or LOSSes, STEP_DONEs) in one message; decode checks every
    entry's meta as a message's, and unburst gives the messages back in step order."""
    steps = [Message(Msg.TRAIN_STEP, job="j", step=s, meta={"lr": 0.1 * s, "loss_scale": 1.0, "norms": s == 6})
             for s in (4, 5, 6)]
    (one,) = burst(steps)
    assert [(m.step, m.meta) for m in unburst(decode(encode(one)))] == [(m.step, m.meta) for m in steps]
    with_rows = Message(Msg.LOSS, step=1, meta={"loss": 1.0, "count": 2}, arrays={"out": np.zeros(2, np.float32)})
    plain = Message(Msg.LOSS, step=2, meta={"loss": 1.0, "count": 2})
    assert burst([with_rows, plain]) == [with_rows, plain]   # arrays: each goes as it is
    assert burst([plain]) == [plain] and unburst(plain) == [plain]


def test_a_burst_too_big_for_a_header_goes_step_by_step():
    """Four STEP_DONEs of a model of 600 parameters (their gradient and weight norms by name) would
    pass the header cap together: they go as four messages, each of which encodes."""
    norms = {f"layers.{i}.attention.query_key_value.weight": 0.125 * i for i in range(600)}
    done = [Message(Msg.STEP_DONE, job="j", step=s,
                    meta={"grad_norm": 1.0, "applied": True, "param_grad_norms": norms, "param_norms": norms})
            for s in (1, 2, 3, 4)]
    sent = burst(done)
    assert sent == done
    assert [decode(encode(m)).step for m in sent] == [1, 2, 3, 4]


@pytest.mark.parametrize("then, arrays, mtype, words", [
    ([[3, {"lr": 0.1}]], [], Msg.EVAL_STEP, ("eval_step", "burst")),                  # not a burst type
    ([[3, {"lr": 0.1}]], [["w", "float32", [1]]], Msg.TRAIN_STEP, ("burst", "arrays")),
    ([], [], Msg.TRAIN_STEP, ("burst", "0 more")),
    ([[s, {"lr": 0.1}] for s in range(3, 3 + STEPS_AHEAD)], [], Msg.TRAIN_STEP, ("burst",)),   # too many
    ([[2, {"lr": 0.1}]], [], Msg.TRAIN_STEP, ("later step",)),                        # not after the first
    ([[4, {"lr": 0.1}], [3, {"lr": 0.1}]], [], Msg.TRAIN_STEP, ("later step",)),      # not rising
    ([[3, {"lr": 0.1, "then": []}]], [], Msg.TRAIN_STEP, ("later step",)),            # nested
    ([[3, {"lr": "fast"}]], [], Msg.TRAIN_STEP, ("train_step", "'lr'")),              # an entry's meta checked
    ([[3, {"loss": 1.0, "count": 2, "layer_grad_norms": ["x"]}]], [], Msg.LOSS, ("layer_grad_norms",)),
    ([3], [], Msg.TRAIN_STEP, ("later step",)),
])
def test_a_bad_burst_is_refused_naming_what_is_wrong(then, arrays, mtype, words):
    h = header(mtype, step=2, arrays=arrays)
    h["meta"]["then"] = then
    frames = [pack(h)] + [b"\0\0\0\0" for _ in arrays]
    reject(frames, *words)

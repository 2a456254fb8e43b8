"""The wire protocol: every message type, and how a message crosses a socket.

A message is a multipart ZeroMQ message:

    frame 0      msgpack header {"t": type, "v": version, "job": id, "step": int,
                 "layer": int, "meta": {...}, "arrays": [[name, dtype, shape], ...]}
    frame 1..n   each array's raw bytes, in header order (C order, little endian),
                 in frames of at most MAX_FRAME_BYTES: an array of n bytes takes
                 max(1, ceil(n / MAX_FRAME_BYTES)) frames, all full but the last

Why frames are small: a peer that has not yet authenticated can still send
ZMTP handshake frames, and libzmq buffers each frame up to the socket's
MAXMSGSIZE before the CURVE handshake looks at it; that cap is one per socket
for a connection's whole life, so the cap a stranger meets is the cap our
tensors travel under. No frame of ours is larger than MAX_FRAME_BYTES, the
header cap (64 KiB): every socket sets MAXMSGSIZE that low (transport.py), a
stranger costs a process at most that per connection, however big the job's
tensors, and 64 KiB frames cost a tcp transfer of 64 MB arrays some 0 to 15%
more CPU than 1 MiB frames (docs/security.md has the measurements).

A message of a model's worth of arrays (LOAD_MODEL, STATE, a big group's WEIGHTS or GRADS: a
name, dtype and shape each, thousands of them) may list more than a header can hold. Then its
table travels in frames of its own, right after the header: the header says "tables": k and
lists no arrays ("arrays": []), and frames 1..k are msgpack lists of array specs of at most
MAX_FRAME_BYTES each, in order, the array frames after them. k is checked against
MAX_TABLE_FRAMES and the frames that came before a table frame is read, each frame's size
before it is unpacked, and the whole table is checked as a header's list is, before any array
is built; so a table costs a receiver no more than the frames it was sent.

An array that lies in a shared-memory segment of the job (same host only,
see shm.py) is listed as [name, dtype, shape, segment, offset] and has no
frame: the receiver maps the segment and checks the reference's bounds.
A socket that does not share memory refuses such references.

LOAD_MODEL's settings (JobSettings: the model, a compiled program's units
included) can outgrow the header cap, so they travel as msgpack bytes in a
uint8 array named SETTINGS_ARRAY. The sender puts a JobSettings in meta["spec"];
`decode` unpacks and validates the array and hands the parsed JobSettings back as
meta["spec"], so no receiver parses them again.

No pickle anywhere: a header is plain msgpack data and an array is bytes whose
dtype and shape the header states. `decode` checks everything (type, version,
meta keys and their types, dtypes, shapes, frame count, byte sizes, caps) before
it builds a single array, so a peer that sends garbage gets a ProtocolError and
the receiver keeps its state.

This is the only module that defines message types; nothing else invents one.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import re
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from cs_runtime.errors import CsError, UserInputError
from cs_runtime.numerics.model import ModelSpec
from cs_runtime.numerics.optim import OptimizerSpec
from cs_runtime.numerics.program_layer import FEATURE_NAME
from cs_runtime.spans import MAX_SPANS
from cs_runtime.numerics.precision import FORMATS, decode_arrays, wire_dtype

PROTOCOL_VERSION = 9   # 2: arrays over MAX_FRAME_BYTES travel in several frames; 3: LOAD_MODEL settings in an array;
#                        4: frames of 64 KiB (were 1 MiB);
#                        5: layer groups, fwd_bwd and the loss in GRADS / STEP_DONE (an older peer would misread them);
#                        6: array tables over a header in frames of their own; 7: ALL_REDUCE;
#                        8: batches by shared memory, their slots handed back by BATCHES_DONE;
#                        9: bursts (meta "then": the same message for the next steps; an older peer would drop them)

# Caps checked before any allocation (a stranger must not make us allocate GBs).
MAX_HEADER_BYTES = 64 * 1024
MAX_ARRAYS = 32768
# A message's array table, when it does not fit the header, takes at most this many frames
# (see above): 4 MiB of names, dtypes and shapes, room for MAX_ARRAYS arrays of 100-byte names.
MAX_TABLE_FRAMES = 64
MAX_ARRAY_BYTES = 2 * 1024**3
MAX_DIMS = 8
# No frame is larger: an array beyond it is split (see above). As small as a header may be,
# so that a stranger's handshake frame may be no bigger than our first message needs.
MAX_FRAME_BYTES = MAX_HEADER_BYTES
# LOAD_MODEL's settings travel as an array of this name (see above), at most this big.
SETTINGS_ARRAY = "__settings__"
MAX_SETTINGS_BYTES = 16 * 1024**2

# Arrays on the wire are one of these; float16 covers the 16-bit formats
# (bfloat16 / cbfloat16 travel as their raw uint16 bit patterns).
ALLOWED_DTYPES = {"float32", "float64", "float16", "int64", "int32", "uint16", "uint8", "bool"}
_WIRE_DTYPES = {name: np.dtype(name).newbyteorder("<") for name in ALLOWED_DTYPES}
# msgpack's list prefix for up to 2**32 items (a table frame's budget leaves it room).
_LIST_PREFIX_BYTES = 5
# The names of those little-endian dtypes, looked up by dtype: numpy's dtype.name is a
# Python-level property costing microseconds, and encode named every array twice.
_WIRE_NAMES = {dtype: name for name, dtype in _WIRE_DTYPES.items()}

# TRACE messages (cs_runtime/trace.py): spans as parallel 1-D arrays, names once.
MAX_SPAN_NAMES = 256
MAX_SPAN_NAME_CHARS = 64
SPAN_ARRAYS = {"name": "int32", "start_ns": "int64", "dur_ns": "int64", "step": "int64", "layer": "int64"}

# Frames smaller than this are copied by ZeroMQ anyway; larger ones go zero-copy.
ZERO_COPY_THRESHOLD = 64 * 1024


class ProtocolError(CsError, ValueError):
    """A received message is malformed; it is dropped, never acted on."""


class MessageTooLarge(UserInputError):
    """A message of ours that no receiver would take (its header over MAX_HEADER_BYTES): refused
    before it is sent, since the peer would drop it (or, over its socket's frame cap, the connection)."""


class Msg(str, enum.Enum):
    # the directory (launch/directory.py), liveness
    REGISTER = "register"        # process -> directory: role, rank, host, pid, endpoints
    LOOKUP = "lookup"            # process -> directory: wants the directory
    DIRECTORY = "directory"      # directory -> process: every registered process
    HEARTBEAT = "heartbeat"      # process -> directory
    STATUS = "status"            # directory -> process: ok or the failure it saw; done: exit 0 now
    EXITED = "exited"            # task wrapper -> directory: its task's exit code (tasks under srun)
    # job set-up
    HELLO = "hello"              # peer introduces itself on a ROUTER socket
    PLAN = "plan"                # chief -> input worker: which batches to stream
    INPUT_STATS = "input_stats"  # input worker -> chief: batches made, time busy / blocked
    LOAD_MODEL = "load_model"    # chief -> MemoryX (weights + optimizer) / -> WSEs (layer specs)
    ACK = "ack"                  # generic acknowledgement
    ERROR = "error"              # a service reports a fatal error to the chief
    # one step
    TRAIN_STEP = "train_step"    # chief -> MemoryX: run training step `step`
    EVAL_STEP = "eval_step"      # chief -> MemoryX: run eval step `step`
    WEIGHTS = "weights"          # MemoryX -> SwarmX -> every WSE: a layer's weights, or a group's
    BATCH = "batch"              # input worker -> WSE: one shard of one global batch
    BATCHES_DONE = "batches_done"  # WSE -> input worker: how many of its batches the WSE is done with
    GRADS = "grads"              # WSE -> SwarmX (summed) -> MemoryX: a layer's or a group's gradients
    LOSS = "loss"                # WSE -> SwarmX (summed) -> chief
    EVAL_RESULT = "eval_result"  # WSE -> SwarmX (summed) -> chief: loss sum, correct, count
    STEP_DONE = "step_done"      # MemoryX -> chief: every layer updated
    GET_STATE = "get_state"      # chief -> MemoryX: weights + optimizer state for a checkpoint
    STATE = "state"              # MemoryX -> chief
    JOB_END = "job_end"          # chief -> services: forget the job
    ALL_REDUCE = "all_reduce"    # WSE -> SwarmX (summed) -> every WSE: per-shard sums (SyncBatchNorm's statistics)
    # the CS system's front door (cs_system serve): submitters and csctl
    SUBMIT = "submit"            # csrun_wse -> front door: queue a job
    JOB_POLL = "job_poll"        # csrun_wse -> front door: where is my job (also: I am still here)
    JOB_STATE = "job_state"      # front door -> csrun_wse: phase, and the directory once it runs
    JOB_DONE = "job_done"        # csrun_wse -> front door: how the job's tasks ended
    GET_JOBS = "get_jobs"        # csctl -> front door
    JOBS = "jobs"                # front door -> csctl: one row per job
    CANCEL = "cancel"            # csctl -> front door: stop a job (its owner only)
    LABEL = "label"              # csctl -> front door: set labels on a job (its owner only)
    REFUSED = "refused"          # front door -> client: the request was not carried out, and why
    # timeline (--trace)
    GET_TRACE = "get_trace"      # chief -> MemoryX, SwarmX (-> every WSE), input workers: your spans
    TRACE = "trace"              # each -> chief (WSEs via SwarmX): spans + the clocks of the round trip


# The streamed tensors: decode joins their multi-frame arrays into buffers the receiver
# keeps, when it offers them (see decode). Types with checks on the array values (TRACE,
# LOAD_MODEL's settings) are not among them: those checks run after the arrays are built.
KEPT_TYPES = frozenset({Msg.WEIGHTS, Msg.GRADS})

# Required meta keys per type, with the Python types they must have.
_NUM = (int, float)
META_SCHEMA: dict[Msg, dict[str, Any]] = {
    Msg.REGISTER: {"role": str, "rank": int, "host": str, "pid": int, "endpoints": dict},
    Msg.LOOKUP: {"roles": list},
    Msg.DIRECTORY: {"peers": list},
    Msg.HEARTBEAT: {"role": str, "rank": int},
    Msg.STATUS: {"ok": bool, "reason": str, "done": bool},
    Msg.EXITED: {"role": str, "rank": int, "host": str, "pid": int, "code": int},
    Msg.HELLO: {"role": str, "rank": int},
    Msg.PLAN: {"phases": list},
    Msg.INPUT_STATS: {"rank": int, "host": str, "batches": int, "busy_s": _NUM, "blocked_s": _NUM,
                      "elapsed_s": _NUM, "done": bool},
    Msg.LOAD_MODEL: {},   # "spec" arrives in SETTINGS_ARRAY (see above)
    Msg.ACK: {"what": str},
    Msg.ERROR: {"role": str, "rank": int, "reason": str},
    Msg.TRAIN_STEP: {"lr": _NUM},
    Msg.EVAL_STEP: {},
    Msg.WEIGHTS: {"phase": str},
    Msg.BATCH: {"stream": str, "global_batch": int, "row_start": int, "row_stop": int},
    Msg.BATCHES_DONE: {"done": int},
    Msg.GRADS: {},
    Msg.LOSS: {"loss": _NUM, "count": int},
    Msg.EVAL_RESULT: {"loss_sum": _NUM, "correct": int, "count": int},
    Msg.STEP_DONE: {"grad_norm": _NUM},
    Msg.GET_STATE: {},
    Msg.STATE: {},
    Msg.JOB_END: {},
    Msg.ALL_REDUCE: {},
    Msg.SUBMIT: {"user": str, "num_csx": int, "owner": str, "labels": dict, "keys": dict},
    Msg.JOB_POLL: {"name": str, "owner": str},
    Msg.JOB_STATE: {"name": str, "job": str, "phase": str, "reason": str, "cs_ip": str, "position": int,
                    "systems": list},
    Msg.JOB_DONE: {"name": str, "owner": str, "phase": str, "reason": str},
    Msg.GET_JOBS: {},
    Msg.JOBS: {"jobs": list, "system": dict},
    Msg.CANCEL: {"name": str, "owner": str},
    Msg.LABEL: {"name": str, "owner": str, "labels": dict},
    Msg.REFUSED: {"reason": str},
    Msg.GET_TRACE: {},
    Msg.TRACE: {"role": str, "rank": int, "names": list, "dropped": int, "clock": str, "recv_ns": int,
                "send_ns": int},
}

# ------------------------------------------------------------ front door
# Job phases, in the order a job goes through them (csctl get jobs).
PHASES = ("QUEUED", "COMPILING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED")
ENDED_PHASES = ("SUCCEEDED", "FAILED", "CANCELLED")
JOB_NAME = re.compile(r"^wsjob-[0-9]{1,9}$")
LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")   # Kubernetes' label syntax
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?)?$")
MAX_LABELS = 32
OWNER_TOKEN = re.compile(r"^[0-9a-f]{64}$")
USER_NAME = re.compile(r"^[A-Za-z0-9_.@-]{1,64}$")
# JOB_DONE's reason: free text from a client, stored and shown to every user; this long at most,
# so that a job's row (labels, user, reason, services) always fits a listing's page.
MAX_REASON_CHARS = 1000
# A job's CURVE keys (the submitter's, for the services that serve it): Z85, 40 characters each.
JOB_KEY_NAMES = ("server_public", "server_secret", "client_public", "client_secret")
Z85_KEY = re.compile(r"^[0-9A-Za-z.\-:+=^!/*?&<>()\[\]{}@%$#]{40}$")


def _check_front_door(mtype: "Msg", meta: dict) -> None:
    """What the types alone do not say: names, labels, keys, phases have a fixed shape."""
    if "name" in META_SCHEMA[mtype] and mtype != Msg.JOB_STATE and not JOB_NAME.match(meta["name"]):
        raise ProtocolError(f"{mtype.value}: job name {meta['name'][:40]!r} is not wsjob-<number>")
    if "owner" in META_SCHEMA[mtype] and not OWNER_TOKEN.match(meta["owner"]):
        raise ProtocolError(f"{mtype.value}: owner credential is not 64 hex digits")
    if "labels" in META_SCHEMA[mtype]:
        check_labels(meta["labels"], ProtocolError)
    if mtype == Msg.SUBMIT:
        if not USER_NAME.match(meta["user"]):
            raise ProtocolError(f"submit: user name {meta['user'][:40]!r} is not allowed")
        if not 1 <= meta["num_csx"] <= 64:
            raise ProtocolError(f"submit: num_csx {meta['num_csx']} is not in [1, 64]")
        keys = meta["keys"]
        if keys and (set(keys) != set(JOB_KEY_NAMES)
                     or not all(isinstance(v, str) and Z85_KEY.match(v) for v in keys.values())):
            raise ProtocolError("submit: keys must be empty or the four Z85 CURVE keys of the job")
    if mtype in (Msg.JOB_STATE, Msg.JOB_DONE) and meta["phase"] not in PHASES:
        raise ProtocolError(f"{mtype.value}: unknown phase {meta['phase'][:20]!r}")
    if mtype == Msg.JOB_DONE and len(meta["reason"]) > MAX_REASON_CHARS:
        raise ProtocolError(f"job_done: reason of {len(meta['reason'])} characters, over {MAX_REASON_CHARS}")


def printable(text: str, limit: int = MAX_REASON_CHARS) -> str:
    """`text` as one line that cannot move a terminal's cursor or forge a log line or a table row:
    control and format characters (newlines, ANSI escapes, bidi overrides) are written as escapes,
    and the result is cut at `limit` characters."""
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)
    return out if len(out) <= limit else out[:limit - 3] + "..."


def check_labels(labels, error=ValueError) -> None:
    """Raise `error` naming the first bad label (keys and values as Kubernetes labels)."""
    if not isinstance(labels, dict) or len(labels) > MAX_LABELS:
        raise error(f"labels must be a map of at most {MAX_LABELS} entries")
    for key, value in labels.items():
        if not (isinstance(key, str) and LABEL_KEY.match(key)):
            raise error(f"label key {str(key)[:70]!r} is not 1-63 letters, digits, '-', '_' or '.'")
        if not (isinstance(value, str) and LABEL_VALUE.match(value)):
            raise error(f"label {key}: value {str(value)[:70]!r} is not 0-63 letters, digits, '-', '_' or '.'")


FRONT_DOOR = {Msg.SUBMIT, Msg.JOB_POLL, Msg.JOB_STATE, Msg.JOB_DONE, Msg.GET_JOBS, Msg.JOBS, Msg.CANCEL,
              Msg.LABEL, Msg.REFUSED}

# Optional meta keys of any message, checked when present.
# "format": the arrays are tensors of that precision format in their wire
# storage (cs_runtime/numerics/precision.py: float16, or uint16 bit patterns); without
# it they are plain float32 (or whatever dtype they state).
# "layer_grad_norms": each layer's gradient norm, in layer order (STEP_DONE, and LOSS in pipelined mode).
# "param_grad_norms": {parameter's program name: its gradient norm}, a tied parameter once (with
# layer_grad_norms, for a program's model: what a traced step reads as its gradients' norms).
# "param_norms": {parameter's program name: its weights' norm as the step began}, as
# param_grad_norms (what a traced step on CSX reads as a parameter's norm).
# "norms": whether TRAIN_STEP wants the step's gradient norms back (default
# yes; the chief asks only on the steps it logs: they cost a pass over every gradient).
# "label_count": labelled targets in the whole global batch (BATCH; a token loss's normaliser).
OPTIONAL_META: dict[str, Any] = {"format": str, "loss_scale": _NUM, "applied": bool, "shared_memory": bool,
                                 "layer_grad_norms": list, "param_grad_norms": dict, "param_norms": dict,
                                 "norms": bool, "label_count": int,
                                 "layers": int,   # WEIGHTS, GRADS: a group of small layers (below)
                                 # GRADS, STEP_DONE: a weight-streaming step's loss (STEP_LOSS)
                                 "loss": _NUM, "count": int, "bytes_in": int, "input_wait_s": _NUM,
                                 "leaving": bool,   # HEARTBEAT: the sender's work is done; it is exiting
                                 # GET_JOBS: list jobs numbered above `after`; JOBS: `next` is the
                                 # `after` of the next page (absent on the last page)
                                 "after": int, "next": int,
                                 # REFUSED for the rate limit: seconds until a request is taken again
                                 "retry_after": _NUM,
                                 "then": list}   # a burst (below)


# ------------------------------------------------------------ layer groups
# Small consecutive layers travel together: one WEIGHTS message, and one GRADS back, for a
# group instead of one per layer (a hop costs every process on the way a wake-up and a
# message's handling, whatever its size). Such a message's `layer` is the group's first
# (lowest) layer, meta "layers" how many it holds (2 or more), and each array is named
# "<layer index>/<parameter>"; a message without "layers" holds one layer, arrays named as
# the layer's parameters. A layer of GROUP_LAYER_BYTES or more (its weights in float32)
# travels alone, so that a big model's stream keeps its layer-by-layer overlap; a group
# holds at most GROUP_BYTES. A grouped array of several frames is decoded into fresh
# memory (a receiver's kept buffers are named by layer, not by "<layer>/<parameter>").
GROUP_LAYER_BYTES = 1024 * 1024
GROUP_BYTES = 4 * GROUP_LAYER_BYTES


def layer_groups(layer_bytes: list[int]) -> list[range]:
    """Consecutive layers (by their float32 weight bytes) cut into the groups that travel together."""
    groups: list[range] = []
    start, total = 0, 0
    for index, nbytes in enumerate(layer_bytes):
        small = nbytes < GROUP_LAYER_BYTES
        if index > start and not (small and total + nbytes <= GROUP_BYTES):
            groups.append(range(start, index))
            start, total = index, 0
        total = total + nbytes if small else GROUP_BYTES   # a big layer closes its group
    if layer_bytes:
        groups.append(range(start, len(layer_bytes)))
    return groups


# Steps sent ahead, answers in bursts. When a step's arguments do not depend on the results
# before it (chief/trainer.py next_step_args), the chief sends up to STEPS_AHEAD TRAIN_STEPs
# before their turn, topping them up in one burst once half are done; whoever runs the steps
# (MemoryX, or a pipelined WSE) runs them in order and holds each step's answer (STEP_DONE,
# LOSS) while more steps wait, up to ANSWERS_HELD, sending every held one before any other
# answer and before it waits. A burst wakes each process on its way once, not once a step.
# ANSWERS_HELD <= STEPS_AHEAD / 2: a burst of answers leaves while steps are still queued.
STEPS_AHEAD = 8
ANSWERS_HELD = 4

# A burst travels as one message: the first step's, its meta "then" holding [step, meta] of
# each later one, in step order (steps rising, at most STEPS_AHEAD in all, no arrays). Each
# message costs every process on its way a receive, a check and a send, whatever its size:
# about 50 us of SwarmX's main thread and as much again at each end on the small preset.
# decode checks every entry's meta as it checks a message's; unburst gives the messages back.
BURST_TYPES = frozenset({"train_step", "loss", "step_done"})


def burst(msgs: list["Message"]) -> list["Message"]:
    """Messages of one type, in step order, as they go: one message where every one is a
    plain burst member (a BURST_TYPES type, no arrays), else each as it is."""
    if len(msgs) < 2 or any(m.arrays or m.type.value not in BURST_TYPES or "then" in m.meta for m in msgs):
        return list(msgs)
    first = msgs[0]
    meta = {**first.meta, "then": [[m.step, m.meta] for m in msgs[1:]]}
    # a big model's per-parameter norms (STEP_DONE) can make a burst's header too big to send:
    # its steps then go one by one, each as it would alone
    if len(msgpack.packb(meta, use_bin_type=True)) > MAX_HEADER_BYTES // 2:
        return list(msgs)
    return [Message(first.type, first.job, first.step, first.layer, meta)]


def unburst(msg: "Message") -> list["Message"]:
    """The messages a (decoded, so checked) burst holds, in step order; any other: itself alone."""
    then = msg.meta.get("then")
    if then is None:
        return [msg]
    first = Message(msg.type, msg.job, msg.step, msg.layer, {k: v for k, v in msg.meta.items() if k != "then"})
    return [first, *(Message(msg.type, msg.job, step, msg.layer, meta) for step, meta in then)]


def _check_burst(mtype: "Msg", step: int, then: list, arrays: list) -> None:
    if mtype.value not in BURST_TYPES or arrays or not 0 < len(then) < STEPS_AHEAD:
        raise ProtocolError(f"{mtype.value}: a burst ('then') of {len(then)} more steps, with "
                            f"{len(arrays)} arrays (a train_step, loss or step_done of 2 to {STEPS_AHEAD} steps, "
                            "no arrays)")
    last = step
    for entry in then:
        if not (type(entry) is list and len(entry) == 2 and _is(entry[0], int) and entry[0] > last
                and type(entry[1]) is dict and "then" not in entry[1]):
            raise ProtocolError(f"{mtype.value}: a burst entry is not [a later step, its meta]")
        last = entry[0]
        _check_meta(mtype, entry[1])


# A weight-streaming step's loss, as LOSS would carry it, rides on the step's last GRADS
# (summed by SwarmX as LOSS is) and MemoryX hands it on in STEP_DONE: two hops fewer a
# step. A job whose steps hand out the model's output sends LOSS, with those rows, instead.
STEP_LOSS = ("loss", "count", "bytes_in", "input_wait_s")


def grouped_name(index: int, name: str) -> str:
    """An array's name in a group's message: its layer's index, then the parameter's name."""
    return f"{index}/{name}"


def group_message(mtype: "Msg", step: int, layers: dict[int, dict], meta: dict) -> "Message":
    """One WEIGHTS or GRADS message for consecutive layers ({index: arrays}, at least one)."""
    first = min(layers)
    if len(layers) == 1:
        return Message(mtype, step=step, layer=first, meta=meta, arrays=layers[first])
    arrays = {grouped_name(index, name): arr for index, named in layers.items() for name, arr in named.items()}
    return Message(mtype, step=step, layer=first, meta={**meta, "layers": len(layers)}, arrays=arrays)


def layer_arrays(msg: "Message") -> list[tuple[int, dict]]:
    """A WEIGHTS or GRADS message's layers, lowest first, each with its arrays (decode has
    checked every grouped name); a layer without parameters gets {}."""
    count = msg.meta.get("layers")
    if count is None:
        return [(msg.layer, msg.arrays)]
    layers: dict[int, dict] = {index: {} for index in range(msg.layer, msg.layer + count)}
    for name, arr in msg.arrays.items():
        index, param = name.split("/", 1)
        layers[int(index)][param] = arr
    return list(layers.items())


def _check_group(mtype: "Msg", header: dict, specs: list) -> None:
    """A group's layers are in range and every array names one of them."""
    count, first = header["meta"]["layers"], header["layer"]
    if mtype not in (Msg.WEIGHTS, Msg.GRADS) or not 2 <= count <= MAX_ARRAYS or first < 0:
        raise ProtocolError(f"{mtype.value}: a group of {count} layers from layer {first} is not allowed")
    prefixes = {str(index) for index in range(first, first + count)}   # as group_message writes them
    for name, *_ in specs:
        index, slash, param = name.partition("/")
        if not (slash and param and index in prefixes):
            raise ProtocolError(f"{mtype.value}: array {name[:40]!r} names no layer of the group "
                                f"{first}..{first + count - 1}")


# ------------------------------------------------------------ BATCH
# A BATCH's arrays: the labels "y" and the features, either one array "x" or, for a
# model of several inputs, one array "x.<feature name>" each (its forward()'s argument
# names: x.input_ids, x.attention_mask, ...), every one with a row per sample of the shard.
BATCH_LABELS, BATCH_FEATURES = "y", "x"
MAX_FEATURES = 64


# How far an input worker may run ahead of a WSE: at most BATCH_SLOTS of its batches that the WSE
# has not said it is done with (BATCHES_DONE, a running count per worker, sent after every
# BATCHES_DONE_EVERY batches it finished and whenever it waits for input). A batch is done when
# the WSE takes the next one: steps are lockstep, so nothing of the earlier batch is read again.
# Only then may the worker write that batch's shared-memory slot again (worker/input_worker.py).
# BATCHES_DONE_EVERY <= BATCH_SLOTS keeps every WSE of a step fed: the slowest one has said it is
# done with all but the last BATCHES_DONE_EVERY - 1 batches it finished.
BATCH_SLOTS = 8
BATCHES_DONE_EVERY = 4


def batch_arrays(x, y: np.ndarray) -> dict[str, np.ndarray]:
    """A shard's features (one array, or a dict by feature name) and labels as BATCH arrays."""
    if not isinstance(x, dict):
        return {BATCH_FEATURES: x, BATCH_LABELS: y}
    for name in x:
        if not (isinstance(name, str) and FEATURE_NAME.match(name)):
            raise ValueError(f"feature name {str(name)[:70]!r} is not a Python identifier of at most 64 characters")
    return {**{f"{BATCH_FEATURES}.{name}": a for name, a in x.items()}, BATCH_LABELS: y}


def batch_features(msg: "Message", arrays: dict | None = None):
    """(features, labels) of a decoded BATCH, after checking its arrays follow the
    contract above (ProtocolError naming what does not): `arrays` are its arrays as
    float32 values (float_arrays), by default as they travelled."""
    arrays = msg.arrays if arrays is None else arrays
    if BATCH_LABELS not in arrays:
        raise ProtocolError("batch: no labels array 'y'")
    named = {k[len(BATCH_FEATURES) + 1:]: a for k, a in arrays.items() if k.startswith(BATCH_FEATURES + ".")}
    other = sorted(set(arrays) - {BATCH_LABELS, BATCH_FEATURES} - {f"{BATCH_FEATURES}.{k}" for k in named})
    if other or (BATCH_FEATURES in arrays) == bool(named):
        raise ProtocolError(f"batch: arrays {sorted(arrays)[:8]}: expected y and either x or x.<feature name>, "
                            f"not both")
    if len(named) > MAX_FEATURES or not all(FEATURE_NAME.match(k) for k in named):
        raise ProtocolError(f"batch: feature names must be at most {MAX_FEATURES} Python identifiers")
    rows = msg.meta["row_stop"] - msg.meta["row_start"]
    for name, a in arrays.items():
        if a.ndim == 0 or len(a) != rows:
            raise ProtocolError(f"batch: array {name[:70]!r} has {len(a) if a.ndim else 'no'} rows, "
                                f"the shard {rows}")
    return (named if named else arrays[BATCH_FEATURES]), arrays[BATCH_LABELS]


# ------------------------------------------------------------ LOAD_MODEL
STRATEGIES = ("weight_streaming", "pipelined")
LOSS_SCALING = ("none", "static", "dynamic")


@dataclass(frozen=True)
class JobSettings:
    """What the chief tells MemoryX, SwarmX and every WSE at LOAD_MODEL (meta "spec"):
    the model, the learning rule, and how the job trains. Parsed only by from_meta."""
    model: ModelSpec
    optimizer: OptimizerSpec           # the learning rule (MemoryX; the WSE in pipelined mode)
    seed: int                          # runconfig.seed: dropout masks
    execution_strategy: str = "weight_streaming"
    replicas: int = 1                  # pipelined: copies of the model on one WSE
    max_gradient_norm: float | None = None   # None: no clipping
    loss_scaling: str = "none"         # none, static or dynamic: whether overflowed steps are skipped
    trace: bool = False                # record a timeline (csrun_wse --trace)

    @property
    def pipelined(self) -> bool:
        return self.execution_strategy == "pipelined"

    @property
    def skips_nonfinite(self) -> bool:
        """With loss scaling a step whose gradients overflowed is skipped whole."""
        return self.loss_scaling != "none"

    def to_meta(self) -> dict:
        return {"model": self.model.to_dict(), "optimizer": self.optimizer.to_dict(), "seed": self.seed,
                "execution_strategy": self.execution_strategy, "replicas": self.replicas,
                "max_gradient_norm": self.max_gradient_norm, "loss_scaling": self.loss_scaling,
                "trace": self.trace}

    @classmethod
    def from_meta(cls, meta) -> "JobSettings":
        """The settings in a LOAD_MODEL's meta "spec"; ProtocolError naming the first bad field."""
        def bad(field_name: str):
            return ProtocolError(f"load_model: spec field {field_name!r} missing or invalid")
        if not isinstance(meta, dict):
            raise bad("spec")
        try:
            model = ModelSpec.from_dict(meta["model"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise bad("model") from None
        if not all(_fields_typed(layer) for layer in model.layers):
            raise bad("model")
        try:
            optimizer = OptimizerSpec.from_dict(meta.get("optimizer"))
        except (TypeError, ValueError):
            raise bad("optimizer") from None
        checks = {"seed": lambda v: _is(v, int),
                  "execution_strategy": lambda v: v in STRATEGIES,
                  "replicas": lambda v: _is(v, int) and v >= 1,
                  "max_gradient_norm": lambda v: v is None or _is(v, _NUM) and v > 0,
                  "loss_scaling": lambda v: v in LOSS_SCALING,
                  "trace": lambda v: isinstance(v, bool)}
        fields = {"seed": meta.get("seed")}
        fields.update({k: meta[k] for k in checks if k in meta and k != "seed"})
        for key, value in fields.items():
            if not checks[key](value):
                raise bad(key)
        return cls(model, optimizer, **fields)


_FIELD_TYPES = {"str": str, "int": int, "float": _NUM, "bool": bool}


def _fields_typed(layer) -> bool:
    """Every field of a LayerSpec of the type it is declared with (sizes never negative)."""
    for f in dataclasses.fields(layer):
        value = getattr(layer, f.name)
        if f.name == "unit":   # a compiled program's unit: validated by ModelSpec.from_dict (Unit.from_meta)
            if value is not None and not isinstance(value, dict):
                return False
            continue
        if not (_is(value, _FIELD_TYPES[f.type]) if f.type != "bool" else isinstance(value, bool)):
            return False
        if f.type == "int" and f.name != "pad_id" and value < 0:
            return False
    return True


@dataclass
class Message:
    type: Msg
    job: str = ""
    step: int = -1
    layer: int = -1
    meta: dict = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def encode(msg: Message, segments=None) -> list:
    """Message -> list of frames (header bytes, then one buffer per array).

    With `segments` (shm.Segments), arrays that lie in a shared segment go by reference.
    """
    specs, frames = [], []
    meta, arrays = msg.meta, msg.arrays
    if msg.type == Msg.LOAD_MODEL and "spec" in meta:
        meta = {k: v for k, v in meta.items() if k != "spec"}
        packed = msgpack.packb(msg.meta["spec"].to_meta(), use_bin_type=True)
        arrays = {**arrays, SETTINGS_ARRAY: np.frombuffer(packed, np.uint8)}
    for name, arr in arrays.items():
        arr = np.asarray(arr, order="C")  # not ascontiguousarray: it turns 0-d into shape (1,)
        dtype = _WIRE_NAMES.get(arr.dtype)   # an allowed dtype, little endian already: as it is
        if dtype is None:
            if arr.dtype.name not in ALLOWED_DTYPES:
                raise ProtocolError(f"array {name!r}: dtype {arr.dtype.name} is not allowed on the wire")
            # The wire is little endian; '>f4' is also named "float32" and would arrive scrambled.
            arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
            dtype = arr.dtype.name
        ref = segments.locate(arr) if segments is not None else None
        if ref is not None:
            specs.append([name, dtype, list(arr.shape), *ref])
            continue
        specs.append([name, dtype, list(arr.shape)])
        frames.extend(_array_frames(arr))
    header = {"t": msg.type.value, "v": PROTOCOL_VERSION, "job": msg.job, "step": msg.step,
              "layer": msg.layer, "meta": meta, "arrays": specs}
    raw = msgpack.packb(header, use_bin_type=True)
    tables = []
    if len(raw) > MAX_HEADER_BYTES:   # a model's worth of arrays: their table in frames of its own
        tables = _table_frames(msg.type, specs)
        raw = msgpack.packb({**header, "arrays": [], "tables": len(tables)}, use_bin_type=True)
    if len(raw) > MAX_HEADER_BYTES:   # array frames are split to fit; a header cannot be
        raise MessageTooLarge(f"a {msg.type.value} message's header is {len(raw)} bytes, over the "
                              f"{MAX_HEADER_BYTES}-byte cap every receiver enforces")
    return [raw, *tables, *frames]


def _table_frames(mtype: Msg, specs: list) -> list[bytes]:
    """The array table cut into msgpack lists of at most MAX_FRAME_BYTES each (see above)."""
    tables, chunk, size = [], [], _LIST_PREFIX_BYTES
    for spec in specs:
        packed = msgpack.packb(spec, use_bin_type=True)
        if size + len(packed) > MAX_FRAME_BYTES and chunk:
            tables.append(msgpack.packb(chunk, use_bin_type=True))
            chunk, size = [], _LIST_PREFIX_BYTES
        if size + len(packed) > MAX_FRAME_BYTES:
            raise MessageTooLarge(f"a {mtype.value} message's array {spec[0][:40]!r} takes {len(packed)} bytes "
                                  f"to describe, over the {MAX_FRAME_BYTES}-byte frame cap")
        chunk.append(spec)
        size += len(packed)
    tables.append(msgpack.packb(chunk, use_bin_type=True))
    if len(tables) > MAX_TABLE_FRAMES or len(specs) > MAX_ARRAYS:
        raise MessageTooLarge(f"a {mtype.value} message of {len(specs)} arrays: its table takes {len(tables)} "
                              f"frames, over the cap of {MAX_TABLE_FRAMES} frames or {MAX_ARRAYS} arrays")
    return tables


def _array_frames(arr: np.ndarray) -> list:
    """The array's bytes as frames of at most MAX_FRAME_BYTES (views: sent zero-copy)."""
    if arr.nbytes < ZERO_COPY_THRESHOLD:
        return [arr.tobytes()]
    if arr.nbytes <= MAX_FRAME_BYTES:
        return [arr]
    raw = memoryview(arr.reshape(-1).view(np.uint8))
    return [raw[start:start + MAX_FRAME_BYTES] for start in range(0, arr.nbytes, MAX_FRAME_BYTES)]


def frames_for(nbytes: int) -> int:
    """How many frames carry an array of `nbytes` bytes."""
    return max(1, -(-nbytes // MAX_FRAME_BYTES))


def decode(frames: list, segments=None, into=None, job: str | None = None, build: bool = True) -> Message:
    """Frames -> Message, after validating everything. Raises ProtocolError.

    `segments` (shm.Segments) resolves shared-memory references; without it they are refused.
    `into(type, step, layer, name, dtype, shape)` may hand decode a buffer the receiver keeps for
    an array of a streamed message (KEPT_TYPES) that arrives in several frames (dtype and shape
    as the validated header says): the frames are joined
    straight into it (no fresh buffer per message, no second copy), and the message's array
    is a read-only view of it. None: a fresh buffer, as without `into`. A buffer not of the
    header's dtype and shape (C-contiguous, writable) refuses the message, before any copy.
    `job`: a message stamped with another job (or none) is refused. `build=False`: for a
    forwarder that passes a streamed message's frames on as they came (SwarmX): everything is
    validated as above, but a KEPT_TYPES message's arrays are not built (no join; msg.arrays empty).
    """
    if not frames:
        raise ProtocolError("empty message")
    header = _unpack_header(_as_bytes(frames[0]))
    mtype = _check_header(header)
    frames = _with_table(header, frames)
    if job is not None and header["job"] != job:
        raise ProtocolError(f"message for job {header['job'][:40]!r}, this is job {job!r}")
    specs = _check_array_specs(header["arrays"], frames[1:])
    if "layers" in header["meta"]:
        _check_group(mtype, header, specs)
    fmt = header["meta"].get("format")
    if fmt is not None:
        stored = _storage_name(fmt)
        for name, dtype, _, _, _ in specs:
            if name == SETTINGS_ARRAY:
                continue
            # labels, ids and masks ride along, and float32 values (running statistics, never rounded)
            if dtype != stored and dtype not in ("int64", "int32", "bool", "float32"):
                raise ProtocolError(f"array {name[:40]!r}: {dtype} is not the storage of {fmt} ({stored})")
    # Every reference and destination is checked before the first byte lands in a kept
    # buffer: a refused message leaves the receiver's buffers as they were.
    shared = {name: _shared_array(segments, name, dtype, shape, ref)
              for name, dtype, shape, ref, _ in specs if ref is not None}
    if not build and mtype in KEPT_TYPES:
        return Message(mtype, header["job"], header["step"], header["layer"], header["meta"], {})
    kept = _destinations(into, mtype, header, specs) if into is not None and mtype in KEPT_TYPES else {}
    arrays = {}
    for name, dtype, shape, ref, parts in specs:
        if ref is not None:
            arrays[name] = shared[name]
            continue
        # Read-only view on the received buffer; kernels copy when they must write.
        # ZeroMQ frames (and inproc zero-copy buffers) are writable, so say it explicitly:
        # a receiver must never scribble on memory the sender may still own.
        arr = np.frombuffer(_joined(parts, kept.get(name)), dtype=dtype).reshape(shape)
        if not arr.flags.aligned:
            # ZeroMQ receives a small frame into its batch buffer, where it starts wherever the
            # stream put it. numpy runs a product of a misaligned operand without BLAS, which
            # gives other float32 bits than the same product of an array made in-process: so
            # every array arrives aligned, and a WSE computes a layer as the CPU path does.
            arr = arr.copy()
        arr.flags.writeable = False
        arrays[name] = arr
    if mtype == Msg.TRACE:
        _check_trace(header["meta"], arrays)
    if mtype == Msg.ALL_REDUCE:
        check_all_reduce(header["layer"], arrays)
    meta = header["meta"]
    if mtype == Msg.LOAD_MODEL:
        meta = {**meta, "spec": JobSettings.from_meta(_settings_meta(arrays.pop(SETTINGS_ARRAY, None)))}
    return Message(mtype, header["job"], header["step"], header["layer"], meta, arrays)


class KeptBuffers:
    """The buffers a receiver keeps for a model's streamed arrays (decode's `into`): one per
    (layer, parameter, dtype), made on first use in the parameter's shape, kept for the job
    instead of fresh pages every message. Only float32 and the model's 16-bit storage
    travel; another dtype, a parameter the model (a numerics.model.ModelSpec) does not have,
    or another shape gets None: decode then builds a fresh array, and the receiver's own
    checks refuse what does not fit."""

    def __init__(self, spec):
        self.layers = spec.layers
        self.dtypes = frozenset({"float32", _storage_name(spec.precision)})
        self.buffers: dict[tuple[int, str, str], np.ndarray] = {}

    def get(self, index: int, name: str, dtype: str, shape: tuple) -> np.ndarray | None:
        buffer = self.buffers.get((index, name, dtype))
        if buffer is None:
            known = None
            if dtype in self.dtypes and 0 <= index < len(self.layers):
                known = self.layers[index].param_shapes().get(name)
            if known is None:
                return None
            buffer = self.buffers[(index, name, dtype)] = np.empty(known, dtype)
        return buffer if buffer.shape == tuple(shape) else None


@functools.lru_cache(maxsize=None)
def _storage_name(fmt: str) -> str:
    """The dtype name a format's tensors travel in (decode checks it on every message)."""
    return wire_dtype(fmt).name


def _settings_meta(packed) -> dict:
    """LOAD_MODEL's settings from their array (see the module docstring)."""
    if packed is None or packed.dtype != np.uint8 or packed.ndim != 1 or packed.nbytes > MAX_SETTINGS_BYTES:
        raise ProtocolError(f"load_model: settings array {SETTINGS_ARRAY!r} missing, not 1-D uint8, "
                            f"or over {MAX_SETTINGS_BYTES} bytes")
    try:
        spec = msgpack.unpackb(packed.tobytes(), raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"load_model: settings are not valid msgpack ({type(exc).__name__})") from None
    if not isinstance(spec, dict):
        raise ProtocolError("load_model: spec field 'spec' missing or invalid")
    return spec


def _shared_array(segments, name: str, dtype: str, shape: tuple, ref: tuple) -> np.ndarray:
    if segments is None:
        raise ProtocolError(f"array {name[:40]!r}: a shared-memory reference on a socket that does not share memory")
    from cs_runtime.wire.shm import SharedMemoryError
    try:
        return segments.resolve(ref[0], ref[1], dtype, shape)
    except SharedMemoryError as exc:
        raise ProtocolError(f"array {name[:40]!r}: {exc}") from None


def _destinations(into, mtype: Msg, header: dict, specs: list) -> dict:
    """name -> the receiver's buffer (bytes, uint8) for each multi-frame array it keeps one for.

    Called after the header and frame sizes are validated; a buffer that does not match
    the header refuses the whole message here, before anything is copied."""
    kept = {}
    for name, dtype, shape, ref, parts in specs:
        if ref is not None or len(parts) < 2:   # a view on its frame or segment: nothing to join
            continue
        buffer = into(mtype, header["step"], header["layer"], name, dtype, shape)
        if buffer is None:
            continue
        # dtype equality, not its name: '>f4' is also named float32 (and .name is slow)
        if not (isinstance(buffer, np.ndarray) and buffer.dtype == _WIRE_DTYPES[dtype] and buffer.shape == shape
                and buffer.flags.c_contiguous and buffer.flags.writeable):
            got = f"{getattr(buffer, 'dtype', type(buffer).__name__)} {getattr(buffer, 'shape', '')}"
            raise ProtocolError(f"array {name[:40]!r}: {dtype} {list(shape)} does not fit the receiver's "
                                f"buffer ({got})")
        kept[name] = buffer.reshape(-1).view(np.uint8)
    return kept


def _joined(parts: list, out: np.ndarray | None = None):
    """One buffer of an array's frames: the frame itself when there is one (no copy), else
    the frames copied one after another into `out` (uint8, their total size) or a fresh buffer."""
    if len(parts) == 1 and out is None:
        return _as_buffer(parts[0])
    if out is None:
        out = np.empty(sum(_frame_len(p) for p in parts), np.uint8)
    start = 0
    for part in parts:
        chunk = np.frombuffer(_as_buffer(part), np.uint8)
        out[start:start + len(chunk)] = chunk
        start += len(chunk)
    return out


def _as_bytes(frame) -> bytes:
    return frame.bytes if hasattr(frame, "bytes") else bytes(frame)


def _as_buffer(frame):
    return frame.buffer if hasattr(frame, "buffer") else frame


def _frame_len(frame) -> int:
    # Bytes, not len(): a frame may be a numpy array (encode's zero-copy frames).
    return memoryview(_as_buffer(frame)).nbytes


def _unpack_header(raw: bytes) -> dict:
    header = _unpack_capped(raw, "header")
    if not isinstance(header, dict):
        raise ProtocolError("header is not a map")
    return header


def _unpack_capped(raw: bytes, what: str):
    """msgpack data of at most MAX_HEADER_BYTES (a header or a table frame), unpacked."""
    if len(raw) > MAX_HEADER_BYTES:
        raise ProtocolError(f"{what} of {len(raw)} bytes exceeds the {MAX_HEADER_BYTES} byte cap")
    try:
        return msgpack.unpackb(raw, raw=False, strict_map_key=True,
                               max_bin_len=MAX_HEADER_BYTES, max_str_len=MAX_HEADER_BYTES)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"{what} is not valid msgpack ({type(exc).__name__})") from None


def _with_table(header: dict, frames: list) -> list:
    """The frames as if the array table were in the header: with "tables", the lists of that many
    frames after it (the header's own list then empty) become header["arrays"], and those frames
    leave the list. The count is checked before a table frame is read, each frame's size before
    it is unpacked; the specs themselves are checked as a header's are."""
    count = header.get("tables")
    if count is None:
        return frames
    if type(count) is not int or not 1 <= count <= min(MAX_TABLE_FRAMES, len(frames) - 1) or header["arrays"]:
        raise ProtocolError(f"header field 'tables' is not a count in [1, {MAX_TABLE_FRAMES}] of the frames "
                            f"that follow, with the header's own 'arrays' empty")
    table = []
    for frame in frames[1:1 + count]:
        part = _unpack_capped(_as_bytes(frame), "array table frame")
        if type(part) is not list or not part or len(table) + len(part) > MAX_ARRAYS:
            raise ProtocolError(f"array table frame is not a non-empty list, or the table lists over {MAX_ARRAYS} arrays")
        table.extend(part)
    header["arrays"] = table
    return [frames[0], *frames[1 + count:]]


_HEADER_FIELDS = (("t", str), ("v", int), ("job", str), ("step", int), ("layer", int), ("meta", dict),
                  ("arrays", list))
_MSG_BY_VALUE = {m.value: m for m in Msg}   # a dict lookup: Msg(value) goes through enum's machinery


def _check_header(header: dict) -> Msg:
    for key, typ in _HEADER_FIELDS:
        value = header.get(key)
        if not isinstance(value, typ) or isinstance(value, bool) and typ is int:
            raise ProtocolError(f"header field {key!r} missing or not {typ.__name__}")
    if header["v"] != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {header['v']} (expected {PROTOCOL_VERSION})")
    mtype = _MSG_BY_VALUE.get(header["t"])
    if mtype is None:
        raise ProtocolError(f"unknown message type {header['t'][:40]!r}")
    meta = header["meta"]
    _check_meta(mtype, meta)
    if "then" in meta:
        _check_burst(mtype, header["step"], meta["then"], header["arrays"])
    return mtype


def _check_meta(mtype: Msg, meta: dict) -> None:
    for key, typ in META_SCHEMA[mtype].items():
        if not _is(meta.get(key), typ):
            raise ProtocolError(f"{mtype.value}: meta field {key!r} missing or of the wrong type")
    for key, value in meta.items():   # a message's few keys, not every optional one
        typ = OPTIONAL_META.get(key)
        if typ is not None and not _is(value, typ):
            raise ProtocolError(f"{mtype.value}: meta field {key!r} of the wrong type")
    if "format" in meta and meta["format"] not in FORMATS:
        raise ProtocolError(f"{mtype.value}: unknown tensor format {meta['format'][:20]!r}")
    if mtype in FRONT_DOOR:
        _check_front_door(mtype, meta)
    norms = meta.get("layer_grad_norms")
    if norms is not None and (len(norms) > MAX_ARRAYS or not all(_is(n, _NUM) for n in norms)):
        raise ProtocolError(f"{mtype.value}: meta field 'layer_grad_norms' is not a list of numbers")
    for key in ("param_grad_norms", "param_norms"):
        named = meta.get(key)
        if named is not None and (len(named) > MAX_ARRAYS or
                                  not all(isinstance(k, str) and _is(n, _NUM) for k, n in named.items())):
            raise ProtocolError(f"{mtype.value}: meta field {key!r} is not a map of names to numbers")


def _is(value, typ) -> bool:
    return isinstance(value, typ) and not (isinstance(value, bool) and typ in (int, _NUM))


def _check_array_specs(specs: list, frames: list) -> list:
    if len(specs) > MAX_ARRAYS:
        raise ProtocolError(f"{len(specs)} arrays exceed the cap of {MAX_ARRAYS}")
    checked = [_check_array_spec(spec) for spec in specs]
    framed = [nbytes for _, _, _, ref, nbytes in checked if ref is None]
    wanted = sum(frames_for(nbytes) for nbytes in framed)
    if wanted != len(frames):
        raise ProtocolError(f"header lists {len(framed)} arrays in {wanted} frames but {len(frames)} frames follow")
    out, start = [], 0
    for name, dtype, shape, ref, nbytes in checked:
        parts = []
        if ref is None:
            count = frames_for(nbytes)
            parts = frames[start:start + count]
            start += count
            _check_frame_sizes(name, nbytes, parts)
        out.append((name, dtype, shape, ref, parts))
    return out


def _check_frame_sizes(name: str, nbytes: int, parts: list) -> None:
    """Every frame of an array full but the last, together the header's byte count."""
    if len(parts) == 1:   # most arrays: one frame, its size the header's
        size = _frame_len(parts[0])
        if size != nbytes:
            raise ProtocolError(f"array {name[:40]!r}: frame has {size} bytes, header says {nbytes}")
        return
    sizes = [_frame_len(p) for p in parts]
    if sum(sizes) != nbytes or any(size != MAX_FRAME_BYTES for size in sizes[:-1]):
        got = sizes[0] if len(sizes) == 1 else f"{sum(sizes)} in frames of {sizes[:3]}..."
        raise ProtocolError(f"array {name[:40]!r}: frame has {got} bytes, header says {nbytes}")


# Bytes a value of each wire dtype: np.dtype(name) costs a microsecond an array.
_ITEMSIZES = {name: dtype.itemsize for name, dtype in _WIRE_DTYPES.items()}


def _check_array_spec(spec) -> tuple:
    """(name, dtype, shape, shared-memory reference or None, bytes) of a valid spec.

    Types are checked exactly (`type(x) is int`): msgpack gives plain ints, strs and lists,
    and a bool is no int here."""
    if type(spec) is not list:
        raise ProtocolError("array spec is not a list")
    ref = None
    if len(spec) == 5:          # [name, dtype, shape, segment, offset]: no frame
        ref = (spec[3], spec[4])
        if not (type(ref[0]) is str and type(ref[1]) is int):
            raise ProtocolError("shared-memory reference is not [segment name, offset]")
        spec = spec[:3]
    if not (len(spec) == 3 and type(spec[0]) is str and type(spec[1]) is str and type(spec[2]) is list):
        raise ProtocolError("array spec is not [name, dtype, shape]")
    name, dtype, shape = spec
    itemsize = _ITEMSIZES.get(dtype)
    if itemsize is None:
        raise ProtocolError(f"array {name[:40]!r}: dtype {dtype[:20]!r} is not allowed")
    if len(shape) > MAX_DIMS:
        raise ProtocolError(f"array {name[:40]!r}: {len(shape)} dims exceed the cap of {MAX_DIMS}")
    # Python ints: a product in int64 wraps (3 dims of 2**31 give 0) and would pass the cap.
    nbytes = itemsize
    for d in shape:
        if type(d) is not int or not 0 <= d <= MAX_ARRAY_BYTES:
            raise ProtocolError(f"array {name[:40]!r}: bad shape {str(shape)[:80]} "
                                f"(dims must be ints in [0, {MAX_ARRAY_BYTES}])")
        nbytes *= d
    if nbytes > MAX_ARRAY_BYTES:
        raise ProtocolError(f"array {name[:40]!r}: {nbytes} bytes exceed the cap")
    return name, dtype, tuple(shape), ref, nbytes


# ALL_REDUCE: a step's collectives are numbered in the order every WSE runs them (the message's
# `layer`: 0, 1, ...), each one float64 vector of per-shard sums (a batch norm's count and
# per-channel sums: at most MAX_ARRAY_BYTES / 8 values), summed by SwarmX in rank order.
ALL_REDUCE_ARRAY = "sum"


def check_all_reduce(number: int, arrays: dict) -> None:
    """An ALL_REDUCE's number and its one float64 vector (what a WSE acts on before it sums)."""
    if number < 0:
        raise ProtocolError(f"all_reduce: collective number {number} is negative")
    if set(arrays) != {ALL_REDUCE_ARRAY} or arrays[ALL_REDUCE_ARRAY].dtype != np.float64 \
            or arrays[ALL_REDUCE_ARRAY].ndim != 1:
        raise ProtocolError(f"all_reduce: arrays must be one 1-D float64 {ALL_REDUCE_ARRAY!r}")


def _check_trace(meta: dict, arrays: dict) -> None:
    """A TRACE's spans: the five arrays, 1-D, one length, name ids within its list of names."""
    names = meta["names"]
    if len(names) > MAX_SPAN_NAMES or not all(isinstance(n, str) and len(n) <= MAX_SPAN_NAME_CHARS
                                              for n in names):
        raise ProtocolError(f"trace: names must be at most {MAX_SPAN_NAMES} strings of at most "
                            f"{MAX_SPAN_NAME_CHARS} characters")
    if set(arrays) != set(SPAN_ARRAYS):
        raise ProtocolError(f"trace: arrays must be {sorted(SPAN_ARRAYS)}")
    lengths = set()
    for name, dtype in SPAN_ARRAYS.items():
        arr = arrays[name]
        if arr.dtype.name != dtype or arr.ndim != 1:
            raise ProtocolError(f"trace: array {name!r} must be 1-D {dtype}")
        lengths.add(len(arr))
    if len(lengths) != 1 or lengths.pop() > MAX_SPANS:
        raise ProtocolError(f"trace: span arrays differ in length or exceed {MAX_SPANS} spans")
    ids, durations = arrays["name"], arrays["dur_ns"]
    if len(ids) and (ids.min() < 0 or ids.max() >= len(names) or durations.min() < 0):
        raise ProtocolError("trace: a span names no listed name or has a negative duration")


def float_arrays(msg: Message) -> dict[str, np.ndarray]:
    """The message's tensors as float32 values, whatever format they travelled in."""
    return decode_arrays(msg.arrays, msg.meta.get("format", "float32"))


def array_bytes(msg: Message) -> int:
    """Payload bytes of a message (what the benchmarks count as 'streamed')."""
    return sum(a.nbytes for a in msg.arrays.values())

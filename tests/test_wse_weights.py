"""The weight-streaming WSE widens a step's 16-bit weights once: the forward pass's
float32 copy serves the backward pass of the same step."""
import numpy as np
import pytest

from cs_runtime.numerics import precision as P
from cs_runtime.numerics.model import mlp_spec
from cs_runtime.wire.protocol import Message, Msg, decode, encode
from wse.emulator import WeightStreamingExecutor


def weights(step: int, phase: str, fmt: str, values: dict) -> Message:
    msg = Message(Msg.WEIGHTS, step=step, layer=0, meta={"phase": phase, "format": fmt},
                  arrays=P.encode_arrays(values, fmt))
    return decode(encode(msg))        # as received: read-only views on the frames


def widen(executor: WeightStreamingExecutor, msg: Message) -> dict:
    return executor.widen(msg.step, msg.layer, msg.arrays, msg.meta["format"], msg.meta["phase"])


@pytest.mark.parametrize("fmt", ["float16", "bfloat16", "cbfloat16"])
def test_backward_reuses_the_forward_widening_and_buffers_are_kept(fmt):
    spec = mlp_spec("m", [4, 3, 2], "relu", 0.0)
    executor = WeightStreamingExecutor(spec, 0, None, None)
    rng = np.random.default_rng(0)
    first = {"weight": rng.standard_normal((4, 3)).astype(np.float32), "bias": np.ones(3, np.float32)}
    widened = widen(executor, weights(7, "fwd", fmt, first))
    for name, value in first.items():
        assert widened[name].dtype == np.float32
        np.testing.assert_array_equal(widened[name], P.quantize(value, fmt))
    executor.step = 7
    other = {"weight": np.zeros((4, 3), np.float32), "bias": np.zeros(3, np.float32)}
    assert widen(executor, weights(7, "bwd", fmt, other)) is widened      # not decoded again
    with pytest.raises(RuntimeError, match="out of order"):
        widen(executor, weights(8, "bwd", fmt, other))
    kept = widened["weight"]
    again = widen(executor, weights(8, "fwd", fmt, other))
    assert again["weight"] is kept and not kept.any()                          # next step: same buffer


def test_float32_weights_are_used_as_they_arrive():
    spec = mlp_spec("m", [4, 3, 2], "relu", 0.0)
    executor = WeightStreamingExecutor(spec, 0, None, None)
    msg = weights(1, "fwd", "float32", {"weight": np.ones((4, 3), np.float32), "bias": np.ones(3, np.float32)})
    assert widen(executor, msg) is msg.arrays

"""The chief sends MemoryX, or a pipelined WSE, its next TRAIN_STEPs before the current step's
answer (chief/trainer.py next_step_args, chief/cluster_executor.py train_step's `ahead`): which
steps go ahead, that each goes once with the arguments its turn gives it, in bursts of at most
STEPS_AHEAD, and that answers go in bursts (protocol.ANSWERS_HELD), a burst one message
(protocol.burst) that decode checks entry by entry (tests/test_protocol.py). That the numbers stay the
CPU path's: tests/test_pipelined.py and tests/test_cluster.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

import collections

from chief.cluster_executor import ClusterExecutor, ServiceError
from chief.input_monitor import InputMonitor
from chief.trainer import Trainer
from cs_runtime.numerics.precision import LossScaler
from cs_runtime.wire.protocol import ANSWERS_HELD, STEPS_AHEAD, Message, Msg, burst, decode, encode, unburst
from wse.pipelined import PipelinedExecutor


def trainer(max_steps=10, checkpoint_steps=0, log_steps=2, scaling="none") -> Trainer:
    t = Trainer.__new__(Trainer)   # only what next_step_args reads
    t.params = SimpleNamespace(optimizer=SimpleNamespace(lr_at=lambda step: 0.5 / (step + 1)))
    t.rc = SimpleNamespace(checkpoint_steps=checkpoint_steps, log_steps=log_steps)
    t.scaler = LossScaler(scaling, static_scale=4.0)
    t.max_steps = max_steps
    return t


def test_next_step_goes_ahead_with_the_arguments_of_its_turn():
    t = trainer()
    assert t.next_step_args(3) == t.step_args(4) == (4, 0.1, 1.0, False)
    assert t.next_step_args(4) == (5, 0.5 / 6, 1.0, True)   # step 5 logs (6 % 2 == 0): its norms asked for
    assert trainer(scaling="static").next_step_args(0) == (1, 0.25, 4.0, True)


@pytest.mark.parametrize("t, step", [
    (trainer(max_steps=10), 9),                       # the last step: nothing after it
    (trainer(checkpoint_steps=5), 4),                 # a checkpoint after it must hold its weights
    (trainer(scaling="dynamic"), 0),                  # the next scale follows this step's result
])
def test_no_step_goes_ahead_when_it_must_wait(t, step):
    assert t.next_step_args(step) is None


class Sent:
    def __init__(self):
        self.messages = []

    def send(self, msg):
        self.messages.append(msg)


def executor(strategy: str) -> ClusterExecutor:
    ex = ClusterExecutor.__new__(ClusterExecutor)   # no sockets: the sends are recorded
    ex.strategy, ex.swarmx, ex.memoryx, ex.sent_ahead = strategy, Sent(), Sent(), collections.deque()
    ex.spec = SimpleNamespace(program=None)   # a model whose steps hand out their loss alone
    ex.input_monitor = InputMonitor(1, 1)
    meta = {"loss": 1.5, "grad_norm": 2.0, "applied": True}
    ex.wait = lambda endpoint, mtype, step: Message(mtype, step=step, meta=meta)
    return ex


def sent_steps(ex):
    """Every TRAIN_STEP sent, each burst (one message) taken apart, as the receiver's decode and
    unburst take it."""
    return [m for sent in (*ex.swarmx.messages, *ex.memoryx.messages) if sent.type == Msg.TRAIN_STEP
            for m in unburst(decode(encode(sent)))]


def train_steps(ex):
    return [(m.step, m.meta["lr"]) for m in sent_steps(ex)]


def test_pipelined_sends_each_step_once_in_bursts_ahead():
    ex, t = executor("pipelined"), trainer(max_steps=20, log_steps=3)
    assert ex.train_step(*t.step_args(0), ahead=t.next_step_args) == (1.5, 2.0, True)
    assert train_steps(ex) == [(s, t.step_args(s)[1]) for s in range(STEPS_AHEAD + 1)]   # 0, and 8 ahead
    assert [m.step for m in ex.swarmx.messages] == [0, 1]   # the 8 in one message
    for step in range(1, STEPS_AHEAD // 2):   # no top-up while more than half are queued
        ex.train_step(*t.step_args(step), ahead=t.next_step_args)
    assert len(train_steps(ex)) == STEPS_AHEAD + 1
    ex.train_step(*t.step_args(STEPS_AHEAD // 2), ahead=t.next_step_args)   # half left: topped up in one burst
    assert [s for s, _ in train_steps(ex)] == list(range(STEPS_AHEAD // 2 + STEPS_AHEAD + 1))
    for step in range(STEPS_AHEAD // 2 + 1, 20):
        ex.train_step(*t.step_args(step), ahead=t.next_step_args)
    assert train_steps(ex) == [(s, t.step_args(s)[1]) for s in range(20)] and not ex.sent_ahead
    assert [m.meta["norms"] for m in sent_steps(ex)] == [t.logs_at(s + 1) for s in range(20)]


def test_steps_go_ahead_only_up_to_a_checkpoint():
    ex, t = executor("pipelined"), trainer(max_steps=20, checkpoint_steps=5)
    ex.train_step(*t.step_args(0), ahead=t.next_step_args)
    assert [s for s, _ in train_steps(ex)] == [0, 1, 2, 3, 4]   # the checkpoint after step 5 holds its weights


def test_a_step_asked_otherwise_than_it_went_ahead_is_refused():
    ex, t = executor("pipelined"), trainer()
    ex.train_step(*t.step_args(0), ahead=t.next_step_args)
    with pytest.raises(ServiceError, match="sent ahead"):
        ex.train_step(1, 0.3, 1.0, False)


def test_weight_streaming_sends_ahead_to_memoryx():
    ex, t = executor("weight_streaming"), trainer()
    ex.train_step(*t.step_args(0), ahead=t.next_step_args)
    ex.train_step(*t.step_args(1), ahead=t.next_step_args)
    assert train_steps(ex) == [(s, t.step_args(s)[1]) for s in range(STEPS_AHEAD + 1)] and not ex.swarmx.messages


def test_a_pipelined_wse_answers_in_bursts_in_step_order():
    wse = PipelinedExecutor.__new__(PipelinedExecutor)   # only what hold and flush use
    wse.up, wse.held = Sent(), []
    for step in range(ANSWERS_HELD - 1):
        wse.hold(Message(Msg.LOSS, step=step, meta={"loss": 0.5 + step, "count": 8}))
    assert not wse.up.messages                       # held while more steps wait
    wse.hold(Message(Msg.LOSS, step=ANSWERS_HELD - 1, meta={"loss": 1.0, "count": 8}))
    wse.hold(Message(Msg.LOSS, step=ANSWERS_HELD, meta={"loss": 2.0, "count": 8}))
    wse.flush()                                      # before it waits, or answers anything else
    assert [m.step for m in wse.up.messages] == [0, ANSWERS_HELD] and not wse.held   # each burst one message
    got = [m for sent in wse.up.messages for m in unburst(decode(encode(sent)))]
    assert [m.step for m in got] == list(range(ANSWERS_HELD + 1))


def test_swarmx_refuses_a_burst_where_parts_are_summed():
    """Bursts come from a pipelined WSE, alone; from one of several WSEs a burst would be summed
    as one step's parts: SwarmX tells the chief instead (an ERROR naming it), and sums nothing."""
    from cs_runtime.swarmx.server import SwarmX

    class Router:
        def __init__(self):
            self.sent = []

        def send(self, msg, identity, share=True):
            self.sent.append((msg, identity))

    swarmx = SwarmX.__new__(SwarmX)   # no sockets: what it sends is recorded
    swarmx.num_wse, swarmx.wse, swarmx.chief, swarmx.pending = 2, {0: b"w0", 1: b"w1"}, b"chief", {}
    swarmx.router, swarmx.penv = Router(), SimpleNamespace(rank=0)
    (loss,) = burst([Message(Msg.LOSS, step=s, meta={"loss": 1.0, "count": 4}) for s in (3, 4)])
    swarmx.collect(b"w1", loss, frames=[])
    ((error, to),) = swarmx.router.sent
    assert to == b"chief" and error.type == Msg.ERROR and "burst of loss from WSE 1 of 2" in error.meta["reason"]
    assert swarmx.pending == {}

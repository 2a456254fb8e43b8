"""The chief sends a pipelined WSE its next TRAIN_STEP before the current step's LOSS
(chief/trainer.py next_step_args, chief/cluster_executor.py train_step's `then`): which
steps go ahead, that each goes once with the arguments its turn gives it, and that weight
streaming sends nothing ahead. That the numbers stay the CPU path's: tests/test_pipelined.py."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from chief.cluster_executor import ClusterExecutor, ServiceError
from chief.input_monitor import InputMonitor
from chief.trainer import Trainer
from cs_runtime.numerics.precision import LossScaler
from cs_runtime.wire.protocol import Message, Msg


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
    ex.strategy, ex.swarmx, ex.memoryx, ex.sent_ahead = strategy, Sent(), Sent(), None
    ex.spec = SimpleNamespace(program=None)   # a model whose steps hand out their loss alone
    ex.input_monitor = InputMonitor(1, 1)
    meta = {"loss": 1.5, "grad_norm": 2.0, "applied": True}
    ex.wait = lambda endpoint, mtype, step: Message(mtype, step=step, meta=meta)
    return ex


def train_steps(ex):
    return [(m.step, m.meta["lr"]) for m in (*ex.swarmx.messages, *ex.memoryx.messages) if m.type == Msg.TRAIN_STEP]


def test_pipelined_sends_each_step_once_the_next_one_ahead():
    ex = executor("pipelined")
    assert ex.train_step(0, 0.5, 1.0, True, then=(1, 0.25, 1.0, False)) == (1.5, 2.0, True)
    assert train_steps(ex) == [(0, 0.5), (1, 0.25)]
    ex.train_step(1, 0.25, 1.0, False, then=(2, 0.125, 1.0, True))
    ex.train_step(2, 0.125, 1.0, True)
    assert train_steps(ex) == [(0, 0.5), (1, 0.25), (2, 0.125)]
    assert ex.sent_ahead is None


def test_a_step_asked_otherwise_than_it_went_ahead_is_refused():
    ex = executor("pipelined")
    ex.train_step(0, 0.5, 1.0, True, then=(1, 0.25, 1.0, False))
    with pytest.raises(ServiceError, match="sent ahead"):
        ex.train_step(1, 0.3, 1.0, False)


def test_weight_streaming_sends_nothing_ahead():
    ex = executor("weight_streaming")
    ex.train_step(0, 0.5, 1.0, True, then=(1, 0.25, 1.0, False))
    ex.train_step(1, 0.25, 1.0, False)
    assert train_steps(ex) == [(0, 0.5), (1, 0.25)] and not ex.swarmx.messages

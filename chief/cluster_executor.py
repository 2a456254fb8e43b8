"""The chief's side of the CS system: drive MemoryX, SwarmX and the WSEs.

Per training step the chief sends one TRAIN_STEP to MemoryX and waits for
two answers: the loss reduced over the WSEs (via SwarmX) and STEP_DONE from
MemoryX once every layer is updated. Input workers ask the chief for their
plan (which batches to stream) and are answered whenever they connect.
"""
from __future__ import annotations

import collections
import logging
import time

import zmq

from chief import story as run_story
from chief.input_monitor import InputMonitor
from cs_runtime.errors import CsError
from cs_runtime import trace
from cs_runtime.checkpoint import flatten, unflatten_for
from cs_runtime.compiler.planner import mode_name, run_mode
from cs_runtime.wire.auth import stop_authenticator
from cs_runtime.process.directory_client import DirectoryClient
from cs_runtime.data.inputs import InputStream, eval_steps
from cs_runtime.numerics.optim import Optimizer
from cs_runtime.numerics.program_layer import hands_out_outputs
from cs_runtime.wire.protocol import STEPS_AHEAD, JobSettings, Message, Msg, burst, float_arrays, unburst
from cs_runtime.process.service import ProcessEnv
from cs_runtime.run_args import RunError
from cs_runtime.wire.transport import Endpoint

log = logging.getLogger("chief")

POLL_MS = 1000
JOB_END_TIMEOUT_MS = 2000
TRACE_TIMEOUT_S = 30     # for every process's spans at the end of a --trace run


class ServiceError(CsError, RuntimeError):
    pass


def input_wait(loss: Message) -> float:
    """Seconds the WSEs waited for input in this step (an optional LOSS field)."""
    value = loss.meta.get("input_wait_s", 0.0)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0.0


def choose_strategy(plan: dict, args, num_csx: int) -> tuple[str, int]:
    """The compiler's execution strategy and replica count: the plan's, which the compile
    made for this system (planner.run_mode); a plan made without knowing it is fitted here."""
    planned = plan.get("execution_strategy", "weight_streaming")
    strategy, replicas, note = run_mode(planned, num_csx, bool(args.multireplica))
    if note and (strategy, replicas) != (planned, plan.get("num_replicas", 1)):
        log.info("the plan says %s; %s: running %s", planned, note, strategy)
    return strategy, replicas


class ClusterExecutor:

    def __init__(self, args, fns, spec, compiled=None, penv: ProcessEnv | None = None,
                 exit_on_failure: bool = True):
        """penv: the job (default: this process's environment). exit_on_failure=False (a chief
        inside a user's process, cs_torch.Session): a failed job raises ServiceError from the
        waiting call instead of ending the process."""
        self.args, self.fns, self.spec, self.params = args, fns, spec, args.params
        self.penv = penv or ProcessEnv.from_environ("chief")
        self.failure = ""
        self.opt_spec = self.params.optimizer.optimizer_spec()
        self.ctx = zmq.Context()
        self.workers = Endpoint(self.ctx, zmq.ROUTER, "chief", self.penv.job)
        # Kept: its socket closes with LINGER 0 when collected, which can drop the REGISTER not yet sent
        # (the CURVE handshake may not be done), and the workers would wait for the chief for ever.
        self.job_dir = DirectoryClient(self.ctx, self.penv.rendezvous, "chief", 0, self.penv.job)
        self.job_dir.register({"router": self.workers.bind()})
        self.heartbeat = self.job_dir.start_heartbeats(None if exit_on_failure else self.on_job_failure,
                                                       run_story.tell_stopped if exit_on_failure else None)
        services = DirectoryClient(self.ctx, self.penv.cs_ip, "chief", 0, self.penv.job)
        self.system_heartbeat = None
        if self.penv.cs_ip != self.penv.rendezvous:   # a shared CS system: its turn is held while we beat
            services.register({})
            self.system_heartbeat = services.start_heartbeats(None if exit_on_failure else self.on_job_failure)
        found = services.lookup(["memoryx", "swarmx"])
        self.memoryx = self.dealer("memoryx", found["memoryx"][0])
        self.swarmx = self.dealer("swarmx", found["swarmx"][0])
        self.strategy, self.replicas = choose_strategy(compiled or {}, args, self.penv.num_csx)
        self.device = f"WSE, Mode={mode_name(self.strategy, self.replicas)}"
        self.plan_phases: list | None = None
        self.waiting_workers: list[bytes] = []
        self.worker_ids: list[bytes] = []       # every worker that said HELLO (asked for spans at the end)
        self.layer_grad_norms: list[float] = []   # of the last training step, for TensorBoard
        self.param_grad_norms: dict[str, float] = {}   # of the last training step, by parameter (a program's)
        self.param_norms: dict[str, float] = {}   # the weights' as the last training step began, likewise
        self._eval_steps: int | None = None
        self.traffic: dict[str, int] = {}   # bytes of the last training step
        self.outputs: dict = {}   # what the last step handed back besides its loss (the model's output)
        self.input_monitor = InputMonitor(self.penv.num_csx, self.penv.num_workers)
        self.pollers: dict[str, zmq.Poller] = {}   # wait's, by the endpoint awaited
        self.sent_ahead: collections.deque = collections.deque()   # TRAIN_STEPs sent before their turn
        self.arrived: dict[tuple, Message] = {}   # (endpoint, type, step): the later answers of a burst

    def dealer(self, role: str, peer: dict) -> Endpoint:
        ep = Endpoint(self.ctx, zmq.DEALER, f"chief->{role}", self.penv.job)
        ep.connect(peer["endpoints"]["router"])
        ep.send(Message(Msg.HELLO, meta={"role": "chief", "rank": 0}))
        return ep

    def on_job_failure(self, reason: str) -> None:
        """Heartbeat thread: the job failed; `wait` raises it within POLL_MS."""
        self.failure = reason

    # ------------------------------------------------------------ waiting
    def wait(self, endpoint: Endpoint, mtype: Msg, step: int = -1) -> Message:
        """Next `mtype` message on `endpoint`, serving workers meanwhile."""
        early = self.arrived.pop((endpoint.name, mtype, step), None)
        if early is not None:
            return early
        poller = self.poller(endpoint)
        while True:
            ready = dict(poller.poll(POLL_MS))
            if self.failure:
                raise ServiceError(self.failure)
            self.input_monitor.on_idle()
            if self.workers.sock in ready:
                self.serve_worker()
            if self.swarmx is not endpoint and self.swarmx.sock in ready:
                self.unexpected(self.swarmx.recv(0))
            if endpoint.sock in ready:
                got = endpoint.recv(0)
                if got is None:
                    continue
                msg, *later = unburst(got[1])
                for answer in later:   # a burst's answers for the steps after: asked for next
                    self.arrived[(endpoint.name, answer.type, answer.step)] = answer
                if msg.type == mtype and (step < 0 or msg.step == step):
                    return msg
                self.unexpected(got)

    def poller(self, endpoint: Endpoint) -> zmq.Poller:
        """The poller of `endpoint`, the workers and SwarmX: made once, not once a wait."""
        poller = self.pollers.get(endpoint.name)
        if poller is None:
            poller = self.pollers[endpoint.name] = zmq.Poller()
            for ep in (endpoint, self.workers, self.swarmx):
                poller.register(ep.sock, zmq.POLLIN)
        return poller

    def unexpected(self, got) -> None:
        if got is None:
            return
        msg = got[1]
        if msg.type == Msg.ERROR:
            raise ServiceError(f"{msg.meta['role']} {msg.meta['rank']} failed: {msg.meta['reason']}")
        log.warning("ignored unexpected %s (step %d)", msg.type.value, msg.step)

    def serve_worker(self) -> None:
        got = self.workers.recv(0)
        if got is None:
            return
        identity, msg = got
        if msg.type == Msg.INPUT_STATS:
            self.input_monitor.on_stats(msg.meta)
            return
        if msg.type != Msg.HELLO:
            self.workers.warn_once(identity, f"unexpected {msg.type.value} from a worker")
            return
        self.waiting_workers.append(identity)
        if identity not in self.worker_ids:
            self.worker_ids.append(identity)
        self.answer_workers()

    def answer_workers(self) -> None:
        if self.plan_phases is None:
            return
        for identity in self.waiting_workers:
            self.workers.send(Message(Msg.PLAN, meta={"phases": self.plan_phases}), identity)
        self.waiting_workers = []

    # ------------------------------------------------------------ executor API
    def num_eval_steps(self) -> int:
        if self._eval_steps is None:
            if self.fns.eval_input_fn is None:
                raise RunError("eval needs an eval_input_fn in run.py")
            # Only the length matters here: the workers stream the data itself.
            stream = InputStream.build("eval", self.fns.eval_input_fn(self.params), self.params.eval_input,
                                       self.params.runconfig.seed)
            self._eval_steps = eval_steps(stream, self.params.runconfig.eval_steps)
        return self._eval_steps

    def load(self, weights, opt_state, phases) -> None:
        settings = JobSettings(self.spec, self.opt_spec, self.params.runconfig.seed, self.strategy, self.replicas,
                               self.params.optimizer.max_gradient_norm,
                               self.params.optimizer.loss_scaling_mode(), trace.RECORDER.enabled)
        state = flatten(weights, opt_state)
        if self.pipelined:
            # Every weight goes to the wafer once, here, and stays there.
            self.swarmx.send(Message(Msg.LOAD_MODEL, meta={"spec": settings}, arrays=state))
        else:
            self.memoryx.send(Message(Msg.LOAD_MODEL, meta={"spec": settings}, arrays=state))
            self.wait(self.memoryx, Msg.ACK)
            self.swarmx.send(Message(Msg.LOAD_MODEL, meta={"spec": settings}))
        self.wait(self.swarmx, Msg.ACK)
        self.plan_phases = phases
        self.answer_workers()
        log.info("model loaded on %s%d WSE(s)", "" if self.pipelined else "MemoryX and ", self.penv.num_csx)

    @property
    def pipelined(self) -> bool:
        return self.strategy == "pipelined"

    def start_step(self, step: int, lr: float, loss_scale: float, norms: bool) -> None:
        """Send TRAIN_STEP `step`, unless it went ahead already with these very arguments."""
        args = (step, lr, loss_scale, norms)
        if self.sent_ahead:
            went = self.sent_ahead.popleft()
            if went != args:   # a bug of the caller's, never a result of the run
                raise ServiceError(f"step {step} was sent ahead as {went}, now asked as {args}")
            return
        self.send_step(args)

    def send_step(self, *steps: tuple) -> None:
        """TRAIN_STEP for each of `steps` ((step, lr, loss_scale, norms), in order): one message."""
        starts = [Message(Msg.TRAIN_STEP, step=step, meta={"lr": lr, "loss_scale": loss_scale, "norms": norms})
                  for step, lr, loss_scale, norms in steps]
        for start in burst(starts):
            (self.swarmx if self.pipelined else self.memoryx).send(start)

    def send_ahead(self, step: int, ahead) -> None:
        """Once no more than half of STEPS_AHEAD steps after `step` are queued, the next ones
        whose arguments `ahead` knows now, up to STEPS_AHEAD (protocol.STEPS_AHEAD)."""
        if len(self.sent_ahead) > STEPS_AHEAD // 2:
            return
        last = self.sent_ahead[-1][0] if self.sent_ahead else step
        going = []
        while len(self.sent_ahead) + len(going) < STEPS_AHEAD:
            args = ahead(last)
            if args is None:
                break
            going.append(tuple(args))
            last = args[0]
        self.send_step(*going)   # one message (protocol.burst)
        self.sent_ahead.extend(going)

    def train_step(self, step: int, lr: float, loss_scale: float = 1.0,
                   norms: bool = True, ahead=None) -> tuple[float, float, bool]:
        """(loss, gradient norm (nan unless `norms`), whether the update was applied).

        `ahead(s)`: the arguments (step, lr, loss_scale, norms) of the step after s when they are
        known now, else None. Up to STEPS_AHEAD of the next steps are sent before this step's
        answer: MemoryX (or a pipelined WSE) finds them queued as it finishes this step instead
        of idling through the hops of the chief's round trip and its logging, and answers in
        bursts. It runs its steps in order, so the maths is that of lockstep steps."""
        self.start_step(step, lr, loss_scale, norms)
        if ahead is not None:
            self.send_ahead(step, ahead)
        if self.pipelined:
            loss = self.wait(self.swarmx, Msg.LOSS, step)
            self.outputs = float_arrays(loss)
            self.input_monitor.on_step(input_wait(loss))
            self.traffic = {"wse_bytes_in": int(loss.meta.get("bytes_in", -1))}
            self.layer_grad_norms = list(loss.meta.get("layer_grad_norms", []))
            self.param_grad_norms = dict(loss.meta.get("param_grad_norms", {}))
            self.param_norms = dict(loss.meta.get("param_norms", {}))
            return float(loss.meta["loss"]), float(loss.meta["grad_norm"]), bool(loss.meta.get("applied", True))
        if hands_out_outputs(self.spec):
            loss = self.wait(self.swarmx, Msg.LOSS, step)
            self.outputs = float_arrays(loss)   # the model's output
        done = self.wait(self.memoryx, Msg.STEP_DONE, step)
        if not hands_out_outputs(self.spec):   # the loss came with the gradients (protocol.STEP_LOSS)
            if "loss" not in done.meta:
                raise ServiceError(f"MemoryX's step_done of step {step} has no loss")
            loss, self.outputs = done, {}
        self.input_monitor.on_step(input_wait(loss))
        self.traffic = {k: int(done.meta.get(k, 0)) for k in ("weight_bytes", "grad_bytes")}
        self.traffic["wse_bytes_in"] = int(loss.meta.get("bytes_in", -1))
        self.traffic["shared_memory"] = bool(done.meta.get("shared_memory", False))
        self.layer_grad_norms = list(done.meta.get("layer_grad_norms", []))
        self.param_grad_norms = dict(done.meta.get("param_grad_norms", {}))
        self.param_norms = dict(done.meta.get("param_norms", {}))
        return float(loss.meta["loss"]), float(done.meta["grad_norm"]), bool(done.meta.get("applied", True))

    def traffic_summary(self) -> str:
        """Bytes through MemoryX in the last step; SwarmX fans weights out to every WSE."""
        t = self.traffic
        if not t:
            return ""
        n = self.penv.num_csx
        if self.pipelined:
            return f"| Streaming Device=WSE, WeightBytes/step={t['wse_bytes_in']} (received by the WSE sockets)"
        how = "shared memory, same host" if t["shared_memory"] else "tcp"
        return (f"| Streaming Device=WSE, WeightBytes/step={t['weight_bytes']} (MemoryX->SwarmX) "
                f"x {1 + n} hops incl. fan-out to {n} WSE(s), GradBytes/step={t['grad_bytes']} (SwarmX->MemoryX), "
                f"WSEBytesIn/step={t['wse_bytes_in']}, via {how}")

    def eval_step(self, step: int) -> tuple[float, int, int]:
        (self.swarmx if self.pipelined else self.memoryx).send(Message(Msg.EVAL_STEP, step=step))
        result = self.wait(self.swarmx, Msg.EVAL_RESULT, step)
        self.outputs = float_arrays(result)
        m = result.meta
        return float(m["loss_sum"]), int(m["correct"]), int(m["count"])

    def state(self):
        holder = self.swarmx if self.pipelined else self.memoryx  # who has the weights
        holder.send(Message(Msg.GET_STATE))
        msg = self.wait(holder, Msg.STATE)
        return unflatten_for(self.spec, Optimizer(self.opt_spec), msg.arrays)

    def collect_traces(self, workers: bool = True) -> list[trace.ProcessTrace]:
        """Every process's spans (without the input workers' unless `workers`), each with its clock
        offset from the GET_TRACE round trip.

        MemoryX and SwarmX answer themselves; SwarmX passes the request to every
        WSE and their answers back; each input worker answers on its socket.
        """
        sent: dict = {}      # memoryx / swarmx / a worker's identity -> when the request left
        for ep in (self.memoryx, self.swarmx):
            sent[ep.name] = trace.now_ns()
            ep.send(Message(Msg.GET_TRACE))
        worker_ids = self.worker_ids if workers else []
        for identity in worker_ids:
            sent[identity] = trace.now_ns()
            self.workers.send(Message(Msg.GET_TRACE), identity)
        expected = ["memoryx", "swarmx", *(f"wse{r}" for r in range(self.penv.num_csx)),
                    *(f"worker{r}" for r in range(len(worker_ids)))]
        traces = []
        for arrived, source, msg in self.trace_answers(len(expected)):
            m = msg.meta
            row = m["role"] if m["role"] in ("memoryx", "swarmx") else f"{m['role']}{m['rank']}"
            asked = sent[source]
            estimate = trace.clock_offset(asked, m["recv_ns"], m["send_ns"], arrived)
            offset = trace.clock_offset(asked, m["recv_ns"], m["send_ns"], arrived, m["clock"])
            traces.append(trace.ProcessTrace(
                row, trace.unpack_spans(m["names"], msg.arrays), offset, m["dropped"],
                {"same_clock": offset == 0 and bool(m["clock"]), "estimated_offset_us": round(estimate / 1000, 1),
                 "round_trip_us": round((arrived - asked) / 1000, 1)}))
        missing = sorted(set(expected) - {t.name for t in traces})
        if missing:
            log.warning("trace: no spans from %s within %d s", ", ".join(missing), TRACE_TIMEOUT_S)
        return traces

    def trace_answers(self, count: int) -> list[tuple[int, object, Message]]:
        """Up to `count` TRACE messages as (when it arrived, who was asked, message)."""
        endpoints = {ep.sock: ep for ep in (self.memoryx, self.swarmx, self.workers)}
        poller = zmq.Poller()
        for sock in endpoints:
            poller.register(sock, zmq.POLLIN)
        deadline = time.monotonic() + TRACE_TIMEOUT_S
        answers = []
        while len(answers) < count and time.monotonic() < deadline:
            for sock in dict(poller.poll(POLL_MS)):
                ep = endpoints[sock]
                got = ep.recv(0)
                arrived = trace.now_ns()
                if got is None or got[1].type == Msg.INPUT_STATS:
                    continue
                if got[1].type != Msg.TRACE:
                    self.unexpected(got)
                    continue
                # A WSE's answer comes through SwarmX: its request left with SwarmX's.
                answers.append((arrived, got[0] if ep is self.workers else ep.name, got[1]))
        return answers

    def close(self) -> None:
        # A long-lived CS system must forget this job before the next one comes.
        for ep in (self.memoryx, self.swarmx):
            ep.send(Message(Msg.JOB_END))
            if ep.recv(JOB_END_TIMEOUT_MS) is None:
                log.warning("%s did not acknowledge the end of the job", ep.name)
        self.heartbeat.stop()
        if self.system_heartbeat is not None:
            self.system_heartbeat.stop()
        stop_authenticator(self.ctx)  # its ZAP thread must not outlive the context
        self.ctx.destroy(linger=0)

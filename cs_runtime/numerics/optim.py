"""Learning rules applied where the master weights live (MemoryX, the CPU path,
or the WSE in pipelined mode). PyTorch semantics, so results are familiar:

- sgd:   g += wd * w;  buf = momentum * buf + (1 - dampening) * g (the first
         step: buf = g);  w -= lr * buf, or with nesterov w -= lr * (g + momentum * buf)
- adam:  g += wd * w;  bias-corrected first/second moments
- adamw: w *= 1 - lr * wd (decoupled), then adam without the wd term
- max_gradient_norm: clip by the global norm over every layer (clip_grad_norm_;
  a tied parameter, held by every layer that reads it, counted once)
- exclude_bias_and_norm: no weight decay of biases and normalisation weights
  (names ending in "bias" or "gain", or a torch norm layer's "weight"), as the
  model zoo groups them

Adam's step count t (its bias correction) is optimizer state, one "step" slot
per parameter as in torch's state_dict (SGD with dampening keeps one too: its
first update takes the gradient undamped, as torch.optim.SGD's does): it advances only when an update is
applied, so a step skipped for overflowed gradients (loss scaling) does not
count, as with torch's GradScaler, which skips optimizer.step() entirely.

Updates are in place (out=) so a step allocates no weight-sized temporaries.
"""
from __future__ import annotations

import dataclasses
import math
import re
import threading
from dataclasses import dataclass

import numpy as np

from cs_runtime import spans
from cs_runtime.numerics import compiled, parallel
from cs_runtime.numerics.precision import unscale_and_check

# A normalisation layer's weight in a captured torch model's state_dict names
# (ln_1.weight, norm.weight, layernorm.weight, bn1.weight); this project's own
# layers call theirs *_gain.
NORM_WEIGHT = re.compile(r"(^|[._])(ln|bn|norm|layer_?norm|batch_?norm)[^.]*\.weight$", re.IGNORECASE)
STEP_SLOT = "step"       # Adam's count of applied updates, a slot like the moments
# cstorch.nn.SelectiveGrad's mask of a parameter (1 where trained), carried as a slot: it goes
# wherever the parameter's optimizer state goes (MemoryX, a pipelined WSE) and is never updated.
MASK_SLOT = "selective_grad_mask"


OPTIMIZER_KINDS = ("sgd", "adam", "adamw")
_SPEC_NUMBERS = ("momentum", "weight_decay", "eps", "dampening")


@dataclass(frozen=True)
class OptimizerSpec:
    """The learning rule, checked once: what params.yaml's `optimizer` section and
    cs_torch's optimizers become, what LOAD_MODEL carries to MemoryX and the WSEs
    (as to_dict()), and what an Optimizer applies.

    Defaults are the Cerebras PyTorch API's and the model zoo's (Adam's and
    AdamW's eps 1e-6, betas (0.9, 0.999)); a caller that mirrors torch.optim
    passes torch's eps (1e-8) itself.
    """
    kind: str
    momentum: float = 0.0
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-6
    exclude_bias_and_norm: bool = False
    nesterov: bool = False
    dampening: float = 0.0

    def __post_init__(self):
        if self.kind not in OPTIMIZER_KINDS:
            raise ValueError(f"unknown optimizer_type {self.kind!r} (one of {', '.join(OPTIMIZER_KINDS)})")
        for name in _SPEC_NUMBERS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
                raise ValueError(f"optimizer {name} must be a finite number >= 0, got {value!r}")
        if not (isinstance(self.betas, (tuple, list)) and len(self.betas) == 2
                and all(not isinstance(b, bool) and isinstance(b, (int, float)) and 0 <= b < 1
                        for b in self.betas)):
            raise ValueError(f"optimizer betas must be two numbers in [0, 1), got {self.betas!r}")
        for name in ("exclude_bias_and_norm", "nesterov"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"optimizer {name} must be true or false, got {getattr(self, name)!r}")
        if (self.nesterov or self.dampening) and self.kind != "sgd":
            raise ValueError(f"nesterov and dampening are SGD's settings, not {self.kind}'s")
        if self.nesterov and (self.momentum <= 0 or self.dampening):
            raise ValueError("nesterov: true requires a momentum and zero dampening (as torch.optim.SGD)")
        object.__setattr__(self, "betas", (float(self.betas[0]), float(self.betas[1])))

    def to_dict(self) -> dict:
        """The wire form (msgpack-able): every field, betas as a list."""
        return {**dataclasses.asdict(self), "betas": list(self.betas)}

    @classmethod
    def from_dict(cls, d) -> "OptimizerSpec":
        """The spec of to_dict()'s dict; ValueError on a missing `kind`, an unknown key or a bad value."""
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError("optimizer: not a mapping with a kind")
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"optimizer: unknown field(s) {sorted(unknown)}")
        betas = d.get("betas", cls.betas)
        return cls(**{**d, "betas": tuple(betas) if isinstance(betas, (list, tuple)) else betas})


class Optimizer:
    """Applies an OptimizerSpec's rule to MemoryX's (or the CPU path's) weights."""

    def __init__(self, spec: OptimizerSpec):
        self.spec = spec
        self.kind, self.momentum, self.weight_decay = spec.kind, spec.momentum, spec.weight_decay
        self.nesterov, self.dampening = spec.nesterov, float(spec.dampening)
        self.exclude_bias_and_norm = spec.exclude_bias_and_norm
        self.beta1, self.beta2 = spec.betas
        self.eps = spec.eps
        self._buffers: dict[tuple, np.ndarray] = {}
        # SGD's plain momentum (no dampening, no Nesterov) as one C loop, where it is built
        self._fused_momentum = (_optim_loops if self.kind == "sgd" and self.momentum and not self.dampening
                                and not self.nesterov else None)

    def slot_names(self) -> tuple[str, ...]:
        if self.kind == "sgd":
            if not self.momentum:
                return ()
            return ("momentum", STEP_SLOT) if self.dampening else ("momentum",)
        return ("exp_avg", "exp_avg_sq", STEP_SLOT)

    def new_slot(self, slot: str, param: np.ndarray, steps_done: int = 0) -> np.ndarray:
        """A slot's starting value: zeros of the parameter's shape, or the step
        count (a float32 scalar, as torch keeps it: exact up to 2**24 steps)."""
        if slot == STEP_SLOT:
            return np.array(steps_done, dtype=np.float32)
        return np.zeros(param.shape, dtype=np.float32)

    def init_state(self, params: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
        """Per parameter, its slots (zeros). State for one layer."""
        return {name: {slot: self.new_slot(slot, p) for slot in self.slot_names()} for name, p in params.items()}

    def fill_missing(self, state: dict[str, dict[str, np.ndarray]], params: dict[str, np.ndarray],
                     steps_done: int) -> None:
        """Add the slots a checkpoint lacks. A checkpoint written before the step
        count was state has none: its updates counted every step, so the count
        goes on from `steps_done` (its global step), as the run would have."""
        for name, p in params.items():
            slots = state.setdefault(name, {})
            for slot in self.slot_names():
                if slot not in slots:
                    slots[slot] = self.new_slot(slot, p, steps_done)

    def update(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
               state: dict[str, dict[str, np.ndarray]], lr: float) -> None:
        """Apply one update to one layer in place (Adam's step count advances by one). A
        parameter without a gradient (a buffer: BatchNorm's running statistics) is left as
        it is, as torch's optimizers skip a parameter whose grad is None."""
        for name, w in params.items():
            if name not in grads:
                continue
            g = np.asarray(grads[name], dtype=np.float32)  # read, never written: it may be a peer's memory
            slots = dict(state[name])
            count = slots.pop(STEP_SLOT, None)
            mask = slots.pop(MASK_SLOT, None)
            t = 0
            if count is not None:
                count += np.float32(1)
                t = int(count)
            lr32, decay = np.float32(lr), self.decay_of(name)
            if mask is None:
                self._update_one(w, g, slots, lr32, t, decay)
            else:
                masked_update(w, g, list(slots.values()), mask != 0,
                              lambda w, g: self._update_one(w, g, slots, lr32, t, decay))

    def update_model(self, layer_names: list[str], weights: dict, grads: list[dict], opt_state: dict,
                     lr: float, step: int, max_norm: float | None, loss_scale: float = 1.0,
                     skip_nonfinite: bool = False, need_norms: bool = True,
                     copies: frozenset = frozenset(), found_finite: bool | None = None,
                     squares: list | None = None) -> tuple[float, bool, list[float]]:
        """Unscale, clip by the global norm, then update every layer.

        Returns (the norm of the unscaled gradients before clipping, whether the
        step was applied, each layer's norm): with `skip_nonfinite` (loss
        scaling on) a step whose gradients hold inf or nan changes nothing.
        Without `need_norms` (and without clipping, which needs the norm) the
        norms are not computed: (nan, applied, []). `copies`: (layer index,
        name) of each gradient that is another layer's copy of a tied
        parameter's (program_layer.tied_copies): counted in its layer's norm
        but not again in the global one, which counts each parameter once, as
        torch's clip_grad_norm_ does. `found_finite`: the gradients were already
        unscaled and checked (`unscale_and_check`, layer by layer as MemoryX receives
        them), and this is what the check found; `squares`: each layer's
        `squared_norms` of them, taken then too (no copies).
        """
        # Without loss scaling there is nothing to unscale, and no step is skipped.
        if found_finite is not None:
            finite = found_finite
        else:
            finite = unscale_and_check(grads, loss_scale) if skip_nonfinite or loss_scale != 1.0 else True
        if squares is not None:
            norm, per_layer = norms_of(squares)
        else:
            norm, per_layer = grad_norms(grads, copies) if need_norms or max_norm else (math.nan, [])
        if skip_nonfinite and not finite:
            return norm, False, per_layer
        factor = clip_factor(norm, max_norm)
        for index, (name, layer_grads) in enumerate(zip(layer_names, grads)):
            with spans.span("update", step=step, layer=index):
                self.update(weights[name], scale_grads(layer_grads, factor), opt_state[name], lr)
        return norm, True, per_layer

    def decay_of(self, name: str) -> float:
        """The weight decay of the parameter called `name`."""
        if self.exclude_bias_and_norm and (name.endswith(("bias", "gain")) or NORM_WEIGHT.search(name)):
            return 0.0
        return self.weight_decay

    def _update_one(self, w, g, slots, lr, t: int, wd: float) -> None:
        """One parameter, a cache-sized piece at a time: the update's several passes
        then read and write main memory once instead of once each."""
        if w.size <= parallel.CHUNK or not (w.flags.c_contiguous and g.flags.c_contiguous):
            self._update_piece(w, g, slots, lr, t, wd)   # one chunk (or strided): no pieces to make
            return
        flat_w, flat_g = w.reshape(-1), g.reshape(-1)
        flat_slots = {name: slot.reshape(-1) for name, slot in slots.items()}

        def chunk(start: int, stop: int) -> None:   # elementwise: chunks side by side (parallel.py)
            self._update_piece(flat_w[start:stop], flat_g[start:stop],
                               {k: v[start:stop] for k, v in flat_slots.items()}, lr, t, wd)
        parallel.in_chunks(flat_w.size, chunk)

    def _update_piece(self, w, g, slots, lr, t: int, wd: float) -> None:
        wd = np.float32(wd)
        if wd and self.kind != "adamw":
            g = g + wd * w
        if self._fused_momentum is not None and _fits_loop(w, g, slots["momentum"]):
            self._fused_momentum.sgd_momentum(w, g, slots["momentum"], self.momentum, lr)   # the numpy path's bits
            return
        tmp = self._scratch(w.shape)
        if self.kind == "sgd":
            if self.momentum:
                g = self._momentum(slots["momentum"], g, t)
            w -= np.multiply(g, lr, out=tmp)
            return
        if self.kind == "adamw" and wd:
            w *= np.float32(1.0) - lr * wd
        m, v = slots["exp_avg"], slots["exp_avg_sq"]
        b1, b2 = np.float32(self.beta1), np.float32(self.beta2)
        # 1 - beta in float64 first: 1 - float32(0.999) is off by 5e-5 relative.
        m *= b1
        m += np.multiply(g, np.float32(1 - self.beta1), out=tmp)
        v *= b2
        np.multiply(g, np.float32(1 - self.beta2), out=tmp)
        v += np.multiply(tmp, g, out=tmp)
        bias1 = 1 - self.beta1 ** t
        bias2 = 1 - self.beta2 ** t
        denom = np.sqrt(v, out=tmp)
        denom /= np.float32(math.sqrt(bias2))
        denom += np.float32(self.eps)
        w -= np.multiply(np.divide(m, denom, out=denom), np.float32(lr / bias1), out=denom)

    def _momentum(self, buf, g, t: int):
        """SGD's momentum buffer updated in place; the step's direction (torch.optim.SGD's rule)."""
        m = np.float32(self.momentum)
        if self.dampening and t == 1:
            buf[...] = g   # torch's buffer starts as the first gradient, undamped
        else:
            buf *= m
            buf += g * np.float32(1 - self.dampening) if self.dampening else g  # from zero: step 1 gives g
        return g + m * buf if self.nesterov else buf

    def _scratch(self, shape: tuple) -> np.ndarray:
        """A float32 buffer of this shape, reused across pieces, layers and steps (one per
        thread: pieces of a parameter update side by side)."""
        key = (shape, threading.get_ident())
        buf = self._buffers.get(key)
        if buf is None:
            buf = self._buffers[key] = np.empty(shape, np.float32)
        return buf


# optional: SGD with momentum's update and a gradient's sum of squares as C loops (_optim.c),
# the numpy passes' bits
_optim_loops = compiled.load("_optim", api=2)


def momentum_path() -> str:
    """How this install applies SGD's plain momentum: "C loops" (_optim.c, built by setup.py
    where a C compiler was found) or "numpy" (the same bits, slower)."""
    return "numpy" if _optim_loops is None else "C loops"


def _fits_loop(*arrays: np.ndarray) -> bool:
    """Whether the C loop takes these: float32, C-contiguous, of one size (the first and
    last written: writeable)."""
    for a in arrays:
        if not (a.dtype == np.float32 and a.flags.c_contiguous and a.size == arrays[0].size):
            return False
    return arrays[0].flags.writeable and arrays[-1].flags.writeable


def masked_update(w: np.ndarray, g: np.ndarray, slots: list, keep: np.ndarray, update) -> None:
    """cstorch.nn.SelectiveGrad's update of w in place, the real API's arithmetic (one rule for the
    CPU backend's optimizers and MemoryX's): w and its state `slots` (arrays, changed in place)
    masked by `keep` (bool), then `update(w, g masked)`, then w's entries outside the mask added back."""
    held = w * ~keep
    w *= keep
    for slot in slots:
        if slot.shape == keep.shape:   # a moment or momentum buffer (a step count is not masked)
            slot *= keep
    update(w, g * keep)
    w += held


def global_norm(grads_per_layer) -> float:
    """L2 norm over every gradient array of every layer (float64 accumulation)."""
    return grad_norms(grads_per_layer)[0]


def grad_norms(grads_per_layer, copies: frozenset = frozenset()) -> tuple[float, list[float]]:
    """(the global L2 norm, each layer's L2 norm), in float64; the gradients named in
    `copies` ((layer index, name)) count in their layer's norm only."""
    if not copies:   # any iterable of layers, a generator too
        return norms_of(squared_norms(grads) for grads in grads_per_layer)
    grads_per_layer = list(grads_per_layer)
    skip = {(i, position) for i, grads in enumerate(grads_per_layer)
            for position, name in enumerate(grads) if (i, name) in copies}
    return norms_of((squared_norms(grads) for grads in grads_per_layer), skip)


def squared_norms(grads: dict[str, np.ndarray]) -> list[float]:
    """Each of one layer's gradients' sum of squares, in float64, in the dict's order."""
    return [sum_squares(g) for g in grads.values()]


# A sum of squares is made in this many lanes: element i's square goes to lane i % SQUARE_LANES,
# each lane summed in element order, then the lanes in lane order. Why: one running sum is a
# chain of dependent adds (a float64 add's latency per element); independent lanes run side by
# side. A float32's square is exact in float64, so the lanes' order is the only rounding choice.
SQUARE_LANES = 64


def sum_squares(g: np.ndarray) -> float:
    """g's sum of squares in float64 (SQUARE_LANES): one C pass (_optim.c) over a float32 array,
    else numpy a chunk at a time, with the same bits."""
    flat = g.reshape(-1)
    if _optim_loops is not None and flat.dtype == np.float32 and flat.flags.c_contiguous:
        return _optim_loops.sum_squares(flat)
    lanes = np.zeros(SQUARE_LANES)
    rows = np.empty((1 + SQUARE_CHUNK // SQUARE_LANES, SQUARE_LANES))   # the lanes so far, then a chunk's squares
    for start in range(0, flat.size, SQUARE_CHUNK):
        part = flat[start:start + SQUARE_CHUNK]
        view = rows[:1 + -(-part.size // SQUARE_LANES)]
        view[0] = lanes
        squares = view[1:].reshape(-1)
        squares[part.size:] = 0.0
        np.square(part, out=squares[:part.size], dtype=np.float64)
        # along axis 0 of a C-ordered array numpy adds row after row: each lane in element order
        lanes = np.add.reduce(view, axis=0)
    total = 0.0
    for lane in lanes:
        total += float(lane)
    return total


SQUARE_CHUNK = SQUARE_LANES << 10   # elements a numpy pass widens at a time (a multiple of the lanes)


def norms_of(squares_per_layer, skip: set = frozenset()) -> tuple[float, list[float]]:
    """grad_norms from each layer's squared_norms, added in layer order (so norms
    built as gradients arrive equal grad_norms' to the last bit); the squares at
    (layer, position) in `skip` are left out of the global norm."""
    total, per_layer = 0.0, []
    for i, squares in enumerate(squares_per_layer):
        layer_total = 0.0
        for position, square in enumerate(squares):
            if (i, position) not in skip:
                total += square
            layer_total += square
        per_layer.append(math.sqrt(layer_total))
    return math.sqrt(total), per_layer


def scale_grads(grads: dict[str, np.ndarray], factor: float) -> dict[str, np.ndarray]:
    """Gradients times the clip factor (the same arrays when there is nothing to scale)."""
    if factor == 1.0:
        return grads
    return {name: g * np.float32(factor) for name, g in grads.items()}


def clip_factor(norm: float, max_norm: float | None) -> float:
    """The factor clip_grad_norm_ multiplies every gradient by (1.0 when no clipping)."""
    if not max_norm or norm <= max_norm:
        return 1.0
    return max_norm / (norm + 1e-6)

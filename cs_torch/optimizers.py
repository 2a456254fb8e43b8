"""cstorch.optim for torch modules (2.x API): SGD (with nesterov), Adam, AdamW; on the CPU backend also
Adagrad, RMSprop, Adamax, Adadelta, Lion, RAdam, ASGD and Rprop.

    optimizer = cstorch.optim.SGD(model.parameters(), 0.01, momentum=0.9, nesterov=True)

Torch's signatures, update rules and state_dict layout; the documented
defaults of the Cerebras optimizers (Adam's and AdamW's eps=1e-6). The
update runs in numpy, in place, on the parameters' own storage (float32),
so it is the same whether a traced step applies the CS system's gradients
(`apply`) or an eager loop calls `step()` after `loss.backward()`.
Inside a traced step `step()` and `zero_grad()` are recorded, not done.
"""
from __future__ import annotations

import numpy as np
import torch

from cs_runtime.numerics.optim import masked_update

from .nn import CsTorchError
from .recording import legacy_loop, probing, replaying


def _as_groups(params, defaults: dict) -> list[dict]:
    params = list(params)
    if not params:
        raise CsTorchError("optimizer got an empty parameter list")
    groups = params if isinstance(params[0], dict) else [{"params": params}]
    out = []
    for group in groups:
        group = {**defaults, **group, "params": list(group["params"])}
        for p in group["params"]:
            if not isinstance(p, torch.Tensor):
                raise CsTorchError(f"optimizer: expected torch parameters, got {type(p).__name__}")
        out.append(group)
    return out


class Optimizer:
    """Param groups, per-parameter state (torch tensors) and torch's state_dict format."""

    def __init__(self, params, defaults: dict):
        lr = defaults["lr"]
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or lr < 0:
            raise CsTorchError(f"{type(self).__name__}: lr must be a non-negative number, got {lr!r}")
        self.defaults = defaults
        self.param_groups = _as_groups(params, defaults)
        self.state: dict = {}

    # ------------------------------------------------------------ torch's calls
    def zero_grad(self, set_to_none: bool = True) -> None:
        if probing() is not None or replaying() is not None:
            return   # gradients are per step on the CS system
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()

    def step(self, closure=None) -> None:
        if closure is not None:
            raise CsTorchError(f"{type(self).__name__}.step: a closure is not supported")
        probe = probing()
        if probe is not None:
            probe.record("opt_step", self)
            return
        if replaying() is not None:
            replaying().updated = True   # a parameter read after this reads the updated weights
            return
        loop = legacy_loop()
        if loop is not None:   # a 1.x loop on the CS system: MemoryX applies the update
            loop.optimizer_step(self)
            return
        self.apply({p: p.grad.detach().numpy() for g in self.param_groups for p in g["params"]
                    if p.grad is not None})

    def apply(self, grads: dict) -> None:
        """One update of every parameter with a gradient in grads ({parameter: ndarray})."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    g = grads.get(p)
                    if g is not None:
                        self._update_one(p, np.asarray(g, dtype=np.float32), group)

    def _update_one(self, p, g: np.ndarray, group: dict) -> None:
        state = self.state.setdefault(p, {})
        entries = getattr(p, "_selective_grad", None)   # cstorch.nn.SelectiveGrad's mask (cs_torch/selective_grad.py)
        if entries is None:
            self._update(p.detach().numpy(), g, group, state)
        else:
            self._masked_update(p.detach().numpy(), g, group, state, entries.mask)

    def _masked_update(self, p: np.ndarray, g: np.ndarray, group: dict, state: dict, mask: torch.Tensor) -> None:
        """SelectiveGrad's update, the real API's arithmetic: the gradient masked; the parameter and its
        state tensors masked before the update, and the parameter's entries outside the mask added back."""
        slots = [value.numpy() for value in state.values() if isinstance(value, torch.Tensor)]
        masked_update(p, g, slots, mask.numpy(), lambda p, g: self._update(p, g, group, state))

    @staticmethod
    def _count(state: dict) -> float:
        """This parameter's update count, advanced (a float, as cstorch's optimizers keep it)."""
        state["step"] = float(state.get("step", 0.0)) + 1
        return state["step"]

    def _buffer(self, state: dict, key: str, like: np.ndarray) -> np.ndarray:
        if key not in state:
            state[key] = torch.zeros(like.shape, dtype=torch.float32)
        return state[key].numpy()

    # ------------------------------------------------------------ state_dict
    def state_dict(self) -> dict:
        index, groups = {}, []
        for group in self.param_groups:
            ids = []
            for p in group["params"]:
                index.setdefault(id(p), len(index))
                ids.append(index[id(p)])
            groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
        state = {index[id(p)]: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                 for p, s in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict) -> None:
        groups = state_dict.get("param_groups")
        if not isinstance(groups, list) or len(groups) != len(self.param_groups):
            raise CsTorchError(f"{type(self).__name__}.load_state_dict: {len(self.param_groups)} param groups "
                               f"expected, the state_dict has {len(groups) if isinstance(groups, list) else 'none'}")
        by_index = {}
        for mine, theirs in zip(self.param_groups, groups):
            if len(mine["params"]) != len(theirs["params"]):
                raise CsTorchError(f"{type(self).__name__}.load_state_dict: a param group's size differs")
            mine.update({k: v for k, v in theirs.items() if k != "params"})
            by_index.update(zip(theirs["params"], mine["params"]))
        self.state = {}
        for key, s in state_dict.get("state", {}).items():
            p = by_index.get(int(key))
            if p is None:
                raise CsTorchError(f"{type(self).__name__}.load_state_dict: state for unknown parameter {key}")
            self.state[p] = {k: (v.detach().clone().float() if isinstance(v, torch.Tensor) else v)
                             for k, v in s.items()}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.defaults})"


class SGD(Optimizer):
    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, maximize: bool = False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise CsTorchError("SGD: nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def _update(self, p, g, group, state):
        if group["maximize"]:
            g = -g
        if group["weight_decay"]:
            g = g + np.float32(group["weight_decay"]) * p
        momentum = group["momentum"]
        if momentum:
            fresh = "momentum_buffer" not in state
            buf = self._buffer(state, "momentum_buffer", p)
            if fresh:
                buf[...] = g
            else:
                buf *= np.float32(momentum)
                buf += np.float32(1 - group["dampening"]) * g
            g = g + np.float32(momentum) * buf if group["nesterov"] else buf
        p -= np.float32(group["lr"]) * g


class Adam(Optimizer):
    decoupled = False

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, amsgrad: bool = False):
        if amsgrad:
            raise CsTorchError(f"{type(self).__name__}: amsgrad=True is not supported")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      amsgrad=False))

    def _update(self, p, g, group, state):
        b1, b2 = (np.float32(b) for b in group["betas"])
        wd = group["weight_decay"]
        if wd and self.decoupled:
            p *= np.float32(1 - group["lr"] * wd)
        elif wd:
            g = g + np.float32(wd) * p
        step = self._count(state)
        m = self._buffer(state, "exp_avg", p)
        v = self._buffer(state, "exp_avg_sq", p)
        m += (g - m) * (np.float32(1) - b1)        # torch's lerp
        v *= b2
        v += (np.float32(1) - b2) * g * g
        c1, c2 = 1 - float(b1) ** step, 1 - float(b2) ** step
        denom = np.sqrt(v) / np.float32(np.sqrt(c2)) + np.float32(group["eps"])
        p -= np.float32(group["lr"] / c1) * (m / denom)


class AdamW(Adam):
    decoupled = True

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6,
                 weight_decay: float = 0.0, correct_bias: bool = True, amsgrad: bool = False):
        if not correct_bias:
            raise CsTorchError("AdamW: correct_bias=False is not supported")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad)


# The real API's other optimizers, on the CPU backend (MemoryX applies SGD, Adam and AdamW only: on CSX
# these are refused by name, cs_torch/cluster_step.py). Each is the real API's documented rule and defaults,
# its state under the real API's keys.
def _decayed(p, g, group):
    g = -g if group.get("maximize") else g
    return g + np.float32(group["weight_decay"]) * p if group["weight_decay"] else g


class Adagrad(Optimizer):
    def __init__(self, params, lr: float = 1e-2, lr_decay: float = 0, weight_decay: float = 0,
                 initial_accumulator_value: float = 0, eps: float = 1e-6, maximize: bool = False):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay, eps=eps, maximize=maximize,
                                      initial_accumulator_value=initial_accumulator_value))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        fresh = "sum" not in state
        total = self._buffer(state, "sum", p)
        if fresh:
            total[...] = np.float32(group["initial_accumulator_value"])
        step = self._count(state)
        total += g * g
        p -= np.float32(group["lr"]) * (g / np.float32(1 + (step - 1) * group["lr_decay"])) / (np.sqrt(total) +
                                                                                           np.float32(group["eps"]))


class RMSprop(Optimizer):
    def __init__(self, params, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, weight_decay: float = 0,
                 momentum: float = 0, centered: bool = False):
        super().__init__(params, dict(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                                      centered=centered))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        alpha = np.float32(group["alpha"])
        square_avg = self._buffer(state, "square_avg", p)
        square_avg *= alpha
        square_avg += (np.float32(1) - alpha) * g * g
        if group["centered"]:
            grad_avg = self._buffer(state, "grad_avg", p)
            grad_avg *= alpha
            grad_avg += (np.float32(1) - alpha) * g
            avg = np.sqrt(square_avg - grad_avg * grad_avg) + np.float32(group["eps"])
        else:
            avg = np.sqrt(square_avg) + np.float32(group["eps"])
        if group["momentum"] > 0:
            buf = self._buffer(state, "momentum_buffer", p)
            buf *= np.float32(group["momentum"])
            buf += g / avg
            p -= np.float32(group["lr"]) * buf
        else:
            p -= np.float32(group["lr"]) * g / avg


class Adamax(Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0,
                 maximize: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      maximize=maximize))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        b1, b2 = (np.float32(b) for b in group["betas"])
        exp_avg, exp_inf = self._buffer(state, "exp_avg", p), self._buffer(state, "exp_inf", p)
        exp_avg *= b1
        exp_avg += (np.float32(1) - b1) * g
        np.maximum(exp_inf * b2, np.abs(g) + np.float32(group["eps"]), out=exp_inf)
        power = float(state.get("beta1_power", float(b1)))
        state["beta1_power"] = power * float(b1)
        p -= np.float32(group["lr"]) * (exp_avg / exp_inf) / np.float32(1.0 - power)


class Adadelta(Optimizer):
    def __init__(self, params, lr: float = 1.0, rho: float = 0.9, eps: float = 1e-6, weight_decay: float = 0,
                 maximize: bool = False):
        super().__init__(params, dict(lr=lr, rho=rho, eps=eps, weight_decay=weight_decay, maximize=maximize))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        rho, eps = np.float32(group["rho"]), np.float32(group["eps"])
        square_avg, acc_delta = self._buffer(state, "square_avg", p), self._buffer(state, "acc_delta", p)
        square_avg *= rho
        square_avg += (np.float32(1) - rho) * g * g
        delta = np.sqrt(acc_delta + eps) / np.sqrt(square_avg + eps) * g
        acc_delta *= rho
        acc_delta += (np.float32(1) - rho) * delta * delta
        p -= np.float32(group["lr"]) * delta


class Lion(Optimizer):
    """sign(beta1 * m + (1 - beta1) * g) steps, weight decay decoupled; then m = beta2 * m + (1 - beta2) * g."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _update(self, p, g, group, state):
        b1, b2 = (np.float32(b) for b in group["betas"])
        lr = np.float32(group["lr"])
        exp_avg = self._buffer(state, "exp_avg", p)
        p *= np.float32(1) - lr * np.float32(group["weight_decay"])
        p -= lr * np.sign(exp_avg * b1 + (np.float32(1) - b1) * g)
        exp_avg *= b2
        exp_avg += (np.float32(1) - b2) * g


class RAdam(Optimizer):
    """Adam rectified: while the variance's length rho_t is at most 5 the step is the bias-corrected momentum."""

    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        b1, b2 = (float(b) for b in group["betas"])
        step = self._count(state)
        m, v = self._buffer(state, "exp_avg", p), self._buffer(state, "exp_avg_sq", p)
        m *= np.float32(b1)
        m += np.float32(1 - b1) * g
        v *= np.float32(b2)
        v += np.float32(1 - b2) * g * g
        c1, c2 = 1 - b1 ** step, 1 - b2 ** step
        rho_inf = 2 / (1 - b2) - 1
        rho_t = rho_inf - 2 * step * b2 ** step / c2
        update = m / np.float32(c1)
        if rho_t > 5:
            rect = np.sqrt((rho_t - 4) * (rho_t - 2) * rho_inf / ((rho_inf - 4) * (rho_inf - 2) * rho_t))
            update = update * np.float32(rect) * (np.float32(np.sqrt(c2)) / (np.sqrt(v) + np.float32(group["eps"])))
        p -= np.float32(group["lr"]) * update


class ASGD(Optimizer):
    """Averaged SGD: eta = lr / (1 + lambd * lr * step) ** alpha; ax averages the weights from step t0 on."""

    def __init__(self, params, lr: float = 1e-2, lambd: float = 1e-4, alpha: float = 0.75, t0: float = 1e6,
                 weight_decay: float = 0, maximize: bool = False):
        super().__init__(params, dict(lr=lr, lambd=lambd, alpha=alpha, t0=t0, weight_decay=weight_decay,
                                      maximize=maximize))

    def _update(self, p, g, group, state):
        g = _decayed(p, g, group)
        eta, mu = float(state.get("eta", group["lr"])), float(state.get("mu", 1.0))
        step = self._count(state)
        ax = self._buffer(state, "ax", p)
        p *= np.float32(1 - group["lambd"] * eta)
        p -= np.float32(eta) * g
        if mu == 1:
            ax[...] = p
        else:
            ax += (p - ax) * np.float32(mu)
        state["eta"] = group["lr"] / (1 + group["lambd"] * group["lr"] * step) ** group["alpha"]
        state["mu"] = 1 / max(1.0, step - group["t0"])


class Rprop(Optimizer):
    """Sign steps whose size grows by etas[1] while the gradient keeps its sign and shrinks by etas[0] when it
    flips (that step then skipped), within step_sizes."""

    def __init__(self, params, lr: float = 1e-3, etas=(0.5, 1.2), step_sizes=(1e-6, 50.0)):
        super().__init__(params, dict(lr=lr, etas=tuple(etas), step_sizes=tuple(step_sizes)))

    def _update(self, p, g, group, state):
        minus, plus = (np.float32(e) for e in group["etas"])
        prev = self._buffer(state, "prev", p)
        fresh = "step_size" not in state
        size = self._buffer(state, "step_size", p)
        if fresh:
            size[...] = np.float32(group["lr"])
        sign = np.sign(g * prev)
        size *= np.where(sign > 0, plus, np.where(sign < 0, minus, np.float32(1)))
        np.clip(size, *(np.float32(s) for s in group["step_sizes"]), out=size)
        g = np.where(sign < 0, np.float32(0), g)
        p -= np.sign(g) * size
        prev[...] = g

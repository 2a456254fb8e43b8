"""A parameter's gradient inside a CSX step, where only its norm comes back.

On CSX the gradients stay in MemoryX (it applies the update), and the step's
answer carries each parameter's gradient norm (STEP_DONE's
`param_grad_norms`: unscaled, before clipping, a tied parameter once). The
eager rerun of the step, which computes what the step logs, gives each
parameter a `GradientNorm` as its `.grad`: reading the norm works as torch
computes it from the values (`torch.norm(p.grad)`, `p.grad.norm()`,
`torch.linalg.vector_norm(p.grad)`, `p.grad.pow(2).sum()` and `torch.sum(p.grad ** 2)`,
as the model zoo's ComputeNorm and clip_grad_norm_ read them), and anything
that needs the values fails in one line, never a number made up.

The weights stay in MemoryX too: the module holds those the job began on until
the loop ends. The answer also carries each parameter's norm as the step began
(`param_norms`, by the gradient norms' rule), and in the rerun `WeightNorms`
makes a parameter's norm read those (the 2.10 trainer's `model_wise_params_norm`,
read before backward); a norm read after the step's optimizer.step() fails in one
line, as the updated weights' norms are not in the answer.
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from .nn import CsTorchError
from .recording import replaying

_NORMS = {torch.norm, torch.Tensor.norm, torch.linalg.vector_norm, torch.linalg.norm}
_POWERS = {torch.pow, torch.Tensor.pow, torch.Tensor.__pow__, torch.square, torch.Tensor.square}
_SUMS = {torch.sum, torch.Tensor.sum}
_DESCRIBING_ATTRIBUTES = {"grad_fn", "is_leaf", "requires_grad", "shape", "dtype", "device", "ndim", "layout",
                          "is_sparse", "is_cuda", "is_meta", "is_nested", "is_quantized", "names", "output_nr"}
_CLEARING = {torch.Tensor.zero_, torch.Tensor.detach_, torch.Tensor.requires_grad_}
# What reading a tensor's description costs nothing and tells nothing of its values.
_DESCRIPTIONS = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.device.__get__,
                 torch.Tensor.size, torch.Tensor.dim, torch.Tensor.numel, torch.Tensor.requires_grad.__get__,
                 torch.Tensor.is_sparse.__get__, torch.Tensor.layout.__get__}


class GradientNorm(torch.Tensor):
    """The gradient of a parameter of `shape` whose 2-norm is `norm` (squared: its elements' squares,
    whose sum is norm**2); it holds no values (one zero, expanded)."""

    @staticmethod
    def __new__(cls, like: torch.Tensor, norm: float, squared: bool = False):
        tensor = torch.Tensor._make_subclass(cls, torch.zeros((), dtype=like.dtype).expand(like.shape))
        tensor.grad_norm, tensor.squared = float(norm), squared
        return tensor

    def __repr__(self) -> str:
        return f"GradientNorm(shape={tuple(self.shape)}, norm={self.grad_norm}{', squared' if self.squared else ''})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        subject = args[0] if args else None
        if func in _DESCRIPTIONS or _describes(func) or not isinstance(subject, GradientNorm):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _CLEARING:   # optimizer.zero_grad(set_to_none=False): the rerun's gradients end
            subject.grad_norm = 0.0 if func is torch.Tensor.zero_ else subject.grad_norm
            return subject
        dtype = kwargs.get("dtype") or subject.dtype
        if func in _NORMS and not subject.squared and _whole_two_norm(args, kwargs):
            return torch.tensor(subject.grad_norm, dtype=dtype)
        if func in _POWERS and not subject.squared and _squares(func, args, kwargs):
            return GradientNorm(subject, subject.grad_norm, squared=True)
        if func in _SUMS and subject.squared and len(args) == 1 and kwargs.get("dim") is None:
            return torch.tensor(subject.grad_norm ** 2, dtype=dtype)
        name = getattr(func, "__name__", str(func))
        if name == "__get__":   # an attribute: name it
            name = "." + getattr(getattr(func, "__self__", None), "__name__", "?")
        raise CsTorchError(f"CSX backend: a step reads its gradients with {name}; on "
                           "CSX they stay in MemoryX and the step sees each one's norm only (torch.norm(p.grad), "
                           "p.grad.pow(2).sum()); use backend('CPU') to read their values")


def _describes(func) -> bool:
    """An attribute read that tells nothing of the values (grad_fn, is_leaf, ndim, ...); .data and
    the like would, and stay refused."""
    if getattr(func, "__name__", "") != "__get__":
        return False
    return getattr(getattr(func, "__self__", None), "__name__", "") in _DESCRIBING_ATTRIBUTES


def _whole_two_norm(args, kwargs) -> bool:
    """A call of a norm function that asks the 2-norm of the whole tensor (torch.norm's default "fro" is it)."""
    order = args[1] if len(args) > 1 else kwargs.get("p", kwargs.get("ord"))
    dim = args[2] if len(args) > 2 else kwargs.get("dim")
    return order in (None, 2, 2.0, "fro") and dim is None and kwargs.get("out") is None


def _squares(func, args, kwargs) -> bool:
    """A call that squares every element."""
    if func in (torch.square, torch.Tensor.square):
        return True
    exponent = args[1] if len(args) > 1 else kwargs.get("exponent")
    return exponent in (2, 2.0)


def norm_grads(params: dict, norms: dict) -> dict:
    """{parameter: its GradientNorm} of the parameters (program name -> parameter; a tied parameter
    under each of its names) from the step's norms by name; a trained parameter none of whose names
    has a norm fails in one line."""
    grads = {}
    for name, param in params.items():
        if name in norms:
            grads[param] = GradientNorm(param.detach(), norms[name])
    missing = [name for name, param in params.items() if param.requires_grad and param not in grads]
    if missing:
        raise CsTorchError(f"CSX backend: the step's answer has no gradient norm of {missing[0]}")
    return grads


class WeightNorms(TorchFunctionMode):
    """While a CSX step is rerun: a parameter's 2-norm (torch.norm(p), p.norm(), p.pow(2).sum(), ...)
    is its norm as the step began, from the step's answer (program name -> norm); `params` maps
    program names to the parameters. With no norms (an eval step) every read is the module's."""

    def __init__(self, params: dict, norms: dict):
        super().__init__()
        self.norms = {id(param): norms[name] for name, param in params.items() if name in norms}
        self.params = {id(param): param for name, param in params.items() if name in norms}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        subject = args[0] if args else None
        norm = self.norms.get(id(subject)) if self.params.get(id(subject)) is subject else None
        if norm is None or not (func in _NORMS or func in _POWERS):
            return func(*args, **kwargs)
        if replaying() is not None and replaying().updated:
            raise CsTorchError("CSX backend: a step reads a parameter's norm after optimizer.step(); on CSX the "
                               "weights stay in MemoryX and the step sees their norms as it began only")
        if func in _NORMS and _whole_two_norm(args, kwargs):
            return torch.tensor(norm, dtype=kwargs.get("dtype") or subject.dtype)
        if func in _POWERS and _squares(func, args, kwargs):
            return GradientNorm(subject, norm, squared=True)
        raise CsTorchError(f"CSX backend: a step reads a parameter with {getattr(func, '__name__', func)} other "
                           "than its 2-norm; on CSX the weights stay in MemoryX and the step sees their 2-norms only")

"""One training step on weights held in this process: the CPU path's, the pipelined WSE's (once per
replica, the gradients summed before the update) and the WSE probe's. Weight streaming splits the
same step across processes, a layer at a time (wse/emulator.py, MemoryX).

    result, grads, logits = forward_backward(spec, x, y, weights, ctx, label_count, loss_scale, step)
    norm, applied, layer_norms = apply_update(optimizer, spec, weights, grads, opt_state, lr, step, ...)
"""
from __future__ import annotations

from cs_runtime.numerics import program_layer
from cs_runtime.numerics.model import ShardContext, model_backward, model_forward, model_loss
from cs_runtime.numerics.precision import scaled


def forward_backward(spec, x, y, weights: dict, ctx: ShardContext, label_count=None, loss_scale: float = 1.0,
                     step: int = -1):
    """The loss (model_loss's result), each layer's gradients (of the loss times `loss_scale`) and the logits
    of the rows `x`, whose share of the global batch `ctx` says."""
    logits, caches = model_forward(spec, x, weights, ctx)
    result = model_loss(spec, logits, y, ctx.global_batch, label_count)
    grads = model_backward(spec, scaled(result.delta, loss_scale), caches, weights, step)
    return result, grads, logits


def apply_update(optimizer, spec, weights: dict, grads: list, opt_state: dict, lr: float, step: int,
                 max_norm: float | None = None, loss_scale: float = 1.0, skip_nonfinite: bool = False,
                 need_norms: bool = True) -> tuple[float, bool, list[float]]:
    """Unscale, clip and apply the step's summed gradients to every layer (Optimizer.update_model, a tied
    parameter counted once); (gradient norm, whether applied, each layer's norm)."""
    names = [layer.name for layer in spec.layers]
    return optimizer.update_model(names, weights, grads, opt_state, lr, step, max_norm, loss_scale,
                                  skip_nonfinite, need_norms=need_norms, copies=program_layer.tied_copies(spec))

"""cstorch.metrics: Metric and the real API's metrics (accuracy, perplexity, F-beta, mean, IOU, per-class
accuracy, Dice, AUC, precision and recall at k), with the documented signatures.

    accuracy = cstorch.metrics.AccuracyMetric("accuracy")

    @cstorch.trace
    @torch.no_grad()
    def eval_step(inputs, targets):
        outputs = compiled_model(inputs)
        accuracy(labels=targets.clone(), predictions=outputs.argmax(-1).int())
        return loss_fn(outputs, targets)

    for inputs, targets in executor:
        eval_step(inputs, targets)
    print(f"Accuracy: {float(accuracy)}")

A metric is a torch.nn.Module whose state is registered buffers
(register_state). Called inside a traced step, its update is one of the
step's effects: it runs after each step with that step's values (computed
from the model's output the step hands back, as a traced step's other
values are; see cs_torch/tracing.py); called outside one, at once. Calling
it returns the value so far (None inside a traced step, as the update is
yet to come); `float(metric)` and `compute()` give it after the loop.
"""
from __future__ import annotations

import sys
import warnings
from collections import defaultdict

import torch

from .recording import probing, replaying


class Metric(torch.nn.Module):
    """Base class: subclasses define reset() (register_state), update(...) and compute()."""

    registry = defaultdict(list)   # name -> the metrics of that name, as cstorch keeps them

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self._num_updates = 0
        self.registry[name].append(self)
        self.reset()

    @property
    def num_updates(self) -> int:
        return self._num_updates

    def reset(self) -> None:
        raise NotImplementedError

    def update(self, *args, **kwargs) -> None:
        raise NotImplementedError

    def compute(self):
        raise NotImplementedError

    def register_state(self, name: str, tensor: torch.Tensor, persistent: bool = False) -> None:
        self.register_buffer(name, tensor, persistent=persistent)

    def forward(self, *args, **kwargs):
        probe = probing()
        if probe is not None:   # a traced step's effect, done with each step's values
            probe.record("closure", self._update_and_compute, args, kwargs)
            return None
        replay = replaying()
        if replay is not None:
            if replay.effects is not None:   # the step's rerun: its values of the arguments
                replay.effects.append((args, kwargs))
            return None
        return self._update_and_compute(*args, **kwargs)

    def _update_and_compute(self, *args, **kwargs):
        with torch.no_grad():
            self.update(*args, **kwargs)
        self._num_updates += 1
        return self.compute()

    def __float__(self) -> float:
        return float(self.compute())


def _sum_like(values: torch.Tensor) -> torch.Tensor:
    return values.float().sum()


class AccuracyMetric(Metric):
    """The share of predictions equal to their labels (weights: a per-element weight, >0 counted)."""

    def reset(self) -> None:
        self.register_state("total_correct_predictions", torch.tensor(0, dtype=torch.float32))
        self.register_state("total_num_tokens", torch.tensor(0, dtype=torch.float32))
        self._dtype = None
        self._num_updates = 0

    def update(self, labels, predictions, weights=None, dtype=None) -> None:
        if labels.shape != predictions.shape:
            warnings.warn(f"Shapes mismatch in accuracy metric: labels {tuple(labels.shape)}, "
                          f"predictions {tuple(predictions.shape)}")
            predictions = predictions.reshape(labels.shape)
        correct = (labels == predictions).float()
        if weights is None:
            self.total_correct_predictions.add_(_sum_like(correct))
            self.total_num_tokens.add_(float(correct.numel()))
        else:
            self.total_correct_predictions.add_(_sum_like(correct * weights))
            self.total_num_tokens.add_(_sum_like(weights > 0))
        self._dtype = dtype

    def compute(self) -> torch.Tensor:
        result = self.total_correct_predictions / self.total_num_tokens
        return result.to(self._dtype) if self._dtype is not None else result


class PerplexityMetric(Metric):
    """exp(total loss / tokens counted): `loss` is the batch's summed loss over its tokens
    (weights: a per-token weight, >0 counted; else every label counts)."""

    def reset(self) -> None:
        self.register_state("total_loss", torch.tensor(0, dtype=torch.float32))
        self.register_state("total_num_tokens", torch.tensor(0, dtype=torch.float32))
        self._dtype = None
        self._num_updates = 0

    def update(self, labels, loss, weights=None, dtype=None) -> None:
        tokens = float(labels.numel()) if weights is None else _sum_like(weights > 0)
        self.total_loss.add_(torch.as_tensor(loss, dtype=torch.float32))
        self.total_num_tokens.add_(tokens)
        self._dtype = dtype

    def compute(self) -> torch.Tensor:
        result = torch.exp(self.total_loss / self.total_num_tokens)
        return result.to(self._dtype) if self._dtype is not None else result


class FBetaScoreMetric(Metric):
    """F-beta of integer class predictions from a confusion matrix: `micro` pools the counts of every
    class not in ignore_labels, `macro` averages the per-class scores over those classes."""

    def __init__(self, num_classes: int, beta: float = 1.0, average_type: str = "micro",
                 ignore_labels: list | None = None, name: str | None = None):
        if num_classes <= 1:
            raise ValueError(f"FBetaScoreMetric: num_classes should be at least 2, got {num_classes}")
        if beta <= 0:
            raise ValueError(f"FBetaScoreMetric: beta should be positive, got {beta}")
        if average_type not in ("micro", "macro"):
            raise ValueError(f"FBetaScoreMetric: average_type should be micro or macro, got {average_type!r}")
        self.num_classes, self.beta, self.average_type = num_classes, float(beta), average_type
        keep = torch.ones(num_classes, dtype=torch.bool)
        for label in ignore_labels or []:
            keep[label] = False
        self.keep = keep
        super().__init__(name or "fbeta")

    def reset(self) -> None:
        self.register_state("confusion_matrix", torch.zeros(self.num_classes, self.num_classes))
        self._dtype = None

    def update(self, labels, predictions, dtype=None) -> None:
        if labels.shape != predictions.shape:
            raise ValueError(f"FBetaScoreMetric: labels {tuple(labels.shape)} and predictions "
                             f"{tuple(predictions.shape)} differ in shape")
        index = labels.reshape(-1).long() * self.num_classes + predictions.reshape(-1).long()
        counts = torch.bincount(index, minlength=self.num_classes ** 2).float()
        self.confusion_matrix.add_(counts.reshape(self.num_classes, self.num_classes))   # [label, prediction]
        self._dtype = dtype

    def compute(self) -> torch.Tensor:
        cm, keep = self.confusion_matrix, self.keep
        true_pos = torch.diagonal(cm)[keep]
        predicted = cm.sum(0)[keep]   # each class's predictions
        actual = cm.sum(1)[keep]      # each class's labels
        b2 = self.beta ** 2
        if self.average_type == "micro":
            tp, p, a = true_pos.sum(), predicted.sum(), actual.sum()
            precision = tp / p if p > 0 else torch.tensor(0.0)
            recall = tp / a if a > 0 else torch.tensor(0.0)
            denom = b2 * precision + recall
            result = (1 + b2) * precision * recall / denom if denom > 0 else torch.tensor(0.0)
        else:
            precision = torch.where(predicted > 0, true_pos / predicted.clamp(min=1), torch.zeros_like(true_pos))
            recall = torch.where(actual > 0, true_pos / actual.clamp(min=1), torch.zeros_like(true_pos))
            denom = b2 * precision + recall
            scores = torch.where(denom > 0, (1 + b2) * precision * recall / denom.clamp(min=1e-30),
                                 torch.zeros_like(denom))
            result = scores.mean()
        return result.to(self._dtype) if self._dtype is not None else result


class MeanMetric(Metric):
    """The weighted mean of the values given: sum(value * weight) / sum(weight), weight broadcast to value."""

    def __init__(self, name: str):
        super().__init__(name)

    def reset(self) -> None:
        self.register_state("total_value", torch.tensor(0, dtype=torch.float32))
        self.register_state("total_weight", torch.tensor(0, dtype=torch.float32))
        self._dtype = None

    def update(self, value, weight=1.0, dtype=None) -> None:
        value = torch.as_tensor(value, dtype=torch.float32)
        weight = torch.broadcast_to(torch.as_tensor(weight, dtype=torch.float32), value.shape)
        self.total_value.add_((value * weight).sum())
        self.total_weight.add_(weight.sum())
        self._dtype = dtype

    def compute(self) -> torch.Tensor:
        result = self.total_value / self.total_weight
        return result.to(self._dtype) if self._dtype is not None else result


class _ConfusionMetric(Metric):
    """A metric of a [label, prediction] confusion matrix of integer classes (weights per element)."""

    def __init__(self, num_classes: int, ignore_classes: list | None = None, name: str | None = None):
        if num_classes <= 1:
            raise ValueError(f"{type(self).__name__}: num_classes should be at least 2, got {num_classes}")
        self.num_classes = num_classes
        self.keep = torch.ones(num_classes, dtype=torch.bool)
        for label in ignore_classes or []:
            self.keep[label] = False
        super().__init__(name or type(self).__name__)

    def reset(self) -> None:
        self.register_state("confusion_matrix", torch.zeros(self.num_classes, self.num_classes))
        self._dtype = None

    def update(self, labels, predictions, weights=None, dtype=None) -> None:
        if labels.shape != predictions.shape:
            raise ValueError(f"{type(self).__name__}: labels {tuple(labels.shape)} and predictions "
                             f"{tuple(predictions.shape)} differ in shape")
        if weights is not None and weights.shape != labels.shape:
            raise ValueError(f"{type(self).__name__}: weights {tuple(weights.shape)} and labels "
                             f"{tuple(labels.shape)} differ in shape")
        index = labels.reshape(-1).long() * self.num_classes + predictions.reshape(-1).long()
        w = None if weights is None else weights.reshape(-1).float()
        counts = torch.bincount(index, weights=w, minlength=self.num_classes ** 2).float()
        self.confusion_matrix.add_(counts.reshape(self.num_classes, self.num_classes))
        self._dtype = dtype

    def _mean_over_classes(self, numerator, denominator) -> torch.Tensor:
        """The mean of numerator / denominator over the kept classes whose denominator is not 0."""
        use = self.keep & (denominator > 0)
        if not use.any():
            return torch.tensor(0.0)
        result = (numerator[use] / denominator[use]).mean()
        return result.to(self._dtype) if self._dtype is not None else result


class MeanIOUMetric(_ConfusionMetric):
    """The mean over classes of true positives / (true positives + false positives + false negatives)."""

    def compute(self) -> torch.Tensor:
        cm = self.confusion_matrix
        tp = torch.diagonal(cm)
        return self._mean_over_classes(tp, cm.sum(0) + cm.sum(1) - tp)


class MeanPerClassAccuracyMetric(_ConfusionMetric):
    """The mean over classes of the share of each class's labels predicted right."""

    def __init__(self, num_classes: int, name: str | None = None):
        super().__init__(num_classes, None, name)

    def compute(self) -> torch.Tensor:
        cm = self.confusion_matrix
        return self._mean_over_classes(torch.diagonal(cm), cm.sum(1))


class DiceCoefficientMetric(_ConfusionMetric):
    """The mean over classes of 2 * true positives / (labels + predictions of the class)."""

    def compute(self) -> torch.Tensor:
        cm = self.confusion_matrix
        return self._mean_over_classes(2 * torch.diagonal(cm), cm.sum(0) + cm.sum(1))


def _divide_no_nan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.where(b != 0, a / torch.where(b != 0, b, torch.ones_like(b)), torch.zeros_like(a))


class AUCMetric(Metric):
    """The area under the ROC or precision-recall curve of probabilities in [0, 1], from counts at
    thresholds (num_thresholds evenly spaced, or the thresholds given, within -1e-7 and 1 + 1e-7):
    Riemann sums by interpolation (trapezoids; for PR, Davis & Goadrich's), minoring or majoring."""

    def __init__(self, num_thresholds: int = 200, curve: str = "ROC", name: str | None = None,
                 summation_method: str = "interpolation", thresholds=None):
        if curve not in ("ROC", "PR"):
            raise ValueError(f"AUCMetric: curve must be either ROC or PR, got {curve!r}")
        if summation_method not in ("interpolation", "minoring", "majoring"):
            raise ValueError(f"AUCMetric: summation_method must be interpolation, minoring or majoring, "
                             f"got {summation_method!r}")
        if thresholds is None:
            if num_thresholds <= 1:
                raise ValueError(f"AUCMetric: num_thresholds must be > 1, got {num_thresholds}")
            thresholds = [(i + 1) / (num_thresholds - 1) for i in range(num_thresholds - 2)]
        else:
            thresholds = sorted(float(x) for x in thresholds)
        self.curve, self.summation_method = curve, summation_method
        self.thresholds = torch.tensor([-1e-7] + thresholds + [1 + 1e-7], dtype=torch.float32)
        self.num_thresholds = len(self.thresholds)
        super().__init__(name or "AUCMetric")

    def reset(self) -> None:
        for state in ("true_positive", "true_negative", "false_positive", "false_negative"):
            self.register_state(state, torch.zeros(self.num_thresholds, dtype=torch.float32))

    def update(self, labels, predictions, weights=None) -> None:
        if labels.shape != predictions.shape:
            raise ValueError(f"AUCMetric: labels {tuple(labels.shape)} and predictions "
                             f"{tuple(predictions.shape)} differ in shape")
        if weights is not None and weights.shape != labels.shape:
            raise ValueError(f"AUCMetric: weights {tuple(weights.shape)} and labels {tuple(labels.shape)} differ")
        labels, predictions = labels.reshape(-1), predictions.reshape(-1).float()
        if labels.numel() and labels.min() < 0:
            raise ValueError("AUCMetric: negative values in `labels` are not allowed")
        if predictions.numel() and (predictions.min() < 0 or predictions.max() > 1):
            raise ValueError("AUCMetric: values in `predictions` must be in [0, 1]")
        w = torch.ones_like(predictions) if weights is None else weights.reshape(-1).float()
        above = predictions[None, :] > self.thresholds[:, None]      # [threshold, example]
        positive = (labels > 0)[None, :]
        for state, mask in (("true_positive", above & positive), ("false_positive", above & ~positive),
                            ("false_negative", ~above & positive), ("true_negative", ~above & ~positive)):
            getattr(self, state).add_((mask.float() * w).sum(-1))

    def _interpolated_pr_auc(self) -> torch.Tensor:
        tp, fn = self.true_positive, self.false_negative
        p = tp + self.false_positive
        dtp, dp = tp[:-1] - tp[1:], p[:-1] - p[1:]
        slope = _divide_no_nan(dtp, dp.clamp(min=0))
        intercept = tp[1:] - slope * p[1:]
        ratio = torch.where((p[:-1] > 0) & (p[1:] > 0), _divide_no_nan(p[:-1], p[1:].clamp(min=0)),
                            torch.ones_like(p[1:]))
        return _divide_no_nan(slope * (dtp + intercept * torch.log(ratio)), (tp[1:] + fn[1:]).clamp(min=0)).sum()

    def compute(self) -> float:
        if self.curve == "PR" and self.summation_method == "interpolation":
            return float(self._interpolated_pr_auc())
        tp, fp, fn, tn = self.true_positive, self.false_positive, self.false_negative, self.true_negative
        recall = _divide_no_nan(tp, tp + fn)
        x, y = (_divide_no_nan(fp, fp + tn), recall) if self.curve == "ROC" else (recall, _divide_no_nan(tp, tp + fp))
        heights = {"interpolation": (y[:-1] + y[1:]) / 2, "minoring": torch.minimum(y[:-1], y[1:]),
                   "majoring": torch.maximum(y[:-1], y[1:])}[self.summation_method]
        return float(((x[:-1] - x[1:]) * heights).sum())


class _AtKMetric(Metric):
    """Counts of the labels (batch, num_labels) found among the k largest predictions (batch, classes)."""

    def __init__(self, k: int, name: str | None = None):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"{type(self).__name__}: k must be a positive integer, got {k!r}")
        self.k = k
        super().__init__(name or type(self).__name__)

    def reset(self) -> None:
        self.register_state("true_positive_at_k", torch.tensor(0.0))
        self.register_state("false_at_k", torch.tensor(0.0))

    def update(self, labels, predictions, weights=None) -> None:
        if weights is not None and len(weights.shape) != 0 and weights.numel() != labels.shape[0]:
            raise ValueError(f"{type(self).__name__}: weights must be a scalar or a vector of size "
                             f"{labels.shape[0]}, got {tuple(weights.shape)}")
        top = torch.topk(predictions, self.k, dim=-1).indices                  # (batch, k)
        hits = (labels[:, :, None] == top[:, None, :]).sum((1, 2)).float()      # labels in the top k, per row
        misses = self.misses(hits, labels)
        w = torch.ones(()) if weights is None else weights.float()
        self.true_positive_at_k.add_((hits * w).sum())
        self.false_at_k.add_((misses * w).sum())

    def compute(self) -> float:
        return float(self.true_positive_at_k / (self.true_positive_at_k + self.false_at_k))


class PrecisionAtKMetric(_AtKMetric):
    """Of the k top predictions of each row, the share that are among its labels."""

    def misses(self, hits, labels):
        return self.k - hits


class RecallAtKMetric(_AtKMetric):
    """Of each row's labels, the share found among its k top predictions."""

    def misses(self, hits, labels):
        return labels.shape[-1] - hits


def get_all_metrics():
    """(name, metric) for every metric made, "name.i" where several share a name."""
    for name, metrics in Metric.registry.items():
        for i, metric in enumerate(metrics):
            yield (f"{name}.{i}" if len(metrics) > 1 else name), metric


def compute_all_metrics() -> dict:
    """{name: float value} of every metric made (names as get_all_metrics gives them)."""
    return {name: float(metric) for name, metric in get_all_metrics()}


# `cerebras.pytorch.metrics.metric` (where the real package defines Metric) is this module.
metric = sys.modules[__name__]

"""GLUE metrics over a whole evaluation set, as fairseq meters.

The metrics are computed by the maintained implementations (scikit-learn's
``accuracy_score``, ``f1_score``, ``matthews_corrcoef``; SciPy's ``pearsonr``,
``spearmanr``) on the predictions and targets of *every* example of a logging window,
never averaged over batches (F1, MCC and correlations are not means of per-batch values).
Values are x100, as GLUE papers report them.

**Summable, id-indexed vectors.** A batch of a split of N examples is described by three
float64 vectors of length N (:func:`indexed`): ``prediction_sum`` (the prediction, a class
id or a score, at each example's dataset index, 0 elsewhere), ``target_sum`` (the same for
the targets) and ``seen`` (1 at the batch's indices). Sums of these over the batches of a
validation step and over DDP workers (fairseq's ``all_reduce`` of summable logging outputs;
a worker without data adds zeros) and over the steps of the validation rebuild the whole
split's predictions exactly: float64 holds class ids and float32 scores without loss.

:class:`PredictionMeter` is a fairseq ``Meter`` that sums the vectors it is given;
:func:`log_predictions` feeds it with ``metrics.log_custom`` inside the criterion's
``reduce_metrics``. Each metric is a derived value of that meter, computed on the examples
with ``seen > 0`` (an example seen twice raises), so ``--best-checkpoint-metric f1`` etc.
see the whole validation set.

Metric names: ``accuracy``, ``f1`` (binary, positive class 1), ``mcc`` (classification);
``pearson``, ``spearman``, ``pearson_spearman`` (their mean; regression). A correlation of
constant predictions or targets is undefined: it is reported as 0 with one warning.
"""

import logging
from typing import Dict, Iterable, Sequence, Tuple

import numpy as np
import torch
from fairseq.logging import meters, metrics
from fairseq.logging.meters import Meter, safe_round
from scipy.stats import pearsonr, spearmanr
from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

logger = logging.getLogger(__name__)

CLASSIFICATION_METRICS = ("accuracy", "f1", "mcc")
REGRESSION_METRICS = ("pearson", "spearman", "pearson_spearman")
ALL_METRICS = CLASSIFICATION_METRICS + REGRESSION_METRICS
METER_KEY = "_predictions"  # fairseq does not print keys starting with "_"
ROUND = 2
_warned = set()


def metric_names(num_classes: int, report_mcc: bool = False) -> Tuple[str, ...]:
    """The metrics reported for a task: regression (1 output) -> correlations; classes ->
    accuracy, F1 when binary, MCC when asked (CoLA)."""
    if num_classes == 1:
        return REGRESSION_METRICS
    names = ("accuracy",) + (("f1",) if num_classes == 2 else ())
    return names + (("mcc",) if report_mcc else ())


def _undefined(name: str, reason: str) -> float:
    if name not in _warned:
        _warned.add(name)
        logger.warning("%s is undefined (%s); reported as 0", name, reason)
    return 0.0


def _constant(name: str, predictions: np.ndarray, targets: np.ndarray):
    """A reason why a correlation is undefined, or None."""
    if len(predictions) < 2:
        return f"{len(predictions)} example(s)"
    for what, values in (("predictions", predictions), ("targets", targets)):
        if np.all(values == values[0]):
            return f"the {what} are constant over {len(values)} examples"
    return None


def _class_ids(name: str, values: np.ndarray) -> np.ndarray:
    """Class ids carried as floats (the id-indexed vectors are float64) -> int64."""
    if values.dtype.kind != "f":
        return values
    if not np.array_equal(values, np.round(values)):
        raise ValueError(f"{name}: the class ids are not whole numbers (regression scores?)")
    return values.astype(np.int64)


def compute_metric(name: str, predictions: Sequence, targets: Sequence) -> float:
    """One metric (x100) of whole-set ``predictions`` and ``targets`` (class ids or scores)."""
    predictions, targets = np.asarray(predictions), np.asarray(targets)
    if predictions.shape != targets.shape or predictions.ndim != 1:
        raise ValueError(f"{name}: {predictions.shape} predictions for {targets.shape} targets")
    if len(predictions) == 0:
        return _undefined(name, "no examples")
    if name in CLASSIFICATION_METRICS:
        predictions, targets = _class_ids(name, predictions), _class_ids(name, targets)
    if name == "accuracy":
        return 100.0 * accuracy_score(targets, predictions)
    if name == "f1":
        return 100.0 * f1_score(targets, predictions, average="binary", pos_label=1, zero_division=0.0)
    if name in ("mcc", "pearson", "spearman"):
        reason = _constant(name, predictions, targets)
        if reason is not None:
            return _undefined(name, reason)
        if name == "mcc":
            return 100.0 * matthews_corrcoef(targets, predictions)
        function = pearsonr if name == "pearson" else spearmanr
        return 100.0 * float(function(predictions.astype(np.float64), targets.astype(np.float64))[0])
    if name == "pearson_spearman":
        return 0.5 * (compute_metric("pearson", predictions, targets) +
                      compute_metric("spearman", predictions, targets))
    raise ValueError(f"unknown metric {name!r}; known: {', '.join(ALL_METRICS)}")


def compute_metrics(names: Iterable[str], predictions, targets) -> Dict[str, float]:
    return {name: compute_metric(name, predictions, targets) for name in names}


def indexed(ids: torch.Tensor, predictions: torch.Tensor, targets: torch.Tensor,
            size: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A batch's predictions and targets ``[B]`` at its examples' dataset indices ``ids``
    ``[B]`` in a split of ``size`` examples -> (``prediction_sum``, ``target_sum``, ``seen``),
    float64 ``[size]`` each (0 elsewhere; see the module docstring)."""
    ids = ids.view(-1).to(predictions.device)
    if not predictions.numel() == targets.numel() == ids.numel():
        raise ValueError(f"{predictions.numel()} predictions, {targets.numel()} targets for {ids.numel()} ids")
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < size:
        raise ValueError(f"example ids {int(ids.min())}..{int(ids.max())} outside a split of {size} examples")
    zeros = torch.zeros(size, dtype=torch.float64, device=predictions.device)
    return tuple(zeros.index_add(0, ids, values.detach().view(-1).to(zeros))
                 for values in (predictions, targets, torch.ones_like(ids)))


class PredictionMeter(Meter):
    """Sums the id-indexed vectors (:func:`indexed`) of the batches (and workers) of a
    logging window; :meth:`metric` computes a metric over the examples seen. Its state is
    three float64 tensors (None before the first update).

    Vectors of another length belong to another split (fairseq's persistent ``valid``
    aggregator sees every ``--valid-subset``): the meter then starts over."""

    def __init__(self, round: int = ROUND):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.prediction_sum = self.target_sum = self.seen = None
        self._cache: Dict[str, float] = {}

    def update(self, prediction_sum, target_sum, seen) -> None:
        vectors = [torch.as_tensor(v).detach().to("cpu", torch.float64).view(-1)
                   for v in (prediction_sum, target_sum, seen)]
        if len({v.numel() for v in vectors}) != 1:
            raise ValueError(f"prediction_sum, target_sum, seen of lengths {[v.numel() for v in vectors]}")
        if self.seen is not None and self.seen.numel() != vectors[2].numel():
            self.reset()
        if self.seen is None:
            self.prediction_sum, self.target_sum, self.seen = (v.clone() for v in vectors)
        else:
            for mine, value in zip((self.prediction_sum, self.target_sum, self.seen), vectors):
                mine += value
        self._cache = {}

    def examples(self) -> Tuple[np.ndarray, np.ndarray]:
        """(predictions, targets) of the examples seen, in dataset order; raises if an
        example was counted more than once."""
        if self.seen is None:
            return np.zeros(0), np.zeros(0)
        seen = self.seen.numpy()
        twice = np.flatnonzero(seen > 1)
        if len(twice):
            raise RuntimeError(f"{len(twice)} examples were evaluated more than once in one validation (dataset "
                               f"ids {twice[:5].tolist()}...): batches or DDP shards overlap")
        keep = seen > 0
        return self.prediction_sum.numpy()[keep], self.target_sum.numpy()[keep]

    def metric(self, name: str) -> float:
        """``name`` over everything seen so far (x100, rounded to ``round`` digits)."""
        if name not in self._cache:
            self._cache[name] = compute_metric(name, *self.examples())
        value = self._cache[name]
        return safe_round(value, self.round) if self.round is not None else value

    def state_dict(self) -> dict:
        return {"prediction_sum": self.prediction_sum, "target_sum": self.target_sum, "seen": self.seen,
                "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reset()
        self.round = state_dict.get("round", ROUND)
        if state_dict.get("seen") is not None:
            self.update(state_dict["prediction_sum"], state_dict["target_sum"], state_dict["seen"])

    @property
    def count(self) -> int:
        return 0 if self.seen is None else int((self.seen > 0).sum())

    @property
    def smoothed_value(self) -> int:
        return self.count


# fairseq's MetersDict.load_state_dict (resuming a checkpoint's meters) finds meter classes
# by name in fairseq.logging.meters
meters.PredictionMeter = PredictionMeter


def _derived(name: str):
    def value(meter_dict):
        return meter_dict[METER_KEY].metric(name)
    return value


def log_predictions(prediction_sum, target_sum, seen, names: Iterable[str]) -> None:
    """Inside ``reduce_metrics``: add id-indexed vectors (:func:`indexed`, possibly summed)
    to the active aggregators' :class:`PredictionMeter` and log the ``names`` metrics
    derived from it."""
    metrics.log_custom(PredictionMeter, METER_KEY, prediction_sum, target_sum, seen)
    for name in names:
        metrics.log_derived(name, _derived(name))

"""GLUE metrics over a whole evaluation set, as fairseq meters.

The metrics are computed by the maintained implementations (scikit-learn's
``accuracy_score``, ``f1_score``, ``matthews_corrcoef``; SciPy's ``pearsonr``,
``spearmanr``) on the predictions and targets of *every* example of a logging window,
never averaged over batches (F1, MCC and correlations are not means of per-batch values).
Values are x100, as GLUE papers report them.

:class:`PredictionMeter` is a fairseq ``Meter`` that concatenates the predictions and
targets it is given. The criterion puts each batch's per-example lists into its logging
output (fairseq all-gathers logging outputs across DDP workers when
``logging_outputs_can_be_summed()`` is False) and :func:`log_predictions` feeds them to the
meter with ``metrics.log_custom`` inside ``reduce_metrics``; each metric is a derived value
of that meter, so ``--best-checkpoint-metric f1`` etc. see the whole validation set.

Metric names: ``accuracy``, ``f1`` (binary, positive class 1), ``mcc`` (classification);
``pearson``, ``spearman``, ``pearson_spearman`` (their mean; regression). A correlation of
constant predictions or targets is undefined: it is reported as 0 with one warning.
"""

import logging
from typing import Dict, Iterable, Sequence, Tuple

import numpy as np
from fairseq.logging import metrics
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


def compute_metric(name: str, predictions: Sequence, targets: Sequence) -> float:
    """One metric (x100) of whole-set ``predictions`` and ``targets`` (class ids or scores)."""
    predictions, targets = np.asarray(predictions), np.asarray(targets)
    if predictions.shape != targets.shape or predictions.ndim != 1:
        raise ValueError(f"{name}: {predictions.shape} predictions for {targets.shape} targets")
    if len(predictions) == 0:
        return _undefined(name, "no examples")
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


class PredictionMeter(Meter):
    """Concatenates predictions and targets over the batches (and workers) of a logging
    window; :meth:`metric` computes a metric over all of them. Its state is plain lists."""

    def __init__(self, round: int = ROUND):
        self.round = round
        self.reset()

    def reset(self) -> None:
        self.predictions: list = []
        self.targets: list = []
        self._cache: Dict[str, float] = {}
        self._cached_count = 0

    def update(self, predictions: Sequence, targets: Sequence) -> None:
        if len(predictions) != len(targets):
            raise ValueError(f"{len(predictions)} predictions for {len(targets)} targets")
        self.predictions.extend(predictions)
        self.targets.extend(targets)

    def metric(self, name: str) -> float:
        """``name`` over everything seen so far (x100, rounded to ``round`` digits)."""
        if self._cached_count != len(self.predictions):
            self._cache, self._cached_count = {}, len(self.predictions)
        if name not in self._cache:
            self._cache[name] = compute_metric(name, self.predictions, self.targets)
        value = self._cache[name]
        return safe_round(value, self.round) if self.round is not None else value

    def state_dict(self) -> dict:
        return {"predictions": list(self.predictions), "targets": list(self.targets), "round": self.round}

    def load_state_dict(self, state_dict: dict) -> None:
        self.reset()
        self.round = state_dict.get("round", ROUND)
        self.update(state_dict["predictions"], state_dict["targets"])

    @property
    def count(self) -> int:
        return len(self.predictions)

    @property
    def smoothed_value(self) -> int:
        return self.count


def _derived(name: str):
    def value(meters):
        return meters[METER_KEY].metric(name)
    return value


def log_predictions(predictions: Sequence, targets: Sequence, names: Iterable[str]) -> None:
    """Inside ``reduce_metrics``: add a batch's per-example lists to the active aggregators'
    :class:`PredictionMeter` and log the ``names`` metrics derived from it."""
    metrics.log_custom(PredictionMeter, METER_KEY, predictions, targets)
    for name in names:
        metrics.log_derived(name, _derived(name))

"""``hf_sentence_prediction`` criterion: cross-entropy (classes) or MSE (``--num-classes 1``).

The model is called as ``model(**sample["net_input"]) -> (logits [B, C], extra)``; logits
may be None when ``extra["losses"]`` alone is the objective (e.g. a pre-training stage; no
labels or metrics are needed then). The loss is summed over the batch and the sample size
is the number of sentences, so fairseq's gradient is that of the mean loss per example.

Extra terms: ``extra["losses"]`` may map names to tensors, either a 0-d per-example
*average* (multiplied by B here) or a ``[B]`` vector of per-example values (summed); they
are added to the loss and each is logged under its name (per example). A NaN/inf term
raises FloatingPointError naming it. ``extra["stats"]`` has the same form and is logged the
same way but *not* added to the loss (diagnostics, e.g. a codebook's usage perplexity).
Their names must differ from each other and from the keys below.

**Logging outputs** are sums, so ``logging_outputs_can_be_summed()`` holds and fairseq's
DDP reduces them with one ``all_reduce`` (CPU/gloo included):

* always: ``loss``, ``task_loss`` (CE in nats or MSE), the extra losses and stats (batch
  totals), ``nsentences``, ``ntokens``, ``sample_size``; in training ``ncorrect``;
* in evaluation (split of N examples, ``sample["split_size"]``, set by the dataset's
  collater): ``prediction_sum``, ``target_sum``, ``seen``, float64 ``[N]`` vectors indexed
  by the examples' dataset ids ``sample["id"]`` (:func:`.metrics.indexed`), and
  ``metric_flags`` ``[len(ALL_METRICS)]`` (1 for each metric this task reports).

Logged: ``loss`` (per example, base 2, fairseq's convention), ``task_loss``, the extra terms
(per example), the training batch accuracy, and in evaluation ``accuracy``/``f1``/``mcc`` or
``pearson``/``spearman``/``pearson_spearman`` over the whole validation set (:mod:`.metrics`:
the summed vectors rebuild every example's prediction; never averaged over batches).
"""

import logging
import math
from dataclasses import dataclass, field
from typing import Dict

import torch
import torch.nn.functional as F
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics
from omegaconf import II

from .metrics import ALL_METRICS, indexed, log_predictions, metric_names

logger = logging.getLogger(__name__)

EVAL_KEYS = ("prediction_sum", "target_sum", "seen", "metric_flags")
RESERVED = {"loss", "task_loss", "nsentences", "ntokens", "sample_size", "ncorrect"} | set(EVAL_KEYS) | set(ALL_METRICS)


@dataclass
class HFSentencePredictionCriterionConfig(FairseqDataclass):
    report_mcc: bool = field(default=False, metadata={"help": "also report Matthews' correlation "
                                                             "(always on for --glue-task CoLA)"})
    best_checkpoint_metric: str = II("checkpoint.best_checkpoint_metric")
    maximize_best_checkpoint_metric: bool = II("checkpoint.maximize_best_checkpoint_metric")


def check_finite(name: str, value: torch.Tensor) -> None:
    if not bool(torch.isfinite(value.detach()).all()):
        raise FloatingPointError(
            f"hf_sentence_prediction: the loss term {name!r} is {value.detach().float().sum().item()} "
            f"(not finite); lower the learning rate or check the model's {name!r} term and the data"
        )


def batch_total(kind: str, name: str, value: torch.Tensor, n: int) -> torch.Tensor:
    """A 0-d per-example average (x n) or a ``[n]`` per-example vector (summed) -> batch total."""
    if value.dim() == 0:
        return value.float() * n
    if value.shape == (n,):
        return value.float().sum()
    raise ValueError(f"extra {kind} {name!r} has shape {tuple(value.shape)}: expected a scalar "
                     f"(per-example average) or [{n}] (per example)")


@register_criterion("hf_sentence_prediction", dataclass=HFSentencePredictionCriterionConfig)
class HFSentencePredictionCriterion(FairseqCriterion):
    def __init__(self, task, cfg: HFSentencePredictionCriterionConfig):
        super().__init__(task)
        self.cfg = cfg
        self.num_classes = int(task.num_classes)
        self.is_regression = self.num_classes == 1
        self.metric_names = metric_names(self.num_classes, bool(cfg.report_mcc or getattr(task, "report_mcc", False)))
        self.metric_flags = torch.tensor([float(m in self.metric_names) for m in ALL_METRICS], dtype=torch.float64)
        best = getattr(cfg, "best_checkpoint_metric", None)
        if best in ALL_METRICS and best not in self.metric_names:
            raise ValueError(
                f"--best-checkpoint-metric {best} is not reported for this task "
                f"({'regression' if self.is_regression else f'{self.num_classes} classes'}); choose one of "
                f"{', '.join(self.metric_names + ('loss',))}"
                + (" (or add --report-mcc)" if best == "mcc" else "")
            )
        if best in self.metric_names and not getattr(cfg, "maximize_best_checkpoint_metric", True):
            logger.warning("--best-checkpoint-metric %s without --maximize-best-checkpoint-metric: "
                           "checkpoint_best.pt will be the checkpoint with the LOWEST %s", best, best)

    def forward(self, model, sample, reduce=True):
        """-> (loss summed over the batch, number of examples, logging output)."""
        logits, extra = model(**sample["net_input"])
        losses = (extra or {}).get("losses") or {}
        stats = (extra or {}).get("stats") or {}
        n = int(sample["nsentences"])
        loss, logging_output = 0.0, {}
        if logits is not None:
            loss, target, outputs = self.task_loss(model, sample, logits)
            logging_output["task_loss"] = loss.detach()
        elif not losses:
            raise ValueError("the model returned neither logits nor extra['losses']: nothing to train")
        for name, value in losses.items():
            if name in RESERVED:
                raise ValueError(f"the model's extra loss {name!r} clashes with a logged key; rename it")
            total = batch_total("loss", name, value, n)
            check_finite(name, total)
            loss = loss + total
            logging_output[name] = total.detach()
        for name, value in stats.items():
            if name in RESERVED or name in losses:
                raise ValueError(f"the model's extra stat {name!r} clashes with "
                                 f"{'an extra loss' if name in losses else 'a logged key'}; rename it")
            logging_output[name] = batch_total("stat", name, value.detach(), n)
        logging_output.update(loss=loss.detach(), nsentences=n, ntokens=sample["ntokens"], sample_size=n)
        if logits is not None:
            if model.training:
                if not self.is_regression:
                    logging_output["ncorrect"] = (outputs == target).sum().detach()
            else:
                logging_output.update(self.evaluation_outputs(sample, outputs, target))
        return loss, n, logging_output

    def evaluation_outputs(self, sample, outputs, target) -> Dict[str, torch.Tensor]:
        """The id-indexed vectors of the whole split (see the module docstring)."""
        size = sample.get("split_size")
        if size is None:
            raise ValueError("hf_sentence_prediction: the batch has no 'split_size' (the number of examples "
                             "of its split); batch the data with HFSentenceDataset's collater")
        prediction_sum, target_sum, seen = indexed(sample["id"], outputs, target, int(size))
        return {"prediction_sum": prediction_sum, "target_sum": target_sum, "seen": seen,
                "metric_flags": self.metric_flags.to(seen.device)}

    def task_loss(self, model, sample, logits):
        """-> (CE or MSE summed over the batch, targets ``[B]``, predictions ``[B]``: class ids
        or float scores)."""
        if "target" not in sample:
            raise ValueError("hf_sentence_prediction: this split has no labels (an unlabelled test file); "
                             "predict it with glue-predict")
        target = model.get_targets(sample, [logits]).view(-1)
        n = target.numel()
        if logits.dim() != 2 or logits.shape != (n, self.num_classes):
            raise ValueError(f"the model returned logits of shape {tuple(logits.shape)}, expected "
                             f"({n}, {self.num_classes}) (batch, --num-classes)")
        if self.is_regression:
            outputs = logits.view(-1).float()
            loss = F.mse_loss(outputs, target.float(), reduction="sum")
        else:
            outputs = logits.argmax(-1)
            loss = F.cross_entropy(logits.float(), target, reduction="sum")
        check_finite("task_loss", loss)
        return loss, target, outputs

    @classmethod
    def reduce_metrics(cls, logging_outputs) -> None:
        def total(key):
            return sum(float(log.get(key, 0)) for log in logging_outputs)

        n = total("nsentences")
        if not n:
            return
        metrics.log_scalar("loss", total("loss") / n / math.log(2), n, round=3)
        if any("task_loss" in log for log in logging_outputs):
            metrics.log_scalar("task_loss", total("task_loss") / n, n, round=4)
        extra = sorted({k for log in logging_outputs for k in log if k not in RESERVED})
        for name in extra:
            metrics.log_scalar(name, total(name) / n, n, round=4)
        if any("ncorrect" in log for log in logging_outputs):
            metrics.log_scalar("accuracy", 100.0 * total("ncorrect") / n, n, round=2)
        evaluated = [log for log in logging_outputs if "seen" in log]
        if evaluated:
            def vector(key):
                return sum(log[key] for log in evaluated)

            names = [m for m, flag in zip(ALL_METRICS, vector("metric_flags").tolist()) if flag > 0]
            log_predictions(vector("prediction_sum"), vector("target_sum"), vector("seen"), names)

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return True  # every value is a sum over examples (see the module docstring)

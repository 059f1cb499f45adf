"""``hf_sentence_prediction`` criterion: cross-entropy (classes) or MSE (``--num-classes 1``).

The model is called as ``model(**sample["net_input"]) -> (logits [B, C], extra)``; logits
may be None when ``extra["losses"]`` alone is the objective (e.g. a pre-training stage; no
labels or metrics are needed then). The loss is summed over the batch and the sample size
is the number of sentences, so fairseq's gradient is that of the mean loss per example.
Extra terms: ``extra["losses"]`` may map
names to tensors, either a 0-d per-example *average* (multiplied by B here) or a ``[B]``
vector of per-example values (summed); they are added to the loss and each is logged under
its name (per example). A NaN/inf term raises FloatingPointError naming it.

**Logged**: ``loss`` (the objective per example, base 2, fairseq's convention),
``task_loss`` (CE in nats or MSE, per example), the extra terms, and in training the batch
accuracy. In evaluation mode the per-example predictions (class ids, or scores) and targets
go into the logging output, and :mod:`.metrics` computes ``accuracy``/``f1``/``mcc`` or
``pearson``/``spearman``/``pearson_spearman`` over the whole validation set (not averaged
over batches). Because of those lists ``logging_outputs_can_be_summed()`` is False: fairseq
then all-gathers the logging outputs (pickled, at most ``--all-gather-list-size`` bytes per
worker and batch) instead of summing them, in training too.
"""

import logging
import math
import pickle
from dataclasses import dataclass, field
from itertools import chain

import torch
import torch.nn.functional as F
from fairseq.criterions import FairseqCriterion, register_criterion
from fairseq.dataclass import FairseqDataclass
from fairseq.logging import metrics
from omegaconf import II

from .metrics import ALL_METRICS, log_predictions, metric_names

logger = logging.getLogger(__name__)

RESERVED = {"loss", "task_loss", "nsentences", "ntokens", "sample_size", "ncorrect", "predictions",
            "targets", "metric_names"} | set(ALL_METRICS)


@dataclass
class HFSentencePredictionCriterionConfig(FairseqDataclass):
    report_mcc: bool = field(default=False, metadata={"help": "also report Matthews' correlation "
                                                             "(always on for --glue-task CoLA)"})
    best_checkpoint_metric: str = II("checkpoint.best_checkpoint_metric")
    maximize_best_checkpoint_metric: bool = II("checkpoint.maximize_best_checkpoint_metric")
    all_gather_list_size: int = II("common.all_gather_list_size")


def check_finite(name: str, value: torch.Tensor) -> None:
    if not bool(torch.isfinite(value.detach()).all()):
        raise FloatingPointError(
            f"hf_sentence_prediction: the loss term {name!r} is {value.detach().float().sum().item()} "
            f"(not finite); lower the learning rate or check the model's {name!r} term and the data"
        )


@register_criterion("hf_sentence_prediction", dataclass=HFSentencePredictionCriterionConfig)
class HFSentencePredictionCriterion(FairseqCriterion):
    def __init__(self, task, cfg: HFSentencePredictionCriterionConfig):
        super().__init__(task)
        self.cfg = cfg
        self.num_classes = int(task.num_classes)
        self.is_regression = self.num_classes == 1
        self.metric_names = metric_names(self.num_classes, bool(cfg.report_mcc or getattr(task, "report_mcc", False)))
        self.all_gather_list_size = getattr(cfg, "all_gather_list_size", None)
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
            if value.dim() == 0:
                total = value.float() * n
            elif value.shape == (n,):
                total = value.float().sum()
            else:
                raise ValueError(f"extra loss {name!r} has shape {tuple(value.shape)}: expected a scalar "
                                 f"(per-example average) or [{n}] (per example)")
            check_finite(name, total)
            loss = loss + total
            logging_output[name] = total.detach()
        logging_output.update(loss=loss.detach(), nsentences=n, ntokens=sample["ntokens"], sample_size=n)
        if logits is not None:
            if model.training:
                if not self.is_regression:
                    logging_output["ncorrect"] = (outputs == target).sum().detach()
            else:
                logging_output["predictions"] = outputs.detach().cpu().tolist()
                logging_output["targets"] = target.detach().cpu().tolist()
                logging_output["metric_names"] = self.metric_names
                self._check_gather_size(logging_output)
        return loss, n, logging_output

    def task_loss(self, model, sample, logits):
        """-> (CE or MSE summed over the batch, targets ``[B]``, predictions ``[B]``: class ids
        or float scores)."""
        if "target" not in sample:
            raise ValueError("hf_sentence_prediction: this split has no labels (an unlabelled test file); "
                             "predict it with scripts/glue_predict.py")
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

    def _check_gather_size(self, logging_output) -> None:
        """In DDP, fairseq pickles each batch's logging output into a fixed buffer."""
        if not (self.all_gather_list_size and torch.distributed.is_available()
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1):
            return
        size = len(pickle.dumps({k: (v.cpu() if torch.is_tensor(v) else v) for k, v in logging_output.items()}))
        if size + 64 > self.all_gather_list_size:
            raise ValueError(
                f"a validation batch's predictions take {size} bytes, more than --all-gather-list-size "
                f"{self.all_gather_list_size}: raise --all-gather-list-size (e.g. {4 * size}) or lower "
                f"--batch-size-valid / --max-tokens-valid"
            )

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
        with_lists = [log for log in logging_outputs if "predictions" in log]
        if with_lists:
            log_predictions(list(chain.from_iterable(log["predictions"] for log in with_lists)),
                            list(chain.from_iterable(log["targets"] for log in with_lists)),
                            with_lists[0]["metric_names"])

    @staticmethod
    def logging_outputs_can_be_summed() -> bool:
        return False  # evaluation outputs hold per-example lists (see the module docstring)

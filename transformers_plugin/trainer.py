"""transformers' ``Trainer`` and ``Seq2SeqTrainer`` for a model with SDMA: the regularisers of eq. (24) added to the
task loss in training and logged each under its own key, and the mixing weight g of eq. (11) following the
optimizer's update count.

    trainer = SDMATrainer(model=attach_sdma(model), args=TrainingArguments(...), train_dataset=...)
    trainer = SDMASeq2SeqTrainer(model=attach_sdma(bart), args=Seq2SeqTrainingArguments(...), ...)
    trainer.train()
"""

from typing import Dict, Optional

import torch
from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from latent_core.sdma import LOSS_NAMES, SDMACore

from transformers_plugin.attach import set_sdma_updates
from transformers_plugin.losses import (check_loss_weights, check_regulariser_scale, regulariser_from_terms,
                                        sdma_terms)


class SDMAUpdatesCallback(TrainerCallback):
    """Moves g of eq. (11) to the Trainer's ``global_step`` after every optimizer update (and at the start, so that a
    resumed run continues where it stopped)."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            set_sdma_updates(model, state.global_step)

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if model is not None:
            set_sdma_updates(model, state.global_step)


class SDMALossMixin:
    """Before a transformers trainer class: its training loss becomes the model's task loss plus
    :func:`~transformers_plugin.sdma_loss` of the same forward (``sdma_weights``: the lambdas by the field names of
    ``SDMALossWeights``); evaluation losses (and ``Seq2SeqTrainer``'s generation) stay the task's. Adds
    :class:`SDMAUpdatesCallback`.

    Each logged training step also carries the regularisers under their own keys, as fairseq logs them: ``sdma/kl_z``,
    ``sdma/kl_q`` (eq. 20), ``sdma/dqq`` (eq. 21, the heads' MI upper bound), ``sdma/dxq`` (eq. 22, the input-query
    MI lower bound), ``sdma/dv_z``, ``sdma/dv_q`` (eq. 23), each unweighted and per sequence, averaged over the
    steps since the last log and over the processes; ``sdma/regulariser`` (what was added to the loss) and
    ``sdma/g``.

    ``sdma_regulariser_scale`` weighs the regularisers against the task loss as fairseq's
    ``--sdma-regulariser-scale`` does: ``sentence`` (default; the authors' criterion) adds each sequence's
    regularisers to a token-SUMMED cross-entropy, which here, where the task loss is a mean over its label tokens
    (or, for one label per sequence, over the sequences), is their sum over the batch's sequences divided by the
    number of label items (the Trainer's ``num_items_in_batch`` where it counts them); ``token`` is the sequence
    mean (~tokens per sequence times stronger); ``batch`` the sequence mean / the label items."""

    def __init__(self, *args, sdma_weights: Optional[Dict[str, float]] = None,
                 sdma_regulariser_scale: str = "sentence", **kwargs):
        self.sdma_weights = check_loss_weights(sdma_weights, f"{type(self).__name__}: sdma_weights")
        self.sdma_regulariser_scale = check_regulariser_scale(sdma_regulariser_scale,
                                                              f"{type(self).__name__}: sdma_regulariser_scale")
        super().__init__(*args, **kwargs)
        self._sdma_logged: Dict[str, torch.Tensor] = {}
        self._sdma_steps = 0
        self.add_callback(SDMAUpdatesCallback())

    def _label_items(self, inputs) -> Optional[int]:
        """The items the task loss averages over in this batch: label tokens (shifted for causal LMs, as the
        Trainer counts them), or the sequences for one label each; None without labels."""
        labels = inputs.get("labels") if isinstance(inputs, dict) else None
        if not isinstance(labels, torch.Tensor):
            return None
        if labels.dim() < 2 or labels.is_floating_point():
            return int(labels.shape[0])
        if getattr(self, "_loss_shifts_labels", False):
            labels = labels[..., 1:]
        return int(labels.ne(-100).sum())

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None, **kwargs):
        items = self._label_items(inputs)  # before the Trainer pops the labels
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch,
                                             **kwargs)
        if model.training:
            factor = 1.0
            if num_items_in_batch is not None and items is not None:
                # the task loss is then summed over this batch and divided by the count over the accumulated (and,
                # averaging tokens across devices, the gathered) batches; the Trainer rescales it by the processes
                items = float(num_items_in_batch)
                if self.args.average_tokens_across_devices and self.args.world_size > 1:
                    factor = float(self.accelerator.num_processes)
            scale = self.sdma_regulariser_scale if items else None
            terms = sdma_terms(model)
            regulariser = regulariser_from_terms(terms, self.sdma_weights, scale, items)
            self._keep_for_log(terms, factor * regulariser)
            loss = loss + factor * regulariser.to(loss.dtype)
        return (loss, outputs) if return_outputs else loss

    def _keep_for_log(self, terms: Dict[str, torch.Tensor], regulariser: torch.Tensor) -> None:
        values = {name: terms[name].detach().float().mean() for name in LOSS_NAMES}
        values["regulariser"] = regulariser.detach().float()
        for name, value in values.items():
            self._sdma_logged[name] = self._sdma_logged.get(name, 0.0) + value
        self._sdma_steps += 1

    def log(self, logs: Dict[str, float], *args, **kwargs) -> None:
        if "loss" in logs and self._sdma_steps:  # a training log: the regularisers since the last one
            names = list(self._sdma_logged)
            means = torch.stack([self._sdma_logged[name] for name in names]) / self._sdma_steps
            if self.args.world_size > 1:
                means = self.accelerator.gather(means).view(-1, len(names)).mean(0)
            logs.update({f"sdma/{name}": round(float(value), 6) for name, value in zip(names, means)})
            core = next((m for m in self.model.modules() if isinstance(m, SDMACore)), None)
            if core is not None:
                logs["sdma/g"] = round(float(core.mix_weight), 6)
            self._sdma_logged, self._sdma_steps = {}, 0
        super().log(logs, *args, **kwargs)


class SDMATrainer(SDMALossMixin, Trainer):
    """``Trainer`` with :class:`SDMALossMixin`."""


class SDMASeq2SeqTrainer(SDMALossMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` with :class:`SDMALossMixin` (``predict_with_generate`` decodes with ``generate()``)."""

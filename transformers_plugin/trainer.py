"""transformers' ``Trainer`` and ``Seq2SeqTrainer`` for a model with SDMA: the regularisers of eq. (24) added to the
task loss in training, and the mixing weight g of eq. (11) following the optimizer's update count.

    trainer = SDMATrainer(model=attach_sdma(model), args=TrainingArguments(...), train_dataset=...)
    trainer = SDMASeq2SeqTrainer(model=attach_sdma(bart), args=Seq2SeqTrainingArguments(...), ...)
    trainer.train()
"""

from typing import Dict, Optional

from transformers import Seq2SeqTrainer, Trainer, TrainerCallback

from transformers_plugin.attention import sdma_loss, set_sdma_updates


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
    :class:`SDMAUpdatesCallback`."""

    def __init__(self, *args, sdma_weights: Optional[Dict[str, float]] = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.sdma_weights = sdma_weights
        self.add_callback(SDMAUpdatesCallback())

    def compute_loss(self, model, inputs, return_outputs=False, **kwargs):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, **kwargs)
        if model.training:
            loss = loss + sdma_loss(self.accelerator.unwrap_model(model), self.sdma_weights).to(loss.dtype)
        return (loss, outputs) if return_outputs else loss


class SDMATrainer(SDMALossMixin, Trainer):
    """``Trainer`` with :class:`SDMALossMixin`."""


class SDMASeq2SeqTrainer(SDMALossMixin, Seq2SeqTrainer):
    """``Seq2SeqTrainer`` with :class:`SDMALossMixin` (``predict_with_generate`` decodes with ``generate()``)."""

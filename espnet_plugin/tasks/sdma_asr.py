"""Registration of the SDMA classes in ESPnet2's ASR task, and the task that trains them.

ESPnet has no plugin registry: ``espnet2.tasks.asr`` picks classes from module-level
``ClassChoices``. Importing this module (``import espnet_plugin`` does) adds

* ``encoder: sdma_transformer`` -> :class:`SDMATransformerEncoder`
* ``encoder: sdma_conformer``   -> :class:`SDMAConformerEncoder`
* ``decoder: sdma_transformer`` -> :class:`SDMATransformerDecoder`
* ``model: sdma``               -> :class:`ESPnetSDMAASRModel`

so ``ASRTask`` training, ``Speech2Text`` and ``ASRTask.build_model_from_file`` find them.
Multi-GPU training spawns workers whose target is ``SDMAASRTask.main_worker``; unpickling
it imports this module in every worker, which registers the classes there too.
"""

import logging
from typing import List

import torch
from espnet2.tasks import asr as espnet_asr

from espnet_plugin.asr.decoder.sdma_transformer_decoder import SDMATransformerDecoder
from espnet_plugin.asr.encoder.sdma_conformer_encoder import SDMAConformerEncoder
from espnet_plugin.asr.encoder.sdma_transformer_encoder import SDMATransformerEncoder
from espnet_plugin.asr.sdma_espnet_model import ESPnetSDMAASRModel
from espnet_plugin.safe_loading import weights_only_loading

PLUGIN_CLASSES = (
    (espnet_asr.encoder_choices, "sdma_transformer", SDMATransformerEncoder),
    (espnet_asr.encoder_choices, "sdma_conformer", SDMAConformerEncoder),
    (espnet_asr.decoder_choices, "sdma_transformer", SDMATransformerDecoder),
    (espnet_asr.model_choices, "sdma", ESPnetSDMAASRModel),
)


def register() -> None:
    """Add the plugin's classes to ESPnet's ASR class choices (idempotent)."""
    for choices, name, cls in PLUGIN_CLASSES:
        present = choices.classes.get(name)
        if present is not None and present is not cls and present.__qualname__ != cls.__qualname__:
            raise RuntimeError(
                f"ESPnet already has a different --{choices.name} {name!r} ({present.__module__}."
                f"{present.__qualname__}); refusing to replace it"
            )
        if choices.base_type is not None and not issubclass(cls, choices.base_type):
            raise TypeError(f"{cls.__name__} is not a {choices.base_type.__name__}")
        choices.classes[name] = cls


register()


class SDMAASRTask(espnet_asr.ASRTask):
    """ESPnet's ``ASRTask`` that also advances the SDMA update counter after each optimizer step.

    The counter (``ESPnetSDMAASRModel.num_updates``) drives the mixing weight of eq. (11);
    counting optimizer steps (not forward passes) keeps it right under ``accum_grad`` and
    skipped non-finite steps, and it is a model buffer, so ``--resume`` restores it.
    """

    @classmethod
    def main_worker(cls, args) -> None:
        """ESPnet's worker (training, ``--resume``, ``--init_param``, n-best averaging), with
        every model file read by ``torch.load(weights_only=True)``: spawned multi-GPU workers
        start here, so each applies the safe loader itself."""
        with weights_only_loading():
            super().main_worker(args)

    @classmethod
    def build_model_from_file(cls, *args, **kwargs):
        """``ASRTask.build_model_from_file`` with the model file read by the safe loader."""
        with weights_only_loading():
            return super().build_model_from_file(*args, **kwargs)

    @classmethod
    def build_optimizers(cls, args, model: torch.nn.Module) -> List[torch.optim.Optimizer]:
        optimizers = super().build_optimizers(args, model)
        if isinstance(model, ESPnetSDMAASRModel):
            optimizers[0].register_step_post_hook(lambda optimizer, a, kw: model.increment_num_updates())
            logging.info("SDMA: mixing weight follows the optimizer steps of %s", type(optimizers[0]).__name__)
        return optimizers


def build_asr_model_from_file(asr_train_config: str, asr_model_file: str, device: str = "cpu"):
    """``ASRTask.build_model_from_file`` reading ``asr_model_file`` with the safe loader:
    ``(model, train_args)`` (the SDMA classes are registered when this module is imported)."""
    with weights_only_loading():
        return espnet_asr.ASRTask.build_model_from_file(asr_train_config, asr_model_file, device)

"""ESPnet2 plugin: SDMA (semantic and disentangled mask attention) for speech recognition.

``import espnet_plugin`` registers ``encoder: sdma_transformer``, ``decoder:
sdma_transformer`` and ``model: sdma`` in ESPnet2's ASR task. Train and decode with
``python -m espnet_plugin.bin.asr_train`` / ``python -m espnet_plugin.bin.asr_inference``
(every option of ESPnet's own entry points), or run an ``egs2`` recipe with
``asr.sh --python "python -m espnet_plugin.bin.python_shim"``.
"""

import contextlib
import sys

# Importing the plugin prints nothing to stdout. ESPnet prints "Failed to import Flash Attention, using ESPnet
# default: ..." to stdout while its attention module imports (espnet/nets/pytorch_backend/transformer/attention.py,
# where flash_attn is absent); recipes pipe tools' stdout into their files (asr.sh's tokenize_text into
# ref.trn/hyp.trn), so what ESPnet's modules print while the plugin imports them goes to stderr.
with contextlib.redirect_stdout(sys.stderr):
    from espnet_plugin.tasks.sdma_asr import SDMAASRTask, register  # noqa: F401,E402  (registers at import)
from latent_core.errors import install_excepthook  # noqa: E402

install_excepthook()  # configuration errors (PluginConfigError) -> one line, exit status 2

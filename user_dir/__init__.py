"""fairseq ``--user-dir`` package of the latent-structure toolkit.

``fairseq-train --user-dir user_dir ...`` imports this package, which registers
every model, criterion and task below and allow-lists the few extra types that
fairseq checkpoints contain for torch's safe loader (``weights_only=True``).
"""

from . import safe_loading

safe_loading.register_checkpoint_types()

from . import sdma  # noqa: E402,F401  (registration)
from . import sentence_vae, qkvae, optimus  # noqa: E402,F401  (registration)
from . import hf_sentence, topic_vq  # noqa: E402,F401  (registration)
from . import tpr  # noqa: E402,F401  (registration)

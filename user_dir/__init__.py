"""fairseq ``--user-dir`` package of the latent-structure toolkit.

``fairseq-train --user-dir user_dir ...`` imports this package, which registers
every model, criterion and task below, reports configuration errors as one line
(``latent_core/errors.py``) and allow-lists the few extra types that
fairseq checkpoints contain for torch's safe loader (``weights_only=True``).
It also makes fairseq's ``translation`` task build its cached batch iterator as at epoch 1,
so that a resumed run is bit-identical to a continuous one (``user_dir/exact_resume.py``), and puts
the root logger back to INFO (``$LOGLEVEL``), which importing fairseq's models leaves at DEBUG.
"""

from latent_core import errors, safe_loading

safe_loading.register_checkpoint_types()
errors.install_excepthook()  # PluginConfigError -> one line, exit status 2

from . import sdma  # noqa: E402,F401  (registration)
from . import sentence_vae, qkvae, optimus  # noqa: E402,F401  (registration)
from . import hf_sentence, topic_vq  # noqa: E402,F401  (registration)
from . import tpr  # noqa: E402,F401  (registration)
from . import exact_resume  # noqa: E402

exact_resume.patch_fairseq_tasks()  # translation: bit-identical resume (user_dir/exact_resume.py)


def _restore_root_log_level() -> None:
    """fairseq 0.12's ``fairseq/models/wav2vec/wav2vec2_classification.py`` calls
    ``logging.basicConfig(level=logging.DEBUG)`` when fairseq's models are imported, which leaves the root
    logger at DEBUG in every fairseq command: libraries' debug lines (matplotlib's, filelock's) then fill the
    output. Back to the level fairseq's commands mean to set: ``$LOGLEVEL``, default INFO."""
    import logging
    import os

    wanted = os.environ.get("LOGLEVEL", "INFO").upper()
    root = logging.getLogger()
    if root.level == logging.DEBUG and wanted != "DEBUG":
        root.setLevel(wanted)


_restore_root_log_level()

"""Optimus (Li et al. 2020): registration of the model, its architectures and its task.

``optimus`` (= ``optimus_base``, the paper's BERT-base + GPT-2 size) and ``optimus_small``
(a CPU-sized one); see :mod:`.model` for the latent injection, :mod:`.pretrained` for
loading local Hugging Face BERT / GPT-2 directories and :mod:`.task` for ``optimus_lm``
(WordPiece in, byte-level BPE out).
"""

from .model import OptimusDecoder, OptimusEncoder, OptimusModel  # noqa: F401  (registration)
from .pretrained import OptimusConfigError  # noqa: F401
from . import task  # noqa: F401,E402  (registers optimus_lm)

"""Optimus (Li et al. 2020): registration of the model and architectures.

``optimus`` (= ``optimus_base``, the paper's BERT-base + GPT-2 size) and ``optimus_small``
(a CPU-sized one); see :mod:`.model` for the latent injection and :mod:`.pretrained` for
loading local Hugging Face BERT / GPT-2 directories.
"""

from .model import OptimusDecoder, OptimusEncoder, OptimusModel  # noqa: F401  (registration)
from .pretrained import OptimusConfigError  # noqa: F401

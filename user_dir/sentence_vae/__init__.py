"""Sentence VAEs in fairseq: the shared model interface (:mod:`.base`), the ``sentence_vae``
task (:mod:`.task`) and criterion (:mod:`.criterion`), and the library code of the tools
``scripts/vae_eval.py`` (:mod:`.evaluate`) and ``scripts/vae_generate.py`` (:mod:`.generate`).
The models live in ``user_dir.qkvae`` (QKVAE, ADVAE) and ``user_dir.optimus``; the VAE
mathematics in ``latent_core.vae``."""

from . import task, criterion  # noqa: F401  (registration)

"""Sentence VAEs in fairseq: the shared model interface (:mod:`.base`), the ``sentence_vae``
task (:mod:`.task`) and criterion (:mod:`.criterion`), and the tools ``vae-eval``
(:mod:`.evaluate`) and ``vae-generate`` (:mod:`.generate`), which share the checkpoint loading
(:mod:`.checkpoint`) and the latent decoder (:mod:`.decoding`).
The models live in ``user_dir.qkvae`` (QKVAE, ADVAE) and ``user_dir.optimus``; the VAE
mathematics in ``latent_core.vae``."""

from . import task, criterion  # noqa: F401  (registration)

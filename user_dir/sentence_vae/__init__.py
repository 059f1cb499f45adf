"""Sentence VAEs in fairseq: the shared model interface (:mod:`.base`), the ``sentence_vae``
task (:mod:`.task`) and criterion (:mod:`.criterion`), checkpoint loading (:mod:`.checkpoint`)
and the latent decoder (:mod:`.decoding`), which the tools ``vae-eval`` and ``vae-generate``
(``user_dir.tools.sentence_vae``) share.
The models live in ``user_dir.qkvae`` (QKVAE, ADVAE) and ``user_dir.optimus``; the VAE
mathematics in ``latent_core.vae``."""

from . import task, criterion  # noqa: F401  (registration)

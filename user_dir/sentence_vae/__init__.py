"""Sentence VAEs in fairseq: the shared model interface (:mod:`.base`), the ``sentence_vae``
task and criterion. The models live in ``user_dir.qkvae`` (QKVAE, ADVAE) and
``user_dir.optimus``; the VAE mathematics in ``user_dir.vae``."""

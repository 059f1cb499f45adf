"""The toolkit-free core of the latent-structure toolkit: plain PyTorch and numpy.

* :mod:`latent_core.sdma`: the one SDMA attention core (every equation of the SDMA paper's
  Section III), used by the fairseq adapter (``user_dir/sdma``) and the ESPnet adapter
  (``espnet_plugin/asr``);
* :mod:`latent_core.vae`: the VAE mathematics shared by QKVAE/ADVAE and Optimus (posteriors,
  KL with free bits/thresholds, beta schedules, importance-weighted bounds, MI, active units);
* :mod:`latent_core.errors`: ``PluginConfigError``, the base of every user-facing error, and
  the hook that reports it as one line;
* :mod:`latent_core.redundancy`: the LR/HR head-redundancy measures (and ``redundancy_plot``, their
  figures);
* :mod:`latent_core.safe_loading`: the non-tensor types the toolkits' checkpoints contain,
  for ``torch.load(weights_only=True)``;
* :mod:`latent_core.op_counts`, :mod:`latent_core.peak_rss`: operator/launch counts and peak memory of
  any callable or command.

Only mathematics and measurement: nothing here imports fairseq, ESPnet, transformers or the project's
other packages, nor parses a toolkit's files or logs (``tests/integration/test_core_isolation.py``
checks every import, also those inside functions). Data preparation and the drivers of the toolkits'
command-line tools live in :mod:`pipelines`; an ESPnet-only user never loads fairseq and the equations
can be read and tested on their own.
"""

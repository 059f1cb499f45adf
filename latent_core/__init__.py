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
* :mod:`latent_core.profiling`: the profiler ranges that name each equation's source in a trace.

Only mathematics, and no command: nothing here imports fairseq, ESPnet, transformers or the project's
other packages, nor parses a toolkit's files or logs (``tests/integration/test_core_isolation.py``
checks every import, also those inside functions). Data preparation lives in :mod:`pipelines`,
the commands in ``user_dir/tools`` and ``espnet_plugin/tools``, the benchmarks in :mod:`benchmarks` and the
experiment drivers in :mod:`experiments`; an ESPnet-only user never loads fairseq and the equations
can be read and tested on their own.
"""

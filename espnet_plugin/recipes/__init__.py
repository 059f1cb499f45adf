"""Recipe drivers: the ESPnet recipe stages run through ESPnet's own Python entry points.

* :mod:`~espnet_plugin.recipes.synthetic`: SDMA-T vs a vanilla transformer on synthetic Mandarin
  speech (``examples/aishell_sdma/asr1/run_synthetic.py`` is its thin wrapper).
"""

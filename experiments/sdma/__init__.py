"""SDMA's drivers: the demo (``sdma-demo``), the readings and BERT-fused comparisons, the learning curves, the
regulariser scales (``examples/sdma_translation/``)."""

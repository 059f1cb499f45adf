"""Command-line tools over trained ESPnet2 SDMA models (``sdma-espnet-redundancy``)."""

"""The ESPnet recipe stages run through ESPnet's own Python entry points (``examples/aishell_sdma/``)."""

"""Optimus' driver: the Table 1 lambda sweep (``examples/optimus/``)."""

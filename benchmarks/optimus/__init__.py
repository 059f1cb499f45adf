"""Optimus' training-speed benchmark (``optimus-bench``)."""

"""HUBERT's driver: the Table 2 transfer protocol (``examples/hubert_tpr/``)."""

"""DisBert's driver: the cross-validation sweep (``examples/topic_vq_sts/``)."""

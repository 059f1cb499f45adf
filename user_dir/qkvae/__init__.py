"""QKVAE and ADVAE (Felhi et al. 2022): registration of the models and architectures."""

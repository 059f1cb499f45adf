"""Optimus (Li et al. 2020): registration of the model and architectures."""

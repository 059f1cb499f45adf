"""The one configuration error of the VAE utilities."""


class VAEConfigError(ValueError):
    """An impossible VAE hyper-parameter (the message names the option and what is allowed)."""

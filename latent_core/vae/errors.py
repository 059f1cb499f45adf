"""The one configuration error of the VAE utilities."""

from latent_core.errors import PluginConfigError


class VAEConfigError(PluginConfigError):
    """An impossible VAE hyper-parameter (the message names the option and what is allowed)."""

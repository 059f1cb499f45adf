"""Commands of the sentence VAEs (QKVAE/ADVAE, Optimus): evaluation (IW-PPL, KL, MI, AU, BLEU) and generation."""

import sys
from typing import Callable, List, Optional

from latent_core.errors import command_error
from latent_core.vae import VAEConfigError


def console_entry(prog: str, main: Callable[[Optional[List[str]]], object]) -> Callable[..., None]:
    """The console entry point of the command ``prog`` that runs ``main(argv)``: exit status 2 after a one-line
    error for a bad option or a missing checkpoint or data file."""

    def cli_main(argv: Optional[List[str]] = None) -> None:
        try:
            main(argv)
        except (VAEConfigError, OSError) as err:  # bad option, missing checkpoint/data file
            sys.exit(command_error(prog, err))

    return cli_main

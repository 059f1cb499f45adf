#!/usr/bin/env python3
"""Figs. 10-11 of the SDMA paper: heat maps of the head-pair head redundancy (HR) matrix.

Same as the console command ``sdma-plot-heads`` (the code and its documentation: ``latent_core.redundancy_plot``).
"""

from latent_core.redundancy_plot import main

if __name__ == "__main__":
    raise SystemExit(main())

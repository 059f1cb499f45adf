#!/usr/bin/env python3
"""Figs. 8/9 of the SDMA paper: t-SNE of the queries q_i^h of each head, coloured by head.

Same as the console command ``sdma-plot-tsne`` (the code and its documentation: ``user_dir.sdma.plot_query_tsne``).
"""

from user_dir.sdma.plot_query_tsne import main

if __name__ == "__main__":
    raise SystemExit(main())

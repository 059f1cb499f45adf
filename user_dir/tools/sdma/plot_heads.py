"""``sdma-plot-heads``: Figs. 10-11 of the SDMA paper, the head-pair HR matrices of several models side by side.

Reads the JSON of ``sdma-redundancy`` or ``sdma-espnet-redundancy`` written with ``--hr-matrix`` and draws
the files on one colour scale (:func:`latent_core.redundancy_plot.plot_results`)::

    sdma-plot-heads vt.json sdma.json --names V-T SDMA-T --out fig10.png

(``python -m user_dir.tools.sdma.plot_heads`` is the same command.)
"""

import argparse
import json
import os
import sys
from pathlib import Path

from latent_core.errors import command_error
from latent_core.redundancy import ATTENTION_TYPES, RedundancyError
from latent_core.redundancy_plot import plot_results


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description="Figs. 10-11 of the SDMA paper: heat maps of the head-pair HR matrix from the JSON of "
                    "sdma-redundancy / sdma-espnet-redundancy (--hr-matrix), side by side.")
    parser.add_argument("results", nargs="+", metavar="RESULT.json", help="redundancy JSON file(s), one panel each")
    parser.add_argument("--names", nargs="+", default=None,
                        help="panel names, one per file (default: the file names), e.g. V-T SDMA-T")
    parser.add_argument("--kind", default="encoder_self", choices=ATTENTION_TYPES,
                        help="attention type (default: encoder_self, the paper's figures)")
    parser.add_argument("--title", default=None, help="figure title")
    parser.add_argument("--out", default="head_redundancy.png", help="output image (default head_redundancy.png)")
    parser.add_argument("--dpi", type=int, default=150)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    prog = os.path.basename(sys.argv[0]) or "sdma-plot-heads"
    try:
        names = args.names or [Path(path).stem for path in args.results]
        if len(names) != len(args.results):
            raise RedundancyError(f"{len(names)} --names for {len(args.results)} result files")
        named = []
        for name, path in zip(names, args.results):
            if not os.path.isfile(path):
                raise FileNotFoundError(f"result file not found: {path}")
            named.append((name, json.loads(Path(path).read_text())))
        plot_results(named, [args.kind], args.out, title=args.title, dpi=args.dpi)
    except (FileNotFoundError, RedundancyError, json.JSONDecodeError) as error:
        return command_error(prog, error)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

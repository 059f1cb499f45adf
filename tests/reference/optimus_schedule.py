"""Reference numbers of the authors' cyclical beta schedule for ``tests/unit/latent_core/test_optimus_schedule.py``.

Evaluates ``frange_cycle_zero_linear`` of ChunyuanLI/Optimus (``code/examples/big_ae/utils.py``, commit
f3190fe) over :data:`GRID` and prints the dictionary the test holds as ``AUTHORS_SCHEDULES``. Only that one
function is taken from their file (read with ``ast``, so nothing else of their ``utils.py`` is imported);
nothing of it is in this repository::

    mkdir -p /tmp/optref && git -C /work/.mirror/ChunyuanLI+Optimus/repo archive HEAD | tar -x -C /tmp/optref
    .venv/bin/python -m tests.reference.optimus_schedule --authors-dir /tmp/optref > tests/reference/optimus_schedule_reference.py

Arguments as their scripts pass them: ``frange_cycle_zero_linear(n_iter, start=0.0, stop=beta, n_cycle,
ratio_increase, ratio_zero)`` (pre-training: 10 cycles, fine-tuning: 1; ratio_zero 0.5 and ratio_increase 0.25
by default). Short arrays are kept whole; long ones as a digest of every element (count of zeros, count of
``stop``, ``math.fsum`` of the values and of index x value) and their values around every cycle's start and
ramp.
"""

import argparse
import ast
import math
import pprint

import numpy as np

# (n_iter, n_cycle, ratio_zero, ratio_increase, stop)
SHORT = [(n, c, z, r, 1.0) for n in (10, 33, 101) for c in (1, 3, 4, 10) for z, r in ((0.5, 0.25), (0.3, 0.5))]
LONG = [(60_001, 10, 0.5, 0.25, 1.0), (2_500, 4, 0.5, 0.25, 1.0), (100_003, 10, 0.5, 0.25, 1.0),
        (20_000, 1, 0.5, 0.25, 1.0), (7_777, 7, 0.3, 0.5, 0.8)]
GRID = SHORT + LONG


def their_function(authors_dir: str):
    path = f"{authors_dir}/code/examples/big_ae/utils.py"
    tree = ast.parse(open(path, encoding="utf-8").read())
    node = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "frange_cycle_zero_linear")
    namespace = {"np": np}
    exec(compile(ast.Module(body=[node], type_ignores=[]), path, "exec"), namespace)
    return namespace["frange_cycle_zero_linear"]


def probe_indices(n_iter: int, n_cycle: int, ratio_zero: float, ratio_increase: float):
    """Indices around every cycle's start, the ramp's start and its end."""
    period = n_iter / n_cycle
    marks = []
    for c in range(n_cycle):
        for frac in (0.0, ratio_zero, ratio_zero + ratio_increase):
            marks.append(int(c * period + frac * period))
    return sorted({i for m in marks for i in range(m - 3, m + 4) if 0 <= i < n_iter})


def digest(values) -> dict:
    values = [float(v) for v in values]
    return {"zeros": sum(v == 0.0 for v in values), "at_stop": sum(v == values[-1] for v in values),
            "sum": math.fsum(values), "index_sum": math.fsum(i * v for i, v in enumerate(values))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--authors-dir", required=True)
    args = p.parse_args()
    frange = their_function(args.authors_dir)
    reference = {}
    for n_iter, n_cycle, ratio_zero, ratio_increase, stop in GRID:
        values = frange(n_iter, start=0.0, stop=stop, n_cycle=n_cycle, ratio_increase=ratio_increase,
                        ratio_zero=ratio_zero)
        key = (n_iter, n_cycle, ratio_zero, ratio_increase, stop)
        if n_iter <= 101:
            reference[key] = {"values": [float(v) for v in values]}
        else:
            reference[key] = {"digest": digest(values),
                              "probes": {i: float(values[i]) for i in probe_indices(n_iter, n_cycle, ratio_zero,
                                                                                    ratio_increase)}}
    print('"""Numbers of the authors\' ``frange_cycle_zero_linear`` (ChunyuanLI/Optimus, commit f3190fe) over the grid')
    print('of ``tests/reference/optimus_schedule.py``, which printed this file; keys: (n_iter, n_cycle, ratio_zero,')
    print('ratio_increase, stop)."""\n')
    print("AUTHORS_SCHEDULES = " + pprint.pformat(reference, width=116, compact=True))


if __name__ == "__main__":
    main()

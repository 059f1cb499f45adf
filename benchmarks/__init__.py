"""Benchmarks and GPU checks: speed and memory against a baseline in the same run (ratios), a table printed and
JSON written; operator, launch and FLOP counts (:mod:`benchmarks.op_counts`); peak memory of a command
(:mod:`benchmarks.peak_rss`); the GPU machine's check (:mod:`benchmarks.gpu_check`).

Nothing in the library imports them. Each is a console script of ``pyproject.toml`` or a ``make`` target
(``python -m benchmarks.<module>`` runs the same main).
"""

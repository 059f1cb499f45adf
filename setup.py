"""Shim for tools that still call ``setup.py``: the package is defined in ``pyproject.toml``
(``pip install -e .`` reads that; ``python setup.py --version`` works through this file)."""

from setuptools import setup

setup()

"""The drivers behind the pages: each trains and compares several runs and writes the tables of one
``examples/<paper>/`` page (one subpackage per paper; ``transformers`` and ``espnet`` for those adapters' pages).

They sit on top: they call the data preparation (:mod:`pipelines.data`), the toolkits' commands and the
commands on trained models (``user_dir/tools``), and nothing below imports them. Each is a console script of
``pyproject.toml`` (``python -m experiments.<paper>.<module>`` runs the same main).
"""

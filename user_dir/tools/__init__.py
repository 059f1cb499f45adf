"""The commands around the models: evaluation, generation, probes, benchmarks, analysis, plots and
the drivers that train and compare several runs, one subpackage per paper (``sdma``,
``sentence_vae``, ``qkvae``, ``optimus``, ``hf_sentence``, ``topic_vq``, ``tpr``).

fairseq never imports this package: ``--user-dir user_dir`` loads the models, criterions and tasks
of the paper packages beside it, which import nothing from here. Each command is a console script
of ``pyproject.toml`` (``python -m user_dir.tools.<paper>.<module>`` runs the same main).
"""

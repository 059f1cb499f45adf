"""The commands a user runs on a trained model: evaluation, generation, probes, analysis and plots, one
subpackage per paper (``sdma``, ``sentence_vae``, ``qkvae``, ``optimus``, ``hf_sentence``, ``topic_vq``,
``tpr``), and checkpoint averaging.

fairseq never imports this package: ``--user-dir user_dir`` loads the models, criterions and tasks
of the paper packages beside it, which import nothing from here. Each command is a console script
of ``pyproject.toml`` (``python -m user_dir.tools.<paper>.<module>`` runs the same main). The drivers of the
pages' experiments are in ``experiments/``, the benchmarks in ``benchmarks/``, data preparation in
``pipelines/data/``.
"""

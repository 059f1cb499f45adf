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
    extras_require={"test": ["pytest", "pytest-timeout", "hypothesis"]},
)

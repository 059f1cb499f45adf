"""pytest plugin (``-p substitution``): the toolkit's own tests run on the plugin's classes.

Loaded by ``run_toolkit_tests.py`` into a pytest run over a toolkit's extracted test files. Before
collection it puts the plugin's classes where the toolkit's tests find the toolkit's:

* fairseq: :class:`user_dir.sdma.model.SDMATransformerModel` as ``fairseq.models.transformer.TransformerModel``
  and as every ``ARCH_MODEL_REGISTRY`` entry of fairseq's ``TransformerModel`` (``transformer``,
  ``transformer_iwslt_de_en``, ``transformer_wmt_en_de``, ...: the training binaries build it);
  fairseq's architecture function fills the transformer options, the plugin's ``build_model`` the
  ``sdma_*`` ones. :class:`user_dir.sdma.fairseq_attention.SDMAMultiheadAttention` as the
  ``MultiheadAttention`` the attention and export test modules name (bound in those modules after
  import: fairseq's own code keeps its class). The plugin's classes subclass the originals they
  imported, so nothing recurses.
* ESPnet (espnet1 ``Encoder``/``Decoder``): each layer's ``MultiHeadedAttention`` is replaced by
  :class:`espnet_plugin.asr.sdma_attention.SDMAMultiHeadedAttention` as the plugin's own encoder and
  decoder do it: encoder self-attention -> group ``encoder_self``, decoder self-attention ->
  ``decoder_self``, source attention -> ``decoder_cross``, with the plugin's presets.

The run's configuration comes from the environment the runner sets: ``TOOLKIT_CONTRACT_TOOLKIT``
(fairseq | espnet), ``TOOLKIT_CONTRACT_MODE`` (none | sma | sdma, or ``toolkit``: the plugin imported but
nothing substituted, the toolkit's own classes, used to verify an expected "toolkit defect") and
``TOOLKIT_CONTRACT_READING`` (authors | paper). In every substituted run each test also checks that
SDMA's regularisers leak nothing when no criterion consumes them (no ``recording()`` scope left open,
nothing recorded outside one).
"""

import contextlib
import importlib
import os
import types

import pytest
import torch

# (toolkit object, the name a test module binds it to) -> the plugin's, set in the test modules after import
TEST_MODULE_NAMES = {}
TOOLKIT = os.environ.get("TOOLKIT_CONTRACT_TOOLKIT", "fairseq")
MODE = os.environ.get("TOOLKIT_CONTRACT_MODE", "sdma")
READING = os.environ.get("TOOLKIT_CONTRACT_READING", "authors")


def substitute_fairseq():
    from omegaconf import OmegaConf, open_dict

    import user_dir  # noqa: F401  (registers the plugin's models; imports fairseq's first)
    import fairseq.models as models
    import fairseq.models.transformer as transformer
    import fairseq.modules.multihead_attention as multihead_attention
    from latent_core.sdma import SDMAOptions
    from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention
    from user_dir.sdma.model import SDMATransformerModel

    toolkit_model = transformer.TransformerModel

    class ContractTransformerModel(SDMATransformerModel):
        """The plugin's model in this run's mode and reading (fairseq's tests set no ``sdma_*`` option; a
        config composed by hydra already carries the dataclass defaults, so the run's values are set)."""

        @classmethod
        def build_model(cls, cfg, task):
            with open_dict(cfg) if OmegaConf.is_config(cfg) else contextlib.nullcontext():
                cfg.sdma_mode, cfg.sdma_reading = MODE, READING
            return super().build_model(cfg, task)

    class ContractMultiheadAttention(SDMAMultiheadAttention):
        """The plugin's attention built with fairseq's arguments (group from the kind of attention)."""

        def __init__(self, embed_dim, num_heads, *args, **kwargs):
            group = "decoder_cross" if kwargs.get("encoder_decoder_attention") else "encoder_self"
            super().__init__(embed_dim, num_heads, *args, sdma=SDMAOptions(mode=MODE, reading=READING),
                             group=group, **kwargs)

    for arch, cls in list(models.ARCH_MODEL_REGISTRY.items()):
        if cls is toolkit_model:  # the binaries build it; its config is the plugin's (hydra: model/sdma_transformer)
            models.ARCH_MODEL_REGISTRY[arch] = ContractTransformerModel
            models.ARCH_MODEL_NAME_REGISTRY[arch] = "sdma_transformer"
    models.MODEL_REGISTRY["transformer"] = ContractTransformerModel
    transformer.TransformerModel = ContractTransformerModel
    # the attention only where the tests name it (see pytest_collection_modifyitems): fairseq's own code looks
    # MultiheadAttention up in its module when TorchScript compiles the none-mode model's layers
    proxy = types.ModuleType(multihead_attention.__name__)
    proxy.__dict__.update(vars(multihead_attention), MultiheadAttention=ContractMultiheadAttention)
    TEST_MODULE_NAMES[multihead_attention.MultiheadAttention, "MultiheadAttention"] = ContractMultiheadAttention
    TEST_MODULE_NAMES[multihead_attention, "multihead_attention"] = proxy


def repair_espnet_without_chainer():
    """ESPnet 202511 defect: ``espnet.asr.asr_utils.PlotAttentionReport`` is None without chainer (which the
    pinned numpy 2 cannot import), yet ``espnet.nets.pytorch_backend.transformer.plot`` subclasses it at
    import, so no espnet1 PyTorch E2E model imports ("TypeError: NoneType takes no arguments"). A base
    class that refuses to be built (it is chainer's training extension) lets them import; in every
    run, the toolkit's own included."""
    from espnet.asr import asr_utils

    if asr_utils.PlotAttentionReport is None:
        class PlotAttentionReport:
            def __init__(self, *args, **kwargs):
                raise ImportError("PlotAttentionReport is chainer's training extension; chainer is not installed")

        asr_utils.PlotAttentionReport = PlotAttentionReport


def substitute_espnet():
    import espnet.nets.pytorch_backend.transformer.decoder as decoder
    import espnet.nets.pytorch_backend.transformer.encoder as encoder
    from espnet.nets.pytorch_backend.transformer.attention import MultiHeadedAttention

    from espnet_plugin.asr.sdma_attention import (
        AISHELL_DECODER_PRESET,
        AISHELL_ENCODER_PRESET,
        SDMAMultiHeadedAttention,
        sdma_options_from_conf,
    )

    def plugin_attention(attention, conf_name, preset, group, **override):
        if type(attention) is not MultiHeadedAttention:  # lightconv, rel-pos...: not the plugin's to replace
            return attention
        options = sdma_options_from_conf(conf_name, {"mode": MODE, "reading": READING, **override}, preset)
        return SDMAMultiHeadedAttention(attention.h, attention.h * attention.d_k, attention.dropout.p, sdma=options,
                                        group=group, qk_norm=not isinstance(attention.q_norm, torch.nn.Identity))

    class ContractEncoderLayer(encoder.EncoderLayer):
        def __init__(self, size, self_attn, *args, **kwargs):
            self_attn = plugin_attention(self_attn, "encoder_conf", AISHELL_ENCODER_PRESET, "encoder_self")
            super().__init__(size, self_attn, *args, **kwargs)

    class ContractDecoderLayer(decoder.DecoderLayer):
        def __init__(self, size, self_attn, src_attn, *args, **kwargs):
            self_attn = plugin_attention(self_attn, "decoder_conf", AISHELL_DECODER_PRESET, "decoder_self")
            # as the plugin's decoder: the cross-attention keeps its mask at inference
            src_attn = plugin_attention(src_attn, "decoder_conf", AISHELL_DECODER_PRESET, "decoder_cross",
                                        mask_at_inference=True)
            super().__init__(size, self_attn, src_attn, *args, **kwargs)

    encoder.EncoderLayer = ContractEncoderLayer
    decoder.DecoderLayer = ContractDecoderLayer


def pytest_configure(config):
    if TOOLKIT == "espnet":
        repair_espnet_without_chainer()
    if MODE != "toolkit":
        {"fairseq": substitute_fairseq, "espnet": substitute_espnet}[TOOLKIT]()
    else:  # the process of a substituted run (the plugin imported: its registrations, e.g. the checkpoint
        # types torch.load allows) with the toolkit's own classes
        importlib.import_module({"fairseq": "user_dir", "espnet": "espnet_plugin"}[TOOLKIT])


def pytest_collection_modifyitems(session, config, items):
    for module in {item.module for item in items if getattr(item, "module", None) is not None}:
        for (toolkit_object, name), plugin_object in TEST_MODULE_NAMES.items():
            if getattr(module, name, None) is toolkit_object:
                setattr(module, name, plugin_object)


def pytest_report_header(config):
    what = "the toolkit's own" if MODE == "toolkit" else f"the plugin's (mode={MODE} reading={READING})"
    return f"toolkit contract: {TOOLKIT}'s tests on {what} classes"


@pytest.fixture(autouse=True)
def regularisers_do_not_leak(monkeypatch):
    """Outside a criterion nothing may be recorded, and no recording scope may stay open."""
    if MODE == "toolkit":
        yield
        return
    import latent_core.sdma as sdma

    kept = []
    add = sdma.SDMARecording.add
    monkeypatch.setattr(sdma.SDMARecording, "add", lambda self, core, rec: (kept.append(core), add(self, core, rec)))
    yield
    assert sdma.active_recording() is None, "an SDMA recording() scope is still open after the test"
    assert not kept, f"SDMA recorded {len(kept)} regulariser inputs though no criterion consumed them"

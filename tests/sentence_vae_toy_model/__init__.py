"""TEST DOUBLE: a tiny GRU sentence VAE, registered as ``test_gru_vae``.

It exists only so that the tests of the ``sentence_vae`` task, criterion and tools do not
depend on the real models (``user_dir/qkvae``, ``user_dir/optimus``). It implements the
interface of ``user_dir/sentence_vae/base.py`` and nothing more: a GRU encoder whose last
hidden state gives the posterior of every latent, and a GRU decoder whose initial state and
every input step are conditioned on the concatenated latents. Not for real use.

A fairseq ``--user-dir`` package: ``fairseq-train --user-dir tests/sentence_vae_toy_model``
imports it, and it imports the plugin (``user_dir``) itself. In the tests' own process, import
it as ``sentence_vae_toy_model`` (pytest puts ``tests/`` on the path of test modules) before
building or loading the model.
"""

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from fairseq import utils
from fairseq.dataclass import FairseqDataclass
from fairseq.models import FairseqIncrementalDecoder, register_model
from torch import nn

from user_dir.sentence_vae.base import SentenceVAEEncoder, SentenceVAEModel, decoder_extra

ARCH = "test_gru_vae"


def parse_latents(spec: str) -> "OrderedDict[str, int]":
    """``z_syn:4,z_sem:4`` -> OrderedDict(z_syn=4, z_sem=4)."""
    out = OrderedDict()
    for entry in spec.split(","):
        name, size = entry.split(":")
        out[name.strip()] = int(size)
    return out


@dataclass
class ToyGRUVAEConfig(FairseqDataclass):
    toy_embed_dim: int = field(default=32, metadata={"help": "test double: embedding size"})
    toy_hidden_dim: int = field(default=64, metadata={"help": "test double: GRU size"})
    toy_latents: str = field(default="z_syn:4,z_sem:4", metadata={"help": "test double: NAME:SIZE,..."})
    toy_max_positions: int = field(default=256, metadata={"help": "test double: longest sentence"})


class ToyGRUEncoder(SentenceVAEEncoder):
    def __init__(self, cfg, dictionary, latent_sizes):
        super().__init__(dictionary)
        self.latent_sizes = latent_sizes
        self.max_source_positions = cfg.toy_max_positions
        self.embed = nn.Embedding(len(dictionary), cfg.toy_embed_dim, padding_idx=dictionary.pad())
        self.gru = nn.GRU(cfg.toy_embed_dim, cfg.toy_hidden_dim, batch_first=True)
        self.to_params = nn.Linear(cfg.toy_hidden_dim, 2 * sum(latent_sizes.values()))

    def posterior_parameters(self, src_tokens, src_lengths):
        pad = self.dictionary.pad()
        if src_tokens[:, 0].eq(pad).any():  # left-padded -> right-padded for packing
            src_tokens = utils.convert_padding_direction(src_tokens, pad, left_to_right=True)
        lengths = src_tokens.ne(pad).sum(1).clamp(min=1).cpu()
        packed = nn.utils.rnn.pack_padded_sequence(self.embed(src_tokens), lengths, batch_first=True,
                                                   enforce_sorted=False)
        _, hidden = self.gru(packed)  # [1, B, H]
        params = self.to_params(hidden[0])  # [B, 2 * sum D]
        means, logvars, start = {}, {}, 0
        for name, size in self.latent_sizes.items():
            means[name] = params[:, start:start + size]
            logvars[name] = params[:, start + size:start + 2 * size]
            start += 2 * size
        return means, logvars


class ToyGRUDecoder(FairseqIncrementalDecoder):
    def __init__(self, cfg, dictionary, latent_sizes):
        super().__init__(dictionary)
        self.latent_sizes = latent_sizes
        self.max_target_positions = cfg.toy_max_positions
        latent_dim = sum(latent_sizes.values())
        self.embed = nn.Embedding(len(dictionary), cfg.toy_embed_dim, padding_idx=dictionary.pad())
        self.init_hidden = nn.Linear(latent_dim, cfg.toy_hidden_dim)
        self.gru = nn.GRU(cfg.toy_embed_dim + latent_dim, cfg.toy_hidden_dim, batch_first=True)
        self.out = nn.Linear(cfg.toy_hidden_dim, len(dictionary))

    def forward(self, prev_output_tokens, encoder_out=None, incremental_state=None, **unused):
        z = torch.cat([encoder_out["latents"][name] for name in self.latent_sizes], -1)  # [B, sum D]
        hidden = None
        if incremental_state is not None:
            hidden = self.get_incremental_state(incremental_state, "hidden")
            prev_output_tokens = prev_output_tokens[:, -1:]
        if hidden is None:
            hidden = torch.tanh(self.init_hidden(z)).unsqueeze(0)  # [1, B, H]
        x = self.embed(prev_output_tokens)  # [B, T, E]
        x = torch.cat([x, z.unsqueeze(1).expand(-1, x.size(1), -1).to(x)], -1)
        output, hidden = self.gru(x, hidden)
        if incremental_state is not None:
            self.set_incremental_state(incremental_state, "hidden", hidden)
        return self.out(output), decoder_extra(encoder_out)  # [B, T, V]

    def reorder_incremental_state(self, incremental_state, new_order):
        hidden = self.get_incremental_state(incremental_state, "hidden")
        if hidden is not None:
            self.set_incremental_state(incremental_state, "hidden", hidden.index_select(1, new_order))

    def max_positions(self):
        return self.max_target_positions


@register_model(ARCH, dataclass=ToyGRUVAEConfig)
class ToyGRUVAE(SentenceVAEModel):
    """TEST DOUBLE sentence VAE (see the module doc)."""

    def __init__(self, encoder, decoder, latent_sizes):
        super().__init__(encoder, decoder, latent_sizes)

    @classmethod
    def build_model(cls, cfg, task):
        latent_sizes = parse_latents(cfg.toy_latents)
        dictionary = task.source_dictionary
        return cls(ToyGRUEncoder(cfg, dictionary, latent_sizes), ToyGRUDecoder(cfg, dictionary, latent_sizes),
                   latent_sizes)

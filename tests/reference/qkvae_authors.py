"""Reference numbers of the authors' QKVAE for ``tests/unit/user_dir/test_qkvae_authors_reading.py``.

Runs the case of ``tests/reference/qkvae_authors_case.py`` through the authors' own modules
(ghazi-f/QKVAE, ``components/links.py``: two ``CoattentiveBARTTransformerLink`` sharing one
truncated BART for q(z_syn|x) and q(z_sem|x), ``QKVBartTransformerLink`` for p(x|z_syn, z_sem);
``components/latent_variables.py``: ``Categorical.rep`` with word dropout for the decoder
inputs), built on a tiny random BART written to a temporary directory, with our parameters
copied into theirs, and prints the dictionaries the tests hold as ``AUTHORS_REFERENCE`` (their modules,
the project's objective) and ``AUTHORS_CRITERION_REFERENCE`` (their modules in training mode with a
fixed word-dropout draw, scored by their own ``components/criteria.py`` ``ELBo`` at several updates). Their code
needs its pinned ``transformers==4.6.1`` (with ``huggingface_hub==0.0.8``), installed apart from
the project's environment; nothing of either is in this repository::

    pip download transformers==4.6.1 --no-deps -d /tmp/whl
    pip install --no-deps --target /tmp/tf461 /tmp/whl/transformers-4.6.1-py3-none-any.whl huggingface_hub==0.0.8
    # transformers 4.6.1 refuses the installed tokenizers at import; the BART modules do not use it:
    sed -i 's/^        require_version_core(deps\\[pkg\\])/        pass/' \\
        /tmp/tf461/transformers/dependency_versions_check.py
    .venv/bin/python -m tests.reference.qkvae_authors --authors-dir /path/to/QKVAE --transformers-dir /tmp/tf461

(commit ed4f292 of ghazi-f/QKVAE.) Weights travel ours -> theirs; their gradients are mapped back
to our layout before the dot products of ``qkvae_authors_case.summary``.
"""

import argparse
import pprint
import sys
import tempfile

import torch

from tests.reference.qkvae_authors_case import (
    AUTHORS_RECIPE, CRITERION_STEPS, EMBED, GREEDY_LENGTH, PADDED_SENTENCES, SENTENCES, FFN, HEADS, LAYERS, SLOT_DIM, SLOTS, SYN_DIM, WORD_DROPOUT,
    authors_objective, build_model, criterion_summary, dictionary, greedy_latents, inputs, probes, summary, word_dropout_keep,
)

LAYER_PARTS = ("self_attn.k_proj", "self_attn.v_proj", "self_attn.q_proj", "self_attn.out_proj",
               "self_attn_layer_norm", "fc1", "fc2", "final_layer_norm")


def tiny_bart(directory: str, d):
    from transformers import BartConfig, BartModel

    config = BartConfig(vocab_size=len(d), d_model=EMBED, encoder_layers=LAYERS, decoder_layers=LAYERS,
                        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS, encoder_ffn_dim=FFN,
                        decoder_ffn_dim=FFN, max_position_embeddings=32, pad_token_id=d.pad(),
                        bos_token_id=d.bos(), eos_token_id=d.eos(), decoder_start_token_id=d.eos(),
                        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0)
    BartModel(config).save_pretrained(directory)


def authors_modules(d, bart_dir: str):
    import components.links as links
    from components.latent_variables import Categorical, Gaussian

    links.BART_LINK, links.LOCAL_ONLY = bart_dir, True
    word_embeddings = torch.nn.Embedding(len(d), EMBED)
    # get_qkv_graphBART: x_to_zst (1 target) and z_posterior (4 targets) share one BART
    x_to_zst = links.CoattentiveBARTTransformerLink(EMBED, EMBED, SYN_DIM, LAYERS, Gaussian.parameter_activations,
                                                    n_targets=1)
    z_posterior = links.CoattentiveBARTTransformerLink(EMBED, EMBED, SLOTS * SLOT_DIM, LAYERS,
                                                       Gaussian.parameter_activations, n_targets=SLOTS)
    z_posterior.transformer = x_to_zst.transformer
    decoder = links.QKVBartTransformerLink(
        SLOTS * SLOT_DIM, EMBED, len(d), LAYERS, Categorical.parameter_activations, word_embeddings,
        n_mems=SLOTS, memory=["z1"], targets=["x_prev"], key=["zs"], nheads=4, mem_size=SLOT_DIM, n_keys=SLOTS,
        z_ids=True, layer_wise=True)
    x_prev = Categorical(len(d), "x_prev", torch.device("cpu"), word_embeddings, d.pad(), markovian=True,
                         is_placeholder=True, word_dropout=WORD_DROPOUT)
    modules = {"x_to_zst": x_to_zst, "z_posterior": z_posterior, "decoder": decoder, "x_prev": x_prev,
               "word_embeddings": word_embeddings}
    for module in modules.values():
        module.double().eval()
    return modules


def parameter_map(theirs):
    """{our name: (their parameter, to_theirs(ours), to_ours(theirs))} for every parameter of ours."""
    enc_bart = theirs["x_to_zst"].transformer
    dec = theirs["decoder"]
    same = (lambda t: t, lambda t: t)
    mapping = {"encoder.sentence_encoder.embed_tokens.weight": (theirs["word_embeddings"].weight, *same)}

    def layer(ours_prefix, their_layer, parts):
        for part in parts:
            for kind in ("weight", "bias"):
                mapping[f"{ours_prefix}.{part}.{kind}"] = (their_layer.get_parameter(f"{part}.{kind}"), *same)

    mapping["encoder.sentence_encoder.embed_positions.weight"] = (enc_bart.encoder.embed_positions.weight, *same)
    for kind in ("weight", "bias"):
        mapping[f"encoder.sentence_encoder.layernorm_embedding.{kind}"] = (
            getattr(enc_bart.encoder.layernorm_embedding, kind), *same)
        mapping[f"encoder.query_layernorm.{kind}"] = (getattr(enc_bart.decoder.layernorm_embedding, kind), *same)
        mapping[f"decoder.layernorm_embedding.{kind}"] = (getattr(dec.transformer_dec.layernorm_embedding, kind),
                                                          *same)
    cross = ("encoder_attn.k_proj", "encoder_attn.v_proj", "encoder_attn.q_proj", "encoder_attn.out_proj",
             "encoder_attn_layer_norm")
    for i in range(LAYERS):
        layer(f"encoder.sentence_encoder.layers.{i}", enc_bart.encoder.layers[i], LAYER_PARTS)
        layer(f"encoder.query_layers.{i}", enc_bart.decoder.layers[i], LAYER_PARTS + cross)
        layer(f"decoder.layers.{i}", dec.transformer_dec.layers[i],
              LAYER_PARTS + ("encoder_attn.q_proj", "encoder_attn.out_proj", "encoder_attn_layer_norm"))
    rows = SLOTS + 2  # fairseq's learned table: padding_idx + 1 offset rows, as BART's 2
    query_positions = enc_bart.decoder.embed_positions.weight
    mapping["encoder.query_positions.weight"] = (
        query_positions, lambda t: torch.cat([t, query_positions.detach()[rows:]]), lambda t: t[:rows])
    mapping["decoder.embed_positions.weight"] = (dec.transformer_dec.embed_positions.weight, *same)
    targets_syn, targets_sem = theirs["x_to_zst"].target, theirs["z_posterior"].target
    mapping["encoder.latent_queries"] = (None, None, None)  # split over the two links, below
    for name, link in (("z_syn", theirs["x_to_zst"]), ("z_sem", theirs["z_posterior"])):
        for kind in ("weight", "bias"):
            mapping[f"encoder.input_projections.{name}.{kind}"] = (getattr(link.input_to_hidden, kind), *same)
            mapping[f"encoder.mean_heads.{name}.{kind}"] = (getattr(link.hidden_to_z_params["loc"], kind), *same)
            mapping[f"encoder.sigma_heads.{name}.{kind}"] = (getattr(link.hidden_to_z_params["scale"], kind),
                                                             *same)
    # keys: ours [layer, slot, C] rows, theirs [slot, layer, C]
    def keys_to_theirs(t):
        return t.view(LAYERS, SLOTS, EMBED, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    def keys_to_ours(t):
        return t.view(SLOTS, LAYERS, EMBED, *t.shape[1:]).transpose(0, 1).reshape(t.shape)

    for kind in ("weight", "bias"):
        mapping[f"decoder.key_mlp.0.{kind}"] = (getattr(dec.key_to_hidden[0], kind), *same)
        mapping[f"decoder.key_mlp.2.{kind}"] = (getattr(dec.key_to_hidden[2], kind), keys_to_theirs, keys_to_ours)
        mapping[f"decoder.output_hidden.{kind}"] = (getattr(dec.hidden_to_z_params["logits"], kind), *same)
    mapping["decoder.slot_ids"] = (dec.mem_ids, *same)
    # values: ours read Cat(d; z), theirs Cat(z; d)
    mapping["decoder.value_proj.weight"] = (
        dec.memory_to_hidden.weight, lambda t: torch.cat([t[:, SLOT_DIM:], t[:, :SLOT_DIM]], 1),
        lambda t: torch.cat([t[:, SLOT_DIM:], t[:, :SLOT_DIM]], 1))
    mapping["decoder.value_proj.bias"] = (dec.memory_to_hidden.bias, *same)
    return mapping, targets_syn, targets_sem


def load_theirs(d, bart_dir: str):
    """Their modules with our parameters copied in: (ours, theirs, mapping, query targets)."""
    ours = build_model(d)
    theirs = authors_modules(d, bart_dir)
    mapping, targets_syn, targets_sem = parameter_map(theirs)
    our_params = dict(ours.named_parameters())
    missing = set(our_params) - set(mapping)
    if missing:
        raise RuntimeError(f"no counterpart for {sorted(missing)}")
    with torch.no_grad():
        for name, (param, to_theirs, _) in mapping.items():
            if param is not None:
                param.copy_(to_theirs(our_params[name].detach()))
        targets_syn.copy_(our_params["encoder.latent_queries"][:1])
        targets_sem.copy_(our_params["encoder.latent_queries"][1:])
    return ours, theirs, mapping, (targets_syn, targets_sem)


def their_gradients(ours, mapping, targets):
    gradients = {}
    probe = probes(ours)
    for name in probe:
        if name == "encoder.latent_queries":
            gradients[name] = torch.cat([targets[0].grad, targets[1].grad])
        else:
            param, _, to_ours = mapping[name]
            gradients[name] = to_ours(param.grad)
    return gradients, probe


def their_forward(theirs, data):
    """Their posteriors and the decoder's logits on the case's tokens with its noise: (means, sigmas,
    logits [B, T, V]). Their links take {variable name: [B, T, E]} and return parameters expanded over T."""
    embedded = theirs["word_embeddings"](data["src"])
    syn = theirs["x_to_zst"]({"x": embedded})
    sem = theirs["z_posterior"]({"x": embedded})
    means = {"z_syn": syn["loc"][:, 0], "z_sem": sem["loc"][:, 0]}
    sigmas = {"z_syn": syn["scale"][:, 0], "z_sem": sem["scale"][:, 0]}
    z = {name: means[name] + sigmas[name] * data["eps"][name] for name in means}
    steps = data["prev"].size(1)
    x_prev = theirs["x_prev"].rep(data["prev"], step_wise=False)
    decoded = theirs["decoder"]({"z1": z["z_sem"].unsqueeze(1).expand(-1, steps, -1),
                                 "zs": z["z_syn"].unsqueeze(1).expand(-1, steps, -1), "x_prev": x_prev})
    return means, sigmas, decoded["logits"]


def run_authors(d, bart_dir: str, sentences=SENTENCES, attention_mask: bool = False):
    """``attention_mask``: hand their BART the padding mask their links never pass (a padded batch)."""
    ours, theirs, mapping, targets = load_theirs(d, bart_dir)
    data = inputs(d, sentences)
    if attention_mask:
        bart, mask = theirs["x_to_zst"].transformer, data["src"].ne(d.pad()).long()
        forward = bart.forward
        bart.forward = lambda *args, **kwargs: forward(*args, attention_mask=mask, **kwargs)
    means, sigmas, logits = their_forward(theirs, data)  # word dropout: x 0.6 in evaluation
    lprobs = torch.log_softmax(logits, dim=-1)
    log_px = lprobs.gather(-1, data["target"].unsqueeze(-1)).squeeze(-1)
    log_px = log_px.masked_fill(data["target"].eq(d.pad()), 0.0).sum(-1)
    objective = authors_objective(log_px, means, sigmas)
    objective["loss"].backward()
    gradients, probe = their_gradients(ours, mapping, targets)
    return summary(means, sigmas, log_px, objective, gradients, probe)


class FixedWordDropout(torch.nn.Module):
    """Stands in for their ``Categorical.w_drp`` (an ``nn.Dropout`` applied to a ones tensor, then
    multiplied by 1 - p): returns the case's keep mask / (1 - p)."""

    def __init__(self, keep: torch.Tensor, p: float):
        super().__init__()
        self.keep, self.p = keep, p

    def forward(self, ones):
        return self.keep.to(ones.dtype) / (1.0 - self.p)


def their_elbo(d, logits, target, means, sigmas, step: int):
    """Their ``components/criteria.py`` ``ELBo.get_loss()`` with qkv_train.py's settings (VAE losses,
    max_elbo_choice 6, linear annealing 3000-6000 x kl_beta 0.6, zs 7000-20000 x kl_beta_zs 0.3,
    kl_th 0.01), on their latent-variable objects holding the posteriors (expanded over the target
    positions, as their links return them) and standard-normal priors, as their Bayesian networks
    leave them after a forward pass."""
    from types import SimpleNamespace

    from components.criteria import ELBo
    from components.latent_variables import Categorical, Gaussian

    cpu = torch.device("cpu")
    h_params = SimpleNamespace(
        is_weighted=[], kl_th=AUTHORS_RECIPE["kl_threshold"], anneal_kl=[3000, 6000], anneal_kl_type="linear",
        kl_beta=0.6, max_elbo=[6, 6.0], zs_anneal_kl=[7000, 20000], zg_anneal_kl=[7000, 10000], kl_beta_zs=0.3,
        kl_beta_zg=0.1, n_latents=[SLOTS], device=cpu)
    steps = target.size(1)
    names = {"z1": "z_sem", "zs": "z_syn"}  # their latent names -> ours
    infer, gen = {}, {}
    for theirs, ours in names.items():
        size = means[ours].size(-1)
        infer[theirs] = Gaussian(size, theirs, cpu, sequence_lv=True)
        infer[theirs].post_params = {"loc": means[ours].unsqueeze(1).expand(-1, steps, -1),
                                     "scale": sigmas[ours].unsqueeze(1).expand(-1, steps, -1)}
        gen[theirs] = Gaussian(size, theirs, cpu, sequence_lv=True)
        gen[theirs].post_params = {"loc": torch.zeros_like(infer[theirs].post_params["loc"]),
                                   "scale": torch.ones_like(infer[theirs].post_params["scale"])}
    embedding = torch.nn.Embedding(len(d), EMBED)
    x = Categorical(len(d), "x", cpu, embedding, d.pad())
    x.post_params = {"logits": logits}
    x_prev = Categorical(len(d), "x_prev", cpu, embedding, d.pad(), is_placeholder=True)
    infer_bn = SimpleNamespace(variables=list(infer.values()), parent={}, variables_star={})
    gen_bn = SimpleNamespace(variables=[*gen.values(), x, x_prev], variables_star={x: target},
                             parent={x: [*gen.values(), x_prev]}, log_proba={})
    model = SimpleNamespace(h_params=h_params, infer_bn=infer_bn, gen_bn=gen_bn, generated_v=x, step=step)
    return ELBo(model, 1).get_loss()


def run_authors_greedy(d, bart_dir: str):
    """Their greedy decoding (``generate_from_z2`` with beam 1, ``only_z_sampling``, ``mask_unk``): at every
    step the whole prefix re-decoded, the argmax of the last position's logits times the unk mask,
    ``gen_len`` steps from <s> (their loop does not stop at </s>)."""
    _, theirs, _, _ = load_theirs(d, bart_dir)
    latents = greedy_latents(d)
    rows = latents["z_syn"].size(0)
    x_prev = torch.full((rows, 1), d.bos(), dtype=torch.long)
    scores = []
    with torch.no_grad():
        for i in range(GREEDY_LENGTH):
            rep = theirs["x_prev"].rep(x_prev, step_wise=False)
            decoded = theirs["decoder"]({"z1": latents["z_sem"].unsqueeze(1).expand(-1, i + 1, -1),
                                         "zs": latents["z_syn"].unsqueeze(1).expand(-1, i + 1, -1), "x_prev": rep})
            logits = decoded["logits"][:, -1]
            unk_mask = torch.ones_like(logits)
            unk_mask[:, d.unk()] = 0
            best = torch.argmax(logits * unk_mask, dim=-1)
            scores.append(torch.log_softmax(logits, dim=-1).gather(-1, best[:, None])[:, 0])
            x_prev = torch.cat([x_prev, best[:, None]], dim=-1)
    scores = torch.stack(scores, 1)
    return [{"tokens": x_prev[row, 1:].tolist(), "scores": scores[row].tolist()} for row in range(rows)]


def run_authors_criterion(d, bart_dir: str):
    """Their ELBo at every update of ``CRITERION_STEPS``, in training mode, with the case's word dropout."""
    results = {}
    for step in CRITERION_STEPS:
        ours, theirs, mapping, targets = load_theirs(d, bart_dir)
        for module in theirs.values():
            module.train()
        theirs["x_prev"].w_drp = FixedWordDropout(word_dropout_keep(d), WORD_DROPOUT)
        data = inputs(d)
        means, sigmas, logits = their_forward(theirs, data)
        loss = their_elbo(d, logits, data["target"], means, sigmas, step)
        loss.backward()
        gradients, probe = their_gradients(ours, mapping, targets)
        results[step] = criterion_summary(loss, gradients, probe)
    return results


def use_their_stack(authors_dir: str, transformers_dir: str) -> None:
    """Import their ``components`` with transformers 4.6.1 (ours is loaded by ``user_dir`` first)."""
    for name in [n for n in sys.modules if n.split(".")[0] in ("transformers", "huggingface_hub", "tokenizers")]:
        del sys.modules[name]
    sys.path[:0] = [transformers_dir, authors_dir]
    import transformers

    if transformers.__version__ != "4.6.1":
        raise SystemExit(f"--transformers-dir holds transformers {transformers.__version__}, not 4.6.1")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--authors-dir", required=True, help="a checkout of ghazi-f/QKVAE")
    parser.add_argument("--transformers-dir", required=True, help="a --target install of transformers 4.6.1")
    args = parser.parse_args(argv)
    use_their_stack(args.authors_dir, args.transformers_dir)
    d = dictionary()
    with tempfile.TemporaryDirectory() as bart_dir:
        torch.manual_seed(0)
        tiny_bart(bart_dir, d)
        reference = run_authors(d, bart_dir)
        criterion = run_authors_criterion(d, bart_dir)
        greedy = run_authors_greedy(d, bart_dir)
        padded = {"without_mask": run_authors(d, bart_dir, PADDED_SENTENCES),
                  "with_mask": run_authors(d, bart_dir, PADDED_SENTENCES, attention_mask=True)}
    pprint.pprint(reference, width=110, sort_dicts=False)
    print("AUTHORS_GREEDY_REFERENCE = ")
    pprint.pprint(greedy, width=110, sort_dicts=False)
    print("AUTHORS_PADDED_REFERENCE = ")
    pprint.pprint(padded, width=110, sort_dicts=False)
    print("AUTHORS_CRITERION_REFERENCE = ")
    pprint.pprint(criterion, width=110, sort_dicts=False)


if __name__ == "__main__":
    main()

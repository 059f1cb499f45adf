"""Reference numbers of the authors' Optimus for ``tests/unit/user_dir/test_optimus_authors_defaults.py``.

Runs the case of ``tests/reference/optimus_authors_case.py`` through the authors' own code
(ChunyuanLI/Optimus, ``code/examples/big_ae/modules/vae.py``: ``VAE.forward`` with
``fb_mode == 1``, i.e. pooled BERT feature -> ``encoder.linear`` -> mu, logvar, the KL hinge
``kl_mask = (loss_kl > dim_target_kl)`` and ``loss = loss_rec + beta * loss_kl`` per sentence,
then ``loss.mean()`` as ``run_lm_vae_pretraining_phdist_beta.py`` does; the encoder is
``BertForLatentConnector`` and the decoder ``GPT2ForLatentConnector`` of the bundled
``code/pytorch_transformers``, with the latent as GPT-2 memory and embedding), with our
parameters copied into theirs, and prints the dictionary the tests hold as ``AUTHORS_REFERENCE``.
Their code runs on the project's environment (Python 3.11, torch 2.x); nothing of it is in this
repository::

    mkdir -p /tmp/optref && git -C /work/.mirror/ChunyuanLI+Optimus/repo archive HEAD | tar -x -C /tmp/optref
    .venv/bin/python -m tests.reference.optimus_authors --authors-dir /tmp/optref

(commit f3190fe of ChunyuanLI/Optimus; /work/.mirror/ChunyuanLI+Optimus/repo is a bare mirror of it,
any checkout of that commit will do.) What is patched here, never in their files: stand-in
modules ``six``, ``boto3`` and ``botocore`` (imported by their tokenizers and download helpers,
unused here and absent from the environment), and ``VAE.reparameterize``, which uses the case's
fixed eps instead of ``normal_()`` (same arithmetic: mu + eps * exp(0.5 logvar)). Their tokenizers
are replaced by stand-ins that map ``</s>`` / ``<pad>`` to the fairseq indices.

Ids: their GPT-2 reads ``labels = <BOS> x <EOS>`` with ``<s>`` as ``<BOS>`` and ``</s>`` as ``<EOS>`` (our
decoder's ``prev = <s> x``, ``optimus_lm``'s ``--decoder-start bos``, and ``target = x </s>``), on the same
vocabulary. Their BERT treats id 0 as padding
(``attention_mask = (inputs > 0)``, ``padding_idx=0``) while fairseq's ``<s>`` (our [CLS]) is index
0 and ``<pad>`` index 1, so their BERT ids swap 0 and 1 and so do the rows of their word-embedding
table (weights ours -> theirs, gradients back); every other parameter is copied as is. Their
gradients are mapped back to our layout before the dot products of ``optimus_authors_case.summary``.
"""

import argparse
import pprint
import sys
import types

import torch

from tests.reference.optimus_authors_case import (
    BERT_FFN, BETA, GPT2_FFN, GREEDY_LENGTH, HEADS, HIDDEN, LATENT, LAYERS, POSITIONS, THRESHOLD, build_model,
    dictionary, greedy_latents, inputs, probes, summary,
)

BERT_WORDS = "encoder.bert.embeddings.word_embeddings.weight"


def use_their_code(authors_dir: str) -> None:
    """Put their ``pytorch_transformers`` and ``modules`` on the path (ours is loaded first),
    with stand-ins for the modules their unused tokenizer / download code imports."""
    import transformers  # noqa: F401  (the project's, imported before theirs is on the path)

    def stub(name, **attrs):
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__dict__.update(attrs)
            sys.modules[name] = module

    stub("six", PY2=False, PY3=True, string_types=(str,))
    stub("boto3")
    stub("botocore")
    stub("botocore.config", Config=object)
    stub("botocore.exceptions", ClientError=Exception)
    sys.path[:0] = [f"{authors_dir}/code", f"{authors_dir}/code/examples/big_ae"]


def swap_01(t: torch.Tensor) -> torch.Tensor:
    """Rows (or ids) 0 and 1 exchanged: fairseq's <s>/<pad> -> their BERT's non-padding/padding id."""
    order = torch.arange(t.size(0))
    order[0], order[1] = 1, 0
    return t[order]


def authors_model(d, eps: torch.Tensor):
    from modules.vae import VAE
    from pytorch_transformers.modeling_bert import BertConfig, BertForLatentConnector
    from pytorch_transformers.modeling_gpt2 import GPT2Config, GPT2ForLatentConnector

    bert_config = BertConfig(vocab_size_or_config_json_file=len(d), hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                             num_attention_heads=HEADS, intermediate_size=BERT_FFN, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0, max_position_embeddings=POSITIONS)
    encoder = BertForLatentConnector(bert_config, latent_size=LATENT)
    gpt2_config = GPT2Config(vocab_size_or_config_json_file=len(d), n_positions=POSITIONS, n_ctx=POSITIONS,
                             n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, resid_pdrop=0.0, embd_pdrop=0.0,
                             attn_pdrop=0.0)
    gpt2_config.latent_size = LATENT  # read by their GPT2Model for linear / linear_emb
    assert GPT2_FFN == 4 * gpt2_config.n_embd  # their MLP's inner size
    decoder = GPT2ForLatentConnector(gpt2_config, latent_size=LATENT, latent_as_gpt_emb=True,
                                     latent_as_gpt_memory=True)
    tokenizer = types.SimpleNamespace(eos_token=d.eos_word, pad_token=d.pad_word,
                                      convert_tokens_to_ids=lambda tokens: [d.index(t) for t in tokens])
    args = argparse.Namespace(latent_size=LATENT, device="cpu", fb_mode=1, dim_target_kl=THRESHOLD, beta=BETA,
                              length_weighted_loss=False)
    vae = VAE(encoder, decoder, tokenizer, tokenizer, args).double().eval()
    if vae.decoder.lm_head.weight is not vae.decoder.transformer.wte.weight:
        raise RuntimeError("their GPT-2 output layer is no longer tied to its embeddings")
    if (vae.eos_token_id, vae.pad_token_id) != (d.eos(), d.pad()):
        raise RuntimeError("the tokenizer stand-in gives the wrong ids")
    recorded = {}

    def reparameterize(self, mu, logvar, nsamples=1):  # their arithmetic, the case's eps
        recorded["mu"], recorded["logvar"] = mu, logvar
        std = logvar.mul(0.5).exp()
        return (mu + torch.mul(eps, std)).unsqueeze(1).expand(mu.size(0), nsamples, mu.size(1))

    vae.reparameterize = types.MethodType(reparameterize, vae)
    return vae, recorded


def parameter_map(vae):
    """{our name: (their parameter, to_theirs(ours), to_ours(theirs))} for every parameter of ours."""
    same = (lambda t: t, lambda t: t)
    mapping = {}
    for name, param in vae.encoder.named_parameters():
        ours = "encoder.posterior.weight" if name == "linear.weight" else f"encoder.bert.{name}"
        mapping[ours] = (param, swap_01, swap_01) if ours == BERT_WORDS else (param, *same)
    for name, param in vae.decoder.named_parameters():  # lm_head.weight is wte.weight (tied)
        ours = {"transformer.linear.weight": "decoder.memory_proj.weight",
                "transformer.linear_emb.weight": "decoder.embed_proj.weight"}.get(name, f"decoder.gpt2.{name}")
        mapping[ours] = (param, *same)
    return mapping


def load_theirs(d, eps):
    """Their VAE with our parameters copied in: (ours, vae, recorded, mapping)."""
    ours = build_model(d)
    vae, recorded = authors_model(d, eps)
    mapping = parameter_map(vae)
    our_params = dict(ours.named_parameters())
    if set(our_params) != set(mapping):
        raise RuntimeError(f"no counterpart for {sorted(set(our_params) ^ set(mapping))}")
    with torch.no_grad():
        for name, (param, to_theirs, _) in mapping.items():
            if param.shape != our_params[name].shape:
                raise RuntimeError(f"{name}: ours {tuple(our_params[name].shape)}, theirs {tuple(param.shape)}")
            param.copy_(to_theirs(our_params[name].detach()))
    return ours, vae, recorded, mapping


def run_authors(d):
    data = inputs(d)
    ours, vae, recorded, mapping = load_theirs(d, data["eps"])
    bos = torch.full((data["src"].size(0), 1), d.bos())
    bert_inputs = swap_01(torch.arange(len(d)))[torch.cat([bos, data["src"]], 1)]  # <s> x </s>, ids 0 <-> 1
    labels = torch.cat([bos, data["src"]], 1)  # <BOS> x <EOS>: <s> and </s>, as our --decoder-start bos
    if bool((bert_inputs == 0).any()) or bool((labels == d.pad()).any()):
        raise RuntimeError("the case must not contain padding")
    loss_rec, loss_kl, loss = vae(bert_inputs, labels)
    loss.mean().backward()  # run_lm_vae_pretraining_phdist_beta.py: loss = loss.mean()
    probe = probes(ours)
    gradients = {}
    for name in probe:
        param, _, to_ours = mapping[name]
        gradients[name] = to_ours(param.grad)
    return summary(recorded["mu"], recorded["logvar"], -loss_rec, loss_kl, loss.mean(), gradients, probe)


def run_authors_greedy(d):
    """Their ``text_from_latent_code`` / ``sample_sequence_conditional`` (run_latent_generation.py) with
    ``top_k=1``: the decoder re-run on the whole prefix with ``past = z`` at every step, the top-1 token
    kept (their multinomial over one token), until ``<EOS>`` or ``GREEDY_LENGTH`` tokens."""
    _, vae, _, _ = load_theirs(d, inputs(d)["eps"])
    out = []
    with torch.no_grad():
        for z in greedy_latents():
            generated = torch.full((1, 1), d.bos(), dtype=torch.long)
            scores = []
            for _ in range(GREEDY_LENGTH):
                logits = vae.decoder(input_ids=generated, past=z[None])[0][0, -1, :]
                best = int(torch.argmax(logits))
                scores.append(float(torch.log_softmax(logits, dim=-1)[best]))
                generated = torch.cat([generated, torch.tensor([[best]])], dim=1)
                if best == d.eos():
                    break
            out.append({"tokens": generated[0, 1:].tolist(), "scores": scores})
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--authors-dir", required=True, help="an extracted checkout of ChunyuanLI/Optimus")
    args = parser.parse_args(argv)
    use_their_code(args.authors_dir)
    reference = run_authors(dictionary())
    pprint.pprint(reference, width=110, sort_dicts=False)
    print("AUTHORS_GREEDY_REFERENCE = ")
    pprint.pprint(run_authors_greedy(dictionary()), width=110, sort_dicts=False)


if __name__ == "__main__":
    main()

"""Reference numbers of the authors' whole ESPnet SDMA-T recogniser for
``tests/unit/espnet_plugin/test_sdma_espnet_authors_model.py``.

Builds their ESPnet1 ``E2E`` (NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers,
``ASR/ESPNet/espnet/nets/pytorch_backend/e2e_asr_disentangled_transformer.py`` and its
``disentangled_transformer`` package, loaded from a checkout you point to, on the installed ESPnet) on the
case of ``tests/reference/sdma_espnet_model_case.py`` and writes
``tests/reference/sdma_espnet_model_reference.pt``: every parameter's gradient of each term alone (CTC,
attention cross-entropy, KL, diversity, L_Dqq, L_Dxq, as their ``E2E.forward`` forms them) and of
``E2E.forward``'s whole loss, the terms' values, and the decoder's log-probabilities step by step
(``forward_one_step`` with its cache). Nothing of their code is in this repository::

    .venv/bin/python -m tests.reference.sdma_espnet_model --authors-dir /path/to/Disentangled-Mask-Attention-in-Transformers

As for the fairseq model (``tests/reference/sdma_model.py``), the two constants of their ``mi_loss``
(``10 L_Dqq - L_Dxq``) are read from a table so that each term can be differentiated alone; their
``plot`` module and the model's reporter (chainer's) are replaced by stand-ins, unused here.
"""

import argparse
import importlib.util
import sys
import types
from pathlib import Path

import torch

from tests.reference.sdma_espnet_model_case import (
    CTC_WEIGHT, FEATURES, LSM_WEIGHT, NUM_UPDATES, PREFIX, TERMS, TOKENS, NoiseStream, authors_argv, authors_name,
    batch, gradient_reference, our_name, pack_gradients, weight,
)
from tests.reference.sdma_model import TERM_SCALES, load_separable

BACKEND = "ASR/ESPNet/espnet/nets/pytorch_backend"
PACKAGE = "espnet.nets.pytorch_backend.disentangled_transformer"


def load_authors(authors_dir: Path):
    root = authors_dir / BACKEND
    if not (root / "e2e_asr_disentangled_transformer.py").is_file():
        raise SystemExit(f"{root}: not found; --authors-dir must be a checkout of the authors' repository")
    import espnet.nets.pytorch_backend  # noqa: F401  (the installed ESPnet; their package joins it)

    package = types.ModuleType(PACKAGE)
    package.__path__ = [str(root / "disentangled_transformer")]
    sys.modules[PACKAGE] = package
    plot = types.ModuleType(PACKAGE + ".plot")
    plot.PlotAttentionReport = object  # theirs subclasses chainer's reporter, absent here
    sys.modules[plot.__name__] = plot
    attention = load_separable(root / "disentangled_transformer" / "attention.py", PACKAGE + ".attention")
    spec = importlib.util.spec_from_file_location("authors_e2e", root / "e2e_asr_disentangled_transformer.py")
    e2e = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(e2e)
    return e2e, attention.DisentangledMaskAttention


def build_authors_model(e2e):
    parser = argparse.ArgumentParser()
    e2e.E2E.add_arguments(parser)
    args = parser.parse_args(authors_argv())
    args.mtlalpha, args.lsm_weight, args.ctc_type = CTC_WEIGHT, LSM_WEIGHT, "builtin"
    args.report_cer = args.report_wer = False
    args.char_list, args.sym_space, args.sym_blank = None, "<space>", "<blank>"
    model = e2e.E2E(FEATURES, len(TOKENS), args).double()
    model.reporter = types.SimpleNamespace(report=lambda *values: None)  # chainer's, absent here
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith((".var", ".num_updates")):
                continue
            ours = our_name(name)
            assert authors_name(ours) == name, name
            parameter.copy_(weight(ours, tuple(parameter.shape)))
    return model


def set_num_updates(model, attention_class):
    """Their modules' counters (each ``forward`` adds one to them afterwards)."""
    for module in model.modules():
        if isinstance(module, attention_class):
            module.num_updates.data.fill_(NUM_UPDATES)


def use_noise(model, attention_class, stream: NoiseStream):
    for module in model.modules():
        if isinstance(module, attention_class):
            def reparameterize(x, log_var, module=module):
                if not module.training:
                    return x
                B, _, L, _ = x.shape
                return x + (log_var / 2.0).exp() * stream.draw(B, L).to(x.dtype)

            module.normal_reparameterizing = reparameterize


def module_term(model, attention_class, key):
    """Their E2E.forward's ``torch.cat(loss_x, dim=1).mean()`` over every SDMA module."""
    return torch.cat([m.outputs_dict[key] for m in model.modules() if isinstance(m, attention_class)], dim=1).mean()


def run_terms(e2e, attention_class):
    model = build_authors_model(e2e)
    data = batch()
    ys_pad = data["text"]
    values, gradients = {}, {}
    for term in TERMS + ("loss",):
        model.zero_grad(set_to_none=True)
        model.train()
        set_num_updates(model, attention_class)
        stream = NoiseStream()
        use_noise(model, attention_class, stream)
        TERM_SCALES.update(dqq=10.0, dxq=1.0)
        # the weights of E2E.forward: CTC alone, attention CE alone, or the whole Aishell-1 loss
        model.mtlalpha = {"ctc": 1.0, "att": 0.0}.get(term, CTC_WEIGHT)
        model.kl_weight, model.div_weight, model.mi_weight = (0.001, 1.0, 1.0) if term == "loss" else (0.0, 0.0, 0.0)
        if term in ("dqq", "dxq"):
            TERM_SCALES.update(dqq=float(term == "dqq"), dxq=float(term == "dxq"))
        loss = model(data["speech"], data["speech_lengths"], ys_pad)
        if term in ("ctc", "att", "loss"):
            value = loss
        elif term == "kl":
            value = module_term(model, attention_class, "loss_kl")
        elif term == "diversity":
            value = module_term(model, attention_class, "loss_div")
        else:  # their mi_loss with one constant kept: L_Dqq, or -L_Dxq
            value = module_term(model, attention_class, "loss_mi") * (1.0 if term == "dqq" else -1.0)
        value.backward()
        values[term] = value.item()
        gradients[term] = gradient_reference((our_name(n), p) for n, p in model.named_parameters()
                                       if not n.endswith((".var", ".num_updates")))
        noise_shapes = stream.shapes
    TERM_SCALES.update(dqq=10.0, dxq=1.0)
    return values, gradients, noise_shapes


def run_decoder_steps(e2e, attention_class):
    """Their decoder's ``forward_one_step`` (evaluation mode, cache carried) over :data:`PREFIX` on the
    first utterance's encoder output: the log-probabilities of every step."""
    from espnet.nets.pytorch_backend.transformer.mask import subsequent_mask

    model = build_authors_model(e2e).eval()
    set_num_updates(model, attention_class)
    data = batch()
    n = int(data["speech_lengths"][0])
    with torch.no_grad():
        memory, _ = model.encoder(data["speech"][:1, :n], None)
        cache, steps = None, []
        for i in range(1, len(PREFIX) + 1):
            ys = torch.tensor([PREFIX[:i]])
            logp, cache = model.decoder.forward_one_step(ys, subsequent_mask(i).unsqueeze(0), memory, cache=cache)
            steps.append(logp[0].tolist())
    return steps


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--authors-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("sdma_espnet_model_reference.pt"))
    args = parser.parse_args(argv)
    e2e, attention_class = load_authors(args.authors_dir)
    values, gradients, noise_shapes = run_terms(e2e, attention_class)
    steps = run_decoder_steps(e2e, attention_class)
    # their regularisers are float32 arithmetic: each term's gradients are stored as one float32 vector
    gradients = pack_gradients(gradients)
    reference = {"values": values, "gradients": gradients, "noise_shapes": noise_shapes, "decoder_steps": steps,
                 "command": "python -m tests.reference.sdma_espnet_model --authors-dir <checkout of "
                            "NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers @ ce68dee>"}
    torch.save(reference, args.out)
    print(f"{args.out}: values {values}; noise draws {len(noise_shapes)}")


if __name__ == "__main__":
    main()

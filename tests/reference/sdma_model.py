"""Reference numbers of the authors' whole SDMA-T model and criterion for
``tests/unit/user_dir/test_sdma_authors_model.py``.

Builds their fairseq ``DisentangledTransformerModel`` (NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers,
``MT/Fairseq/examples/translation/disentangled_transformer``, loaded from a checkout you point to, on the
installed fairseq) on the case of ``tests/reference/sdma_model_case.py`` and writes
``tests/reference/sdma_model_reference.pt``: every parameter's gradient of each loss term alone (their
label-smoothed cross-entropy, KL, diversity, L_Dqq and L_Dxq) and of their criterion's whole loss, the
terms' values, and a beam search with fairseq's ``SequenceGenerator``. Nothing of their code is in this
repository::

    .venv/bin/python -m tests.reference.sdma_model --authors-dir /path/to/Disentangled-Mask-Attention-in-Transformers

Their module adds L_Dqq and L_Dxq into one ``mi_loss`` (``10 L_Dqq - L_Dxq``); to differentiate each
alone, the two constants of that expression are read from a table (:data:`TERM_SCALES`) when their module
is loaded. With the table at their values (10, 1) the model computes what their file does: checked here
against their file as it is.
"""

import argparse
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path

import torch

from tests.reference.sdma_model_case import (
    BEAM, LABEL_SMOOTHING, MAX_LEN, NUM_UPDATES, TERMS, WORDS, NoiseStream, authors_argv, authors_name, batch,
    gradient_reference, our_name, pack_gradients, weight,
)

PLUGIN = "MT/Fairseq/examples/translation/disentangled_transformer"
PACKAGE = "authors_sdma"
# the two constants of their mi_loss (fairseq and ESPnet files alike), made settable: 10 L_Dqq - 1 L_Dxq
SEPARABLE = (
    (r"(mi_loss = -\(1 - mi_probs \+ 1e-6\)\.log\(\)\.mul\(mask\)\.mean\(\(1, 2, 3\)\)) \* 10",
     r"\1 * TERM_SCALES['dqq']"),
    (r"mi_loss = mi_loss -\s?\(F\.log_softmax\(", "mi_loss = mi_loss - TERM_SCALES['dxq'] * (F.log_softmax("),
)
TERM_SCALES = {"dqq": 10.0, "dxq": 1.0}


def load_separable(path: Path, module_name: str) -> types.ModuleType:
    """Their attention module at ``path`` with the constants of its ``mi_loss`` read from
    :data:`TERM_SCALES`, registered as ``module_name`` (before anything of theirs imports it)."""
    source = path.read_text()
    for pattern, replacement in SEPARABLE:
        source, count = re.subn(pattern, replacement, source)
        if count != 1:
            raise SystemExit(f"{path}: their mi_loss changed ({pattern!r} found {count} times)")
    module = types.ModuleType(module_name)
    module.__file__ = str(path)
    module.TERM_SCALES = TERM_SCALES
    exec(compile(source, str(path), "exec"), module.__dict__)
    sys.modules[module_name] = module
    return module


def load_authors(authors_dir: Path):
    """Their model and criterion modules. Their package ``__init__`` imports from a fairseq fork
    (``fairseq.disentangled_transformer``); the sub-packages are registered here without it."""
    root = authors_dir / PLUGIN
    if not root.is_dir():
        raise SystemExit(f"{root}: not found; --authors-dir must be a checkout of the authors' repository")
    for name in list(sys.modules):
        if name == PACKAGE or name.startswith(PACKAGE + "."):
            del sys.modules[name]
    for sub in ("", ".models", ".modules", ".criterions", ".utils"):
        package = types.ModuleType(PACKAGE + sub)
        package.__path__ = [str(root / sub.lstrip(".").replace(".", "/"))]
        sys.modules[PACKAGE + sub] = package
    load_separable(root / "modules" / "disentangled_attention.py", PACKAGE + ".modules.disentangled_attention")
    model = importlib.import_module(PACKAGE + ".models.disentangled_transformer")
    criterion = importlib.import_module(PACKAGE + ".criterions.disentangled_label_smoothed_cross_entropy")
    return model, criterion


def build_authors_model(model_module):
    from fairseq.data import Dictionary
    from fairseq.models import ARCH_CONFIG_REGISTRY

    dictionary = Dictionary()
    for word in WORDS:
        dictionary.add_symbol(word)

    class Task:  # what their build_model and criterion read of a translation task
        source_dictionary = target_dictionary = src_dict = tgt_dict = dictionary

    parser = argparse.ArgumentParser(argument_default=argparse.SUPPRESS)  # as fairseq's model group
    model_module.DisentangledTransformerModel.add_args(parser)
    args = parser.parse_args(authors_argv())
    args.max_source_positions = args.max_target_positions = 1024
    ARCH_CONFIG_REGISTRY["disentangled_transformer"](args)
    model = model_module.DisentangledTransformerModel.build_model(args, Task()).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.requires_grad:
                ours = our_name(name)
                assert authors_name(ours) == name, name
                parameter.copy_(weight(ours, tuple(parameter.shape)))
    model.set_num_updates(NUM_UPDATES)
    return model, Task()


def use_noise(model, attention_class, stream: NoiseStream):
    for module in model.modules():
        if isinstance(module, attention_class):
            def reparameterize(x, log_var, module=module):
                if not module.training:
                    return x
                B, _, L, _ = x.shape
                return x + (log_var / 2.0).exp() * stream.draw(B, L)

            module.normal_reparameterizing = reparameterize


def run_terms(model_module, criterion_module, attention_class):
    """Each term's gradient alone, their criterion's whole loss and its gradient."""
    model, task = build_authors_model(model_module)
    sample = batch(task.tgt_dict.pad(), task.tgt_dict.eos())
    criterion = criterion_module.LabelSmoothedCrossEntropyCriterion(task, False, LABEL_SMOOTHING)
    criterion.padding_idx = task.tgt_dict.pad()
    values, gradients = {}, {}
    for term in TERMS + ("loss",):
        model.zero_grad(set_to_none=True)
        model.train()
        stream = NoiseStream()
        use_noise(model, attention_class, stream)
        TERM_SCALES.update(dqq=10.0, dxq=1.0)
        if term == "loss":
            loss, sample_size, logging_output = criterion(model, sample)
            value = loss
        else:
            if term in ("dqq", "dxq"):
                TERM_SCALES.update(dqq=float(term == "dqq"), dxq=float(term == "dxq"))
            net_output = model(**sample["net_input"], regular_attn=False)
            if term == "ce":
                lprobs, target = criterion.get_lprobs_and_target(model, net_output, sample)
                value, _ = criterion_module.label_smoothed_nll_loss(
                    lprobs, target, LABEL_SMOOTHING, ignore_index=task.tgt_dict.pad())
            elif term == "kl":
                value = criterion_module.cluster_loss(net_output)
            elif term == "diversity":
                value = criterion_module.cluster_div_loss(net_output)
            else:  # their mi_loss with one constant kept: L_Dqq, or -L_Dxq
                value = criterion_module.mi_loss(net_output) * (1.0 if term == "dqq" else -1.0)
        value.backward()
        values[term] = value.item()
        gradients[term] = gradient_reference((our_name(n), p) for n, p in model.named_parameters())
        noise_shapes = stream.shapes
    TERM_SCALES.update(dqq=10.0, dxq=1.0)
    return values, gradients, noise_shapes


def check_separable_is_their_file(authors_dir: Path, model_module, criterion_module, attention_class,
                                  reference_loss: float) -> None:
    """Their criterion's loss with ``clustering`` (the one method :data:`SEPARABLE` edits) taken from
    their file as it is equals the loss of the loaded module."""
    path = authors_dir / PLUGIN / "modules" / "disentangled_attention.py"
    spec = importlib.util.spec_from_file_location(PACKAGE + "_unedited_attention", path)
    unedited = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(unedited)
    model, task = build_authors_model(model_module)
    use_noise(model, attention_class, NoiseStream())
    for module in model.modules():
        if isinstance(module, attention_class):
            module.clustering = types.MethodType(unedited.DisentangledAttention.clustering, module)
    criterion = criterion_module.LabelSmoothedCrossEntropyCriterion(task, False, LABEL_SMOOTHING)
    loss, _, _ = criterion(model.train(), batch(task.tgt_dict.pad(), task.tgt_dict.eos()))
    assert abs(loss.item() - reference_loss) <= 1e-12 * abs(reference_loss), (loss.item(), reference_loss)


def run_beam_search(model_module):
    """fairseq's beam search over their model in evaluation mode (no sampling noise)."""
    from fairseq.sequence_generator import SequenceGenerator

    model, task = build_authors_model(model_module)
    model.eval()
    sample = batch(task.tgt_dict.pad(), task.tgt_dict.eos())
    generator = SequenceGenerator([model], task.tgt_dict, beam_size=BEAM, max_len_a=0, max_len_b=MAX_LEN)
    with torch.no_grad():
        hypotheses = generator.generate([model], sample)
    return [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
              "positional_scores": h["positional_scores"].tolist()} for h in sentence] for sentence in hypotheses]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--authors-dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("sdma_model_reference.pt"))
    args = parser.parse_args(argv)
    model_module, criterion_module = load_authors(args.authors_dir)
    attention_class = sys.modules[PACKAGE + ".modules.disentangled_attention"].DisentangledAttention
    values, gradients, noise_shapes = run_terms(model_module, criterion_module, attention_class)
    beams = run_beam_search(model_module)
    check_separable_is_their_file(args.authors_dir, model_module, criterion_module, attention_class, values["loss"])
    # their regularisers are float32 arithmetic: each term's gradients are stored as one float32 vector
    gradients = pack_gradients(gradients)
    reference = {"values": values, "gradients": gradients, "noise_shapes": noise_shapes, "beam_search": beams,
                 "command": "python -m tests.reference.sdma_model --authors-dir <checkout of "
                            "NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers @ ce68dee>"}
    torch.save(reference, args.out)
    print(f"{args.out}: values {values}; noise draws {len(noise_shapes)}; "
          f"beams {[[h['tokens'] for h in s] for s in beams]}")


if __name__ == "__main__":
    main()

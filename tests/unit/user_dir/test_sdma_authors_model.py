"""The whole ``sdma_transformer`` (authors reading) and its criterion against the authors' whole model.

``tests/reference/sdma_model_reference.pt`` holds what the authors' fairseq ``DisentangledTransformerModel``
and ``disentangled_label_smoothed_cross_entropy`` compute on the case of ``tests/reference/sdma_model_case.py``
(2 + 2 layers, a padded batch, fixed weights and noise; written by ``tests/reference/sdma_model.py``):
every parameter's gradient of each loss term alone and of the whole loss, and a beam search. Here our
model, through ``sdma_label_smoothed_cross_entropy`` and fairseq's ``SequenceGenerator``, is held to them
element-wise. Their criterion casts the regularisers to float32, hence the tolerances.
"""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from fairseq import options, tasks
from fairseq.sequence_generator import SequenceGenerator

from tests.reference.sdma_model_case import (
    BEAM, EMBED, HEAD_DIM, HEADS, MAX_LEN, NUM_UPDATES, TERMS, NoiseStream, batch, gradient_reference,
    our_fairseq_argv, unpack_gradients, weight, write_dictionaries,
)
from user_dir.sdma.fairseq_attention import SDMAMultiheadAttention

REFERENCE = torch.load(Path(__file__).parents[2] / "reference" / "sdma_model_reference.pt", weights_only=True)
REFERENCE["gradients"] = unpack_gradients(REFERENCE["gradients"])
RTOL, ATOL = 2e-5, 2e-6  # relative to each parameter's largest gradient entry (see assert_gradients_match)


def build_ours(tmp_path):
    write_dictionaries(tmp_path)
    args = options.parse_args_and_arch(options.get_training_parser(), our_fairseq_argv(str(tmp_path)))
    task = tasks.setup_task(args)
    model = task.build_model(args).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(weight(name, tuple(parameter.shape)))
    model.set_num_updates(NUM_UPDATES)
    return model, task.build_criterion(args), task


def use_noise(model, stream: NoiseStream):
    """Every reparameterisation takes the stream's next draw, converted to our [T, B, E] layout."""
    for module in model.modules():
        if isinstance(module, SDMAMultiheadAttention):
            core = module.sdma

            def perturb(x, training, log_var=None, scale=1.0, core=core):
                if not training:
                    return x
                T, B, _ = x.shape
                eps = stream.draw(B, T).permute(2, 0, 1, 3).reshape(T, B, HEADS * HEAD_DIM)
                return x + math.sqrt(core.options.noise_var) / scale * eps

            core.perturb = perturb


def term_value(term, parts):
    terms = parts.terms
    return {"ce": lambda: parts.ce_loss, "kl": lambda: (terms["kl_z"] + terms["kl_q"]).sum(),
            "diversity": lambda: (terms["dv_z"] + terms["dv_q"]).sum(), "dqq": lambda: terms["dqq"].sum(),
            "dxq": lambda: terms["dxq"].sum()}[term]()


def run_ours(tmp_path, defect=None):
    """Our values, gradients and beam search on the case; ``defect(model, criterion)`` plants one first."""
    model, criterion, task = build_ours(tmp_path)
    if defect is not None:
        defect(model, criterion)
    sample = batch(task.target_dictionary.pad(), task.target_dictionary.eos())
    values, gradients, shapes = {}, {}, None
    for term in TERMS + ("loss",):
        model.zero_grad(set_to_none=True)
        model.train()
        stream = NoiseStream()
        use_noise(model, stream)
        if term == "loss":
            value, _, _ = criterion(model, sample)
        else:
            value = term_value(term, criterion.loss_parts(model, sample))
        value.backward()
        values[term] = value.item()
        gradients[term] = gradient_reference(model.named_parameters())
        shapes = stream.shapes
    model.eval()
    generator = SequenceGenerator([model], task.target_dictionary, beam_size=BEAM, max_len_a=0, max_len_b=MAX_LEN)
    with torch.no_grad():
        hypotheses = generator.generate([model], sample)
    beams = [[{"tokens": h["tokens"].tolist(), "score": float(h["score"]),
               "positional_scores": h["positional_scores"].tolist()} for h in sentence] for sentence in hypotheses]
    return {"values": values, "gradients": gradients, "noise_shapes": shapes, "beam_search": beams}


def assert_gradients_match(ours, theirs, term):
    assert set(ours) == set(theirs), set(ours) ^ set(theirs)
    for name, reference in theirs.items():
        scale = max(reference.abs().max().item(), 1e-8)
        torch.testing.assert_close(ours[name], reference, rtol=RTOL, atol=ATOL * scale,
                                   msg=lambda m: f"{term}: gradient of {name}: {m}")


def assert_matches(ours, theirs):
    assert ours["noise_shapes"] == theirs["noise_shapes"]  # same draws in the same order and shapes
    for term in TERMS + ("loss",):
        assert ours["values"][term] == pytest.approx(theirs["values"][term], rel=1e-6, abs=1e-6), term
        assert_gradients_match(ours["gradients"][term], theirs["gradients"][term], term)
    for our_sentence, their_sentence in zip(ours["beam_search"], theirs["beam_search"], strict=True):
        assert [h["tokens"] for h in our_sentence] == [h["tokens"] for h in their_sentence], "beam search: hypotheses"
        for our_hypothesis, their_hypothesis in zip(our_sentence, their_sentence):
            assert our_hypothesis["positional_scores"] == pytest.approx(
                their_hypothesis["positional_scores"], rel=1e-6, abs=1e-6), "beam search: token scores"
            assert our_hypothesis["score"] == pytest.approx(their_hypothesis["score"], rel=1e-6, abs=1e-6)


@pytest.fixture(scope="module")
def ours(tmp_path_factory):
    return run_ours(tmp_path_factory.mktemp("sdma_model"))


def test_every_gradient_of_every_term_and_the_beam_search_match_the_authors(ours):
    assert_matches(ours, REFERENCE)


def test_the_case_exercises_every_term_and_parameter():
    """Each regulariser reaches the mixtures of all three attention types, and every parameter gets a
    gradient from the whole loss (a reference of zeros would hold nothing)."""
    gradients = REFERENCE["gradients"]
    assert all(g.abs().max() > 0 for g in gradients["loss"].values())
    for term in ("kl", "diversity", "dqq", "dxq"):
        for group in ("encoder.layers.1.self_attn", "decoder.layers.1.self_attn", "decoder.layers.1.encoder_attn"):
            reached = [n for n, g in gradients[term].items() if n.startswith(group + ".sdma") and g.abs().max() > 0]
            assert reached, (term, group)
    assert gradients["ce"]["decoder.output_projection.weight"].abs().max() > 0
    assert gradients["kl"]["decoder.output_projection.weight"].abs().max() == 0


def sdma_cores(model, group=None):
    return [m.sdma for m in model.modules() if isinstance(m, SDMAMultiheadAttention)
            and (group is None or m.sdma.sdma_group == group)]


def centroid_gradient_scale_5(model, criterion):  # c_g: only the means' gradients change
    for core in sdma_cores(model):
        for gmm in (core.feature_gmm, core.query_gmm):
            gmm.centroid_grad_scale = 5.0


def annealing_one_update_late(model, criterion):  # g at update 999: a 4e-4 change of the mixing weight
    model.set_num_updates(NUM_UPDATES - 1)


def dxq_weight_negated(model, criterion):  # the sign of lambda_x in eq. (24): only the whole loss changes
    criterion.weight_overrides["sdma_dxq_weight"] *= -1


def label_smoothing_0_11(model, criterion):
    criterion.eps = 0.11


def cross_attention_unmasked_in_decoding(model, criterion):  # training unchanged; beam search differs
    for core in sdma_cores(model, "decoder_cross"):
        core.options = dataclasses.replace(core.options, mask_at_inference=False)


@pytest.mark.parametrize("defect", [centroid_gradient_scale_5, annealing_one_update_late, dxq_weight_negated,
                                    label_smoothing_0_11, cross_attention_unmasked_in_decoding])
def test_a_planted_defect_fails_the_comparison(tmp_path, defect):
    with pytest.raises(AssertionError):
        assert_matches(run_ours(tmp_path, defect), REFERENCE)

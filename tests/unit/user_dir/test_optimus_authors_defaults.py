"""``optimus`` with its defaults reproduces the authors' Optimus computation.

``AUTHORS_REFERENCE`` (``tests/reference/optimus_authors_reference.py``) holds what their code
(ChunyuanLI/Optimus: ``VAE.forward`` with ``fb_mode == 1`` over ``BertForLatentConnector`` and
``GPT2ForLatentConnector``, ``loss.mean()``) computed on the case of
``tests/reference/optimus_authors_case.py``: same weights, tokens and noise, float64, no dropout.
Ours: pooled [CLS] -> W_E, memory + embedding injection with key = value = h_Mem (the model's
defaults), the KL hinge of ``latent_core.vae.KLRegularizer`` and the loss averaged over sentences
(the ``sentence_vae`` criterion's defaults for this model). The two agree to float64 rounding
(<= 1e-13 relative); the tolerance is 1e-5.
"""

import argparse

import pytest
import torch

from latent_core.vae import DiagonalGaussian
from tests.reference.sentence_vae_case import ATOL, RTOL, close
from tests.reference.optimus_authors_case import (
    BETA, LATENT, THRESHOLD, build_model, dictionary, inputs, posterior_and_likelihood, run_ours, run_ours_greedy,
)
from tests.reference.optimus_authors_reference import AUTHORS_GREEDY_REFERENCE, AUTHORS_REFERENCE
from user_dir.sentence_vae.criterion import SentenceVAECriterion, SentenceVAECriterionConfig

@pytest.fixture(scope="module")
def d():
    return dictionary()


@pytest.fixture(scope="module")
def ours(d):
    return run_ours(build_model(d), d)


@pytest.mark.parametrize("key", ["mu", "logvar", "log_px_given_z", "kl_hinge", "loss"])
def test_reproduces_their_posterior_likelihood_hinge_and_loss(ours, key):
    assert close(ours[key], AUTHORS_REFERENCE[key]), key


def test_reproduces_their_gradients(ours):
    theirs = AUTHORS_REFERENCE["gradients"]
    assert set(ours["gradients"]) == set(theirs)
    for name in theirs:
        assert ours["gradients"][name] == pytest.approx(theirs[name], rel=RTOL, abs=ATOL), name


def test_the_case_exercises_both_sides_of_the_hinge():
    """Dimensions below and above lambda = 0.5, none so close that rounding could flip the mask."""
    mean = torch.tensor(AUTHORS_REFERENCE["mu"], dtype=torch.float64).view(-1, LATENT)
    logvar = torch.tensor(AUTHORS_REFERENCE["logvar"], dtype=torch.float64).view(-1, LATENT)
    kl = DiagonalGaussian(mean, logvar).kl_standard_normal()
    above = kl > THRESHOLD
    assert 0 < int(above.sum()) < kl.numel()
    assert float((kl - THRESHOLD).abs().min()) > 1e-2
    assert close((kl * above).sum(-1).tolist(), AUTHORS_REFERENCE["kl_hinge"])
    assert bool((kl.sum(-1) > torch.tensor(AUTHORS_REFERENCE["kl_hinge"]) + 0.1).all())


def test_free_bits_is_not_what_they_compute(d):
    """The paper's eq. 9 (max(lambda, KL_d)) on the same posteriors: the masked dimensions count
    lambda each instead of 0, and the comparison catches it."""
    free_bits = run_ours(build_model(d), d, variant="free_bits")
    assert close(free_bits["mu"], AUTHORS_REFERENCE["mu"])
    assert abs(free_bits["loss"] - AUTHORS_REFERENCE["loss"]) > 1e-3


def test_the_criterion_defaults_for_optimus_give_their_loss(d):
    """The ``sentence_vae`` criterion without --kl-variant and --sentence-avg takes the model's
    hinge and sentence average and returns their loss (z given as the case's sample; no dropout,
    so training mode, where the criterion decodes the given latents, is deterministic)."""
    model = build_model(d)
    assert model.default_kl_variant == "hinge" and model.sentence_average_loss
    cfg = SentenceVAECriterionConfig(beta_schedule=f"constant:{BETA}", kl_threshold=str(THRESHOLD),
                                     sentence_avg=False, max_update=0)
    assert cfg.kl_variant is None
    criterion = SentenceVAECriterion(argparse.Namespace(source_dictionary=d, target_dictionary=d), cfg)
    data = inputs(d)
    model.train()
    with torch.no_grad():
        _, _, z, _ = posterior_and_likelihood(model, data)
        sample = {"net_input": {"src_tokens": data["src"], "src_lengths": data["lengths"],
                                "prev_output_tokens": data["prev"], "latents": {"z": z}},
                  "target": data["target"], "ntokens": data["target"].numel()}
        loss, sample_size, log = criterion(model, sample)
    assert criterion.kl_variant == "hinge" and criterion.regularizers["z"].variant == "hinge"
    assert criterion.regularizers["z"].threshold == THRESHOLD
    assert sample_size == len(AUTHORS_REFERENCE["log_px_given_z"])  # sentences, not tokens
    assert float(loss) / sample_size == pytest.approx(AUTHORS_REFERENCE["loss"], rel=RTOL, abs=ATOL)
    assert float(log["kl_penalty_z"]) == pytest.approx(sum(AUTHORS_REFERENCE["kl_hinge"]), rel=RTOL, abs=ATOL)


def greedy_matches(ours, theirs) -> bool:
    return all(o["tokens"] == t["tokens"] and o["scores"] == pytest.approx(t["scores"], rel=RTOL, abs=ATOL)
               for o, t in zip(ours, theirs, strict=True))


def test_greedy_generation_from_fixed_latents_is_theirs():
    """Our incremental decoder (z as GPT-2 memory and embedding) under their top-1 rule equals their
    generation loop, which re-runs the whole prefix with past = z: tokens and scores."""
    d = dictionary()
    assert greedy_matches(run_ours_greedy(build_model(d), d), AUTHORS_GREEDY_REFERENCE)


def test_greedy_comparison_fails_without_the_latent_embedding():
    """Planted defect: z not added to the token embeddings (their latent_as_gpt_emb) while decoding."""
    d = dictionary()
    model = build_model(d)
    with torch.no_grad():
        model.decoder.embed_proj.weight.zero_()
    assert not greedy_matches(run_ours_greedy(model, d), AUTHORS_GREEDY_REFERENCE)

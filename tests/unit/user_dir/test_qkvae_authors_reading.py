"""``--qkvae-reading authors`` reproduces the authors' QKVAE computation.

``AUTHORS_REFERENCE`` (``tests/reference/qkvae_authors_reference.py``) holds what their modules
(ghazi-f/QKVAE on transformers 4.6.1) computed on the case of
``tests/reference/qkvae_authors_case.py``: same weights, tokens and noise, float64, evaluation mode.
The remaining differences are their EPSILON = 1e-8 added to the posterior means and to the
features before the output embedding (relative effect <= 1e-6).
"""

import pytest
import torch

from tests.reference.sentence_vae_case import ATOL, RTOL, close
from tests.reference.qkvae_authors_case import (
    AUTHORS_RECIPE, CRITERION_STEPS, PADDED_SENTENCES, build_model, dictionary, run_ours, run_ours_criterion, run_ours_greedy,
)
from tests.reference.qkvae_authors_reference import (
    AUTHORS_CRITERION_REFERENCE, AUTHORS_GREEDY_REFERENCE, AUTHORS_PADDED_REFERENCE, AUTHORS_REFERENCE,
)

@pytest.fixture(scope="module")
def results():
    d = dictionary()
    return {reading: run_ours(build_model(d, reading), d) for reading in ("authors", "paper")}


@pytest.mark.parametrize("key", ["mu_z_syn", "mu_z_sem", "sigma_z_syn", "sigma_z_sem", "log_px_given_z",
                                 "kl_z_syn", "kl_z_sem", "loss"])
def test_authors_reading_reproduces_their_posteriors_likelihood_and_loss(results, key):
    assert close(results["authors"][key], AUTHORS_REFERENCE[key]), key


def test_authors_reading_reproduces_their_gradients(results):
    ours, theirs = results["authors"]["gradients"], AUTHORS_REFERENCE["gradients"]
    assert set(ours) == set(theirs)
    for name in theirs:
        assert ours[name] == pytest.approx(theirs[name], rel=RTOL, abs=ATOL), name


def test_paper_reading_is_a_different_computation(results):
    """The same weights through the paper's encoder (one unmasked pass, no input projections or
    query positions) and decoder (no output Linear, no 0.6 scaling) give other posteriors."""
    paper = results["paper"]
    mu = torch.tensor(paper["mu_z_sem"]) - torch.tensor(AUTHORS_REFERENCE["mu_z_sem"])
    assert mu.abs().max() > 0.1
    assert abs(paper["loss"] - AUTHORS_REFERENCE["loss"]) > 0.1


@pytest.mark.parametrize("step", CRITERION_STEPS)
def test_our_criterion_with_the_authors_recipe_is_their_elbo(step):
    """Their ``components/criteria.py`` ELBo (AE phase, annealing, free bits 0.01, one beta per latent)
    against our ``sentence_vae`` criterion with examples/sentence_vae/train_qkvae_authors.sh's options,
    in training mode with the same word dropout."""
    d = dictionary()
    ours, theirs = run_ours_criterion(build_model(d), d, step), AUTHORS_CRITERION_REFERENCE[step]
    assert ours["loss"] == pytest.approx(theirs["loss"], rel=RTOL, abs=ATOL)
    for name, value in theirs["gradients"].items():
        assert ours["gradients"][name] == pytest.approx(value, rel=RTOL, abs=ATOL), name


@pytest.mark.parametrize("defect", [
    {"kl_threshold": 0.05},  # the project's default lambda instead of their 0.01
    {"beta_schedule": "z_sem=linear:3000:7000:0.6,z_syn=linear:7000:20000:0.3"},  # z_sem's ramp 1,000 updates long
    {"beta_schedule": "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.6"},  # z_syn's beta of z_sem
])
def test_a_planted_recipe_defect_fails_the_criterion_comparison(defect):
    d = dictionary()
    failures = 0
    for step in CRITERION_STEPS:
        ours = run_ours_criterion(build_model(d), d, step, {**AUTHORS_RECIPE, **defect})
        failures += ours["loss"] != pytest.approx(AUTHORS_CRITERION_REFERENCE[step]["loss"], rel=RTOL, abs=ATOL)
    assert failures > 0


POSTERIOR_KEYS = ("mu_z_syn", "mu_z_sem", "sigma_z_syn", "sigma_z_sem")


def rows(values, width):
    return torch.tensor(values, dtype=torch.float64).view(-1, width) if width else torch.tensor(values)


def test_padded_batch_equals_theirs_with_the_padding_mask_they_omit():
    """On a padded batch ours equals their modules once their BART gets the padding mask (posteriors,
    log p(x|z), loss and gradients)."""
    d = dictionary()
    ours, theirs = run_ours(build_model(d), d, PADDED_SENTENCES), AUTHORS_PADDED_REFERENCE["with_mask"]
    for key in POSTERIOR_KEYS + ("log_px_given_z", "kl_z_syn", "kl_z_sem", "loss"):
        assert close(ours[key], theirs[key]), key
    for name, value in theirs["gradients"].items():
        assert ours["gradients"][name] == pytest.approx(value, rel=RTOL, abs=ATOL), name


def test_padded_batch_without_their_mask_differs_only_in_padded_sentences():
    """Their code as it runs lets real tokens attend to padding: the longest (unpadded) sentence is
    unchanged, the padded ones move (the deliberate difference of the authors reading)."""
    d = dictionary()
    ours, theirs = run_ours(build_model(d), d, PADDED_SENTENCES), AUTHORS_PADDED_REFERENCE["without_mask"]
    width = len(ours["mu_z_sem"]) // len(PADDED_SENTENCES)
    for key in POSTERIOR_KEYS:
        ours_rows, their_rows = rows(ours[key], width), rows(theirs[key], width)
        assert torch.allclose(ours_rows[0], their_rows[0], rtol=RTOL, atol=ATOL), key
    difference = (torch.tensor(ours["log_px_given_z"]) - torch.tensor(theirs["log_px_given_z"])).abs()
    assert difference[0] < ATOL and (difference[1:] > 0.1).all()


def greedy_matches(ours, theirs) -> bool:
    return all(o["tokens"] == t["tokens"] and o["scores"] == pytest.approx(t["scores"], rel=RTOL, abs=ATOL)
               for o, t in zip(ours, theirs, strict=True))


def test_greedy_generation_from_fixed_latents_is_theirs():
    """Our incremental decoder under their greedy rule equals their full re-decoding, token and score."""
    d = dictionary()
    assert greedy_matches(run_ours_greedy(build_model(d), d), AUTHORS_GREEDY_REFERENCE)


def test_greedy_comparison_fails_without_the_evaluation_word_dropout_scale():
    """Planted defect: decoder inputs not scaled by 1 - p at inference (their Categorical.rep does)."""
    d = dictionary()
    model = build_model(d)
    model.decoder.token_embedding_scale = lambda tokens, like: None
    assert not greedy_matches(run_ours_greedy(model, d), AUTHORS_GREEDY_REFERENCE)

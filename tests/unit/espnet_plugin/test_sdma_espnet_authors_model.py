"""The whole ESPnet2 ``model: sdma`` (authors reading) against the authors' ESPnet1 recogniser.

``tests/reference/sdma_espnet_model_reference.pt`` holds what their ``E2E`` (``e2e_asr_disentangled_transformer.py``
with their Aishell-1 settings) computes on the case of ``tests/reference/sdma_espnet_model_case.py`` (conv2d
subsampling, 2 + 2 blocks, a padded batch, fixed weights and noise; written by
``tests/reference/sdma_espnet_model.py``): every parameter's gradient of CTC, attention cross-entropy, KL,
diversity, L_Dqq and L_Dxq alone and of their whole loss, and the decoder's step-by-step log-probabilities.
Here our model (its ``forward`` for the whole loss; ESPnet's CTC/attention loss and the recorded regularisers
for the terms) and our decoder's ``forward_one_step`` are held to them element-wise. Their clustering runs in
float32 (``x.float()``), hence the tolerances.
"""

import math
from pathlib import Path

import pytest
import torch

pytest.importorskip("espnet2")

import espnet_plugin  # noqa: E402,F401  (registers the classes)
from espnet.nets.pytorch_backend.transformer.mask import subsequent_mask  # noqa: E402
from espnet2.asr.espnet_model import ESPnetASRModel  # noqa: E402
from espnet_plugin.tasks.sdma_asr import SDMAASRTask  # noqa: E402
from latent_core.sdma import SDMACore, collect_sdma_losses, recording  # noqa: E402
from tests.reference.sdma_espnet_model_case import (  # noqa: E402
    CTC_WEIGHT, NUM_UPDATES, PREFIX, TERMS, NoiseStream, batch, gradient_reference, our_args, unpack_gradients, weight,
)

REFERENCE = torch.load(Path(__file__).parents[2] / "reference" / "sdma_espnet_model_reference.pt", weights_only=True)
REFERENCE["gradients"] = unpack_gradients(REFERENCE["gradients"])
RTOL, ATOL = 5e-5, 2e-5  # ATOL relative to each parameter's largest gradient entry


def build_ours():
    model = SDMAASRTask.build_model(our_args()).double()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.copy_(weight(name, tuple(parameter.shape)))
    return model


def use_noise(model, stream: NoiseStream):
    """Every reparameterisation takes the stream's next draw ([B, H, L, d_k]), in ESPnet's [B, T, E] layout
    scaled by the utterance's predicted standard deviation per head."""
    for core in (m for m in model.modules() if isinstance(m, SDMACore)):
        def perturb(x, training, log_var=None):
            if not training:
                return x
            B, T, _ = x.shape
            eps = stream.draw(B, T).permute(0, 2, 1, 3)  # [B, T, H, d_k]
            return x + (eps * torch.exp(0.5 * log_var)[..., None]).reshape(x.shape)

        core.perturb = perturb


def term_value(model, data, term):
    """One term as ESPnet's model forms it: CTC alone or attention CE alone (ctc_weight 1 / 0), or one
    regulariser averaged over the modules and utterances (their ``torch.cat(..., dim=1).mean()``)."""
    if term in ("ctc", "att"):
        model.ctc_weight = 1.0 if term == "ctc" else 0.0
        return ESPnetASRModel.forward(model, **data)[0]
    with recording() as records:
        ESPnetASRModel.forward(model, **data)
    terms = collect_sdma_losses(model, records, {}, combine="module_mean")
    per_utterance = {"kl": terms["kl_z"] + terms["kl_q"], "diversity": terms["dv_z"] + terms["dv_q"],
                     "dqq": terms["dqq"], "dxq": terms["dxq"]}[term]
    return per_utterance.mean()


def run_ours(defect=None):
    model = build_ours()
    if defect is not None:
        defect(model)
    data = batch()
    values, gradients, shapes = {}, {}, None
    for term in TERMS + ("loss",):
        model.zero_grad(set_to_none=True)
        model.train()
        model.ctc_weight = CTC_WEIGHT
        model.set_num_updates(NUM_UPDATES)
        stream = NoiseStream()
        use_noise(model, stream)
        value = model(**data)[0] if term == "loss" else term_value(model, data, term)
        value.backward()
        values[term] = value.item()
        gradients[term] = gradient_reference(model.named_parameters())
        shapes = stream.shapes
    model.eval()
    model.set_num_updates(NUM_UPDATES)
    n = int(data["speech_lengths"][0])
    steps = []
    with torch.no_grad():
        memory, _, _ = model.encoder(data["speech"][:1, :n], torch.tensor([n]))
        cache = None
        for i in range(1, len(PREFIX) + 1):
            logp, cache = model.decoder.forward_one_step(torch.tensor([PREFIX[:i]]), subsequent_mask(i).unsqueeze(0),
                                                         memory, cache=cache)
            steps.append(logp[0].tolist())
    return {"values": values, "gradients": gradients, "noise_shapes": shapes, "decoder_steps": steps}


def assert_matches(ours, theirs):
    assert ours["noise_shapes"] == theirs["noise_shapes"]
    for term in TERMS + ("loss",):
        assert ours["values"][term] == pytest.approx(theirs["values"][term], rel=1e-5, abs=1e-6), term
        assert set(ours["gradients"][term]) == set(theirs["gradients"][term])
        for name, reference in theirs["gradients"][term].items():
            scale = max(reference.abs().max().item(), 1e-8)
            torch.testing.assert_close(ours["gradients"][term][name], reference, rtol=RTOL, atol=ATOL * scale,
                                       msg=lambda m: f"{term}: gradient of {name}: {m}")
    for step, (our_step, their_step) in enumerate(zip(ours["decoder_steps"], theirs["decoder_steps"], strict=True)):
        assert our_step == pytest.approx(their_step, rel=1e-6, abs=1e-6), f"decoder step {step}"


@pytest.fixture(scope="module")
def ours():
    return run_ours()


def test_every_gradient_of_every_term_and_the_decoder_steps_match_the_authors(ours):
    assert_matches(ours, REFERENCE)


def test_the_case_exercises_every_term():
    gradients = REFERENCE["gradients"]
    for term in ("kl", "diversity", "dqq", "dxq"):
        for group in ("encoder.encoders.1.self_attn", "decoder.decoders.1.self_attn", "decoder.decoders.1.src_attn"):
            assert any(n.startswith(group + ".sdma") and g.abs().max() > 0 for n, g in gradients[term].items()), \
                (term, group)
    assert gradients["ctc"]["ctc.ctc_lo.weight"].abs().max() > 0
    assert gradients["ctc"]["decoder.output_layer.weight"].abs().max() == 0
    assert gradients["att"]["decoder.output_layer.weight"].abs().max() > 0


def centroid_gradient_scale_10(model):  # their Aishell-1 mu_grad is 5
    for core in (m for m in model.modules() if isinstance(m, SDMACore)):
        for gmm in (core.feature_gmm, core.query_gmm):
            gmm.centroid_grad_scale = 10.0


def regularisers_summed_over_attention_types(model):  # the paper reading's combination, not their mean
    model.sdma_reading = "paper"


def kl_weight_001(model):  # the fairseq scripts' 0.01 instead of their Aishell-1 0.001
    model.sdma_loss_weights["sdma_kl_weight"] = 0.01


def cross_attention_unmasked_in_decoding(model):  # only the decoder steps change
    for core in (m for m in model.modules() if isinstance(m, SDMACore)):
        if core.sdma_group == "decoder_cross":
            core.options = type(core.options)(**{**core.options.__dict__, "mask_at_inference": False})


@pytest.mark.parametrize("defect", [centroid_gradient_scale_10, regularisers_summed_over_attention_types,
                                    kl_weight_001, cross_attention_unmasked_in_decoding])
def test_a_planted_defect_fails_the_comparison(defect):
    with pytest.raises(AssertionError):
        assert_matches(run_ours(defect), REFERENCE)


def test_noise_is_scaled_by_the_predicted_variance():
    """The stand-in noise path is the module's own arithmetic: z = x + exp(log_var / 2) eps per head."""
    stream = NoiseStream()
    x, log_var = torch.zeros(1, 3, 8, dtype=torch.float64), torch.full((1, 3, 2), math.log(4.0), dtype=torch.float64)
    model = build_ours()
    use_noise(model, stream)
    core = next(m for m in model.modules() if isinstance(m, SDMACore))
    z = core.perturb(x, True, log_var)
    reference = NoiseStream().draw(1, 3).permute(0, 2, 1, 3).reshape(1, 3, 8)
    torch.testing.assert_close(z, 2.0 * reference)

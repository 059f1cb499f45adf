"""The regularisers of eq. (20)-(23) per sentence, batched over the layers of one attention type
(:func:`sdma_losses`, :func:`collect_sdma_losses`), their weighted sum of eq. (24) and the clustering diagnostics."""

import math
from typing import Dict, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from latent_core.sdma.compiled import compiled
from latent_core.sdma.mixture import clusters_first, log_prior, trace_precision
from latent_core.sdma.options import (AUTHORS_EPS, LOG_2PI, LOSS_NAMES, LOSS_WEIGHTS, REGULARISER_SCALES,
                                      SDMAConfigError)
from latent_core.sdma.records import ClusteringRecord, SDMARecording

# ----------------------------------------------------------------------------
# Regularisers. Layout: ``[L, T, B, n_h, C]`` -- the L layers of one attention
# type are stacked so each term costs a handful of batched ops (not one set per
# layer); inside, every term works on the clusters-first view ``[C, L, T, B, n_h]``
# (:func:`clusters_first`). ``valid`` is a float ``[T, B]`` mask of real
# (non-padding) query positions, shared by the layers. Every function returns one
# value PER SENTENCE, ``[B]``: the mean over layers, heads and the sentence's own
# tokens (the 1/(N n_h n_q) of eq. 20-23), as the authors' ``clustering()`` does;
# :func:`scale_regulariser` turns the per-sentence values into the batch's loss term.
# ----------------------------------------------------------------------------


def _sentence_mean(per_token: Tensor, valid: Tensor) -> Tensor:
    """``[L, T, B]`` -> ``[B]``: mean over layers and over each sentence's valid positions."""
    n_q = valid.sum(0).clamp_min(1.0)  # [B]
    return ((per_token * valid).sum(1) / n_q).mean(0)


def vade_kl(log_joint: Tensor, log_resp: Tensor, trace_precision: Tensor, dim: int,
            posterior_var, valid: Tensor, resp: Optional[Tensor] = None,
            authors_log_prior: Optional[Tensor] = None) -> Tensor:
    """KL(q(z, c | x) || p(z, c)) in the VaDE form per sentence, ``[B]`` (eq. 20).

    With q(z|x) = N(z, s2 I) and q(c|x) = p(c|z) (eq. 9), per token and head:
      sum_c q(c) KL(N(z, s2) || N(mu_c, sigma_c^2)) + KL(q(c) || pi)
        = -log p(z) + s2/2 sum_c q(c) tr(Sigma_c^-1) - d/2 log(2 pi e s2)
    where log p(z) = log_joint_c - log p(c|z) for any c. ``trace_precision`` is
    ``[L, n_h, C]`` (see :meth:`GaussianMixture.trace_precision`); ``resp`` is
    ``log_resp.exp()`` when the caller already has it.

    ``authors_log_prior`` (log pi, ``[L, n_h, C]``): the authors' categorical term
    KL(pi || q(c)) (``F.kl_div(log_probs, prior)``) replaces KL(q(c) || pi). ``posterior_var``
    is s2, a number or a tensor ``[L, T, B, n_h]`` (one variance per position and head).
    """
    log_joint, log_resp = clusters_first(log_joint), clusters_first(log_resp)  # [C, L, T, B, H]
    resp = log_resp.exp() if resp is None else clusters_first(resp)
    log_marginal = log_joint[0] - log_resp[0]  # log p(z), [L, T, B, H]
    trace = (resp * trace_precision.permute(2, 0, 1)[:, :, None, None, :]).sum(0)
    if isinstance(posterior_var, Tensor):
        const = 0.5 * dim * (LOG_2PI + torch.log(posterior_var) + 1.0)
    else:
        const = 0.5 * dim * (LOG_2PI + math.log(posterior_var) + 1.0)
    per_token = 0.5 * posterior_var * trace - log_marginal - const
    if authors_log_prior is not None:
        log_prior = authors_log_prior.permute(2, 0, 1)[:, :, None, None, :]  # [C, L, 1, 1, H]
        forward_kl = (resp * (log_resp - log_prior)).sum(0)  # KL(gamma || pi), inside -log p(z)
        reverse_kl = (log_prior.exp() * (log_prior - log_resp)).sum(0)  # KL(pi || gamma)
        per_token = per_token - forward_kl + reverse_kl
    return _sentence_mean(per_token.mean(-1), valid)


def cluster_diversity(resp: Tensor, valid: Tensor, alpha: float, beta: float, squared: bool = True) -> Tensor:
    """L_DV of eq. (23) per sentence, ``[B]`` (mean over layers and heads).

    sum_ij [M_hat o (C C^T - I)]_ij^2 with M_hat = alpha I + beta (1 - I) equals
    alpha^2 sum_i (s_i - 1)^2 + beta^2 (||C^T C||_F^2 - sum_i s_i^2), s_i = ||C_i||^2,
    so no ``T x T`` matrix is formed. Normalised by n_q^2 of each sentence.
    ``squared=False``: the authors' form, M_hat o (C C^T - I)^2 (alpha and beta weigh the
    squared entries).
    """
    diag_weight, off_weight = (alpha * alpha, beta * beta) if squared else (alpha, beta)
    resp = clusters_first(resp) * valid[None, None, :, :, None]  # [C, L, T, B, H]
    self_sim = (resp * resp).sum(0)  # s_i, [L, T, B, H]
    gram = torch.einsum("cltbh,kltbh->cklbh", resp, resp)  # C^T C, [C, C, L, B, H]
    diag = diag_weight * ((self_sim - 1.0) ** 2 * valid[None, :, :, None]).sum(1)  # [L, B, H]
    off = off_weight * ((gram * gram).sum((0, 1)) - (self_sim * self_sim).sum(1))
    n_q = valid.sum(0).clamp_min(1.0)[None, :, None]  # [1, B, 1]
    return ((diag + off) / (n_q * n_q)).mean((0, 2))


def token_given_cluster(log_joint_q: Tensor, valid: Tensor) -> Tensor:
    """p(q_i^h | c) of eq. (17), clusters-first ``[C, L, T, B, H]``: pi_c N(q_i^h | c) normalised
    over the sentence's real tokens (an exact softmax)."""
    pad = (valid <= 0)[None, None, :, :, None]
    p_token_given_c = torch.softmax(log_joint_q.masked_fill(pad, float("-inf")), dim=2)
    return p_token_given_c.masked_fill(pad, 0.0)  # sentences of length 0 stay finite


def authors_token_given_cluster(log_joint_q: Tensor) -> Tuple[Tensor, Tensor]:
    """The authors' p(q_i^h | c) (``F.normalize(cluster_probs * pdf, p=1, dim=length, eps=1e-6)``
    with ``pdf = exp(log_pdf - log_pdf.max())``), clusters-first ``[C, L, T, B, H]``, and which of
    its normalisers ``[C, L, 1, B, H]`` sit at the 1e-6 clamp.

    One max over the whole batch of a layer shifts every log-density, so a sentence whose
    queries all lie far below that max gets a normaliser under 1e-6: its probabilities are then
    divided by 1e-6 instead of their sum and stop summing to one.
    """
    layer_max = log_joint_q.detach().amax(dim=(0, 2, 3, 4), keepdim=True)  # one max per layer
    joint = torch.exp(log_joint_q - layer_max)
    norm = joint.sum(2, keepdim=True)
    clamped = norm < AUTHORS_EPS
    return joint / norm.clamp_min(AUTHORS_EPS), clamped


def head_mi_upper_bound(log_joint_q: Tensor, resp_q: Tensor, valid: Tensor, authors: bool = False,
                        p_token_given_c: Optional[Tensor] = None) -> Tensor:
    """L_Dqq of eq. (21) per sentence, ``[B]``: -1/(n_q n_h^2) sum_i sum_{h != h'} log(1 - p(q_i^h | q_i^h')).

    p(q_i^h | c) (eq. 17) = pi_c N(q_i^h | c) / sum_i' pi_c N(q_i'^h | c): a softmax over
    the sentence's tokens of the query GMM's log-joint (eq. 18);
    p(q_i^h | q_i^h') = sum_c p(q_i^h | c) p(c | q_i^h')  (eq. 16).

    ``authors=True``: their normaliser (:func:`authors_token_given_cluster`; pass the
    ``valid`` of the padded length for their sum over pad tokens) and their
    -log(1 - min(p, 1) + 1e-6). ``p_token_given_c``: precomputed p(q_i^h | c), clusters-first.
    """
    log_joint_q, resp_q = clusters_first(log_joint_q), clusters_first(resp_q)  # [C, L, T, B, H]
    n_h = log_joint_q.size(-1)
    if p_token_given_c is None:
        p_token_given_c = (authors_token_given_cluster(log_joint_q)[0] if authors
                           else token_given_cluster(log_joint_q, valid))
    p_pair = (p_token_given_c[..., :, None] * resp_q[..., None, :]).sum(0)  # [L, T, B, H, H']
    off_diag = 1.0 - torch.eye(n_h, device=p_pair.device, dtype=p_pair.dtype)
    if authors:
        neg_log = -torch.log(1.0 - p_pair.clamp(max=1.0) + AUTHORS_EPS) * off_diag
    else:
        neg_log = -torch.log1p(-p_pair.clamp(max=1.0 - 1e-6)) * off_diag
    return _sentence_mean(neg_log.sum((-1, -2)) / (n_h * n_h), valid)


def query_input_mi_lower_bound(resp_q: Tensor, valid: Tensor) -> Tensor:
    """L_Dxq of eq. (22) per sentence, ``[B]``, with the critic f(q_i^h, x_j) = sum_c p(c|q_i^h) p(c|q_j^h) (eq. 19).

    1/(n_q n_h) sum_i sum_h log softmax_j f(q_i^h, x_j) evaluated at j = i, with
    the softmax over the sentence's real tokens. Maximised (enters eq. 24 with -lambda_x).
    """
    resp_q = clusters_first(resp_q)  # [C, L, T, B, H]
    # f(q_i, x_j) as [L, T_i, T_j, B, H]: one multiply-add per cluster over long rows
    critic = resp_q[0, :, :, None] * resp_q[0, :, None]
    for c in range(1, resp_q.size(0)):
        critic = torch.addcmul(critic, resp_q[c, :, :, None], resp_q[c, :, None])
    key_pad = (valid <= 0)[None, None, :, :, None]  # [1, 1, T_j, B, 1]
    log_norm = torch.logsumexp(critic.masked_fill(key_pad, float("-inf")), dim=2)  # [L, T, B, H]
    log_ratio = (resp_q * resp_q).sum(0) - log_norm  # f(q_i, x_i) - log sum_j exp f(q_i, x_j)
    return _sentence_mean(log_ratio.mean(-1), valid)


def _stack_layers(tensors: List[Tensor]) -> Tensor:
    """``L x [T, B, H, C]`` -> ``[L, T, B, H, C]``, stored clusters-first (``[C, L, T, B, H]``)."""
    return torch.stack([clusters_first(t) for t in tensors], dim=1).movedim(0, -1)


# Diagnostics of the clustering a user can watch (sums, so they add over batches and DDP workers):
# the share of the authors' L_Dqq normalisers at their 1e-6 clamp, their L_Dqq against the exact one
# (same positions), and the cluster hardness (mean max_c p(c|z) of the feature GMMs over real tokens).
DIAGNOSTIC_SUMS = ("dqq_clamped", "dqq_normalisers", "dqq_authors", "dqq_exact", "hardness_sum", "hardness_count")


def _accumulate(into: Dict[str, Tensor], name: str, value: Tensor) -> None:
    value = value.detach().float()
    into[name] = into[name] + value if name in into else value


_LAYER_FIELDS = ("log_joint_z", "log_resp_z", "log_joint_q", "log_resp_q", "log_joint_k", "log_resp_k")


def sdma_losses(items: List[Tuple[nn.Module, ClusteringRecord]],
                diagnostics: Optional[Dict[str, Tensor]] = None) -> Dict[str, Tensor]:
    """The regularisers of SDMA modules of ONE attention type, per sentence (``[B]`` each).

    ``items``: (module, its record) pairs. The records' clustering tensors are stacked along a
    layer axis so each term is one batched computation, averaged over the layers (:func:`group_terms`,
    compiled with the ``compile`` option in training). The modules' ``reading`` decides the form of each
    term (see the module docstring). ``diagnostics``: a dict to which the sums of :data:`DIAGNOSTIC_SUMS`
    are added.
    """
    if not items:
        return {}
    first_core, first = items[0]
    o = first_core.options
    layers = {name: [getattr(record, name) for _, record in items] for name in _LAYER_FIELDS
              if getattr(first, name) is not None}
    log_vars = {kind: [record.log_vars[kind] for _, record in items] for kind in first.log_vars}
    gmms = {"z": [core.feature_gmm for core, _ in items]}
    if first.log_joint_q is not None:
        gmms["q"] = [core.query_gmm for core, _ in items]
    gmm_parameters = {kind: ([g.log_vars for g in group], [g.prior_logits for g in group]) for kind, group in gmms.items()}
    terms = compiled(group_terms) if first_core.compiles(first_core.training) else group_terms
    # contiguous: inductor saves a view of a transposed input with the strides of the first call's sizes
    losses, sums = terms(layers, log_vars, gmm_parameters, first.valid.contiguous(), authors=o.authors, head_dim=first_core.head_dim,
                         num_heads=first_core.num_heads, posterior_var=o.kl_posterior_var, alpha=o.diversity_alpha,
                         beta=o.diversity_beta, diagnose=diagnostics is not None)
    for name, value in sums.items():
        _accumulate(diagnostics, name, value)
    return losses


def group_terms(layers: Dict[str, List[Tensor]], log_vars: Dict[str, List[Tensor]],
                gmm_parameters: Dict[str, Tuple[List[Tensor], List[Tensor]]], real_queries: Tensor, *, authors: bool,
                head_dim: int, num_heads: int, posterior_var: float, alpha: float, beta: float,
                diagnose: bool) -> Tuple[Dict[str, Tensor], Dict[str, Tensor]]:
    """Eq. (20)-(23) of one attention type from tensors alone: ``(losses, diagnostic sums)``.

    ``layers``: the :class:`ClusteringRecord` fields, one ``[T, B, n_h, C]`` tensor per layer each;
    ``log_vars``: the learned posterior log-variances per layer (``z``, ``q``, ``k``), if any;
    ``gmm_parameters``: ``{"z": (log-variances, prior logits) per layer, "q": ...}`` of the feature and query
    GMMs; ``real_queries`` ``[T, B]``; ``posterior_var`` sigma_tilde^2 where no learned one is given.
    """
    real = real_queries.float()
    # the authors average over the padded length and normalise over pad tokens too
    valid = torch.ones_like(real) if authors else real
    log_joint_z = _stack_layers(layers["log_joint_z"])
    log_resp_z = _stack_layers(layers["log_resp_z"])
    resp_z = log_resp_z.exp()
    z_log_vars, z_prior_logits = gmm_parameters["z"]
    trace_z = trace_precision(torch.stack(z_log_vars))  # [L, H, C]
    log_prior_z = log_prior(torch.stack(z_prior_logits)) if authors else None

    def s2(kind):  # sigma_tilde^2: the option's number, or the learned [L, T, B, H]
        if kind not in log_vars:
            return posterior_var
        return torch.stack([v.float() for v in log_vars[kind]]).exp()

    losses = {
        "kl_z": vade_kl(log_joint_z, log_resp_z, trace_z, head_dim, s2("z"), valid, resp_z, log_prior_z),
        "dv_z": cluster_diversity(resp_z, valid, alpha, beta, squared=not authors),
    }
    sums: Dict[str, Tensor] = {}
    if authors and "log_joint_k" in layers:
        # cross-attention: the (noisy) encoder keys' KL and diversity, over the padded source length
        log_joint_k = _stack_layers(layers["log_joint_k"])
        log_resp_k = _stack_layers(layers["log_resp_k"])
        resp_k = log_resp_k.exp()
        valid_k = log_joint_k.new_ones(log_joint_k.shape[1:3], dtype=torch.float32)  # [S, B]: padded length
        losses["kl_z"] = losses["kl_z"] + vade_kl(log_joint_k, log_resp_k, trace_z, head_dim, s2("k"), valid_k,
                                                  resp_k, log_prior_z)
        losses["dv_z"] = losses["dv_z"] + cluster_diversity(resp_k, valid_k, alpha, beta, squared=False)
    if diagnose:
        with torch.no_grad():
            hardest = clusters_first(resp_z).amax(0)  # [L, T, B, H]
            sums["hardness_sum"] = (hardest * real[None, :, :, None]).sum()
            sums["hardness_count"] = real.sum() * hardest.size(0) * hardest.size(-1)
    if "log_joint_q" in layers:
        log_joint_q = _stack_layers(layers["log_joint_q"])
        log_resp_q = _stack_layers(layers["log_resp_q"])
        resp_q = log_resp_q.exp()
        q_log_vars, q_prior_logits = gmm_parameters["q"]
        heads = (len(q_log_vars), num_heads, -1)  # one query GMM shared by the heads: [L, 1, C] -> [L, H, C]
        trace_q = trace_precision(torch.stack(q_log_vars)).expand(heads)
        log_prior_q = log_prior(torch.stack(q_prior_logits)).expand(heads) if authors else None
        losses["kl_q"] = vade_kl(log_joint_q, log_resp_q, trace_q, head_dim, s2("q"), valid, resp_q, log_prior_q)
        losses["dv_q"] = cluster_diversity(resp_q, valid, alpha, beta, squared=not authors)
        authors_p = clamped = None
        if authors or diagnose:
            authors_p, clamped = authors_token_given_cluster(clusters_first(log_joint_q))
        losses["dqq"] = head_mi_upper_bound(log_joint_q, resp_q, valid, authors,
                                            p_token_given_c=authors_p if authors else None)
        losses["dxq"] = query_input_mi_lower_bound(resp_q, valid)
        if diagnose:
            with torch.no_grad():
                other = head_mi_upper_bound(log_joint_q, resp_q, valid, not authors,
                                            p_token_given_c=None if authors else authors_p)
                exact, theirs = (other, losses["dqq"]) if authors else (losses["dqq"], other)
                sums["dqq_clamped"] = clamped.sum()
                sums["dqq_normalisers"] = clamped.new_full((), clamped.numel(), dtype=torch.float32)
                sums["dqq_authors"] = theirs.sum()
                sums["dqq_exact"] = exact.sum()
    return losses, sums


GROUP_COMBINATIONS = ("sum", "module_mean")


def collect_sdma_losses(model: nn.Module, records: SDMARecording, diagnostics: Optional[Dict[str, Tensor]] = None,
                        combine: str = "sum") -> Dict[str, Tensor]:
    """Per-sentence SDMA losses (eq. 20-23) of the forward pass ``records`` holds (:func:`recording`):
    layer mean per attention type, summed over types.

    Modules are grouped by ``sdma_group`` (e.g. ``encoder_self``, ``decoder_self``,
    ``decoder_cross``): each group's terms are averaged over its layers (the 1/N of
    eq. 20 and 23), and the groups are summed. Every value is ``[B]`` (one per sentence
    of the batch); a term no module produced (e.g. the query terms of SMA-T) is zeros,
    and when no SDMA module ran at all (V-T) every term is a 0-dim zero, so every term is
    present in every step's logging output. ``diagnostics``: see :func:`sdma_losses`.

    ``combine="module_mean"``: the authors' ESPnet model instead averages over every module of
    every type (``torch.cat(loss_kl, dim=1).mean()``): each group's layer mean is weighted by
    its share of the modules.
    """
    groups: Dict[Tuple, list] = {}  # in module order, as the records of one group are stacked
    for module in model.modules():
        record = records.get(module)  # only SDMA cores are recorded
        if record is not None:
            key = (getattr(module, "sdma_group", "default"), record.layout())
            groups.setdefault(key, []).append((module, record))
    if combine not in GROUP_COMBINATIONS:
        raise SDMAConfigError(f"combine={combine!r} is not one of {', '.join(GROUP_COMBINATIONS)}")
    modules = sum(len(items) for items in groups.values())
    per_group = []
    for items in groups.values():
        terms = sdma_losses(items, diagnostics)
        if combine == "module_mean":
            terms = {name: value * (len(items) / modules) for name, value in terms.items()}
        per_group.append(terms)
    present = [v for g in per_group for v in g.values()]
    zeros = torch.zeros_like(present[0]) if present else torch.zeros(())
    total = {}
    for name in LOSS_NAMES:
        values = [g[name] for g in per_group if name in g]
        total[name] = torch.stack(values).sum(0) if values else zeros
    return total


def diagnostic_summary(sums: Mapping) -> Dict:
    """``dqq_clamped`` (share of the authors' L_Dqq normalisers at their clamp), ``dqq_ratio``
    (their L_Dqq / the exact one) and ``hardness`` (mean max_c p(c|z)) from the sums of
    :data:`DIAGNOSTIC_SUMS`. Numbers give floats (a value whose denominator is 0 is left out);
    tensors give 0-dim tensors without a device sync (NaN where the denominator is 0); a value
    whose sums are missing is left out."""
    out = {}
    for name, num, den in (("dqq_clamped", "dqq_clamped", "dqq_normalisers"),
                           ("dqq_ratio", "dqq_authors", "dqq_exact"),
                           ("hardness", "hardness_sum", "hardness_count")):
        if den not in sums:
            continue
        denominator, numerator = sums[den], sums.get(num, 0.0)
        if isinstance(denominator, Tensor):
            ratio = numerator / denominator.clamp_min(torch.finfo(denominator.dtype).tiny)
            out[name] = torch.where(denominator > 0, ratio, torch.full_like(ratio, float("nan")))
        elif float(denominator) > 0:
            out[name] = float(numerator) / float(denominator)
    return out


def weighted_regulariser(terms: Dict[str, Tensor], weights: Dict[str, float]) -> Tensor:
    """lambda_k (KL_z + KL_q) + lambda_q L_Dqq - lambda_x L_Dxq + lambda_d (DV_z + DV_q): eq. (24) without L_CE.

    ``terms`` as returned by :func:`collect_sdma_losses` (``[B]`` per sentence); ``weights``
    keyed like :data:`LOSS_WEIGHTS`. Zero-weighted terms are skipped. Float32, one value
    per sentence (``[B]``, or 0-dim when the terms are).
    """
    total = torch.zeros_like(next(iter(terms.values())), dtype=torch.float32)
    for term in weighted_terms(terms, weights).values():
        total = total + term
    return total


def weighted_terms(terms: Dict[str, Tensor], weights: Dict[str, float]) -> Dict[str, Tensor]:
    """Each term of eq. (24) as it enters the loss, ``{name: sign * lambda * term}`` (float32; zero-weighted
    terms left out): the parts :func:`weighted_regulariser` sums."""
    return {name: sign * weights[option] * terms[name].float()
            for option, (_, names, sign) in LOSS_WEIGHTS.items() if weights[option] for name in names}


def scale_regulariser(per_sentence: Tensor, scale: str, num_tokens: float) -> Tensor:
    """The batch's regulariser term from per-sentence values ``[B]``, next to a token-SUMMED L_CE.

    * ``sentence`` (default): the sum over the batch's sentences, as the authors' fairseq
      criterion does (``.mean((1, 2)).sum()``); the whole loss is then extensive in the
      batch (two copies of a sentence give twice every term) and the Table I lambdas weigh
      each sentence's regularisers against that sentence's summed L_CE;
    * ``batch``: the batch mean, added once per batch (~``nsentences`` times weaker);
    * ``token``: the batch mean times ``num_tokens`` (eq. 24 read with a per-token L_CE;
      ~tokens-per-sentence times stronger than ``sentence``).
    """
    if scale == "sentence":
        return per_sentence.sum()
    if scale == "batch":
        return per_sentence.mean() if per_sentence.dim() else per_sentence
    if scale == "token":
        return (per_sentence.mean() if per_sentence.dim() else per_sentence) * float(num_tokens)
    raise SDMAConfigError(f"regulariser scale {scale!r} is not one of {', '.join(REGULARISER_SCALES)}")

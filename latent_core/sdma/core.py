"""The parameters and computations of SDMA for one attention module (:class:`SDMACore`): what the
fairseq and ESPnet adapters hold."""

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn as nn
from torch import Tensor

from latent_core.errors import check_heads_divide
from latent_core.profiling import sourced
from latent_core.sdma.attention import TAKES_RAW_INPUTS
from latent_core.sdma.mixture import GaussianMixture, log_softmax_clusters
from latent_core.sdma.options import SDMAConfigError, SDMAOptions, mixing_weight
from latent_core.sdma.records import ClusteringRecord, SDMARecording, active_recording
from latent_core.sdma.regularisers import sdma_losses


def add_standard_normal(x: Tensor, sigma: float) -> Tensor:
    """x + sigma * eps, eps ~ N(0, 1) of ``x``'s shape, dtype and device (eq. 8), laid out in memory as ``x`` (its
    dimensions in the order of their strides).

    The sum is written into the draw itself (one ``[..., C]`` buffer per draw, not two), which is a base tensor: an
    in-place add into a *view* of the draw would cost autograd a ``CopySlices`` (a clone and a copy) in backward.
    Not ``randn_like``: fairseq hands the layers a transposed x (``[T, B, C]`` over ``[B, T, C]`` storage), and
    sampling into a strided tensor takes PyTorch's per-element path (~9x slower). Nor a ``[T, B, C]``-contiguous draw:
    adding tensors of two layouts takes ~2x as long on a CPU as adding two of one.
    """
    order = sorted(range(x.dim()), key=lambda dim: -x.stride(dim))  # outermost dimension first
    eps = torch.randn([x.size(dim) for dim in order], dtype=x.dtype, device=x.device)
    return eps.mul_(sigma).add_(x.permute(order)).permute([order.index(dim) for dim in range(x.dim())])


class SDMACore(nn.Module):
    """Parameters and computations of SDMA for one attention module.

    Holds the per-head feature GMM theta_z (``[n_h, n_c, d_k]``), the query GMM theta_q
    shared across heads (``[1, n_c^q, d_k]``, only in ``sdma`` mode) and the mixing
    weight g of eq. (11) as a persistent buffer: it follows ``set_num_updates`` in
    training and is saved in checkpoints, so inference uses its end-of-training value.
    The adapters call :meth:`perturb`, :meth:`cluster`, :meth:`cluster_queries` and
    :meth:`record`; :func:`collect_sdma_losses` turns the clustering recorded in a
    :func:`recording` scope into the regularisers (batched over the layers of each attention type).
    """

    def __init__(self, embed_dim: int, num_heads: int, options: SDMAOptions):
        super().__init__()
        options.validate()
        check_heads_divide("num_heads", num_heads, "embed_dim", embed_dim, SDMAConfigError)
        self.options = options
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.feature_gmm = GaussianMixture(
            num_heads, options.clusters, self.head_dim, options.centroid_grad_scale, init=options.gmm_initialisation
        )
        self.query_gmm = (
            GaussianMixture(1, options.query_clusters, self.head_dim, options.centroid_grad_scale,
                            init=options.gmm_initialisation)
            if options.mode == "sdma"
            else None
        )
        self.register_buffer("mix_weight", torch.zeros(()), persistent=True)
        # this forward pass's GMM parameters as the Triton clustering read them, for its record (see _cluster_rows)
        self._parameters_read: Dict[str, Tuple[Tensor, Tensor]] = {}

    # -- schedule ---------------------------------------------------------------
    def set_num_updates(self, num_updates: int) -> None:
        o = self.options
        self.mix_weight.fill_(mixing_weight(num_updates, o.mix_max, o.mix_rate))

    def active(self, training: bool) -> bool:
        """Whether the semantic mask is applied in this forward pass (never in mode ``none``: an attention
        module built with it is the toolkit's plain attention, as the option documents)."""
        return self.options.mode != "none" and (training or self.options.mask_at_inference)

    # -- clustering -------------------------------------------------------------
    @sourced("noise")
    def perturb(self, x: Tensor, training: bool, log_var: Optional[Tensor] = None, scale: float = 1.0) -> Tensor:
        """z = x + sigma * eps in training (eq. 8, variance ``noise_var``): torch's generator, or with
        ``attention_kernel=triton`` Philox inside one kernel (:func:`~latent_core.sdma.triton_kernels.sampling_noise`).

        ``scale``: ``x`` is the sample's input divided by it (unscaled queries whose scores the kernel scales), so the
        noise is sigma / scale. ``log_var`` (``[..., n_h]``, the authors' ESPnet ``var_estimation``): a log-variance per
        position and head instead of ``noise_var``.
        """
        if training and log_var is not None:
            eps = torch.randn(x.shape, dtype=x.dtype, device=x.device)
            std = torch.exp(0.5 * log_var.float()).to(x.dtype)
            heads = (self.num_heads, -1)
            return torch.addcmul(x.unflatten(-1, heads), eps.unflatten(-1, heads), std[..., None]).flatten(-2)
        if training and self.options.noise_var > 0:
            sigma = math.sqrt(self.options.noise_var) / scale
            if self.options.attention_kernel == "triton":  # one launch, Philox: the kernels' draw, not torch's
                from latent_core.sdma.triton_kernels import sampling_noise

                return sampling_noise(x, sigma)
            return add_standard_normal(x, sigma)
        return x

    @property
    def clustering_scale(self) -> float:
        """The factor :meth:`sample`'s clustering input is clustered at (pass it to :meth:`cluster`): 1/10 in
        the authors' reading with c_g <= 1, where their fairseq code clusters x / 10 (their
        ``grad_multiplier == 1`` branch), else 1."""
        return 0.1 if self.options.authors and self.options.centroid_grad_scale <= 1 else 1.0

    def sample(self, x: Tensor, training: bool, scale: float = 1.0) -> Tuple[Tensor, Tensor]:
        """(input of the feature clustering, input of the projections) for attention input ``x``.

        Both are the one sample z of eq. (8), except in the authors' reading with c_g <= 1, where
        their code clusters the clean x (at :attr:`clustering_scale`, 1/10) and projects the noisy x. ``scale``: see
        :meth:`perturb`.
        """
        # scale only where there is one: a perturb replaced to fix the noise (tests, analysis) may not take it
        z = self.perturb(x, training) if scale == 1.0 else self.perturb(x, training, scale=scale)
        if self.clustering_scale != 1.0:
            return x, z
        return z, z

    def sample_queries(self, q: Tensor, training: bool, scale: float = 1.0) -> Tuple[Tensor, Tensor]:
        """(input of the query GMM, queries of the scores) for the queries ``q``: scaled, or (``scale`` != 1) unscaled
        with the scores' factor ``scale`` (:attr:`kernel_takes_raw_inputs`); cluster them at
        ``clustering_scale * scale``.

        Paper reading: ``q`` itself (it carries the sample of eq. 8 through W_q). Authors
        reading: a second draw, q + sigma * eps on the scaled queries (their ``disentangled_attention`` step 4;
        sigma / scale on unscaled ones), used for both; with c_g <= 1 their code clusters q / 10 (the clean q, at
        :attr:`clustering_scale`) and scores the noisy q.
        """
        if not self.options.authors:
            return q, q
        return self.sample(q, training, scale)

    def cluster(self, x: Tensor, gmm_terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                scale: float = 1.0) -> Tuple[Tensor, Tensor]:
        """Feature clustering of eq. (9) of ``scale * x``: ``x [..., n_h * d_k]`` -> (log-joint, log p(c|z)),
        ``[..., n_h, n_c]``.

        ``gmm_terms``: see :meth:`GaussianMixture.log_joint` (inference only); ``scale``: the input's factor
        (:attr:`clustering_scale` for :meth:`sample`'s clustering input), folded into the density.
        """
        return self.cluster_jointly([x], gmm_terms, scale)[0]

    def cluster_jointly(self, inputs: Sequence[Tensor], gmm_terms: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                        scale: float = 1.0) -> List[Tuple[Tensor, Tensor]]:
        """:meth:`cluster` of each of ``inputs`` (``[..., n_h * d_k]``, leading shapes may differ) with
        one density evaluation: a cross-attention's queries and keys share the feature GMM, whose
        parameters are then expanded, and their gradient collected, once instead of twice."""
        leads = [x.shape[:-1] for x in inputs]
        heads = [x.reshape(*x.shape[:-1], self.num_heads, self.head_dim) for x in inputs]
        log_joint, log_resp = self._cluster_rows(self.feature_gmm, heads, gmm_terms, scale)  # [N_1 + N_2, n_h, n_c]
        if len(inputs) == 1:
            return [(log_joint.view(*leads[0], *log_joint.shape[1:]), log_resp.view(*leads[0], *log_resp.shape[1:]))]
        sizes = [math.prod(lead) for lead in leads]
        return [(joint.view(*lead, *joint.shape[1:]), resp.view(*lead, *resp.shape[1:]))
                for joint, resp, lead in zip(log_joint.split(sizes), log_resp.split(sizes), leads)]

    def cluster_queries(self, q: Tensor, scale: float = 1.0) -> Tuple[Tensor, Tensor]:
        """Query clustering (eq. 18 prior, eq. 9 form) of ``scale * q``: ``q [..., n_h, d_k]`` -> ``[..., n_h, n_c^q]``."""
        lead = q.shape[:-1]
        log_joint, log_resp = self._cluster_rows(self.query_gmm, [q.reshape(-1, 1, self.head_dim)], None, scale)
        return log_joint.reshape(*lead, -1), log_resp.reshape(*lead, -1)

    @sourced("clustering")
    def _cluster_rows(self, gmm: GaussianMixture, zs: Sequence[Tensor],
                      gmm_terms: Optional[Tuple[Tensor, Tensor, Tensor]], scale: float) -> Tuple[Tensor, Tensor]:
        """(log p(z, c), log p(c | z)) of eq. (9) for the rows of ``zs`` (``[..., G, d]`` each) in order, ``[N, G,
        C]`` (clusters-first storage): the Triton kernel with ``attention_kernel=triton``, else the GMM's log-joint
        and a log-softmax."""
        if self.options.attention_kernel == "triton":
            from latent_core.sdma.triton_kernels import gaussian_clustering

            width = gmm.groups * gmm.dim
            rows = torch.cat([z.reshape(-1, width) for z in zs]) if len(zs) > 1 else zs[0].reshape(-1, width)
            # with autograd the kernel also hands back the parameters it read: the regularisers read those (via
            # record), so their gradients join the clustering's in its backward kernel, not in an autograd sum
            read = torch.is_grad_enabled()
            out = gaussian_clustering(rows, gmm.means, gmm.log_vars, gmm.prior_logits, scale, gmm.centroid_grad_scale,
                                      parameters_read=read)
            if read:
                self._parameters_read["z" if gmm is self.feature_gmm else "q"] = out[2:]
            return out[:2]
        log_joint = gmm.log_joint_rows(zs, gmm_terms, scale)
        return log_joint, log_softmax_clusters(log_joint)

    @staticmethod
    def heads_first(resp: Tensor, batch_first: bool = False, contiguous: bool = True) -> Tensor:
        """``[T, B, n_h, C]`` (``[B, T, n_h, C]`` with ``batch_first``, ESPnet's layout) ->
        ``[B * n_h, T, C]`` (the layout of the attention scores).

        ``contiguous``: copied into that layout (the matrix products of the other kernels need it: on a
        clusters-first view bmm falls back to one product per batch entry); without it a view where one
        exists (the Triton kernels read any dense layout: one copy fewer forward and backward)."""
        if batch_first:
            B, T, H, C = resp.shape
            order = (0, 2, 1, 3)
        else:
            T, B, H, C = resp.shape
            order = (1, 2, 0, 3)
        heads = resp.permute(*order)
        return heads.contiguous().view(B * H, T, C) if contiguous else heads.reshape(B * H, T, C)

    def attention_responsibilities(self, log_resp: Tensor, batch_first: bool = False) -> Tensor:
        """log p(c|.) of ``log_resp`` (``[T, B, n_h, C]``, ``[B, T, n_h, C]`` with ``batch_first``) as the attention
        takes it (:func:`~latent_core.sdma.sdma_attention` with ``log_responsibilities=True``), ``[B * n_h, T, C]``
        (:meth:`heads_first`): a view for the Triton kernel, which reads any dense layout and the logs themselves
        (no copy, no exp, forward or backward), a copy for the others."""
        return self.heads_first(log_resp, batch_first, contiguous=not self.kernel_takes_raw_inputs)

    @property
    def kernel_takes_raw_inputs(self) -> bool:
        """Whether this module's attention kernel takes unscaled queries with the scores' factor and log p(c|.)
        (:data:`~latent_core.sdma.attention.TAKES_RAW_INPUTS`): the adapters then leave 1/sqrt(d_k) to it."""
        return self.options.attention_kernel in TAKES_RAW_INPUTS

    # -- regularisers -----------------------------------------------------------
    @staticmethod
    def computes_regularisers() -> bool:
        """Whether a forward pass computes the regularisers' inputs (the query clustering, the records).

        Inside a :func:`recording` scope, and whenever autograd is on: activation checkpointing
        (fairseq's ``--checkpoint-activations``, ESPnet's ``gradient_checkpoint_layers``) recomputes
        the forward pass in backward, outside the scope, and must save the same tensors as the
        first pass. Not in ``no_grad`` decoding outside a scope (beam search).
        """
        return torch.is_grad_enabled() or active_recording() is not None

    def record(self, log_joint_z: Tensor, log_resp_z: Tensor, query_valid: Tensor,
               log_joint_q: Optional[Tensor] = None, log_resp_q: Optional[Tensor] = None,
               log_joint_k: Optional[Tensor] = None, log_resp_k: Optional[Tensor] = None,
               log_vars: Optional[Dict[str, Tensor]] = None, into: Optional[SDMARecording] = None) -> None:
        """Keep this forward pass's clustering in the active :func:`recording` (see
        :class:`ClusteringRecord` for the arguments), or in ``into`` where given (an adapter that keeps the
        records of each model's forward itself). Outside a scope nothing is kept; nor is
        anything inside backward (activation checkpointing recomputing the forward pass: the
        criterion already took the first pass's records).
        """
        records = into if into is not None else active_recording()
        parameters_read, self._parameters_read = self._parameters_read, {}
        if records is None or torch._C._current_graph_task_id() != -1:
            return
        records.add(self, ClusteringRecord(log_joint_z, log_resp_z, query_valid, log_joint_q, log_resp_q,
                                           log_joint_k, log_resp_k, log_vars or {}, parameters_read))

    def regularisers(self, log_joint_z: Tensor, log_resp_z: Tensor, query_valid: Tensor,
                     log_joint_q: Optional[Tensor] = None,
                     log_resp_q: Optional[Tensor] = None) -> Dict[str, Tensor]:
        """All SDMA loss terms of this module alone (``[T, B, n_h, C]`` inputs)."""
        return sdma_losses([(self, ClusteringRecord(log_joint_z, log_resp_z, query_valid, log_joint_q, log_resp_q))])

    def extra_repr(self) -> str:
        o = self.options
        return (
            f"mode={o.mode}, reading={o.reading}, heads={self.num_heads}, clusters={o.clusters}, "
            f"query_clusters={o.query_clusters}, nu={o.mix_max}, c_g={o.centroid_grad_scale}"
        )

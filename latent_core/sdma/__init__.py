"""Semantic and disentangled mask attention (SDMA): the one attention core.

Chien & Huang, "Latent Semantic and Disentangled Attention", TPAMI 2024
(doi:10.1109/TPAMI.2024.3432631), Section III. Plain PyTorch: the fairseq adapter
(``user_dir.sdma.fairseq_attention``) and the ESPnet adapter (``espnet_plugin.asr.sdma_attention``) build on
this package. Its files, each readable top to bottom, the direct form of an equation beside its fast path:

* ``options``      the modes, readings and kernels; :class:`SDMAOptions` (Table I) and the weights of eq. (24)
* ``mixture``      the Gaussian mixtures of eq. (5)/(9) and their log-joint
* ``attention``    eq. (1), (2), (10), (11): :func:`sdma_attention` and its kernel table :data:`KERNELS`
* ``reference``    the direct forms the fast paths are tested against (eq. 1, 2, 11 as they read; the kernels' dropout)
* ``triton_kernels`` the GPU path (``attention_kernel=triton``): Triton kernels with their backward for the
                   clustering of eq. (9) and the masked mixture (imported on first use, not by this package)
* ``records``      what a forward pass records for the regularisers (:func:`recording`)
* ``regularisers`` eq. (20)-(24) per sentence, batched over layers; clustering diagnostics
* ``core``         :class:`SDMACore`, the parameters and computations of one attention module
* ``nonfinite``    where a non-finite loss comes from

Symbols follow the paper:

* ``z``   attention input split into heads, ``[..., n_h, d_k]`` (eq. 8)
* ``q``   scaled query split into heads, ``[..., n_h, d_k]``
* ``C``   clustering probabilities p(c | z) ("responsibilities", eq. 9)
* ``M``   semantic mask (eq. 10), ``g`` the mixing weight gamma of eq. (11)

Everything that touches log-densities runs in float32 and in log space, so the
module is safe under fp16/bf16 autocast and a collapsed cluster (all of its
responsibilities ~0) never produces NaN.

Two readings (``SDMAOptions.reading``), see :data:`READINGS` and examples/sdma_translation/readings.md:

* ``authors`` (default): the training computation of the authors' fairseq code, which
  produced the paper's tables (``modules/disentangled_attention.py`` of
  NYCU-MLLab/Disentangled-Mask-Attention-in-Transformers): a second noise draw on the
  scaled queries, k and v from the clean input in self-attention (the noisy keys and the
  clean values in cross-attention), posterior variance 0.01 (their fixed ``self.var``, also
  their noise variance), regularisers averaged over the padded length, KL(pi || gamma),
  alpha/beta on the squared entries of eq. (23), their L_Dqq normaliser (one max shift per
  layer, clamped at 1e-6), the cross-attention keys' KL and diversity, their initialisation
  and the two 1e-6 floors of their L1 normalisations. The ESPnet adapter's ``authors``
  reading follows their ESPnet code instead (learned per-position variances: the
  ``log_var`` arguments of :meth:`SDMACore.perturb` and :meth:`SDMACore.record`;
  ``combine="module_mean"`` in :func:`collect_sdma_losses`);
* ``paper``: the equations as printed: one sample z per step for clustering and the q/k/v
  projections (eq. 8 and Algorithm 1), sigma_tilde^2 = 0.1 (Section IV-A3), real positions
  only, KL(gamma || pi) (eq. 20), the weighted mask squared (eq. 23), the exact
  per-sentence softmax of eq. (17).

In both, the scaling factor ``s`` of Algorithm 1 is 1 (its final value in the paper).

Attention is computed in one place for both toolkits: :func:`sdma_attention` (eq. 1, 2, 10, 11 from
q, k, v, the responsibilities, the blocked keys, g and the reading) dispatches on :data:`KERNELS`
(``explicit``, ``sdpa``, ``lowrank``, ``triton``; ``auto`` picks one, :func:`select_kernel`). A new attention
variant is one function of :class:`AttentionInputs` and one row of :data:`KERNELS`;
``tests/unit/latent_core/test_sdma_kernels_exact.py`` holds every row to the explicit kernel (float64; the
``triton`` row, which has no float64 path, in ``test_sdma_triton_kernels.py``).
"""

from latent_core.sdma.options import (  # noqa: F401
    ATTENTION_KERNELS, AUTHORS_EPS, AUTHORS_POSTERIOR_VAR, AUTHORS_SCRIPT_LOSS_WEIGHTS, LOSS_NAMES, LOSS_WEIGHTS,
    PAPER_POSTERIOR_VAR, READINGS, REGULARISER_SCALES, REMOVED_OPTIONS, SDMA_MODES, SMALLER_DISENTANGLEMENT_WEIGHTS,
    SDMAConfigError, SDMALossWeights, SDMAOptions, check_loss_weight,
    mixing_weight, removed_option_message,
)
from latent_core.sdma.mixture import (  # noqa: F401
    GaussianMixture, authors_linear_init, clusters_first, log_prior, log_softmax_clusters, trace_precision,
)
from latent_core.sdma.attention import (  # noqa: F401
    KERNELS, TAKES_SCORE_BIAS, AttentionInputs, authors_semantic_mask, explicit_kernel, fused_mix_attention, lowrank_kernel,
    lowrank_mix_attention, mix_attention, reading_semantic_mask, responsibility_product,
    sdma_attention, sdpa_kernel, select_kernel, semantic_mask, semantic_mask_product,
)
from latent_core.sdma.reference import mix_attention_direct  # noqa: F401
from latent_core.sdma.records import (  # noqa: F401
    ClusteringRecord, SDMARecording, active_recording, all_real_queries, current_real_queries, real_queries,
    recording, tie_to_output,
)
from latent_core.sdma.regularisers import (  # noqa: F401
    DIAGNOSTIC_SUMS, GROUP_COMBINATIONS, authors_token_given_cluster, cluster_diversity, collect_sdma_losses,
    diagnostic_summary, head_mi_upper_bound, query_input_mi_lower_bound, scale_regulariser, sdma_losses,
    token_given_cluster, vade_kl, weighted_regulariser,
)
from latent_core.sdma.core import SDMACore  # noqa: F401
from latent_core.sdma.nonfinite import (  # noqa: F401
    check_finite, diagnose_nonfinite, first_nonfinite_activation, first_nonfinite_parameter,
)

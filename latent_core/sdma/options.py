"""SDMA options: the modes, readings and kernels, the hyper-parameters of one attention module
(:class:`SDMAOptions`, Table I), the weights of eq. (24) and the schedule of eq. (11)'s mixing weight."""

import math
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Dict, Mapping, Optional, Tuple

from latent_core.errors import PluginConfigError, check_positive_int

if TYPE_CHECKING:
    from torch import Tensor

SDMA_MODES = ("sdma", "sma", "none")
# What the SDMA modules compute in training (SDMAOptions.reading): the authors' code or the printed equations
READINGS = ("authors", "paper")
# How the mixed attention of eq. (11) is computed (SDMAOptions.attention_kernel)
ATTENTION_KERNELS = ("auto", "explicit", "sdpa", "lowrank", "triton")  # "auto" and the rows of KERNELS
# Options SDMA no longer has -> why (both toolkits' errors say it when one is set: removed_option_message)
REMOVED_OPTIONS = {
    "compile": "running SDMA's training through torch.compile took minutes before the first update (3-5 minutes "
               "on a 2-core CPU, no update logged within 270 s on an H100), and the eager path trains the same model",
}


def removed_option_message(option: str, name: str, remedy: str) -> str:
    """The error of a removed option (``name`` a key of :data:`REMOVED_OPTIONS`, ``option`` how the user spelled
    it, ``remedy`` what to do): ``--sdma-compile: this option was removed: <why>; drop it``."""
    return f"{option}: this option was removed: {REMOVED_OPTIONS[name]}; {remedy}"


# Names of the regularisers every SDMA module reports (eq. 20, 21, 22, 23).
LOSS_NAMES = ("kl_z", "kl_q", "dqq", "dxq", "dv_z", "dv_q")


def check_loss_weight(name: str, value: float, option: str) -> float:
    """The one check of an eq. (24) weight (``name`` a key of :data:`LOSS_WEIGHTS`, ``option`` how
    the user spelled it, e.g. ``--sdma-kl-weight`` or ``model_conf.sdma_kl_weight``): finite, >= 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and value >= 0):
        raise SDMAConfigError(f"{option}={value}: the weight {LOSS_WEIGHTS[name][0]} of eq. (24) "
                              "must be a finite number >= 0")
    return float(value)


# SDMALossWeights fields that other settings change: Table I's tiny and Zh-En rows (lambda_q 50, lambda_x 5), and
# the authors' IWSLT'14/WMT'14 scripts, whose --mi_loss_weight 10 their criterion turns into lambda_q 100, lambda_x 10
# for every size (their L_Dqq carries a factor 10)
SMALLER_DISENTANGLEMENT_WEIGHTS = {"dqq_weight": 50.0, "dxq_weight": 5.0}
AUTHORS_SCRIPT_LOSS_WEIGHTS = {"dqq_weight": 100.0, "dxq_weight": 10.0}

# How the per-sentence regularisers enter the batch loss (see scale_regulariser).
REGULARISER_SCALES = ("sentence", "batch", "token")

LOG_2PI = math.log(2.0 * math.pi)  # of the Gaussian log-densities (eq. 9, 20)
AUTHORS_EPS = 1e-6  # the eps of the authors' F.normalize calls and of their log(1 - p + eps)
PAPER_MASK_FLOOR = 1e-6  # the paper reading's floor on M of eq. (10): no overlap falls back to plain attention
# Posterior variance sigma_tilde^2 of eq. (20): Section IV-A3 prints 0.1; the authors' code uses
# its fixed ``self.var`` = 0.01, the variance of its sampling noise too.
PAPER_POSTERIOR_VAR = 0.1
AUTHORS_POSTERIOR_VAR = 0.01


class SDMAConfigError(PluginConfigError):
    """An impossible SDMA hyper-parameter (the message names the option)."""


def check_score_bias(score_bias: "Tensor", scores: Tuple[int, int, int, int], caller: str = "") -> None:
    """Raise :class:`SDMAConfigError` unless ``score_bias`` is 4-D and broadcasts to the ``scores`` shape
    ``[B, H, T, S]``."""
    if score_bias.dim() != 4 or any(b not in (1, n) for b, n in zip(score_bias.shape, scores)):
        raise SDMAConfigError(f"{caller}score_bias of shape {tuple(score_bias.shape)} does not broadcast to the scores "
                              f"[B, H, T, S] = {list(scores)}")


def _option(default, help: str, **metadata):
    """A dataclass field whose ``metadata["help"]`` is the documentation of the option (fairseq's
    convention, read by its ``gen_parser_from_dataclass`` and by the ESPnet adapter's errors)."""
    return field(default=default, metadata={"help": help, **metadata})


@dataclass
class SDMAOptions:
    """Hyper-parameters of one SDMA attention module: the one place their defaults and
    documentation are written (paper Section IV-A3 and Table I).

    Each field is one option under one name in both toolkits: fairseq ``--sdma-<field>`` (the
    ``sdma_<field>`` fields of ``user_dir/sdma/model.py``, which take these defaults and help texts),
    ESPnet ``encoder_conf: {sdma_conf: {<field>: ...}}`` (:meth:`from_conf`). Presets (a Table I row,
    the Aishell-1 run) override only what differs.
    """

    mode: str = _option("sdma", "sdma: SDMA-T; sma: SMA-T (no head disentanglement); none: vanilla attention",
                        choices=SDMA_MODES)
    reading: str = _option(
        "authors", "authors: the training computation of the authors' code, which produced the paper's "
                   "numbers (second noise draw on the queries, clean k/v, their KL, diversity and L_Dqq "
                   "forms, padded-length averages, their initialisation); paper: the equations as printed "
                   "(see examples/sdma_translation/readings.md)", choices=READINGS)
    # Tables II-IV fix n_c = 4 (Section IV-C1; Table V's n_c = 4 row is Table II's SDMA-T base, and the
    # authors' IWSLT script passes --clusters 4) although Table I lists 8/8 for IWSLT'14 base
    clusters: int = _option(4, "n_c of the feature GMM theta_z, eq. (5)/(9) (Tables II-IV: 4; Table I lists 8)",
                            metavar="N")
    query_clusters: int = _option(4, "n_c of the query GMM theta_q, eq. (18) (Tables II-IV: 4; Table I lists 8)",
                                  metavar="N")
    mix_max: float = _option(0.9, "nu, upper bound of the mixing weight of eq. (11), in (0, 1]", metavar="NU")
    mix_rate: float = _option(5e-4, "R of the annealed mixing weight g = 1 - max(1 - nu, exp(-R * num_updates)), "
                                    "eq. (11)", metavar="R")
    centroid_grad_scale: float = _option(10.0, "c_g: multiplier of the GMM means' gradient (Table I: 10; 5 for "
                                               "Zh-En and Aishell-1)", metavar="C_G")
    noise_var: float = _option(0.01, "variance sigma^2 of the training-time sampling noise, eq. (8)", metavar="S2")
    posterior_var: Optional[float] = _option(
        None, "variance sigma_tilde^2 of q(z|x) and q(q|x) in the KL of eq. (20) (default: the reading's: "
              f"authors = {AUTHORS_POSTERIOR_VAR}, their code; paper = {PAPER_POSTERIOR_VAR}, Section IV-A3)",
        metavar="S2")
    gmm_init: Optional[str] = _option(
        None, "how both GMMs start: authors = their code's xavier_normal_ on every GMM parameter (means near "
              "the origin, soft clusters at step 0); paper = means N(0, 1), unit variances, a uniform prior "
              "(near-hard clusters at step 0); default: the reading's", choices=READINGS)
    diversity_alpha: float = _option(1.25, "alpha of the diversity mask, eq. (23)", metavar="A")
    diversity_beta: float = _option(0.75, "beta of the diversity mask, eq. (23)", metavar="B")
    attention_kernel: str = _option(
        "auto", "how A_hat V of eq. (11) is computed: explicit (scores, one softmax, the multiplicative mask of "
                "eq. 2; attention weights available), sdpa (two torch scaled_dot_product_attention calls, the "
                "mask as additive log M; attention dropout then drawn per branch), lowrank (one SDPA call over the "
                "value widened by the key responsibilities, no T x S mask; attention dropout then drops A before the "
                "mask; slower than sdpa in every shape measured on an H100, see examples/sdma_translation/README.md), "
                "triton (Triton kernels for the clustering of eq. 9 and a flash-style masked mixture, each with its "
                "backward: a few launches per module instead of dozens; CUDA, or a CPU under TRITON_INTERPRET=1; "
                "attention dropout drops A_hat as in explicit), "
                "auto (sdpa on CUDA when the weights are not needed and no attention dropout is active, explicit "
                "otherwise)",
        choices=ATTENTION_KERNELS)
    mask_at_inference: bool = _option(True, "apply the semantic mask when not training (the paper drops the "
                                            "decoder self-attention's mask at test time)")

    @classmethod
    def from_conf(cls, conf: Optional[Mapping], where: str, preset: Optional[Mapping] = None) -> "SDMAOptions":
        """Validated options from a mapping of option names (``{"clusters": 8, ...}``) on top of
        ``preset`` (field names -> values); errors name ``where`` + the key, e.g.
        ``encoder_conf.sdma_conf.clusters=0: ...``."""
        names = [f.name for f in fields(cls)]
        values = dict(preset or {})
        for key, value in dict(conf or {}).items():
            if key in REMOVED_OPTIONS:
                raise SDMAConfigError(removed_option_message(
                    f"{where}.{key}", key, "delete the key (from a trained model's config.yaml too)"))
            if key not in names:
                raise SDMAConfigError(f"{where}.{key}: unknown SDMA option; the options are {', '.join(names)}")
            values[key] = value
        return cls(**values).validate(prefix=f"{where}.", word_sep="_")

    def validate(self, prefix: str = "--sdma-", word_sep: str = "-") -> "SDMAOptions":
        """Raise :class:`SDMAConfigError` naming the option (``prefix`` + name) that is wrong."""

        def opt(name):
            return prefix + name.replace("_", word_sep)

        if self.mode not in SDMA_MODES:
            raise SDMAConfigError(
                f"{opt('mode')}={self.mode!r} is not one of {', '.join(SDMA_MODES)}"
            )
        if self.reading not in READINGS:
            raise SDMAConfigError(f"{opt('reading')}={self.reading!r} is not one of {', '.join(READINGS)}")
        if self.gmm_init is not None and self.gmm_init not in READINGS:
            raise SDMAConfigError(f"{opt('gmm_init')}={self.gmm_init!r} is not one of {', '.join(READINGS)}")
        if self.attention_kernel not in ATTENTION_KERNELS:
            raise SDMAConfigError(f"{opt('attention_kernel')}={self.attention_kernel!r} is not one of "
                                  f"{', '.join(ATTENTION_KERNELS)}")
        for name in ("clusters", "query_clusters"):
            value = getattr(self, name)
            check_positive_int(opt(name), value, SDMAConfigError, "the number of GMM clusters")
        for name in ("mix_max", "mix_rate", "centroid_grad_scale", "noise_var", "posterior_var",
                     "diversity_alpha", "diversity_beta"):
            value = getattr(self, name)
            if name == "posterior_var" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise SDMAConfigError(f"{opt(name)}={value!r} must be a finite number")
        if not (0.0 < self.mix_max <= 1.0):
            raise SDMAConfigError(f"{opt('mix_max')}={self.mix_max}: nu must lie in (0, 1]")
        for name in ("mix_rate", "centroid_grad_scale", "noise_var"):
            if getattr(self, name) < 0:
                raise SDMAConfigError(f"{opt(name)}={getattr(self, name)} must be >= 0")
        if self.posterior_var is not None and self.posterior_var <= 0:
            raise SDMAConfigError(f"{opt('posterior_var')}={self.posterior_var} must be > 0")
        for name in ("diversity_alpha", "diversity_beta"):
            if getattr(self, name) < 0:
                raise SDMAConfigError(f"{opt(name)}={getattr(self, name)} must be >= 0")
        if not isinstance(self.mask_at_inference, bool):
            raise SDMAConfigError(f"{opt('mask_at_inference')}={self.mask_at_inference!r} must be true or false")
        return self

    @property
    def authors(self) -> bool:
        return self.reading == "authors"

    @property
    def gmm_initialisation(self) -> str:
        """``gmm_init``, else the reading's."""
        return self.gmm_init or self.reading

    @property
    def kl_posterior_var(self) -> float:
        """sigma_tilde^2 of eq. (20): ``posterior_var``, else the reading's value."""
        if self.posterior_var is not None:
            return float(self.posterior_var)
        return AUTHORS_POSTERIOR_VAR if self.authors else PAPER_POSTERIOR_VAR


@dataclass
class SDMALossWeights:
    """The weights of eq. (24) (Table I, IWSLT'14 base; the rows and presets override what differs).
    Options ``sdma_<field>`` (fairseq ``--sdma-kl-weight``, ESPnet ``model_conf.sdma_kl_weight``)."""

    # metadata: the paper's symbol, the loss terms (LOSS_NAMES) it weights and its sign in eq. (24)
    kl_weight: float = _option(0.01, "lambda_k of eq. (24) (Table I: 0.01)", metavar="W",
                               symbol="lambda_k", terms=("kl_z", "kl_q"), sign=1.0)
    dqq_weight: float = _option(100.0, "lambda_q of eq. (24) (Table I: 100 base/small, 50 tiny/Zh-En)", metavar="W",
                                symbol="lambda_q", terms=("dqq",), sign=1.0)
    dxq_weight: float = _option(10.0, "lambda_x of eq. (24) (Table I: 10 base/small, 5 tiny/Zh-En)", metavar="W",
                                symbol="lambda_x", terms=("dxq",), sign=-1.0)
    diversity_weight: float = _option(1.0, "lambda_d of eq. (24) (Table I: 1)", metavar="W",
                                      symbol="lambda_d", terms=("dv_z", "dv_q"), sign=1.0)

    def as_options(self) -> Dict[str, float]:
        """``{"sdma_kl_weight": ..., ...}``: the keys of :data:`LOSS_WEIGHTS`."""
        return {f"sdma_{f.name}": getattr(self, f.name) for f in fields(self)}


# Loss-weight option (fairseq --sdma-*-weight, ESPnet model_conf sdma_*_weight)
# -> (paper symbol, loss terms it weights, sign in eq. 24), read off SDMALossWeights
LOSS_WEIGHTS = {f"sdma_{f.name}": (f.metadata["symbol"], f.metadata["terms"], f.metadata["sign"])
                for f in fields(SDMALossWeights)}


def mixing_weight(num_updates: float, mix_max: float = SDMAOptions.mix_max,
                  mix_rate: float = SDMAOptions.mix_rate) -> float:
    """gamma = 1 - max(1 - nu, exp(-rate * t))  (eq. 11; the paper drops the minus sign)."""
    return 1.0 - max(1.0 - mix_max, math.exp(-mix_rate * float(num_updates)))

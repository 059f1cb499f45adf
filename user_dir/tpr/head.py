"""The TPR layer of HUBERT (Moradshahi et al. 2019, arXiv:1910.12647, Section 3).

Plain PyTorch. Symbols follow the paper: ``n_S`` symbols (fillers) of size ``d_S`` in the
columns of the global symbol matrix ``S [d_S, n_S]``, ``n_R`` roles of size ``d_R`` in the
columns of the role matrix ``R [d_R, n_R]``. For every token t::

    h_S, h_R = filler path(v), role path(v)      # eq. (3) transformer, or eq. (2) LSTM
    a_S = softmax(W_S h_S / T)                   # eq. (4), [n_S]
    a_R = softmax(W_R h_R / T)                   # eq. (4), [n_R]
    f = S a_S, r = R a_R                         # eq. (7)
    x = scale * vec(f r^T) = scale * vec(S a_S a_R^T R^T)   # eq. (1), [d_S * d_R]

``vec`` is the row-major flatten of the ``[d_S, d_R]`` matrix, so ``x.view(d_S, d_R) @ r``
unbinds the filler when ``r`` has unit norm and is orthogonal to the other roles.

Unlike the authors' code, the padding mask IS given to the transformer paths (their
``src_key_padding_mask`` was commented out, so pad tokens leaked into real tokens' fillers
and roles); the LSTM path carries its state over padded steps unchanged.
"""

import logging
import math
from typing import NamedTuple, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from latent_core.errors import check_heads_divide, check_positive_int

logger = logging.getLogger(__name__)

ENCODERS = ("transformer", "lstm")
AGGREGATIONS = ("concat", "mean", "max", "first")


class TPROutput(NamedTuple):
    x: Tensor  # [B, T, d_S * d_R] bound token representations (scaled), zero at padding
    a_S: Tensor  # [B, T, n_S] symbol selections
    a_R: Tensor  # [B, T, n_R] role selections
    f: Tensor  # [B, T, d_S] fillers S a_S
    r: Tensor  # [B, T, d_R] roles R a_R


# --------------------------------------------------------------------------- checks


def check_temperature(value, option: str = "--tpr-temperature") -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{option} {value!r} must be a finite number > 0 (the softmax temperature T of eq. 4)")
    return float(value)


def check_orthogonality(value, option: str = "--tpr-orthogonality") -> float:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{option} {value!r} must be a finite number >= 0 (lambda of eq. 6)")
    return float(value)


# ------------------------------------------------------------------------ functions
def bind(S: Tensor, R: Tensor, a_S: Tensor, a_R: Tensor) -> Tuple[Tensor, Tensor, Tensor]:
    """Eq. (1) with the rank-one binding B = a_S a_R^T.

    ``S [d_S, n_S]``, ``R [d_R, n_R]``, ``a_S [..., n_S]``, ``a_R [..., n_R]`` ->
    (x ``[..., d_S * d_R]`` = vec(f r^T), f ``[..., d_S]``, r ``[..., d_R]``).
    """
    f = a_S @ S.t()  # f = S a_S  (eq. 7 for fillers)
    r = a_R @ R.t()  # r = R a_R  (eq. 7)
    x = f.unsqueeze(-1) * r.unsqueeze(-2)  # f r^T = S a_S a_R^T R^T   (eq. 1)
    return x.flatten(-2), f, r


def role_orthogonality(R: Tensor) -> Tuple[Tensor, Tensor]:
    """Double soft orthogonality of eq. (6) (without lambda), ``R [d_R, n_R]`` ->
    (||R R^T - I_{d_R}||_F^2, ||R^T R - I_{n_R}||_F^2), both 0-d.

    R R^T and R^T R have rank <= min(d_R, n_R): when n_R > d_R the second term is at least
    n_R - d_R (n_R - d_R zero eigenvalues of R^T R, each off by 1 from I), when d_R > n_R the
    first is at least d_R - n_R. Only a square orthogonal R makes both zero.
    """
    d_R, n_R = R.shape
    eye_d = torch.eye(d_R, dtype=R.dtype, device=R.device)
    eye_n = torch.eye(n_R, dtype=R.dtype, device=R.device)
    return (R @ R.t() - eye_d).pow(2).sum(), (R.t() @ R - eye_n).pow(2).sum()


def warn_unreachable_orthogonality(n_R: int, d_R: int, lam: float) -> Optional[str]:
    """The warning (logged and returned) when lambda > 0 and R cannot be orthogonal."""
    if lam <= 0 or n_R == d_R:
        return None
    if n_R > d_R:
        message = (f"--tpr-roles {n_R} > --tpr-role-dim {d_R} with --tpr-orthogonality {lam}: R R^T "
                   f"({d_R} x {d_R}) can reach I, but R^T R ({n_R} x {n_R}) has rank <= {d_R}, so "
                   f"||R^T R - I||_F^2 >= {n_R - d_R} (n_R - d_R) at best: the regulariser never reaches 0")
    else:
        message = (f"--tpr-roles {n_R} < --tpr-role-dim {d_R} with --tpr-orthogonality {lam}: R^T R "
                   f"({n_R} x {n_R}) can reach I, but R R^T ({d_R} x {d_R}) has rank <= {n_R}, so "
                   f"||R R^T - I||_F^2 >= {d_R - n_R} (d_R - n_R) at best: the regulariser never reaches 0")
    logger.warning(message)
    return message


# ---------------------------------------------------------------------------- paths
class LSTMBindingPaths(nn.Module):
    """Eq. (2): two LSTM cells whose hidden-state input is the previous token's
    vec(x^(t-1)) (binding of the previous role and symbol) and whose cell states are their own.

    ``forward(v [B, T, H], padding_mask [B, T], select) -> (x, a_S, a_R, f, r)``, each
    ``[B, T, .]``; ``select(h_S, h_R) -> (a_S, a_R)`` applies eq. (4). Padded steps keep the
    state (any padding layout works) and return zeros.
    """

    def __init__(self, input_size: int, d_S: int, d_R: int):
        super().__init__()
        self.hidden = d_S * d_R
        self.cell_S = nn.LSTMCell(input_size, self.hidden)
        self.cell_R = nn.LSTMCell(input_size, self.hidden)

    def forward(self, v: Tensor, padding_mask: Tensor, select, S: Tensor, R: Tensor):
        B, T, _ = v.shape
        x_prev = v.new_zeros(B, self.hidden)
        c_S, c_R = v.new_zeros(B, self.hidden), v.new_zeros(B, self.hidden)
        outs = []
        for t in range(T):
            h_S, c_S_new = self.cell_S(v[:, t], (x_prev, c_S))  # eq. (2)
            h_R, c_R_new = self.cell_R(v[:, t], (x_prev, c_R))  # eq. (2)
            a_S, a_R = select(h_S, h_R)  # eq. (4)
            x, f, r = bind(S, R, a_S, a_R)  # eq. (1)
            keep = (~padding_mask[:, t]).unsqueeze(-1).to(v.dtype)
            x_prev = keep * x + (1 - keep) * x_prev
            c_S = keep * c_S_new + (1 - keep) * c_S
            c_R = keep * c_R_new + (1 - keep) * c_R
            outs.append((x * keep, a_S, a_R, f, r))
        return tuple(torch.stack(parts, dim=1) for parts in zip(*outs))


class TPRLayer(nn.Module):
    """HUBERT's TPR layer: ``forward(h [B, T, H], padding_mask [B, T] True at padding)`` ->
    :class:`TPROutput` (x ``[B, T, d_S*d_R]``, zero at padding).

    ``encoder``: ``transformer`` (eq. 3; one ``nn.TransformerEncoderLayer`` per path, with the
    key padding mask) or ``lstm`` (eq. 2). ``scale``: initial value of the trainable scalar
    multiplying the bound values (the paper: ~1000 against underflow in the LSTM variant).
    """

    def __init__(self, input_size: int, n_symbols: int = 50, n_roles: int = 35, d_symbol: int = 32,
                 d_role: int = 32, temperature: float = 1.0, encoder: str = "transformer", heads: int = 1,
                 dropout: float = 0.1, ffn_dim: Optional[int] = None, scale: float = 1.0):
        super().__init__()
        for option, value in (("--tpr-symbols", n_symbols), ("--tpr-roles", n_roles),
                              ("--tpr-symbol-dim", d_symbol), ("--tpr-role-dim", d_role), ("--tpr-heads", heads)):
            check_positive_int(option, value)
        self.temperature = check_temperature(temperature)
        if encoder not in ENCODERS:
            raise ValueError(f"--tpr-encoder {encoder!r}: choose {' or '.join(ENCODERS)}")
        if not (math.isfinite(scale) and scale != 0):
            raise ValueError(f"--tpr-scale {scale!r} must be a finite non-zero number")
        self.n_S, self.n_R, self.d_S, self.d_R = n_symbols, n_roles, d_symbol, d_role
        self.encoder = encoder
        self.output_size = d_symbol * d_role
        # global symbol and role matrices (columns = embeddings); R starts (semi-)orthogonal
        self.S = nn.Parameter(torch.randn(d_symbol, n_symbols) / math.sqrt(d_symbol))
        self.R = nn.Parameter(nn.init.orthogonal_(torch.empty(d_role, n_roles)))
        self.scale = nn.Parameter(torch.tensor(float(scale)))
        if encoder == "transformer":
            check_heads_divide("--tpr-heads", heads, "the encoder's hidden size", input_size)
            ffn = ffn_dim or 4 * input_size

            def layer():
                return nn.TransformerEncoderLayer(input_size, heads, ffn, dropout, batch_first=True)

            self.filler_encoder, self.role_encoder = layer(), layer()  # eq. (3)
            selector_input = input_size
        else:
            self.paths = LSTMBindingPaths(input_size, d_symbol, d_role)  # eq. (2)
            selector_input = self.output_size
        self.W_S = nn.Linear(selector_input, n_symbols)  # eq. (4)
        self.W_R = nn.Linear(selector_input, n_roles)

    def select(self, h_S: Tensor, h_R: Tensor) -> Tuple[Tensor, Tensor]:
        """Eq. (4): (softmax(W_S h_S / T), softmax(W_R h_R / T))."""
        return (F.softmax(self.W_S(h_S) / self.temperature, dim=-1),
                F.softmax(self.W_R(h_R) / self.temperature, dim=-1))

    def forward(self, h: Tensor, padding_mask: Tensor) -> TPROutput:
        if self.encoder == "transformer":
            h_S = self.filler_encoder(h, src_key_padding_mask=padding_mask)  # eq. (3), padding masked
            h_R = self.role_encoder(h, src_key_padding_mask=padding_mask)
            a_S, a_R = self.select(h_S, h_R)
            x, f, r = bind(self.S, self.R, a_S, a_R)
            x = x * (~padding_mask).unsqueeze(-1).to(x.dtype)
        else:
            x, a_S, a_R, f, r = self.paths(h, padding_mask, self.select, self.S, self.R)
        return TPROutput(self.scale * x, a_S, a_R, f, r)

    def orthogonality(self) -> Tuple[Tensor, Tensor]:
        return role_orthogonality(self.R)


class Aggregation(nn.Module):
    """Eq. (5)'s Agg: ``(x [B, T, D], padding_mask [B, T]) -> [B, output_size]``.

    ``concat``: the T token vectors (padding zeroed) right-padded with zeros to ``max_len``
    positions, flattened and projected by a linear layer to ``output_size`` (the paper's
    choice; needs the task's fixed --max-positions); ``mean``/``max`` over the non-padding
    tokens; ``first``: the first token ([CLS]). Appending padding never changes the result.
    """

    def __init__(self, strategy: str, size: int, max_len: Optional[int] = None, output_size: Optional[int] = None):
        super().__init__()
        if strategy not in AGGREGATIONS:
            raise ValueError(f"--tpr-aggregation {strategy!r}: choose from {', '.join(AGGREGATIONS)}")
        self.strategy, self.size = strategy, size
        self.output_size = size
        if strategy == "concat":
            check_positive_int("--max-positions (concat aggregation)", max_len)
            self.max_len = max_len
            self.output_size = output_size or size
            self.project = nn.Linear(max_len * size, self.output_size)

    def forward(self, x: Tensor, padding_mask: Tensor) -> Tensor:
        keep = (~padding_mask).unsqueeze(-1)
        if self.strategy == "first":
            return x[:, 0]
        if self.strategy == "mean":
            k = keep.to(x.dtype)
            return (x * k).sum(1) / k.sum(1).clamp_min(1.0)
        if self.strategy == "max":
            return x.masked_fill(~keep, float("-inf")).amax(1)
        B, T, D = x.shape
        if T > self.max_len:
            raise ValueError(f"--tpr-aggregation concat: a batch of {T} pieces exceeds --max-positions {self.max_len}")
        x = x * keep.to(x.dtype)
        # == project(x zero-padded to max_len positions): the zero positions meet only the
        # weight columns past T * D, so those are skipped (max_len / T times less work)
        return F.linear(x.reshape(B, T * D), self.project.weight[:, :T * D], self.project.bias)

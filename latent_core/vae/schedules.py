"""Beta schedules: pure functions of fairseq's update counter ``num_updates``.

No schedule keeps a counter of its own, so a run resumed from a checkpoint continues
exactly where it stopped (fairseq restores ``num_updates``).

* ``constant:BETA``
* ``linear:START:END:BETA_MAX``: 0 up to step START, then linear to BETA_MAX at step END,
  BETA_MAX afterwards (KL annealing, Bowman et al. 2016). QKVAE (Appendix B) anneals z_sem
  over steps 3k-6k to 0.6 and z_syn over 7k-20k to 0.3, one window per latent.
* ``cyclical:N_CYCLES:ZERO:INCREASE:CONSTANT[:BETA_MAX[:TOTAL_STEPS]]`` (Fu et al. 2019;
  Optimus Section 4.3: 10 cycles, 0.5/0.25/0.25): TOTAL_STEPS (default: fairseq's
  ``--max-update``) are cut into N_CYCLES periods; in each, beta is 0 for the first ZERO
  fraction, rises linearly to BETA_MAX (default 1) over the next INCREASE fraction and stays
  there for the last CONSTANT fraction, element for element as the array of Optimus'
  ``frange_cycle_zero_linear`` (:meth:`CyclicalSchedule.__call__`). After TOTAL_STEPS beta
  stays at BETA_MAX.

``--beta-schedule`` holds comma-separated entries ``[LATENT=]SCHEDULE``; an entry without a
latent name is the default of every latent not named, e.g.
``z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3`` or ``cyclical:10:0.5:0.25:0.25``.
``--ae-steps N`` adds an auto-encoder phase: beta = 0 for updates < N whatever the schedule
(the schedule is not shifted).
"""

import functools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence

from latent_core.errors import check_positive_int

from .errors import VAEConfigError

SCHEDULE_OPTION = "--beta-schedule"
AE_STEPS_OPTION = "--ae-steps"
MAX_UPDATES = 2**63 - 1  # a 64-bit update counter; larger step counts overflow float division


def _check_steps(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise VAEConfigError(f"{name}={value!r} must be an integer number of updates >= 0")
    if value > MAX_UPDATES:
        raise VAEConfigError(f"{name}={value!r} is more updates than a 64-bit counter holds "
                             f"(at most 2**63 - 1)")


def _check_beta(name: str, value: float) -> None:
    if not (math.isfinite(value) and value >= 0):
        raise VAEConfigError(f"{name}={value} must be a finite number >= 0")


@dataclass(frozen=True)
class ConstantSchedule:
    """beta(t) = beta."""

    beta: float

    def __post_init__(self):
        _check_beta("beta", self.beta)

    def __call__(self, num_updates: int) -> float:
        return float(self.beta)


@dataclass(frozen=True)
class LinearSchedule:
    """beta(t) = beta_max * clip((t - start) / (end - start), 0, 1)."""

    start: int
    end: int
    beta_max: float

    def __post_init__(self):
        _check_steps("start", self.start)
        _check_steps("end", self.end)
        if self.end <= self.start:
            raise VAEConfigError(f"end={self.end} must be > start={self.start}")
        _check_beta("beta_max", self.beta_max)

    def __call__(self, num_updates: int) -> float:
        progress = (num_updates - self.start) / (self.end - self.start)
        return self.beta_max * min(1.0, max(0.0, progress))


@dataclass(frozen=True)
class CyclicalSchedule:
    """Fu et al.'s cyclical schedule as used by Optimus (Section 4.3); see the module doc."""

    n_cycles: int
    total_steps: int
    zero_ratio: float = 0.5
    increase_ratio: float = 0.25
    constant_ratio: float = 0.25
    beta_max: float = 1.0

    def __post_init__(self):
        for name in ("n_cycles", "total_steps"):
            value = getattr(self, name)
            check_positive_int(name, value, VAEConfigError)
            if value > MAX_UPDATES:
                raise VAEConfigError(f"{name}={value!r} must be at most 2**63 - 1")
        ratios = (self.zero_ratio, self.increase_ratio, self.constant_ratio)
        for name, value in zip(("zero_ratio", "increase_ratio", "constant_ratio"), ratios):
            if not 0.0 <= value <= 1.0:
                raise VAEConfigError(f"{name}={value} must lie in [0, 1]")
        if abs(sum(ratios) - 1.0) > 1e-6:
            raise VAEConfigError(
                f"zero, increase and constant ratios {ratios} must sum to 1 (they sum to {sum(ratios):g})"
            )
        _check_beta("beta_max", self.beta_max)

    def __call__(self, num_updates: int) -> float:
        """Element ``num_updates`` of Optimus' ``frange_cycle_zero_linear(total_steps, 0, beta_max,
        n_cycles, increase_ratio, zero_ratio)`` array (their ``utils.py``), without building it.

        Their loop, per cycle c: for i = 0, 1, ... while v <= beta_max, write L[int(i + c * period)] = 0
        while i < period * zero_ratio, else v, then v += step (v from 0, step = beta_max / (period *
        increase_ratio)); every element no cycle writes keeps beta_max, and a later cycle overwrites an
        earlier one. Hence, where the period is not a whole number of steps, a cycle starts at
        int(c * period) and its ramp starts with one 0, on their accumulated v (exact up to ramps of
        ``EXACT_RAMP_LIMIT`` values, k * step beyond). After ``total_steps``: beta_max (their pre-training
        script gives 1.0, the same at their beta = 1). beta_max = 0 (their loop never ends) is 0;
        increase_ratio = 0 (their division by zero) jumps to beta_max after the zero phase.
        """
        t = max(int(num_updates), 0)
        if t >= self.total_steps or self.beta_max == 0:
            return float(self.beta_max)
        period = self.total_steps / self.n_cycles
        zeros = max(math.ceil(period * self.zero_ratio), 0)  # i < period * zero_ratio
        ramp = _optimus_ramp(period, self.increase_ratio, float(self.beta_max))
        length = zeros + ramp.length  # elements one cycle writes (may exceed what len() can return)
        for c in range(min(self.n_cycles - 1, int(t // period) + 1), -1, -1):
            base = c * period
            if int(base) + length + 1 < t:
                break  # this cycle and every earlier one stop before t
            for i in (t - int(base) + 1, t - int(base), t - int(base) - 1):  # the last write wins
                if 0 <= i < length and int(i + base) == t:
                    return 0.0 if i < zeros else ramp[i - zeros]
        return float(self.beta_max)


EXACT_RAMP_LIMIT = 1_000_000


@functools.lru_cache(maxsize=16)
def _optimus_ramp(period: float, increase_ratio: float, beta_max: float) -> "_Ramp":
    """The values one cycle of ``frange_cycle_zero_linear`` writes after its zeros: v = 0, step, 2 step, ...
    while v <= beta_max, v accumulated as their loop does (``v += step``)."""
    if increase_ratio == 0:
        return _Ramp(0.0, 0, ())
    step = beta_max / (period * increase_ratio)
    count = math.floor(beta_max / step) + 2  # an upper bound of the loop's length
    if count > EXACT_RAMP_LIMIT:
        return _Ramp(step, math.floor(beta_max / step) + 1, ())
    values, v = [], 0.0
    while v <= beta_max:
        values.append(v)
        v += step
    return _Ramp(step, len(values), tuple(values))


@dataclass(frozen=True)
class _Ramp:
    """Indexable ramp: the accumulated values where they were computed, else ``k * step``; with
    ``step = 0`` (increase_ratio 0) no ramp element (beta_max follows the zeros)."""

    step: float
    length: int
    values: tuple

    def __getitem__(self, k: int) -> float:
        return self.values[k] if self.values else k * self.step


Schedule = Callable[[int], float]


@dataclass(frozen=True)
class AutoEncoderPhase:
    """beta = 0 for num_updates < ae_steps (pure auto-encoding), then ``schedule``'s value."""

    ae_steps: int
    schedule: Schedule

    def __post_init__(self):
        _check_steps(AE_STEPS_OPTION, self.ae_steps)

    def __call__(self, num_updates: int) -> float:
        return 0.0 if num_updates < self.ae_steps else self.schedule(num_updates)


# ----------------------------------------------------------------------------
# Spec parsing
# ----------------------------------------------------------------------------

# name -> (form, fewest and most arguments)
_FORMS = {
    "constant": ("constant:BETA", 1, 1),
    "linear": ("linear:START:END:BETA_MAX", 3, 3),
    "cyclical": ("cyclical:N_CYCLES:ZERO:INCREASE:CONSTANT[:BETA_MAX[:TOTAL_STEPS]]", 4, 6),
}


def _int(text: str, what: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise VAEConfigError(f"{what}={text!r} is not an integer") from None


def _float(text: str, what: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise VAEConfigError(f"{what}={text!r} is not a number") from None


def _cyclical(args: List[str], total_updates: Optional[int]) -> CyclicalSchedule:
    n_cycles = _int(args[0], "N_CYCLES")
    ratios = [_float(a, w) for a, w in zip(args[1:4], ("ZERO", "INCREASE", "CONSTANT"))]
    beta_max = _float(args[4], "BETA_MAX") if len(args) > 4 else 1.0
    total = _int(args[5], "TOTAL_STEPS") if len(args) > 5 else total_updates
    if not total:
        raise VAEConfigError(
            "cyclical needs the total number of updates: set --max-update or give TOTAL_STEPS"
        )
    return CyclicalSchedule(n_cycles, total, *ratios, beta_max=beta_max)


def parse_schedule(text: str, total_updates: Optional[int] = None) -> Schedule:
    """One schedule from ``NAME:ARG:...`` (forms in the module doc).

    ``total_updates`` (fairseq's ``--max-update``) is the cyclical schedule's default length.
    Raises :class:`VAEConfigError` naming ``--beta-schedule`` and the offending text.
    """
    name, *args = text.strip().split(":")
    try:
        if name not in _FORMS:
            raise VAEConfigError(f"unknown schedule {name!r}; known: {', '.join(_FORMS)}")
        form, fewest, most = _FORMS[name]
        if not fewest <= len(args) <= most:
            raise VAEConfigError(f"expected {form}")
        if name == "constant":
            return ConstantSchedule(_float(args[0], "BETA"))
        if name == "linear":
            return LinearSchedule(_int(args[0], "START"), _int(args[1], "END"),
                                  _float(args[2], "BETA_MAX"))
        return _cyclical(args, total_updates)
    except VAEConfigError as err:
        raise VAEConfigError(f"{SCHEDULE_OPTION} {text!r}: {err}") from None


def parse_beta_schedules(spec: str, latents: Sequence[str], ae_steps: int = 0,
                         total_updates: Optional[int] = None) -> Dict[str, Schedule]:
    """``--beta-schedule`` -> one schedule per latent in ``latents``.

    ``ae_steps`` > 0 wraps every schedule in :class:`AutoEncoderPhase`. Errors: unknown or
    repeated latent names, a latent left without a schedule, and every :func:`parse_schedule`
    error.
    """
    _check_steps(AE_STEPS_OPTION, ae_steps)
    by_latent: Dict[Optional[str], Schedule] = {}  # None: the default entry
    for entry in spec.split(","):
        latent, named, text = entry.rpartition("=")
        key = latent.strip() if named else None
        if key is not None and key not in latents:
            raise VAEConfigError(
                f"{SCHEDULE_OPTION}: unknown latent {key!r}; the latents are {', '.join(latents)}"
            )
        if key in by_latent:
            raise VAEConfigError(f"{SCHEDULE_OPTION}: two schedules for {key or 'the default'}")
        by_latent[key] = parse_schedule(text, total_updates)
    missing = [name for name in latents if name not in by_latent and None not in by_latent]
    if missing:
        raise VAEConfigError(f"{SCHEDULE_OPTION}: no schedule for latent(s) {', '.join(missing)}")
    schedules = {name: by_latent.get(name, by_latent.get(None)) for name in latents}
    if ae_steps:
        schedules = {name: AutoEncoderPhase(ae_steps, s) for name, s in schedules.items()}
    return schedules

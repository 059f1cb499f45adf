"""The cyclical beta schedule is Optimus' ``frange_cycle_zero_linear``, element for element, on numbers their
function printed (``tests/reference/optimus_schedule.py``): whole arrays of short runs, and every element of long
ones through a digest, where the period is not a whole number of steps included."""

import math

import pytest

from latent_core.vae import CyclicalSchedule
from tests.reference.optimus_schedule import digest, probe_indices
from tests.reference.optimus_schedule_reference import AUTHORS_SCHEDULES


def schedule(n_iter, n_cycle, ratio_zero, ratio_increase, stop) -> CyclicalSchedule:
    return CyclicalSchedule(n_cycle, n_iter, ratio_zero, ratio_increase, 1.0 - ratio_zero - ratio_increase, stop)


@pytest.mark.parametrize("key", [k for k, v in AUTHORS_SCHEDULES.items() if "values" in v], ids=str)
def test_short_runs_equal_their_array(key):
    ours = schedule(*key)
    assert [ours(t) for t in range(key[0])] == AUTHORS_SCHEDULES[key]["values"]


@pytest.mark.parametrize("key", [k for k, v in AUTHORS_SCHEDULES.items() if "digest" in v], ids=str)
def test_long_runs_equal_their_array_in_every_element(key):
    ours = schedule(*key)
    values = [ours(t) for t in range(key[0])]
    assert digest(values) == AUTHORS_SCHEDULES[key]["digest"]
    probes = AUTHORS_SCHEDULES[key]["probes"]
    assert set(probes) == set(probe_indices(*key[:4]))
    assert {i: values[i] for i in probes} == probes


def test_the_cases_the_old_formula_missed():
    """60,001 steps in 10 cycles: a cycle starts at int(c * 6000.1), so step 54,000 is the last cycle's first zero
    (a phase formula, (t mod period) / period, put it in the previous cycle's flat part, 1.0); 2,500 steps in 4
    cycles: the ramp starts with one 0 on their accumulated v."""
    long_run = schedule(60_001, 10, 0.5, 0.25, 1.0)
    probes = AUTHORS_SCHEDULES[(60_001, 10, 0.5, 0.25, 1.0)]["probes"]
    assert probes[53_999] == long_run(53_999) == 1.0 and probes[54_000] == long_run(54_000) == 0.0
    short = schedule(2_500, 4, 0.5, 0.25, 1.0)  # period 625: zeros 0..312, ramp from 313, step 1/156.25
    assert short(312) == short(313) == 0.0 and short(314) == 1 / 156.25


def test_after_the_run_and_degenerate_ratios():
    assert schedule(100, 10, 0.5, 0.25, 0.7)(100) == 0.7 == schedule(100, 10, 0.5, 0.25, 0.7)(10 ** 9)
    jump = CyclicalSchedule(4, 100, 0.5, 0.0, 0.5)  # their division by zero: 0 for the zero phase, then beta_max
    assert [jump(t) for t in (0, 12, 13, 24, 25, 37, 38)] == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert CyclicalSchedule(4, 100, beta_max=0.0)(60) == 0.0  # their loop would never end
    huge = CyclicalSchedule(2, 2 ** 62)  # ramps past the exact limit: k * step
    assert huge(2 ** 60 + 2 ** 58) == pytest.approx(0.5) and math.isfinite(huge(2 ** 61 - 1))

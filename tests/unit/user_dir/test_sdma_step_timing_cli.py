"""``python -m benchmarks.sdma.step_timing``: the update timing alone, per reading."""

import json

import pytest
import torch

from benchmarks.sdma import step_timing


def test_the_update_timing_runs_alone_for_the_reading_and_threads_given(monkeypatch, capsys, tmp_path):
    seen = []

    def fake_time_updates(config, setting):
        seen.append((config, setting.reading, setting.rounds, setting.updates_per_round, torch.get_num_threads()))
        ratios = {"min": 1.0, "median": 1.0, "max": 1.0, "median_ci95": [0.95, 1.05]}
        model = {"wall_ms": [1.0], "cpu_ms": [1.0], "speed_ratio": ratios, "cpu_ratio": ratios, "fastest_ratio": 1.0,
                 "flops_ratio": 1.0, "elementwise_bytes": 1.0, "elementwise_bytes_ratio": 1.0, "elementwise_ops": 1}
        return {"config": config, "setting": setting.__dict__, "models": {"V-T": model}}

    monkeypatch.setattr(step_timing, "time_updates", fake_time_updates)
    threads = torch.get_num_threads()
    try:
        step_timing.main(["--configs", "tiny2x2,tiny", "--reading", "paper", "--rounds", "3", "--threads", "1",
                          "--updates-per-round", "1", "--json", str(tmp_path / "timing.json")])
    finally:
        torch.set_num_threads(threads)
    assert seen == [("tiny2x2", "paper", 3, 1, 1), ("tiny", "paper", 3, 1, 1)]
    out = capsys.readouterr().out
    assert "update timing, tiny, paper reading, 1 threads" in out
    assert "0.950-1.050" in out  # the median's interval, as the table prints it
    written = json.loads((tmp_path / "timing.json").read_text())
    assert set(written) == {"tiny2x2", "tiny"} and written["tiny"]["models"]["V-T"]["speed_ratio"]["median_ci95"] == [
        0.95, 1.05]


def test_an_impossible_number_of_updates_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        step_timing.main(["--configs", "tiny2x2", "--updates-per-round", "0"])
    assert "--updates-per-round" in capsys.readouterr().err


def test_the_median_interval_holds_the_median_and_widens_with_the_spread():
    steady = [0.84, 0.85, 0.86, 0.85, 0.84, 0.86, 0.85]
    noisy = [0.65, 0.85, 1.05, 0.7, 1.0, 0.8, 0.9]
    low, high = step_timing.median_interval(steady)
    assert low <= 0.85 <= high and high - low < 0.03
    noisy_low, noisy_high = step_timing.median_interval(noisy)
    assert noisy_low <= 0.85 <= noisy_high and noisy_high - noisy_low > 5 * (high - low)
    assert step_timing.median_interval(noisy) == [noisy_low, noisy_high]  # seeded: the same timings, the same interval
    assert step_timing.median_interval([0.9, 0.8]) is None
    assert step_timing.median_interval([0.9, 0.9, 0.9]) == [0.9, 0.9]


def test_an_unknown_configuration_is_named():
    with pytest.raises(SystemExit):
        step_timing.main(["--configs", "huge"])

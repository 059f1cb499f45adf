"""``python -m benchmarks.sdma.step_timing``: the update timing alone, per reading."""

import pytest
import torch

from benchmarks.sdma import step_timing


def test_the_update_timing_runs_alone_for_the_reading_and_threads_given(monkeypatch, capsys):
    seen = []

    def fake_time_updates(config, setting):
        seen.append((config, setting.reading, setting.rounds, torch.get_num_threads()))
        ratios = {"min": 1.0, "median": 1.0, "max": 1.0}
        model = {"wall_ms": [1.0], "cpu_ms": [1.0], "speed_ratio": ratios, "cpu_ratio": ratios, "flops_ratio": 1.0,
                 "elementwise_bytes": 1.0, "elementwise_bytes_ratio": 1.0, "elementwise_ops": 1}
        return {"config": config, "setting": setting.__dict__, "models": {"V-T": model}}

    monkeypatch.setattr(step_timing, "time_updates", fake_time_updates)
    threads = torch.get_num_threads()
    try:
        step_timing.main(["--configs", "tiny2x2,tiny", "--reading", "paper", "--rounds", "3", "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert seen == [("tiny2x2", "paper", 3, 1), ("tiny", "paper", 3, 1)]
    assert "update timing, tiny, paper reading, 1 threads" in capsys.readouterr().out


def test_an_unknown_configuration_is_named():
    with pytest.raises(SystemExit):
        step_timing.main(["--configs", "huge"])

"""``python -m benchmarks.sdma.step_timing``: the update timing alone, per reading."""

import json

import pytest
import torch

from benchmarks.sdma import step_timing


def test_the_update_timing_runs_alone_for_the_reading_and_threads_given(monkeypatch, capsys, tmp_path):
    seen = []

    def fake_time_updates(config, setting, isolated=False):
        seen.append((config, setting.reading, setting.rounds, setting.updates_per_round, torch.get_num_threads(),
                     isolated))
        ratios = {"min": 1.0, "median": 1.0, "max": 1.0, "median_ci95": [0.95, 1.05]}
        model = {"wall_ms": [1.0], "cpu_ms": [1.0], "faults_per_update": [12.0], "speed_ratio": ratios,
                 "cpu_ratio": ratios, "fastest_ratio": 1.0, "flops_ratio": 1.0, "elementwise_bytes": 1.0, "elementwise_bytes_ratio": 1.0, "elementwise_ops": 1}
        return {"config": config, "setting": setting.__dict__, "models": {"V-T": model}}

    monkeypatch.setattr(step_timing, "time_updates", fake_time_updates)
    threads = torch.get_num_threads()
    try:
        step_timing.main(["--configs", "tiny2x2,tiny", "--reading", "paper", "--rounds", "3", "--threads", "1",
                          "--updates-per-round", "1", "--json", str(tmp_path / "timing.json")])
    finally:
        torch.set_num_threads(threads)
    assert seen == [("tiny2x2", "paper", 3, 1, 1, False), ("tiny", "paper", 3, 1, 1, False)]
    out = capsys.readouterr().out
    assert "update timing, tiny, paper reading, 1 threads, one process" in out
    assert "0.950-1.050" in out  # the median's interval, as the table prints it
    written = json.loads((tmp_path / "timing.json").read_text())
    assert set(written) == {"tiny2x2", "tiny"} and written["tiny"]["models"]["V-T"]["speed_ratio"]["median_ci95"] == [
        0.95, 1.05]
    step_timing.main(["--configs", "tiny2x2", "--isolated", "--rounds", "3"])
    assert seen[-1][0] == "tiny2x2" and seen[-1][-1] is True
    assert "a process per model" in capsys.readouterr().out


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


def test_unknown_models_are_named():
    with pytest.raises(ValueError, match="'T5'"):
        step_timing.time_updates("tiny2x2", models=["V-T", "T5"])


@pytest.mark.integration  # spawns two processes that build fairseq models (~20 s)
def test_isolated_models_run_in_processes_of_their_own_with_the_same_counts():
    import os

    setting = step_timing.StepSetting(sentences=4, tokens=5, vocab=50, rounds=2, updates_per_round=1)
    shared = step_timing.time_updates("tiny2x2", setting, models=["V-T", "SDMA-T"])
    isolated = step_timing.time_updates("tiny2x2", setting, models=["V-T", "SDMA-T"], isolated=True)
    assert isolated["isolated"] and not shared["isolated"]
    ids = {name: r["process_id"] for name, r in isolated["models"].items()}
    assert len(set(ids.values())) == 2 and os.getpid() not in ids.values()
    assert {r["process_id"] for r in shared["models"].values()} == {os.getpid()}
    for name in ("V-T", "SDMA-T"):  # the same models, counted alike wherever they run
        for key in ("flops_per_update", "elementwise_ops", "elementwise_bytes", "params"):
            assert isolated["models"][name][key] == shared["models"][name][key], (name, key)
        r = isolated["models"][name]
        assert len(r["wall_ms"]) == len(r["faults_per_update"]) == 2 and min(r["faults_per_update"]) >= 0


@pytest.mark.integration
def test_a_model_process_that_dies_is_named():
    setting = step_timing.StepSetting(sentences=4, tokens=5, vocab=50, rounds=1, updates_per_round=1)
    processes = step_timing._IsolatedProcesses("tiny2x2", setting, ["V-T", "SMA-T"])
    try:
        processes.workers["SMA-T"][0].kill()
        processes.workers["SMA-T"][0].join()
        assert processes.run("V-T", 1)["wall_ms"] > 0
        with pytest.raises(RuntimeError, match="process of SMA-T ended"):
            processes.run("SMA-T", 1)
    finally:
        processes.close()

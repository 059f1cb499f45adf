"""The SDMA quickstart (``make demo``, ``experiments.sdma.quickstart``) and the log helpers of ``pipelines.runs``.

Pure functions first (updates from --minutes, segment boundaries, log parsing of a
fabricated multi-segment fairseq log, ratio statistics), then the segment runner with a
fake ``fairseq-train``, then one end-to-end run of the quickstart on a small real Ding
subset with 4 updates in 2 interleaved segments per model (about a minute and a half on
2 idle cores).
"""

import json
import math
from pathlib import Path

import pytest

from pipelines import runs
from experiments.sdma import quickstart as qs

DING = Path("/usr/share/trans/de-en")


# ----------------------------------------------------------------------------
# updates, segments, log interval
# ----------------------------------------------------------------------------


def test_updates_are_a_pure_function_of_minutes():
    default = qs.updates_for_minutes(qs.DEFAULT_MINUTES)
    assert default == qs.parse_args([]).updates
    assert 290 <= default <= 320  # the calibration run's 303 updates took 10.9 minutes
    per_update_pair = sum(qs.SECONDS_PER_UPDATE.values())
    assert qs.updates_for_minutes(60) == pytest.approx(
        (3600 - qs.FIXED_SECONDS - 6 * qs.PROCESS_SECONDS) / per_update_pair, abs=1)
    assert qs.parse_args(["--minutes", "60"]).updates == qs.updates_for_minutes(60)
    assert [qs.updates_for_minutes(m) for m in (5, 10, 30, 60)] == sorted(
        qs.updates_for_minutes(m) for m in (5, 10, 30, 60))
    # the inverse gives back the minutes (to within one update pair)
    for minutes in (11, 30, 60):
        assert qs.idle_minutes(qs.updates_for_minutes(minutes)) == pytest.approx(minutes, abs=0.03)
    # more segments, more start-ups, fewer updates in the same time
    assert qs.updates_for_minutes(11, segments=6) < default


def test_updates_flag_overrides_minutes_and_small_budgets_fail():
    args = qs.parse_args(["--updates", "7", "--minutes", "60"])
    assert args.updates == 7 and args.updates_given
    assert not qs.parse_args([]).updates_given
    with pytest.raises(SystemExit):
        qs.parse_args(["--minutes", "2.5"])  # fixed stages and start-ups alone take 2.6 minutes
    with pytest.raises(SystemExit):
        qs.parse_args(["--updates", "0"])
    with pytest.raises(SystemExit):
        qs.parse_args(["--segments", "0"])


@pytest.mark.parametrize("updates,segments", [(303, 4), (2464, 4), (1167, 5), (40, 4), (7, 3), (4, 2), (3, 4), (1, 4)])
def test_segment_bounds_cover_the_updates(updates, segments):
    interval = qs.log_interval_for(updates, segments)
    bounds = qs.segment_bounds(updates, segments, interval)
    assert len(bounds) == min(segments, updates)
    assert bounds[0][0] == 0 and bounds[-1][1] == updates
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous
    assert all(start < end for start, end in bounds)
    assert all(end % interval == 0 for _, end in bounds[:-1])  # logged intervals never straddle two processes
    sizes = [end - start for start, end in bounds]
    assert max(sizes) - min(sizes) <= interval
    if updates >= 4 * segments:
        assert min(sizes) // interval >= 3  # several logged intervals per segment, the first one skipped
    assert 1 <= interval <= 10


def test_the_plan_scales_the_idle_calibration_by_the_measured_load():
    idle = qs.idle_minutes(300) * 60
    quiet = qs.plan_message(300, "--minutes 15", 4, idle, qs.LOAD_PROBE_IDLE_SECONDS, 1.0)
    busy = qs.plan_message(300, "--minutes 15", 4, idle, 2 * qs.LOAD_PROBE_IDLE_SECONDS, 2.0)
    assert f"about {qs.duration(idle)}," in quiet and f"about {qs.duration(2 * idle)}," in busy
    assert "2.00x the idle calibration" in busy and f"({qs.duration(idle)} on an idle 2-core machine" in busy
    eta = qs.Eta(2.0)  # before any segment ran, every estimate is the idle one times the load
    assert eta.segment("V-T", 100) == pytest.approx(2.0 * (qs.PROCESS_SECONDS + 100 * qs.SECONDS_PER_UPDATE["V-T"]))
    assert eta.fixed("decode") == pytest.approx(2.0 * qs.STAGE_SECONDS["decode"])


def test_measure_load_times_training_updates_of_the_demo_size(monkeypatch):
    from benchmarks.sdma import step_timing

    calls = []
    monkeypatch.setattr(step_timing, "training_update", lambda *a: calls.append(a))
    monkeypatch.setattr(step_timing, "build_for_updates", lambda config, mode, setting: (config, mode, None, None))
    seconds, load = qs.measure_load(updates=3)
    assert len(calls) == 4 and calls[0][:2] == ("tiny2x2", "none")  # one warm-up, three timed
    assert load == pytest.approx(seconds / qs.LOAD_PROBE_IDLE_SECONDS)


def test_default_plan():
    updates = qs.updates_for_minutes(qs.DEFAULT_MINUTES)
    interval = qs.log_interval_for(updates, qs.SEGMENTS)
    assert interval == 10
    assert len(qs.segment_bounds(updates, qs.SEGMENTS, interval)) == 4


# ----------------------------------------------------------------------------
# fairseq logs
# ----------------------------------------------------------------------------

HEAD = "2026-11-23 19:45:02 | INFO | "


def fake_train_log(start, end, interval, wps=lambda u: 4000.0 + u, wpb=3000.0, save_dir="/x"):
    """A ``fairseq-train --log-format simple`` log of updates start -> end (the lines the helpers read)."""
    lines = [
        f"{HEAD}fairseq_cli.train | {{'_name': None, 'common': {{'log_interval': {interval}}}, "
        f"'optimization': {{'max_update': {end}}}}}",
        f"{HEAD}fairseq_cli.train | num. shared model params: 3,145,728 (num. trained: 3,145,728)",
        f"{HEAD}fairseq.trainer | Loaded checkpoint {save_dir}/checkpoint_last.pt (epoch 2 @ {start} updates)"
        if start else f"{HEAD}fairseq.trainer | No existing checkpoint found {save_dir}/checkpoint_last.pt",
        f"{HEAD}fairseq.trainer | begin training epoch 2",
        f"{HEAD}fairseq_cli.train | Start iterating over samples",
    ]
    for update in range(start + 1, end + 1):
        if update % interval == 0:
            lines.append(
                f"{HEAD}train_inner | epoch 002:     {update % 43} / 43 loss={10 - update / 100:.3f}, "
                f"nll_loss=9.9, ppl=900.1, wps={wps(update):.1f}, ups=1.33, wpb={wpb:.1f}, bsz=212.4, "
                f"num_updates={update}, lr=0.0001, gnorm=1.2, train_wall=4, wall=7")
    lines += [
        f"{HEAD}valid | epoch 002 | valid on 'valid' subset | loss 9.57 | nll_loss 9.334 | ppl 645.59 | "
        f"wps 1160.8 | wpb 2323 | bsz 165.3 | num_updates {end} | best_loss 9.57",
        f"{HEAD}fairseq_cli.train | Stopping training due to num_updates: {end} >= max_update: {end}",
        f"{HEAD}train | epoch 002 | loss 10.808 | nll_loss 10.691 | ppl 1653.67 | wps 417.3 | ups 0.14 | "
        f"wpb 2988.2 | bsz 213 | num_updates {end} | lr 0.0002 | gnorm 2.619 | train_wall 273 | wall 0",
        f"{HEAD}fairseq_cli.train | done training in 154.5 seconds",
    ]
    return "\n".join(lines) + "\n"


def test_log_parsing_of_several_segments():
    logs = [fake_train_log(s, e, 5) for s, e in [(0, 20), (20, 40), (40, 55)]]
    assert [runs.resumed_update(log) for log in logs] == [0, 20, 40]
    assert [runs.last_num_updates(log) for log in logs] == [20, 40, 55]
    assert [i["num_updates"] for i in runs.train_inner_intervals(logs[1])] == [25, 30, 35, 40]
    first = runs.train_inner_intervals(logs[0])[0]
    assert first == {"num_updates": 5, "wps": 4005.0, "wpb": 3000.0, "loss": 9.95}
    assert runs.model_parameters(logs[1]) == 3145728
    # words/s of a segment: its intervals after the first, words over seconds
    speed = runs.segment_words_per_second(logs[1], start_update=20)
    assert speed["intervals"] == 3
    assert speed["words"] == pytest.approx(3 * 5 * 3000.0)
    expected_seconds = sum(5 * 3000.0 / (4000.0 + u) for u in (30, 35, 40))
    assert speed["seconds"] == pytest.approx(expected_seconds, rel=1e-6)
    assert speed["words_per_second"] == pytest.approx(speed["words"] / expected_seconds)
    # a single interval is used rather than nothing
    assert runs.segment_words_per_second(fake_train_log(0, 5, 5), 0)["intervals"] == 1
    assert math.isnan(runs.segment_words_per_second(fake_train_log(0, 4, 5), 0)["words_per_second"])


def test_segment_words_per_second_counts_updates_from_the_resume_point():
    log = fake_train_log(22, 40, 5, wps=lambda u: 1000.0)  # first interval: 23..25, 3 updates
    speed = runs.segment_words_per_second(log, start_update=22, skip_first=0)
    assert speed["words"] == pytest.approx((3 + 5 + 5 + 5) * 3000.0)
    assert speed["words_per_second"] == pytest.approx(1000.0)


def test_ratio_stats():
    stats = runs.ratio_stats([0.8, 0.9, float("nan"), 0.7])
    assert (stats["min"], stats["median"], stats["max"]) == (0.7, 0.8, 0.9)
    assert len(stats["per_round"]) == 4
    assert math.isnan(runs.ratio_stats([float("nan")])["median"])


def test_pooled_words_per_second():
    segments = [{"words": 1000.0, "measured_seconds": 1.0}, {"words": 1000.0, "measured_seconds": 3.0}]
    assert qs.pooled_words_per_second(segments) == pytest.approx(500.0)  # not the mean of 1000 and 333


# ----------------------------------------------------------------------------
# the segment runner with a fake fairseq-train
# ----------------------------------------------------------------------------


def fake_runner(calls, resumed=None):
    def run_streaming(cmd, log_path, echo_filter=None, wrap_rss=False):
        cmd = [str(c) for c in cmd]
        calls.append(cmd)
        end = int(cmd[cmd.index("--max-update") + 1])
        save_dir = Path(cmd[cmd.index("--save-dir") + 1])
        start = runs.last_num_updates((save_dir / "state").read_text()) if (save_dir / "state").exists() else 0
        log = fake_train_log(start if resumed is None else resumed, end, int(cmd[cmd.index("--log-interval") + 1]))
        save_dir.mkdir(parents=True, exist_ok=True)
        (save_dir / "checkpoint_last.pt").write_text("")
        (save_dir / "state").write_text(f"num_updates={end}")
        lines = log.splitlines(keepends=True)
        return {"log": log, "seconds": 12.0, "lines": lines, "line_seconds": [float(i) for i in range(len(lines))]}

    return run_streaming


def test_train_segment_starts_fresh_then_resumes(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(qs, "run_streaming", fake_runner(calls))
    save_dir = tmp_path / "vanilla"
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_text("stale")  # an earlier demo's
    (save_dir / "state").write_text("num_updates=999")
    _subdir, arch = qs.MODELS["V-T"]
    first = qs.train_segment(tmp_path / "bin", save_dir, arch, 1, 0, 20, 5, "train-1of2.log")
    assert first["start"] == 0 and first["end"] == 20 and first["startup_seconds"] == 3.0
    assert first["intervals"] == 3 and first["words_per_second"] > 0 and first["loss"] == pytest.approx(9.8)
    second = qs.train_segment(tmp_path / "bin", save_dir, arch, 1, 20, 40, 5, "train-2of2.log")
    assert second["end"] == 40
    assert [c[c.index("--max-update") + 1] for c in calls] == ["20", "40"]
    assert calls[0][calls[0].index("--arch") + 1] == "transformer"


def test_train_segment_refuses_a_wrong_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(qs, "run_streaming", fake_runner([], resumed=10))
    save_dir = tmp_path / "sdma"
    with pytest.raises(SystemExit, match="checkpoint_last.pt missing"):
        qs.train_segment(tmp_path / "bin", save_dir, qs.MODELS["SDMA-T"][1], 1, 20, 40, 5, "x.log")
    save_dir.mkdir()
    (save_dir / "checkpoint_last.pt").write_text("")
    with pytest.raises(SystemExit, match="expected updates 20 -> 40, got 10 -> 40"):
        qs.train_segment(tmp_path / "bin", save_dir, qs.MODELS["SDMA-T"][1], 1, 20, 40, 5, "x.log")


# ----------------------------------------------------------------------------
# end to end, real data subset, real fairseq
# ----------------------------------------------------------------------------


@pytest.mark.skipif(not DING.exists(), reason="apt-get install trans-de-en (make install does)")
def test_quickstart_end_to_end_interleaved(tmp_path):
    import torch

    from conftest import run_checked, venv_bin

    from pipelines.data import ding, translation

    out = tmp_path / "qs"
    raw, prep = out / "data" / "raw", out / "data" / "prep"  # where the quickstart reuses its data
    ding.main(["--out-dir", str(raw), "--max-words", "6", "--valid-size", "40",
                             "--test-size", "20"])
    translation.main(["--train-prefix", str(raw / "train"), "--valid-prefix", str(raw / "valid"),
                              "--test-prefix", str(raw / "test"), "--src", "de", "--tgt", "en", "--joint",
                              "--vocab-size", "400", "--out-dir", str(prep), "--workers", "1"])
    # 4 updates leave the models untrained: they would decode 200 tokens per sentence
    proc = run_checked([venv_bin("python"), "-m", "experiments.sdma.quickstart", "--updates", "4", "--segments", "2",
                        "--out-dir", out, "--gen-max-len", "8"], timeout=1200)
    printed = proc.stdout
    assert "DEBUG" not in proc.stdout + proc.stderr  # no library debug logging (fairseq's root logger at DEBUG)

    results = json.loads((out / "results.json").read_text())
    assert results["updates"] == 4 and results["segments"] == 2 and results["minutes"] is None
    assert results["segment_bounds"] == [[0, 2], [2, 4]] and results["log_interval"] == 1
    segment_runs = results["segment_runs"]
    assert [(r["round"], r["model"], r["start"], r["end"]) for r in segment_runs] == [
        (1, "V-T", 0, 2), (1, "SDMA-T", 0, 2), (2, "V-T", 2, 4), (2, "SDMA-T", 2, 4)]  # interleaved
    assert all(r["words_per_second"] > 0 for r in segment_runs)
    ratio = results["train_words_per_second_ratio"]
    assert len(ratio["per_round"]) == 2 and ratio["min"] <= ratio["median"] <= ratio["max"]
    for name in ("V-T", "SDMA-T"):
        model = results[name]
        for key in ("BLEU", "LR enc", "HR enc", "LR dec", "HR dec", "LR cross", "HR cross",
                    "train words/s", "params", "train_words_per_second_segments"):
            assert key in model, (name, key)
        assert model["train words/s"] > 0 and model["params"] > 0
    for subdir in ("vanilla", "sdma"):
        second = (out / subdir / "train-2of2.log").read_text()
        assert runs.resumed_update(second) == 2 and runs.last_num_updates(second) == 4
    assert (out / "fig6_sdma.png").stat().st_size > 0
    assert "plan: 4 updates per model (--updates) in 2 interleaved segments each" in printed
    # the plan's duration is the idle calibration times the load measured on this machine before it
    load = results["load_factor"]
    assert load == pytest.approx(results["load_probe_seconds"] / qs.LOAD_PROBE_IDLE_SECONDS)
    assert f"{results['load_probe_seconds']:.2f} s per probe update, {load:.2f}x" in printed
    assert results["planned_minutes"] == pytest.approx(results["idle_minutes_estimate"] * load)
    assert "BLEU (sacreBLEU 13a, test split, beam 5; 95% bootstrap intervals" in printed
    assert "SDMA-T - V-T" in printed and "validation cross-entropy at the last update" in printed
    assert "learning curves" in printed
    pair = results["bleu_bootstrap"]["comparisons"]["SDMA-T - V-T"]
    assert pair["interval"][0] <= pair["difference"] <= pair["interval"][1]
    assert "train SDMA-T segment 2/2: updates 2 -> 4 (about" in printed and "demo done ~" in printed
    assert "SDMA-T / V-T words/s over 2 interleaved rounds: min" in printed

    # segments change nothing: the same 4 updates in one process give the same weights
    single = qs.train_segment(prep / "bin", tmp_path / "single", qs.MODELS["V-T"][1], 1, 0, 4, 1, "train.log")
    assert single["end"] == 4
    split = torch.load(out / "vanilla" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    whole = torch.load(tmp_path / "single" / "checkpoint_last.pt", map_location="cpu", weights_only=True)["model"]
    assert split.keys() == whole.keys()
    assert all(torch.equal(split[k], whole[k]) for k in split)

"""The regulariser-scale driver: log parsing, one result per model, the collected table."""

import json

from experiments.sdma import regulariser_scales as rs

LOG = """\
2026-11-23 19:58:04 | INFO | valid | epoch 003 | valid on 'valid' subset | loss 8.598 | nll_loss 8.128 | ppl 279.77 | wps 1769.1 | wpb 2323 | bsz 165.3 | num_updates 100
2026-11-23 19:59:04 | INFO | train_inner | epoch 003:     10 / 43 loss=8.1, ppl=12.5, num_updates=110
2026-11-23 20:05:04 | INFO | valid | epoch 005 | valid on 'valid' subset | loss 7.9 | nll_loss 7.05 | ce_loss 7.2 | sdma_reg 3.1835 | sdma_dxq -4.7046 | ppl 152.4 | wps 1486.9 | wpb 2323 | bsz 165.3 | num_updates 200
"""


def test_validation_perplexities_of_vanilla_and_sdma_lines():
    assert rs.validation_perplexities(LOG) == {100: 279.77, 200: 152.4}


def test_every_scale_and_the_baseline_are_trained():
    runs = rs.runs()
    assert list(runs) == ["V-T", "SDMA-T sentence", "SDMA-T batch", "SDMA-T token"]
    for scale in rs.SCALES:
        args = runs[f"SDMA-T {scale}"]
        assert args[args.index("--sdma-regulariser-scale") + 1] == scale


def test_report_collects_finished_models_only(tmp_path, capsys):
    for name, ppl in (("V-T", 39.45), ("SDMA-T batch", 39.0)):
        rs.write_json(rs.run_dir(tmp_path, name) / "result.json", {"valid_ppl": {"400": ppl}})
    assert rs.main(["--report-only", "--out-dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "V-T" in printed and "SDMA-T batch" in printed and "SDMA-T token" not in printed
    collected = json.loads((tmp_path / "results.json").read_text())["runs"]
    assert collected["V-T"]["valid_ppl"] == {"400": 39.45}


def test_report_without_finished_models_fails(tmp_path):
    assert rs.main(["--report-only", "--out-dir", str(tmp_path)]) == 1

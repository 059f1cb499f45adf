"""``make test-toolkits``' classification (tests/toolkits/run_toolkit_tests.py), without downloading:
an unexpected failure, an expected failure that now passes, a failure for another reason than the
listed one, an entry that matches nothing and a "toolkit defect" that passes alone fail the command;
an expected failure does not; a malformed list is refused with a message naming the entry."""

from pathlib import Path

import pytest

from toolkits import run_toolkit_tests as contract  # tests/toolkits (tests/ is on the path, as for conftest)

ENTRY = """
[[expected]]
toolkit = "fairseq"
test = "tests/test_export.py::TestExportModels::test_export_transformer*"
configs = ["sma/*", "sdma/*"]
category = "by-design"
error = "SDMAConfigError: torch.jit.script"
reason = "SMA/SDMA cannot be scripted"
"""
EXPORT = "tests/test_export.py::TestExportModels::test_export_transformer"
SCRIPT_ERROR = "latent_core.sdma.SDMAConfigError: torch.jit.script: a --sdma-mode sdma model cannot be scripted"
RAN = [("fairseq", config) for config in contract.CONFIGS]


def result(nodeid, config, outcome, message="", toolkit="fairseq"):
    return contract.Result(toolkit, config, nodeid, outcome, message)


def classify(results, text=ENTRY, ran=RAN):
    return contract.classify(results, contract.load_expected(Path("expected.toml"), text), ran)


def test_expected_failure_passes_the_command():
    report = classify([result(EXPORT, "sdma/paper", "failed", SCRIPT_ERROR), result(EXPORT, "none", "passed")])
    assert [r.classification for r in report.results] == ["expected (by-design)", "passed"]
    assert report.results[0].reason == "SMA/SDMA cannot be scripted"
    assert report.exit_code == 0


def test_unexpected_failure_fails_the_command():
    report = classify([result(EXPORT, "none", "failed", "AttributeError: x"),
                       result(EXPORT, "sdma/paper", "failed", SCRIPT_ERROR)])
    assert report.results[0].classification == "unexpected"
    assert report.exit_code == 1


def test_failure_for_another_reason_than_listed_is_unexpected():
    report = classify([result(EXPORT, "sdma/paper", "failed", "AttributeError: 'Namespace' has no attribute 'x'")])
    assert report.results[0].classification == "unexpected"
    assert "SDMAConfigError: torch.jit.script" in report.results[0].reason
    assert report.exit_code == 1


def test_expected_failure_that_passes_fails_the_command():
    report = classify([result(EXPORT, "sma/authors", "passed"), result(EXPORT, "sdma/paper", "failed", SCRIPT_ERROR)])
    assert report.results[0].classification == "unexpectedly passing"
    assert report.exit_code == 1


def test_skipped_tests_are_neither():
    report = classify([result(EXPORT, "sdma/paper", "failed", SCRIPT_ERROR), result(EXPORT, "sma/paper", "skipped")])
    assert report.results[1].classification == "skipped" and report.exit_code == 0


def test_entry_matching_no_test_fails_the_command_where_its_configs_ran():
    report = classify([result("tests/test_transformer.py::T::test_forward_backward", "sdma/paper", "passed")])
    assert len(report.stale) == 1 and report.exit_code == 1
    # an entry whose toolkit or configurations did not run is not judged
    assert classify([], ran=[("espnet", "sdma/paper")]).exit_code == 0
    assert classify([], ran=[("fairseq", "none")]).exit_code == 0


def test_toolkit_defect_that_passes_with_the_toolkit_class_fails_the_command(monkeypatch):
    text = ENTRY.replace("by-design", "toolkit-defect")
    report = classify([result(EXPORT, "sdma/paper", "failed", SCRIPT_ERROR)], text)
    assert report.results[0].classification == "expected (toolkit-defect)" and report.exit_code == 0
    reruns = []

    def run_pytest(toolkit, config, root, targets, keyword):
        reruns.append((toolkit, config, list(targets)))
        return [result(EXPORT, config, "passed")]

    monkeypatch.setattr(contract, "run_pytest", run_pytest)
    contract.verify_toolkit_defects(report, contract.load_expected(Path("e.toml"), text), {"fairseq": Path(".")})
    assert reruns == [("fairseq", contract.TOOLKIT_CONFIG, [EXPORT])]
    assert [r.nodeid for r in report.misclassified] == [EXPORT] and report.exit_code == 1
    # failing there with the listed error confirms it
    report.misclassified.clear()
    failing = [result(EXPORT, contract.TOOLKIT_CONFIG, "failed", SCRIPT_ERROR)]
    monkeypatch.setattr(contract, "run_pytest", lambda *args: failing)
    contract.verify_toolkit_defects(report, contract.load_expected(Path("e.toml"), text), {"fairseq": Path(".")})
    assert report.exit_code == 0


@pytest.mark.parametrize("change, message", [
    (("category = \"by-design\"", "category = \"flaky\""), "category 'flaky' is not one of"),
    (("error = \"SDMAConfigError: torch.jit.script\"\n", ""), "missing ['error']"),
    (("reason = ", "why = "), "missing ['reason'], unknown ['why']"),
    (("configs = [\"sma/*\", \"sdma/*\"]", "configs = [\"sdma\"]"), "configs must be a non-empty list of patterns"),
    (("configs = [\"sma/*\", \"sdma/*\"]", "configs = []"), "configs must be a non-empty list"),
    (("toolkit = \"fairseq\"", "toolkit = \"torch\""), "toolkit 'torch' is not one of"),
    (("test = \"tests/", "test = \" \"\nx = \"tests/"), "unknown ['x']"),
    (("reason = \"SMA/SDMA cannot be scripted\"", "reason = \"\""), "reason must be a non-empty string"),
    (("[[expected]]", "[[expect]]"), "unknown table(s) ['expect']"),
    (("[[expected]]", "[[expected]"), "not TOML"),
])
def test_malformed_entry_is_refused_by_name(change, message):
    with pytest.raises(contract.ExpectedListError) as error:
        contract.load_expected(Path("expected.toml"), ENTRY.replace(*change))
    assert message in str(error.value)
    assert str(error.value).startswith("expected.toml")


def test_the_checked_in_list_is_well_formed():
    entries = contract.load_expected()
    assert entries and {e.category for e in entries} <= set(contract.CATEGORIES)


def test_star_is_the_only_wildcard():
    node = "test/test_beam_search.py::test_beam_search_equal[transformer-args1-0.0-0.0-0.5-0.1-cpu-float32]"
    assert contract.glob_match("test/test_beam_search.py::test_beam_search_equal[transformer-*-cpu-*]", node)
    assert not contract.glob_match("test/test_beam_search.py::test_beam_search_equal[t]*", node)
    assert contract.glob_match("sdma/*", "sdma/paper") and not contract.glob_match("sdma/*", "sma/paper")


def test_junit_report_becomes_node_ids_and_key_lines(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text("""<testsuites><testsuite>
<testcase classname="tests.test_export.TestExportModels" name="test_export_transformer" file="tests/test_export.py">
  <failure message="RuntimeError: ...">def test():
&gt;   torch.jit.script(m)
E   RuntimeError:
E   Module 'SDMACore' has no attribute 'options'
tests/test_export.py:3: RuntimeError</failure></testcase>
<testcase classname="tests.test_mha" name="test_parity[a-b]" file="tests/test_mha.py"/>
<testcase classname="tests.test_mha" name="test_parity[a-b]" file="tests/test_mha.py">
  <error message="failed on teardown">E   AssertionError: SDMA recorded 1 regulariser inputs</error></testcase>
<testcase classname="tests.test_mha" name="test_gpu" file="tests/test_mha.py"><skipped message="cpu"/>
</testcase>
<testcase classname="tests.test_roberta" name="">
  <error message="collection failure">E   ImportError: x</error></testcase>
</testsuite></testsuites>""")
    results = {r.nodeid: r for r in contract.parse_junit(junit, "fairseq", "none")}
    export = results["tests/test_export.py::TestExportModels::test_export_transformer"]
    assert (export.outcome, export.message) == ("failed", "RuntimeError: Module 'SDMACore' has no attribute 'options'")
    assert results["tests/test_mha.py::test_parity[a-b]"].outcome == "failed"  # the teardown error wins
    assert results["tests/test_mha.py::test_gpu"].outcome == "skipped"
    assert results["tests/test_roberta.py"].message == "ImportError: x"


def test_a_run_on_the_toolkit_classes_judges_toolkit_defects_only():
    defect = ENTRY.replace("by-design", "toolkit-defect").replace("test_export_transformer*", "test_mask*")
    text = ENTRY.replace('["sma/*", "sdma/*"]', '["*"]') + defect
    toolkit_only = [("fairseq", contract.TOOLKIT_CONFIG)]
    mask = "tests/test_export.py::TestExportModels::test_mask_for_xformers"
    report = classify([result(mask, contract.TOOLKIT_CONFIG, "failed", SCRIPT_ERROR),
                       result(EXPORT, contract.TOOLKIT_CONFIG, "passed")], text, toolkit_only)
    assert [r.classification for r in report.results] == ["expected (toolkit-defect)", "passed"]
    assert report.exit_code == 0

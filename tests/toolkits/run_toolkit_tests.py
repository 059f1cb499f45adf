#!/usr/bin/env python3
"""``make test-toolkits``: fairseq's and ESPnet's own tests as the plugin's contract.

The plugin claims SDMA is a drop-in for the toolkits' transformer. This command checks the claim
with the toolkits' own test files, at the versions ``constraints.txt`` pins:

1. downloads each toolkit's sdist with ``pip download`` (pip's own configured index, mirror or proxy),
   checks its sha256, and extracts it under ``.cache/toolkit-tests/`` (git-ignored; no toolkit file is
   committed);
2. runs the selected test files (transformer, attention, generation, export, checkpointing,
   dropout; :data:`SELECTION`, the others excluded with a reason in :data:`EXCLUDED`) with pytest
   in one subprocess per configuration, the plugin's classes substituted by the pytest plugin
   ``substitution.py`` (``-p substitution``): ``none`` (reading-independent), ``sma`` and ``sdma``
   in the readings ``authors`` and ``paper``;
3. classifies every failure against ``expected_failures.toml`` (``by-design``: the plugin
   documents it as unsupported; ``toolkit-defect``: fails with the toolkit's own class too), and
   re-runs the failures classified ``toolkit-defect`` on the toolkit's own classes to check that;
4. prints a table (suite | mode/reading | passed/total) and the total time, writes ``--json``,
   and exits 1 on a failure not in the list, an expected failure that now passes, a list entry
   that matches no test, or a "toolkit defect" that passes with the toolkit's own classes.

Usage: ``python tests/toolkits/run_toolkit_tests.py [--only fairseq|espnet] [--configs none
sdma/paper ...] [--json PATH] [--jobs N]``.
"""

import argparse
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import tomllib
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CACHE = REPO / ".cache" / "toolkit-tests"
EXPECTED = HERE / "expected_failures.toml"

SDISTS = {  # toolkit -> (pip requirement, sha256 of its sdist, top directory of the archive)
    "fairseq": ("fairseq_fixed==0.12.3.1", "c607577a54ab30e2ee0f0b0a754ea5cdbc6ad0a9f99a1726638a2201445bc1cc",
                "fairseq_fixed-0.12.3.1"),
    "espnet": ("espnet==202511", "280573dab2d4a0c669f0801cb7b07fa7732dd53138990cc80519e53a72412d4c", "espnet-202511"),
}
# configuration -> (SDMA mode, reading); "toolkit" (the toolkit's own classes) only verifies toolkit defects
CONFIGS = {"none": ("none", "authors"), "sma/authors": ("sma", "authors"), "sma/paper": ("sma", "paper"),
           "sdma/authors": ("sdma", "authors"), "sdma/paper": ("sdma", "paper")}
TOOLKIT_CONFIG = "toolkit"
CATEGORIES = ("by-design", "toolkit-defect")

# What runs: pytest node ids (files, classes or tests) and a -k expression per toolkit.
SELECTION = {
    "fairseq": ([
        "tests/test_transformer.py",                 # forward/backward of TransformerModel.build_model
        "tests/test_inference_dropout.py",           # --retain-dropout(-modules) on the built model
        "tests/test_export.py",                      # TorchScript of MultiheadAttention and the model
        "tests/test_multihead_attention.py",         # the attention class (xformers parity deselected by -k)
        "tests/test_sequence_generator.py::TestJitSequenceGenerator",  # scripted SequenceGenerator on the model
        "tests/test_checkpoint_utils.py",            # train, save, load ensembles, prune layers on load
        "tests/test_online_backtranslation.py",      # --arch transformer under online back-translation (generation)
        *(f"tests/test_binaries.py::TestTranslation::{name}" for name in (
            "test_transformer", "test_transformer_cross_self_attention", "test_transformer_layerdrop",
            "test_mixture_of_experts", *(f"test_translation_multi_simple_epoch_{variant}" for variant in (
                "no_vepoch", "dicts", "src_tgt_dict_spec")))),
        "tests/test_binaries.py::TestActivationCheckpointing",  # --checkpoint/--offload-activations keep the loss
    ], "not xformers_single_forward_parity and not xformers_blocksparse_parity"),
    "espnet": ([
        "test/test_transformer_decode.py",           # cached (incremental) encoder/decoder == full forward
        "test/test_beam_search.py",                  # legacy recognize() vs BeamSearch, transformer models
        "test/test_beam_search_timesync.py",         # time-synchronous beam search, transformer models
        "test/test_asr_quantize.py",                 # dynamic quantisation (export) of the transformer ASR model
        "test/test_train_dtype.py",                  # training in float16/32/64
    ], "not cuda and not rnn"),
}
# What does not run, and why (one line per file or group).
EXCLUDED = {
    "fairseq": {
        "test_binaries.py (fconv, lstm, lightconv, dynamicconv, LASER, stories, optimizers)": "other architectures",
        "test_binaries.py (NAT, CMLM, insertion, alignment, pointer-generator, multilingual, latent depth)":
            "their own model classes (subclasses or other models), which the plugin does not replace",
        "test_binaries.py (language models, masked LMs, RoBERTa)": "decoder-only / encoder-only models",
        "test_binaries.py::TestTranslation::test_translation_multi_simple_epoch": "its 6 language-token variants "
            "train the same model 6 times (37 s a run); its three one-run siblings train it under that task",
        "test_multihead_attention.py::test_xformers_*": "need xformers, which the pinned stack lacks "
                                                        "(parity of two kernels, see expected_failures.toml)",
        "test_sequence_generator.py (all but TestJitSequenceGenerator)": "fairseq's fake TestModel, no transformer",
        "test_activation_checkpointing.py": "checkpoint_wrapper on a toy net (the transformer's: test_binaries)",
        "test_espnet_multihead_attention.py, test_sparse_multihead_attention.py": "other attention classes",
        "test_roberta.py, test_lstm_jitable.py, test_lm_context_window.py, test_valid_subset_checks.py, "
        "test_plasma_utils.py, test_reproducibility.py": "RoBERTa, LSTM, language models, fconv",
        "test_train.py, test_checkpoint_utils_for_task_level_attributes.py, test_average_checkpoints.py, "
        "test_ema.py, test_sequence_scorer.py": "mocked trainers or toy models: no model class of fairseq's",
        "the other 29 files": "data, dictionaries, decoding constraints, optimizers, fp16, positional embeddings, "
                              "metrics, I/O: no model or attention class",
    },
    "espnet": {
        "test/test_e2e_asr_transformer.py, test_e2e_mt_transformer.py, test_e2e_st_transformer.py, test_lm.py, "
        "...": "import chainer (directly or through e2e_mt.py / e2e_st.py), which the pinned numpy 2 cannot "
               "import: they fail with ESPnet alone before any attention is built",
        "test/test_batch_beam_search.py": "imports kenlm (not in the stack) and reads test/beam_search_test.arpa, "
                                          "which the sdist does not ship",
        "rnn and cuda parameters (-k)": "RNN models; CUDA (none here)",
        "conformer, Mask-CTC, transducer, TTS, VC, streaming": "other architectures and tasks",
        "espnet2 tests": "not in the sdist (it ships espnet1's test/ only): the ESPnet2 plugin's "
                         "encoder/decoder/model are not covered here",
    },
}
NOTES = {
    "fairseq": "the sdist lacks tests/utils.py and tests/__init__.py: tests/toolkits/fairseq_helpers.py stands in "
               "(fairseq 0.12's flags); examples/translation_moe is taken from fairseq/examples/",
    "espnet": "espnet1's Encoder/Decoder layers with the plugin's attention (the sdist has no espnet2 tests); "
              "substitution.py lets espnet1's PyTorch E2E models import without chainer (an ESPnet defect)",
}


# -- the toolkits' files ------------------------------------------------------------------------
def download_sdist(requirement: str, into: Path) -> None:
    """``pip download`` of the source distribution of ``requirement`` through pip's configured index (PIP_INDEX_URL,
    pip.conf, a proxy). No build isolation: preparing an sdist's metadata would otherwise install its build
    requirements (torch, for fairseq) into a throw-away environment."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--no-build-isolation",
               "--disable-pip-version-check", "--dest", str(into), requirement]
    print("$ " + " ".join(command[2:]), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"pip download {requirement} failed (exit {result.returncode}): check pip's index settings "
                 f"(pip config list)\n{result.stdout[-2000:]}{result.stderr[-2000:]}")


def fetch(toolkit: str) -> Path:
    """The extracted sdist of ``toolkit`` (downloaded and verified once), laid out for pytest."""
    requirement, sha256, top = SDISTS[toolkit]
    root = CACHE / top
    CACHE.mkdir(parents=True, exist_ok=True)
    (CACHE / "pytest.ini").write_text("[pytest]\n")  # -c: neither the repository's nor the sdist's settings
    if (root / ".prepared").exists():
        return refresh_helpers(toolkit, root)
    archive = CACHE / f"{top}.tar.gz"
    if not archive.exists() or hashlib.sha256(archive.read_bytes()).hexdigest() != sha256:
        archive.unlink(missing_ok=True)
        download_sdist(requirement, CACHE)
        if not archive.exists():
            sys.exit(f"pip download {requirement} saved no {archive.name} in {CACHE}")
        digest = hashlib.sha256(archive.read_bytes()).hexdigest()
        if digest != sha256:
            archive.unlink()
            sys.exit(f"{archive.name}: sha256 {digest} is not the pinned {sha256} (the index served another file)")
    # only the tests (and what they read): the sdist's package sources must not shadow the installed toolkit
    keep = {"fairseq": {"tests/": "tests/", "fairseq/examples/translation_moe/": "examples/translation_moe/"},
            "espnet": {"test/": "test/"}}[toolkit]
    shutil.rmtree(root, ignore_errors=True)
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            name = member.name.removeprefix(top + "/")
            prefix = next((p for p in keep if name.startswith(p)), None)
            if prefix and member.isfile():
                target = root / (keep[prefix] + name[len(prefix):])
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())
    (root / ".prepared").write_text(sha256)
    return refresh_helpers(toolkit, root)


def refresh_helpers(toolkit: str, root: Path) -> Path:
    """What the tests import and the sdist lacks (fairseq: ``tests/__init__.py``, ``tests/utils.py``;
    ESPnet: ``test/__init__.py``: its tests import each other as ``test.<module>``), written every run."""
    package = root / {"fairseq": "tests", "espnet": "test"}[toolkit]
    (package / "__init__.py").write_text("")
    if toolkit == "fairseq":
        shutil.copy(HERE / "fairseq_helpers.py", package / "utils.py")
    return root


# -- running pytest -------------------------------------------------------------------------------
@dataclasses.dataclass
class Result:
    toolkit: str
    config: str
    nodeid: str
    outcome: str  # passed | failed | skipped
    message: str = ""
    classification: str = ""  # passed, skipped, expected (category), unexpected, unexpectedly passing
    reason: str = ""


def run_pytest(toolkit: str, config: str, root: Path, targets: Sequence[str], keyword: str) -> List[Result]:
    mode, reading = CONFIGS.get(config, (TOOLKIT_CONFIG, "authors"))
    junit = CACHE / f"junit-{toolkit}-{config.replace('/', '-')}.xml"
    junit.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOOLKIT_CONTRACT_TOOLKIT": toolkit,
           "TOOLKIT_CONTRACT_MODE": mode, "TOOLKIT_CONTRACT_READING": reading,
           "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    cmd = [sys.executable, "-m", "pytest", "-c", str(CACHE / "pytest.ini"), "--rootdir", str(root),
           "-p", "substitution", "-p", "no:cacheprovider", "-o", "junit_family=xunit1", f"--junitxml={junit}",
           "-q", "--no-header", "--continue-on-collection-errors", "--timeout", "900",
           "-W", "ignore::DeprecationWarning",
           *(["-k", keyword] if keyword else []), *targets]
    log = CACHE / f"log-{toolkit}-{config.replace('/', '-')}.txt"
    with open(log, "w") as out:
        subprocess.run(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    if not junit.exists():
        sys.exit(f"{toolkit} {config}: pytest wrote no report, see {log}")
    return parse_junit(junit, toolkit, config)


def parse_junit(path: Path, toolkit: str, config: str) -> List[Result]:
    results = {}
    for case in ET.parse(path).iter("testcase"):
        file, classname, name = case.get("file"), case.get("classname", ""), case.get("name", "")
        if file:
            module = file[:-3].replace("/", ".")
            inner = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
            nodeid = "::".join(part for part in (file, inner.replace(".", "::"), name) if part)
        else:  # a collection error: pytest names the module only
            nodeid = (classname.replace(".", "/") + ".py") if classname else name
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", key_line(child.get("message", ""), child.text or "")
            elif child.tag == "skipped" and outcome == "passed":
                outcome, message = "skipped", child.get("message", "")
        if nodeid not in results or (outcome == "failed" and results[nodeid].outcome != "failed"):  # teardown
            results[nodeid] = Result(toolkit, config, nodeid, outcome, message)
    return list(results.values())


def key_line(message: str, text: str) -> str:
    """The line of a failure that says what went wrong: pytest's last ``E   SomeError: ...`` line
    (with the next line where the message starts there), else the report's message."""
    lines = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    for i in reversed(range(len(lines))):
        if re.match(r"^[\w.]+(Error|Exception|Failure|Interrupt)\b", lines[i]):
            follows = " " + lines[i + 1] if lines[i].endswith(":") and i + 1 < len(lines) else ""
            return (lines[i] + follows)[:300]
    return (lines[-1] if lines else message)[:300]


# -- the expected failures --------------------------------------------------------------------------
class ExpectedListError(ValueError):
    """A malformed entry of expected_failures.toml (the message names it)."""


@dataclasses.dataclass
class Expected:
    toolkit: str
    test: str
    configs: List[str]
    category: str
    error: str  # what the failure's key line must contain
    reason: str

    def applies(self, config: str) -> bool:
        if config == TOOLKIT_CONFIG:  # a toolkit defect fails with the toolkit's classes too
            return self.category == "toolkit-defect"
        return any(glob_match(pattern, config) for pattern in self.configs)

    def matches(self, result: Result) -> bool:
        return result.toolkit == self.toolkit and glob_match(self.test, result.nodeid) and self.applies(result.config)


def glob_match(pattern: str, text: str) -> bool:
    """``*`` matches anything; every other character itself (node ids carry ``[...]``)."""
    return re.fullmatch(".*".join(map(re.escape, pattern.split("*"))), text) is not None


def load_expected(path: Path = EXPECTED, text: Optional[str] = None) -> List[Expected]:
    """The list's entries; a malformed one raises :class:`ExpectedListError` naming it."""
    try:
        data = tomllib.loads(path.read_text() if text is None else text)
    except tomllib.TOMLDecodeError as error:
        raise ExpectedListError(f"{path.name}: not TOML: {error}") from None
    if set(data) - {"expected"} or not isinstance(data.get("expected", []), list):
        raise ExpectedListError(f"{path.name}: unknown table(s) {sorted(set(data) - {'expected'})}; "
                                "the list is [[expected]] entries")
    fields, entries = {f.name for f in dataclasses.fields(Expected)}, []
    for index, entry in enumerate(data.get("expected", []), 1):
        where = f"{path.name}: [[expected]] entry {index} ({entry.get('test', 'no test')})"
        if set(entry) != fields:
            raise ExpectedListError(f"{where}: keys must be {sorted(fields)}; missing {sorted(fields - set(entry))}, "
                                    f"unknown {sorted(set(entry) - fields)}")
        configs = entry["configs"]
        checks = [(entry["toolkit"] in SDISTS, f"toolkit {entry['toolkit']!r} is not one of {sorted(SDISTS)}"),
                  (entry["category"] in CATEGORIES, f"category {entry['category']!r} is not one of {CATEGORIES}"),
                  *((isinstance(entry[key], str) and entry[key].strip(), f"{key} must be a non-empty string")
                    for key in ("test", "error", "reason")),
                  (isinstance(configs, list) and configs and all(isinstance(c, str) and any(
                      glob_match(c, name) for name in CONFIGS) for c in configs),
                   f"configs must be a non-empty list of patterns of {list(CONFIGS)}")]
        for ok, message in checks:
            if not ok:
                raise ExpectedListError(f"{where}: {message}")
        entries.append(Expected(**entry))
    return entries


@dataclasses.dataclass
class Report:
    results: List[Result]
    stale: List[Expected]  # entries that match no test that ran
    misclassified: List[Result] = dataclasses.field(default_factory=list)  # "toolkit defects" that pass alone

    @property
    def exit_code(self) -> int:
        bad = [r for r in self.results if r.classification in ("unexpected", "unexpectedly passing")]
        return 1 if bad or self.stale or self.misclassified else 0


def classify(results: List[Result], entries: List[Expected], ran: Sequence[Tuple[str, str]]) -> Report:
    """Label each result; ``ran``: the (toolkit, config) pairs that ran (entries elsewhere are not judged)."""
    used = set()
    for result in results:
        entry = next((e for e in entries if e.matches(result)), None)
        if entry is not None:
            used.add(id(entry))
        if result.outcome == "skipped":
            result.classification = "skipped"
        elif result.outcome == "passed":
            result.classification = "unexpectedly passing" if entry else "passed"
        elif entry and entry.error not in result.message:
            result.classification = "unexpected"
            result.reason = f"expected to fail with {entry.error!r}, failed otherwise"
            continue
        else:
            result.classification = f"expected ({entry.category})" if entry else "unexpected"
        result.reason = entry.reason if entry else ""
    judged = [e for e in entries if any(t == e.toolkit and e.applies(c) for t, c in ran)]
    return Report(results, [e for e in judged if id(e) not in used])


def verify_toolkit_defects(report: Report, entries: List[Expected], roots: Dict[str, Path], jobs=1) -> None:
    """Re-run each failure classified as a toolkit defect on the toolkit's own classes: it must fail there
    too, with the entry's error."""
    claims = {toolkit: {r.nodeid: r for r in report.results if r.toolkit == toolkit and r.config != TOOLKIT_CONFIG
                        and r.classification == "expected (toolkit-defect)"} for toolkit in roots}
    claims = {toolkit: claimed for toolkit, claimed in claims.items() if claimed}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        reruns = pool.map(lambda t: run_pytest(t, TOOLKIT_CONFIG, roots[t], sorted(claims[t]), ""), claims)
    for (toolkit, claimed), rerun in zip(claims.items(), reruns):
        alone = {r.nodeid: r for r in rerun}
        for nodeid, claim in claimed.items():
            result = alone.get(nodeid, Result(toolkit, TOOLKIT_CONFIG, nodeid, "not run"))
            error = next(e.error for e in entries if e.matches(claim))
            if result.outcome != "failed" or error not in result.message:
                report.misclassified.append(result)


# -- output -----------------------------------------------------------------------------------------
def suite_of(result: Result) -> str:
    return f"{result.toolkit} {result.nodeid.split('::')[0].rsplit('/', 1)[-1].removesuffix('.py')}"


def table(results: List[Result]) -> str:
    rows: Dict[Tuple[str, str], List[Result]] = {}
    for result in results:
        rows.setdefault((suite_of(result), result.config), []).append(result)
    order = list(CONFIGS) + [TOOLKIT_CONFIG]
    lines = [f"{'suite':<38} | {'mode/reading':<12} | passed/total | expected | unexpected | skipped"]
    for (suite, config), group in sorted(rows.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        ran = [r for r in group if r.outcome != "skipped"]
        count = lambda *labels: sum(r.classification in labels for r in group)  # noqa: E731
        lines.append(f"{suite:<38} | {config:<12} | {count('passed', 'unexpectedly passing'):>5}/{len(ran):<6} | "
                     f"{count('expected (by-design)', 'expected (toolkit-defect)'):>8} | "
                     f"{count('unexpected', 'unexpectedly passing'):>10} | {len(group) - len(ran):>7}")
    return "\n".join(lines)


def problems(report: Report) -> List[str]:
    """What makes the exit status 1: unexpected failures and passes (one line per file, configuration and
    key line), stale entries, toolkit defects that are not."""
    groups: Dict[Tuple[str, ...], List[Result]] = {}
    for r in report.results:
        if r.classification in ("unexpected", "unexpectedly passing"):
            groups.setdefault((r.classification, r.config, r.nodeid.split("::")[0], r.message, r.reason), []).append(r)
    lines = [f"{label.upper()} [{config}] {group[0].nodeid}" + (f" and {len(group) - 1} more" if group[1:] else "")
             + f"\n    {message}" + (f"\n    ({reason})" if reason else "")
             for (label, config, _, message, reason), group in groups.items()]
    lines += [f"STALE ENTRY (matches no test that ran): {e.toolkit} {e.test} {e.configs}" for e in report.stale]
    return lines + [f"NOT A TOOLKIT DEFECT: {r.nodeid} {r.outcome} with the toolkit's own classes {r.message}"
                    for r in report.misclassified]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", choices=sorted(SDISTS), help="one toolkit (default: both)")
    parser.add_argument("--configs", nargs="+", choices=[*CONFIGS, TOOLKIT_CONFIG], default=list(CONFIGS),
                        help=f"default: all but {TOOLKIT_CONFIG} (the toolkit's own classes, nothing substituted)")
    parser.add_argument("--json", type=Path, help="write every result and the summary here")
    parser.add_argument("--jobs", type=int, default=2, help="pytest processes at once (default 2: one per core)")
    args = parser.parse_args(argv)
    start = time.monotonic()
    entries = load_expected()  # a malformed list fails before anything runs
    toolkits = [args.only] if args.only else sorted(SDISTS)
    roots = {toolkit: fetch(toolkit) for toolkit in toolkits}
    for toolkit in toolkits:
        print(f"{toolkit}: {NOTES[toolkit]}\n  not run: " + "\n  not run: ".join(
            f"{what}: {why}" for what, why in EXCLUDED[toolkit].items()))
    runs = [(toolkit, config) for toolkit in sorted(toolkits, reverse=True) for config in args.configs]  # longest first
    results: List[Result] = []
    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for batch in pool.map(lambda run: run_pytest(*run, roots[run[0]], *SELECTION[run[0]]), runs):
            results += batch
    report = classify(results, entries, runs)
    verify_toolkit_defects(report, entries, roots, args.jobs)
    print("\n" + table(report.results), *problems(report), sep="\n")
    elapsed = time.monotonic() - start
    print(f"\ntotal time {elapsed:.0f} s; exit {report.exit_code}")
    if args.json:
        args.json.write_text(json.dumps({"seconds": round(elapsed, 1), "exit_code": report.exit_code,
                                         "results": [dataclasses.asdict(r) for r in report.results],
                                         "stale": [dataclasses.asdict(e) for e in report.stale],
                                         "misclassified": [r.nodeid for r in report.misclassified]}, indent=1))
    return report.exit_code


if __name__ == "__main__":
    sys.exit(main())

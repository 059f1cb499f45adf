"""Tokenized BLEU as the SDMA paper reports it (user_dir/tools/sdma/bleu.py and its command ``sdma-bleu``)
and the two BLEU lines of examples/sdma_translation/evaluate.sh (end to end on the Ding pairs)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, prepare_ding_bin, run_checked, venv_bin
from user_dir.tools.sdma import bleu as translation_bleu
from user_dir.tools.sdma.bleu import (
    PAPER_LABEL,
    BLEUInputError,
    bleu_of_tokenized,
    compound_split,
    resolve_tokenizer,
    sacrebleu_score,
    tokenize_lines,
    tokenized_bleu,
)

DING = Path("/usr/share/trans/de-en")

HYPS = [
    "Das Know-how der U-Bahn-Fahrer ist sehr gut.",
    "Er hat's gesagt: \"Wir kommen morgen\", oder?",
    "Die E-Mail kam nicht an.",
    "Ein kleiner Test.",
]
REFS = [
    "Das Know-how der U-Bahn ist sehr gut.",
    "Er hat es gesagt: \"Wir kommen morgen\".",
    "Die E-Mail ist nicht angekommen.",
    "Ein kleiner Test.",
]


def fairseq_bleu(hyps, refs):
    """BLEU-4 of whitespace-tokenised lines with fairseq's own scorer (libbleu), as fairseq-generate."""
    from fairseq.data.dictionary import Dictionary
    from fairseq.scoring.bleu import BleuConfig, Scorer

    d = Dictionary()
    scorer = Scorer(BleuConfig(pad=d.pad(), eos=d.eos(), unk=d.unk()))
    for hyp, ref in zip(hyps, refs):
        scorer.add(d.encode_line(ref, add_if_not_exist=True), d.encode_line(hyp, add_if_not_exist=True))
    return scorer.score(), scorer.precision(), scorer.brevity()


@pytest.mark.parametrize("line, expected", [
    ("Das Know-how der U-Bahn", "Das Know ##AT##-##AT## how der U ##AT##-##AT## Bahn"),
    ("a-b-c", "a ##AT##-##AT## b-c"),  # matches do not overlap, as in Perl's s{...}{...}g
    ("gut - sehr gut", "gut - sehr gut"),  # a free-standing dash is not a compound
    ("-x- e-mail--x", "-x- e ##AT##-##AT## mail ##AT##-##AT## -x"),
    ("", ""),
])
def test_compound_split_as_fairseqs_script(line, expected):
    assert compound_split(line) == expected


def test_moses_tokenisation():
    assert tokenize_lines(["I can't go, really."], "en") == ["I can 't go , really ."]
    assert tokenize_lines(['Er sagt: "Ja!"'], "de") == ['Er sagt : " Ja ! "']  # no XML escaping
    assert tokenize_lines(["  a   b  "], "en", "none") == ["a b"]


def test_known_bleu_value():
    # p1..p4 = 4/5, 3/4, 2/3, 1/2, BP = 1: BLEU = (4/5 * 3/4 * 2/3 * 1/2) ** (1/4) = 0.2 ** 0.25
    result = tokenized_bleu(["a b c d e"], ["a b c d f"], "en", "none")
    assert result.score == pytest.approx(100 * 0.2 ** 0.25, abs=1e-9)
    assert result.fairseq_string().startswith("BLEU4 = 66.87, 80.0/75.0/66.7/50.0 (BP=1.000")


@pytest.mark.parametrize("split", [False, True])
def test_tokenized_bleu_equals_fairseqs_scorer(split):
    scored = {}
    result = tokenized_bleu(HYPS, REFS, "de", split_compounds=split, tokenized_out=scored)
    assert any("##AT##-##AT##" in line for line in scored["ref"]) == split
    assert scored["ref"][1] == 'Er hat es gesagt : " Wir kommen morgen " .'
    score, precisions, brevity = fairseq_bleu(scored["hyp"], scored["ref"])
    assert result.score == pytest.approx(score, abs=1e-9)
    assert result.precisions == pytest.approx([100 * p for p in precisions], abs=1e-9)
    assert result.brevity_penalty == pytest.approx(brevity, abs=1e-12)
    assert 0 < result.score < 100


def test_compound_splitting_changes_the_score():
    plain = tokenized_bleu(HYPS, REFS, "de").score
    split = tokenized_bleu(HYPS, REFS, "de", split_compounds=True).score
    assert plain != split


def test_brevity_penalty_against_fairseq():
    hyps, refs = ["a b c d"], ["a b c d e f g"]
    score, _, brevity = fairseq_bleu(hyps, refs)
    result = bleu_of_tokenized(hyps, refs)
    assert result.score == pytest.approx(score, abs=1e-9) and result.bp == pytest.approx(brevity, abs=1e-12)
    assert brevity < 1


def test_chinese_target_keeps_sacrebleus_zh_tokenisation():
    assert resolve_tokenizer("auto", "zh") == "zh" and resolve_tokenizer("auto", "en") == "moses"
    hyps = ["我们今天去北京。", "他喜欢读书。"]
    refs = ["我们明天去北京。", "他很喜欢读书。"]
    result = tokenized_bleu(hyps, refs, "zh")
    assert result.tokenizer == "zh" and "zh tokeniser" in result.describe()
    # every n-gram order has matches, so sacreBLEU's smoothing does not matter
    assert result.score == pytest.approx(sacrebleu_score(hyps, refs, "zh").score, abs=1e-9)


@pytest.mark.parametrize("call, pattern", [
    (lambda: tokenized_bleu(["a"], ["a", "b"], "en"), "1 hypotheses but 2 references"),
    (lambda: tokenized_bleu([], [], "en"), "no references"),
    (lambda: tokenized_bleu(["a"], ["a"], "en", tokenizer="spacy"), "spacy"),
])
def test_bad_input_is_named(call, pattern):
    with pytest.raises(BLEUInputError, match=pattern):
        call()


def test_script_prints_and_writes_both_scores(tmp_path, capsys):
    (tmp_path / "hyp.txt").write_text("\n".join(HYPS) + "\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("\n".join(REFS) + "\n", encoding="utf-8")
    out = tmp_path / "eval"
    assert translation_bleu.main(["--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt"),
                                  "--lang", "de", "--compound-split", "--out-dir", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("sacreBLEU (detokenised, 13a): ")
    assert printed[1].startswith(PAPER_LABEL + ": ") and "compound splitting" in printed[1]
    payload = json.loads((out / "bleu.json").read_text())
    assert payload["sacrebleu"]["score"] == pytest.approx(sacrebleu_score(HYPS, REFS, "13a").score)
    assert payload["tokenized_bleu"]["score"] == pytest.approx(
        tokenized_bleu(HYPS, REFS, "de", split_compounds=True).score)
    assert (out / "bleu_tokenized.txt").read_text().strip() == printed[1]
    assert len((out / "ref.tok.txt").read_text().splitlines()) == len(REFS)


def test_script_chinese_target(tmp_path, capsys):
    (tmp_path / "hyp.txt").write_text("我们今天去北京。\n", encoding="utf-8")
    (tmp_path / "ref.txt").write_text("我们明天去北京。\n", encoding="utf-8")
    assert translation_bleu.main(["--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt"),
                                  "--lang", "zh"]) == 0
    sacre, paper = capsys.readouterr().out.splitlines()
    assert sacre.startswith("sacreBLEU (detokenised, zh): ") and "sacreBLEU zh tokeniser" in paper


def test_script_names_misaligned_files(tmp_path, capsys):
    (tmp_path / "hyp.txt").write_text("a\nb\n")
    (tmp_path / "ref.txt").write_text("a\n")
    assert translation_bleu.main(["--hyp", str(tmp_path / "hyp.txt"), "--ref", str(tmp_path / "ref.txt"),
                                  "--lang", "en"]) == 2
    assert "2 hypotheses but 1 references" in capsys.readouterr().err


# ------------------------------------------------------------------ evaluate.sh end to end


def run(cmd, env=None):
    proc = run_checked(cmd, env=env)
    return proc


@pytest.fixture(scope="module")
def en_de_run(tmp_path_factory):
    """English->German Ding pairs (a German target: compound splitting on by default) and a
    tiny model trained for one short epoch (its translations are poor; only the plumbing counts)."""
    if not DING.exists():
        pytest.skip("apt-get install trans-de-en (make install does)")
    work = tmp_path_factory.mktemp("eval_sh")
    data_bin = prepare_ding_bin(work, src="en", tgt="de", max_words=6, valid_size=30, test_size=30)
    save_dir = work / "ckpt"
    run([venv_bin("fairseq-train"), data_bin, "--user-dir", REPO / "user_dir", "--task", "translation",
         "--arch", "sdma_transformer_iwslt_de_en_tiny", "--encoder-layers", "1", "--decoder-layers", "1",
         "--encoder-embed-dim", "32", "--decoder-embed-dim", "32", "--encoder-ffn-embed-dim", "64",
         "--decoder-ffn-embed-dim", "64", "--criterion", "sdma_label_smoothed_cross_entropy",
         "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "4000",
         "--max-epoch", "1", "--cpu", "--no-progress-bar", "--disable-validation", "--save-dir", save_dir,
         "--seed", "1"])
    return save_dir, data_bin, work


def evaluate_sh(save_dir, data_bin, out_dir, **env):
    full_env = {**os.environ, "PYTHON": sys.executable, "N_AVG": "1", "SKIP_REDUNDANCY": "1",
                "BATCH_SIZE": "64", "GEN_ARGS": "--cpu --max-len-a 0 --max-len-b 8", **env}
    return subprocess.run(["bash", REPO / "examples/sdma_translation/evaluate.sh", save_dir, data_bin, out_dir],
                          capture_output=True, text=True, env=full_env)


def test_evaluate_sh_prints_and_writes_both_bleu_scores(en_de_run):
    save_dir, data_bin, work = en_de_run
    out = work / "eval"
    proc = evaluate_sh(save_dir, data_bin, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    sacre = [line for line in lines if line.startswith("sacreBLEU (detokenised, 13a): ")]
    paper = [line for line in lines if line.startswith(PAPER_LABEL + ": ")]
    assert len(sacre) == 1 and len(paper) == 1, proc.stdout
    assert "Moses-tokenised de, compound splitting" in paper[0]  # German target: WMT'14 En-De convention
    for name in ("bleu.txt", "bleu_tokenized.txt", "bleu.json", "hyp.tok.txt", "ref.tok.txt"):
        assert (out / name).is_file(), name
    payload = json.loads((out / "bleu.json").read_text())
    cli = json.loads((out / "bleu.txt").read_text())  # the sacrebleu CLI's own output
    assert payload["sacrebleu"]["score"] == pytest.approx(cli["score"], abs=0.05)
    refs = (work / "prep" / "spm" / "test.de.raw").read_text().splitlines()
    assert len((out / "ref.tok.txt").read_text().splitlines()) == len(refs)


def test_evaluate_sh_compound_split_switch(en_de_run):
    save_dir, data_bin, work = en_de_run
    proc = evaluate_sh(save_dir, data_bin, work / "bad", COMPOUND_SPLIT="maybe")
    assert proc.returncode == 2 and "COMPOUND_SPLIT must be auto, 1 or 0" in proc.stderr

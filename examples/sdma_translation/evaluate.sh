#!/usr/bin/env bash
# Evaluate a trained SDMA-T / SMA-T / V-T run as in the SDMA paper: average the last
# 5 epoch checkpoints, decode the test set with beam 5, score BLEU two ways against the
# raw references, then measure attention redundancy. The two BLEU scores:
#   sacreBLEU (detokenised, 13a; zh for a Chinese target): the standard, comparable score;
#   tokenized BLEU (fairseq-style, as the paper's Tables II-IV): Moses-tokenised hypotheses
#     vs Moses-tokenised references, BLEU-4 as fairseq-generate / multi-bleu.perl, with the
#     ##AT##-##AT## compound splitting of WMT'14 En-De for a German target
#     (sdma-bleu, user_dir/tools/sdma/bleu.py).
#
# usage: examples/sdma_translation/evaluate.sh SAVE_DIR DATA_BIN [OUT_DIR]
#   SAVE_DIR  the run's checkpoints (checkpoint{epoch}.pt)
#   DATA_BIN  the fairseq-preprocess output the run was trained on
#   OUT_DIR   default SAVE_DIR/eval_${SUBSET}: gen.out, hyp.txt, bleu.txt (sacreBLEU),
#             bleu_tokenized.txt, bleu.json (both scores), hyp.tok.txt, ref.tok.txt
# env: N_AVG=5 BEAM=5 LENPEN=1.0 BATCH_SIZE=128 SUBSET=test
#      REF=DATA_BIN/../spm/${SUBSET}.${TGT}.raw (written by prepare-translation)
#      SACREBLEU_TOK (default: zh for a Chinese target, else 13a)  PYTHON  SKIP_REDUNDANCY=0
#      COMPOUND_SPLIT=auto|1|0 (auto: on for a German target, i.e. WMT'14 En-De)
#      BLEU_TOKENIZER=auto|moses|zh|none (tokenized BLEU; auto: zh for a Chinese target, else moses)
#      GEN_ARGS (extra fairseq-generate options, space-separated, e.g. "--cpu --max-len-b 50")
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
usage() {
    awk 'NR == 1 { next } /^#/ { sub(/^# ?/, ""); print; next } { exit }' "${BASH_SOURCE[0]}" >&2
    exit 2
}
[[ $# -ge 2 && $# -le 3 ]] || usage
SAVE_DIR=$1
DATA_BIN=$2
SUBSET=${SUBSET:-test}
OUT_DIR=${3:-$SAVE_DIR/eval_$SUBSET}
N_AVG=${N_AVG:-5}
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x "$ROOT/.venv/bin/python" ]]; then PYTHON="$ROOT/.venv/bin/python"; else PYTHON=python3; fi
fi
BIN_DIR=$(dirname "$PYTHON")
tool() { if [[ -x "$BIN_DIR/$1" ]]; then echo "$BIN_DIR/$1"; else echo "$1"; fi; }

[[ -d "$SAVE_DIR" ]] || { echo "error: checkpoint directory $SAVE_DIR not found" >&2; usage; }
# the language pair from the binarised file names, e.g. test.de-en.de.bin
shopt -s nullglob
bins=("$DATA_BIN/$SUBSET".*-*.*.bin)
shopt -u nullglob
[[ ${#bins[@]} -gt 0 ]] || { echo "error: no $SUBSET.SRC-TGT.*.bin in $DATA_BIN" >&2; usage; }
pair=$(basename "${bins[0]}" | cut -d. -f2)
SRC=${pair%-*}
TGT=${pair#*-}
REF=${REF:-$(dirname "$DATA_BIN")/spm/$SUBSET.$TGT.raw}
[[ -f "$REF" ]] || { echo "error: reference $REF not found (set REF=...)" >&2; exit 2; }
case $TGT in zh*) TOK=${SACREBLEU_TOK:-zh} ;; *) TOK=${SACREBLEU_TOK:-13a} ;; esac
case ${COMPOUND_SPLIT:-auto} in
    auto) case $TGT in de*) split=(--compound-split) ;; *) split=() ;; esac ;;
    1) split=(--compound-split) ;;
    0) split=() ;;
    *) echo "error: COMPOUND_SPLIT must be auto, 1 or 0, not '$COMPOUND_SPLIT'" >&2; exit 2 ;;
esac
mkdir -p "$OUT_DIR"
read -r -a gen_args <<< "${GEN_ARGS:-}"

AVG=$SAVE_DIR/checkpoint_avg$N_AVG.pt
echo "[evaluate] average the last $N_AVG epoch checkpoints -> $AVG"
"$PYTHON" -m user_dir.tools.average_checkpoints --inputs "$SAVE_DIR" \
    --num-epoch-checkpoints "$N_AVG" --output "$AVG"

# --required-batch-size-multiple 1: with fairseq's default of 8, batch_by_size drops the last
# batch when its size is not a multiple of 8, i.e. up to 7 test sentences would go missing.
echo "[evaluate] fairseq-generate $SRC->$TGT ($SUBSET, beam ${BEAM:-5}) -> $OUT_DIR/gen.out"
"$(tool fairseq-generate)" "$DATA_BIN" --user-dir "$ROOT/user_dir" --path "$AVG" \
    --source-lang "$SRC" --target-lang "$TGT" --gen-subset "$SUBSET" \
    --beam "${BEAM:-5}" --lenpen "${LENPEN:-1.0}" --batch-size "${BATCH_SIZE:-128}" \
    --required-batch-size-multiple 1 \
    --remove-bpe sentencepiece "${gen_args[@]}" > "$OUT_DIR/gen.out"
grep ^H "$OUT_DIR/gen.out" | sort -V | cut -f3 > "$OUT_DIR/hyp.txt"
n_hyp=$(wc -l < "$OUT_DIR/hyp.txt")
n_ref=$(wc -l < "$REF")
if [[ $n_hyp -ne $n_ref ]]; then
    echo "error: $n_hyp hypotheses but $n_ref reference lines in $REF; is REF the $SUBSET split of $DATA_BIN?" >&2
    exit 1
fi

echo "[evaluate] sacreBLEU (tokenize $TOK) against $REF -> $OUT_DIR/bleu.txt"
"$(tool sacrebleu)" "$REF" -i "$OUT_DIR/hyp.txt" -tok "$TOK" | tee "$OUT_DIR/bleu.txt"

echo "[evaluate] BLEU scores ($TGT, $n_hyp sentences) -> $OUT_DIR/bleu.json, $OUT_DIR/bleu_tokenized.txt"
"$PYTHON" -m user_dir.tools.sdma.bleu --hyp "$OUT_DIR/hyp.txt" --ref "$REF" --lang "$TGT" \
    --sacrebleu-tokenize "$TOK" --tokenizer "${BLEU_TOKENIZER:-auto}" "${split[@]}" --out-dir "$OUT_DIR"

if [[ "${SKIP_REDUNDANCY:-0}" == 1 ]]; then
    exit 0
fi
echo "[evaluate] attention redundancy ($SUBSET)"
"$PYTHON" -m user_dir.tools.sdma.redundancy --path "$AVG" "$DATA_BIN" --subset "$SUBSET"

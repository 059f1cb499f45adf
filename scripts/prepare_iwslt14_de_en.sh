#!/usr/bin/env bash
# IWSLT'14 German->English, prepared as for the SDMA paper (Table I):
# fairseq's prepare-iwslt14.sh split (valid = every 23rd training line, test =
# TED dev2010 + TEDX dev2012 + TED tst2010-2012, 6750 lines), lowercased as in
# fairseq's recipe, separate sentencepiece BPE vocabularies of 6K (de) / 8K (en),
# binarised with fairseq-preprocess. Never downloads anything.
#
# usage: scripts/prepare_iwslt14_de_en.sh RAW_DE_EN_DIR [OUT_DIR]
#   RAW_DE_EN_DIR  the extracted 'de-en' folder of the IWSLT 2014 release (or its parent):
#                  train.tags.de-en.{de,en}, IWSLT14.TED*.de-en.{de,en}.xml
#   OUT_DIR        default data/iwslt14_de_en (raw/, text/, spm/, bin/)
# env: SRC_VOCAB=6000 TGT_VOCAB=8000 LOWERCASE=1 MODEL_TYPE=bpe WORKERS=$(nproc) PYTHON=...
#      OVERWRITE=1 (replace OUT_DIR/bin from a previous run)
#      MAX_POSITIONS=1024 (the model's limit in subword tokens + </s>; longer sentences are
#      refused, naming the count and the first file:line) TOO_LONG=truncate|skip (or cut/drop them)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare_common.sh"

parse_raw_out "${BASH_SOURCE[0]}" data/iwslt14_de_en "$@"
if [[ ! -f "$RAW/train.tags.de-en.de" && ! -f "$RAW/de-en/train.tags.de-en.de" ]]; then
    echo "error: no train.tags.de-en.de in $RAW or $RAW/de-en" >&2
    usage_from_header "${BASH_SOURCE[0]}"
fi

"$PYTHON" -m pipelines.data.iwslt14 iwslt14 "$RAW" "$OUT/raw"
lower=()
if [[ "${LOWERCASE:-1}" == 1 ]]; then lower=(--lowercase); fi
"$PYTHON" -m pipelines.data.translation \
    --train-prefix "$OUT/raw/train" --valid-prefix "$OUT/raw/valid" --test-prefix "$OUT/raw/test" \
    --src de --tgt en --out-dir "$OUT" \
    --src-vocab-size "${SRC_VOCAB:-6000}" --tgt-vocab-size "${TGT_VOCAB:-8000}" \
    --model-type "${MODEL_TYPE:-bpe}" --workers "$WORKERS" "${PREPARE_EXTRA[@]}" "${lower[@]}"

#!/usr/bin/env bash
# WMT'14 English->German, prepared as for the SDMA paper (Table I): one joint
# sentencepiece BPE vocabulary of 44K shared by both languages (train with
# --share-all-embeddings), newstest2013 as valid, newstest2014 as test,
# binarised with fairseq-preprocess --joined-dictionary. Never downloads anything.
#
# usage: scripts/prepare_wmt14_en_de.sh RAW_DIR [OUT_DIR]
#   RAW_DIR  holds plain, line-aligned text files:
#              train.{en,de}           the concatenated training corpora
#                                      (Europarl v7 + Common Crawl + News Commentary)
#              newstest2013.{en,de}    (or WMT's newstest2013-deen-{src.en,ref.de}.sgm)
#              newstest2014.{en,de}    (or newstest2014-deen-{src.en,ref.de}.sgm)
#   OUT_DIR  default data/wmt14_en_de (text/, spm/, bin/)
# env: TRAIN_PREFIX VALID_PREFIX TEST_PREFIX (override the file prefixes),
#      VOCAB=44000 MODEL_TYPE=bpe WORKERS=$(nproc) PYTHON=...
#      OVERWRITE=1 (replace OUT_DIR/bin from a previous run)
#      MAX_POSITIONS=1024 (the model's limit in subword tokens + </s>; longer sentences are
#      refused, naming the count and the first file:line) TOO_LONG=truncate|skip (or cut/drop them)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare_common.sh"

parse_raw_out "${BASH_SOURCE[0]}" data/wmt14_en_de "$@"

TRAIN_PREFIX=${TRAIN_PREFIX:-$RAW/train}
require_pair_or_usage "${BASH_SOURCE[0]}" "$TRAIN_PREFIX" en de
VALID_PREFIX=${VALID_PREFIX:-$(plain_or_sgm newstest2013 deen en de "$RAW" "$OUT/raw/newstest2013")}
TEST_PREFIX=${TEST_PREFIX:-$(plain_or_sgm newstest2014 deen en de "$RAW" "$OUT/raw/newstest2014")}
require_pair "$VALID_PREFIX" en de
require_pair "$TEST_PREFIX" en de

"$PYTHON" -m pipelines.data.translation \
    --train-prefix "$TRAIN_PREFIX" --valid-prefix "$VALID_PREFIX" --test-prefix "$TEST_PREFIX" \
    --src en --tgt de --out-dir "$OUT" --joint --vocab-size "${VOCAB:-44000}" \
    --model-type "${MODEL_TYPE:-bpe}" --workers "$WORKERS" "${PREPARE_EXTRA[@]}"

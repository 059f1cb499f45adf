#!/usr/bin/env bash
# WMT'17 Chinese->English, prepared as for the SDMA paper (Table I): News
# Commentary v12 for training, newsdev2017 as valid, newstest2017 as test; the
# Chinese side is segmented with jieba, then separate sentencepiece BPE
# vocabularies of 25K (zh) / 20K (en), binarised with fairseq-preprocess.
# Never downloads anything.
#
# usage: scripts/prepare_wmt17_zh_en.sh RAW_DIR [OUT_DIR]
#   RAW_DIR  holds plain, line-aligned text files:
#              news-commentary-v12.zh-en.{zh,en}
#              newsdev2017.{zh,en}     (or WMT's newsdev2017-zhen-{src.zh,ref.en}.sgm)
#              newstest2017.{zh,en}    (or newstest2017-zhen-{src.zh,ref.en}.sgm)
#   OUT_DIR  default data/wmt17_zh_en (text/, spm/, bin/)
# env: TRAIN_PREFIX VALID_PREFIX TEST_PREFIX (override the file prefixes),
#      SRC_VOCAB=25000 TGT_VOCAB=20000 MODEL_TYPE=bpe WORKERS=$(nproc) PYTHON=...
#      OVERWRITE=1 (replace OUT_DIR/bin from a previous run)
#      MAX_POSITIONS=1024 (the model's limit in subword tokens + </s>; longer sentences are
#      refused, naming the count and the first file:line) TOO_LONG=truncate|skip (or cut/drop them)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/prepare_common.sh"

parse_raw_out "${BASH_SOURCE[0]}" data/wmt17_zh_en "$@"

TRAIN_PREFIX=${TRAIN_PREFIX:-$RAW/news-commentary-v12.zh-en}
require_pair_or_usage "${BASH_SOURCE[0]}" "$TRAIN_PREFIX" zh en
VALID_PREFIX=${VALID_PREFIX:-$(plain_or_sgm newsdev2017 zhen zh en "$RAW" "$OUT/raw/newsdev2017")}
TEST_PREFIX=${TEST_PREFIX:-$(plain_or_sgm newstest2017 zhen zh en "$RAW" "$OUT/raw/newstest2017")}
require_pair "$VALID_PREFIX" zh en
require_pair "$TEST_PREFIX" zh en

"$PYTHON" -m pipelines.data.translation \
    --train-prefix "$TRAIN_PREFIX" --valid-prefix "$VALID_PREFIX" --test-prefix "$TEST_PREFIX" \
    --src zh --tgt en --out-dir "$OUT" --jieba \
    --src-vocab-size "${SRC_VOCAB:-25000}" --tgt-vocab-size "${TGT_VOCAB:-20000}" \
    --model-type "${MODEL_TYPE:-bpe}" --workers "$WORKERS" "${PREPARE_EXTRA[@]}"

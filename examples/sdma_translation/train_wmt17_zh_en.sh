#!/usr/bin/env bash
# Train SDMA-T / SMA-T / V-T on WMT'17 Chinese->English (SDMA paper, Table I).
#
# Table I setting: 512/1024 (embed/FFN), 6+6 layers, 4 heads, n_c 4; lambda_k 0.01,
# lambda_d 1, lambda_q 50, lambda_x 5, c_g 5 (the architecture sets these).  Separate
# 25K (zh, jieba-segmented) / 20K (en) sentencepiece vocabularies.  Optimisation:
# Adam (0.9, 0.98), lr 5e-4, inverse_sqrt with 8K warm-up updates, weight decay 1e-4,
# label smoothing 0.1, 4096 tokens per batch, 79K updates.  Only one size exists
# (--size must stay base).  Dropout: the architecture's default unless DROPOUT is set.
#
# usage: examples/sdma_translation/train_wmt17_zh_en.sh [--mode sdma|sma|none]
#            [--data DIR] [--save-dir DIR] [-- fairseq-train args]
#   data default: data/wmt17_zh_en/bin (scripts/prepare_wmt17_zh_en.sh)
#   save default: checkpoints/wmt17_zh_en_${MODE}
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_train_args "${BASH_SOURCE[0]}" "$@"
if [[ $SIZE != base ]]; then
    echo "error: WMT'17 Zh-En has only the base model (sdma_transformer_wmt_zh_en); drop --size" >&2
    exit 2
fi

DATA_BIN=${DATA_BIN:-data/wmt17_zh_en/bin}
SAVE_DIR=${SAVE_DIR:-checkpoints/wmt17_zh_en_${MODE}}
MAX_UPDATE=${MAX_UPDATE:-79000}
WARMUP=${WARMUP:-8000}
require_data_bin zh en

run_fairseq_train zh en sdma_transformer_wmt_zh_en

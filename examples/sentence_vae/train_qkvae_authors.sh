#!/usr/bin/env bash
# QKVAE as the authors' qkv_train.py trains it (ghazi-f/QKVAE; the paper's Appendix B where it agrees):
# BART-base geometry initialised from BART (--bart-dir), the authors reading (decoder started from <s>,
# word dropout 0.4 on embeddings, ...), free bits lambda = 0.01 per dimension (their --kl_th default; the
# paper prints 0.05), an auto-encoding phase of 3,000 steps (optimizer state reset at its end, as their
# re-created optimizer), z_sem's beta annealed linearly to 0.6 over steps 3k-6k and z_syn's to 0.3 over
# 7k-20k, transformers' Adafactor with lr 2e-4 and relative_step=False (so scale_parameter=True; fairseq's
# adafactor with --scale-parameter), a constant learning rate (their --lr_sched 0), gradient norm clipped
# at 100, 64 sentences per batch, 40 epochs.
#
# usage: examples/sentence_vae/train_qkvae_authors.sh DATA_BIN BART_DIR [SAVE_DIR] [-- fairseq-train args]
#   DATA_BIN: fairseq-preprocess --only-source output (e.g. prepare-english-vae-data's bin/)
#   BART_DIR: a local Hugging Face BART-base directory
# Environment: FAIRSEQ_TRAIN (default: the repository venv's fairseq-train).
set -euo pipefail
if [[ $# -lt 2 ]]; then sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; fi
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
data=$1 bart=$2
shift 2
save=outputs/vae_runs/qkvae_authors
if [[ $# -gt 0 && $1 != -- ]]; then save=$1; shift; fi
if [[ $# -gt 0 && $1 == -- ]]; then shift; fi
train=${FAIRSEQ_TRAIN:-$root/.venv/bin/fairseq-train}
[[ -x $train ]] || train=fairseq-train
exec "$train" "$data" --user-dir "$root/user_dir" --task sentence_vae --decoder-start auto \
    --arch qkvae_bart_base --qkvae-reading authors --bart-dir "$bart" \
    --criterion sentence_vae --kl-variant free_bits --kl-threshold 0.01 --ae-steps 3000 \
    --beta-schedule "z_sem=linear:3000:6000:0.6,z_syn=linear:7000:20000:0.3" \
    --optimizer adafactor --scale-parameter --lr 2e-4 --lr-scheduler fixed --clip-norm 100 \
    --batch-size 64 --max-epoch 40 --save-dir "$save" "$@"

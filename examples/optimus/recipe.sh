#!/usr/bin/env bash
# Optimus as published (optimus.txt Sec. 4.3 and 5): pre-train BERT + GPT-2 joined by z on a large
# corpus, fine-tune per KL threshold lambda on the target corpus (Table 1), then the downstream
# uses (Figure 3 / 4, Table 6). Every stage is a command of this plugin; see README.md beside it.
#
#   BERT_DIR=/models/bert-base-cased GPT2_DIR=/models/gpt2 \
#   PRETRAIN_TRAIN=wiki.train.txt PRETRAIN_VALID=wiki.valid.txt \
#   FINETUNE_TRAIN=yelp.train.txt FINETUNE_VALID=yelp.valid.txt FINETUNE_TEST=yelp.test.txt \
#   LABELLED=yelp_sst2_layout/ OUT=outputs/optimus bash examples/optimus/recipe.sh
#
# Without GPT2_DIR a byte-level BPE is trained on PRETRAIN_TRAIN (GPT-2's format) and the
# GPT-2 decoder is trained from scratch with DECODER_FLAGS (the offline run of the README).
# Text files hold one raw sentence per line; LABELLED holds train.tsv/test.tsv (sentence<TAB>label).
set -euo pipefail

: "${BERT_DIR:?set BERT_DIR to a local Hugging Face BERT directory}"
: "${PRETRAIN_TRAIN:?}" "${PRETRAIN_VALID:?}" "${FINETUNE_TRAIN:?}" "${FINETUNE_VALID:?}" "${FINETUNE_TEST:?}"
OUT=${OUT:-outputs/optimus}
GPT2_DIR=${GPT2_DIR:-}
BPE_VOCAB=${BPE_VOCAB:-8000}
DECODER_FLAGS=${DECODER_FLAGS:---decoder-layers 4 --decoder-embed-dim 256 --decoder-attention-heads 4 --decoder-ffn-embed-dim 1024}
PRETRAIN_UPDATES=${PRETRAIN_UPDATES:-2000}
PRETRAIN_LR=${PRETRAIN_LR:-5e-5}            # authors: AdamW 5e-5; a from-scratch decoder wants ~5e-4
PRETRAIN_BETA_MAX=${PRETRAIN_BETA_MAX:-0.5}  # the released pre-trained checkpoint (beta0.5_d1.0); the text: 1.0
PRETRAIN_LAMBDA=${PRETRAIN_LAMBDA:-1.0}      # its dim_target_kl
BATCH=${BATCH:-16}
EXTRA=${EXTRA:-}                             # e.g. --cpu
LAMBDAS=${LAMBDAS:-0 0.05 0.1 0.25 0.5 1}
SWEEP_LAMBDA=${SWEEP_LAMBDA:-0.5}            # the model used downstream (Table 1's trade-off)

# 1. data: one sentence in both tokenizations, the same tokenizers for both corpora
if [ -z "$GPT2_DIR" ]; then
  prepare-optimus-data --out-dir "$OUT/data/pretrain" --train "$PRETRAIN_TRAIN" --valid "$PRETRAIN_VALID" \
    --bert-dir "$BERT_DIR" --train-bpe "$OUT/bpe" --bpe-vocab-size "$BPE_VOCAB" --skip-too-long
  GPT2_TOKENIZER="$OUT/bpe"
  DECODER="$DECODER_FLAGS"
else
  prepare-optimus-data --out-dir "$OUT/data/pretrain" --train "$PRETRAIN_TRAIN" --valid "$PRETRAIN_VALID" \
    --bert-dir "$BERT_DIR" --gpt2-dir "$GPT2_DIR" --skip-too-long
  GPT2_TOKENIZER="$GPT2_DIR"
  DECODER="--gpt2-dir $GPT2_DIR"
fi
prepare-optimus-data --out-dir "$OUT/data/finetune" --train "$FINETUNE_TRAIN" --valid "$FINETUNE_VALID" \
  --test "$FINETUNE_TEST" --bert-dir "$BERT_DIR" --gpt2-dir "$GPT2_TOKENIZER" --skip-too-long

# 2. pre-training (Sec. 4.3): 10 cyclical periods (AE 0.5, anneal 0.25, constant 0.25), KL hinge
fairseq-train "$OUT/data/pretrain" --user-dir user_dir --task optimus_lm --criterion sentence_vae \
  --arch optimus_small --bert-dir "$BERT_DIR" $DECODER --latent-dim 32 \
  --beta-schedule "cyclical:10:0.5:0.25:0.25:$PRETRAIN_BETA_MAX" --kl-variant hinge --kl-threshold "$PRETRAIN_LAMBDA" \
  --optimizer adam --adam-betas "(0.9, 0.999)" --lr "$PRETRAIN_LR" --lr-scheduler polynomial_decay \
  --total-num-update "$PRETRAIN_UPDATES" --warmup-updates 100 --max-update "$PRETRAIN_UPDATES" --clip-norm 1.0 \
  --batch-size "$BATCH" --seed 1 --save-dir "$OUT/pretrain" --no-epoch-checkpoints --num-workers 0 $EXTRA

# 3. fine-tuning per lambda (Sec. 5.1, Table 1): --restore-file + --reset-* inside the driver
optimus-lambda-sweep --data "$OUT/data/finetune" --pretrained "$OUT/pretrain/checkpoint_last.pt" \
  --out-dir "$OUT" --lambdas $LAMBDAS --batch-size "$BATCH" $EXTRA

# 4. downstream uses on the lambda = SWEEP_LAMBDA model (Sec. 5.2-5.3)
if [ -n "${LABELLED:-}" ]; then
  optimus-low-resource --checkpoint "$OUT/lambda_$SWEEP_LAMBDA/checkpoint_last.pt" \
    --optimus-data "$OUT/data/finetune" --bert-dir "$BERT_DIR" --data-dir "$LABELLED" \
    --out "$OUT/low_resource.json" --tsne "$OUT/tsne.png"
  optimus-cond-gen --checkpoint "$OUT/lambda_$SWEEP_LAMBDA/checkpoint_last.pt" \
    --optimus-data "$OUT/data/finetune" --data-dir "$LABELLED" --out "$OUT/conditional_generation.json"
fi

#!/usr/bin/env bash
# DisBert / DisRoBERTa (Yu et al., topic_vq_sts.txt) on a GLUE-format dataset, the paper's three
# stages with the hyper-parameters of its Table 7, and the plain encoder with the same options.
#
#   examples/topic_vq_sts/run_glue.sh TASK GLUE_DIR ENCODER_DIR [SAVE_ROOT] [SEED]
#
#   TASK        MRPC | STS-B | QQP  (Table 7 column; Quora = QQP's format)
#   GLUE_DIR    directory with train.tsv, dev.tsv, test.tsv of that task (standard GLUE files)
#   ENCODER_DIR local Hugging Face BERT/RoBERTa directory (weights + tokenizer), e.g. bert-base-uncased
#
# Writes SAVE_ROOT/{ntm,vqvae,disbert,base}/ and a GLUE submission SAVE_ROOT/TASK.tsv. Extra
# fairseq options can be passed in FAIRSEQ_EXTRA (e.g. "--cpu --freeze-layers 10" on a CPU,
# "--fp16" on a GPU, "--distributed-world-size 4" for DDP).
set -euo pipefail
task=${1:?TASK}; data=${2:?GLUE_DIR}; encoder=${3:?ENCODER_DIR}; root=${4:-checkpoints/topic_vq_$1}; seed=${5:-1}
here=$(cd "$(dirname "$0")/../.." && pwd)
py=${PYTHON:-$here/.venv/bin/python}
train="$(dirname "$py")/fairseq-train"
case $task in  # Table 7: K, NTM batch/epochs/lr, VQ batch/lr, model batch/epochs/lr, max length
  MRPC)  K=30; nb=256; ne=500; nlr=1e-3; vb=32;  vlr=2e-5; b=32;  e=10; lr=2e-5; len=128; metric=f1 ;;
  STS-B) K=40; nb=256; ne=500; nlr=1e-3; vb=32;  vlr=2e-5; b=32;  e=10; lr=2e-5; len=128; metric=pearson_spearman ;;
  QQP)   K=90; nb=512; ne=150; nlr=2e-3; vb=128; vlr=3e-5; b=128; e=5;  lr=3e-5; len=128; metric=f1 ;;
  *) echo "unknown TASK $task (MRPC, STS-B or QQP)" >&2; exit 2 ;;
esac
ne=${NTM_EPOCHS:-$ne}; ve=${VQ_EPOCHS:-10}; e=${EPOCHS:-$e}; K=${NUM_TOPICS:-$K}; len=${MAX_LEN:-$len}  # overrides (smoke tests, small data)
common=("$data" --user-dir "$here/user_dir" --task topic_vq_sentence_prediction --glue-task "$task"
        --hf-tokenizer-dir "$encoder" --max-positions "$len" --topic-features --criterion hf_sentence_prediction
        --optimizer adam --adam-betas "(0.9,0.999)" --seed "$seed" --no-epoch-checkpoints
        --required-batch-size-multiple 1 ${FAIRSEQ_EXTRA:-})
iv=$(( ne % 10 == 0 ? 10 : 1 ))  # fairseq saves/validates only on multiples of the interval: end on one
topic=(--arch topic_vq_sts --hf-model-dir "$encoder" --num-topics "$K")

# 1. neural topic model (Section 3.1), selected by its dev loss
"$train" "${common[@]}" "${topic[@]}" --topic-vq-stage ntm --batch-size $nb --max-epoch $ne --lr $nlr \
    --validate-interval $iv --save-interval $iv --save-dir "$root/ntm"
# 2. topic-enhanced VQ-VAE trained jointly with the NTM (Section 3.2, eq. 1 and 6, gamma = 1)
"$train" "${common[@]}" "${topic[@]}" --topic-vq-stage vqvae --topic-vq-init "$root/ntm/checkpoint_best.pt" \
    --batch-size $vb --max-epoch $ve --lr $vlr --save-dir "$root/vqvae"
# 3. semantics-driven attention in the last layer + output enhancement (Section 3.3)
"$train" "${common[@]}" "${topic[@]}" --topic-vq-init "$root/vqvae/checkpoint_best.pt" \
    --batch-size $b --max-epoch $e --lr $lr \
    --best-checkpoint-metric $metric --maximize-best-checkpoint-metric --save-dir "$root/disbert"
# the plain encoder with the same fine-tuning options (the paper's Bert/RoBERTa rows)
"$train" "${common[@]}" --arch hf_sentence_classifier --hf-model-dir "$encoder" \
    --batch-size $b --max-epoch $e --lr $lr \
    --best-checkpoint-metric $metric --maximize-best-checkpoint-metric --save-dir "$root/base"

for system in disbert base; do
  "$py" -m user_dir.tools.hf_sentence.predict --path "$root/$system/checkpoint_best.pt" --data "$data" --split valid \
      --out "$root/$system.dev.tsv"
done
"$py" -m user_dir.tools.hf_sentence.predict --path "$root/disbert/checkpoint_best.pt" --data "$data" --split test \
    --out "$root/$task.tsv"
echo "GLUE submission: $root/$task.tsv"

#!/usr/bin/env bash
# CPU quick start, second half: fine-tune the quick start's pre-trained model on the demo
# conversations until it answers, no GPU and no network.
#
#   bash scripts/quickstart_sft.sh                   # pre-trains first (scripts/quickstart.sh) if need be
#   QS_SFT_STEPS=10 QS_HIDDEN=64 QS_LAYERS=2 QS_STEPS=10 QS_OUT=/tmp/qs bash scripts/quickstart_sft.sh   # smoke run
#
# Stages: 1 the pre-trained model (out/quickstart/, made by scripts/quickstart.sh when missing),
# 2 the demo conversations (stdlib docstrings as questions and answers, whole modules held out),
# their packing and the held-out multiple-choice task, 3 the base model's held-out reply loss,
# 4 fine-tuning with torchrun (DDP over 2 CPU processes), 5 the fine-tuned model's reply loss,
# its answer to a held-out question and the task, both models item by item (scripts/compare_task.py),
# 6 export to a folder that stock transformers chats with. The last line is a one-line summary.
#
# Every knob is an environment variable: the pre-training ones of scripts/quickstart.sh (QS_OUT,
# QS_HIDDEN, QS_LAYERS, ...) say which pre-trained model, the QS_SFT_* ones the fine-tuning.
set -euo pipefail

abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(abspath "${QS_OUT:-$REPO_ROOT/out/quickstart}")"
# The conversations to train on, and beside them (*_heldout.jsonl) the held-out ones.
DEFAULT_CONVERSATIONS="$REPO_ROOT/dataset/demo_sft.jsonl"
CONVERSATIONS="$(abspath "${QS_SFT_CORPUS:-$DEFAULT_CONVERSATIONS}")"
HELD_OUT="${CONVERSATIONS%.jsonl}_heldout.jsonl"
cd "$REPO_ROOT"
PYTHON="${PYTHON:-python}"
TORCHRUN="${TORCHRUN:-torchrun}"

HIDDEN="${QS_HIDDEN:-128}"
PRETRAINED="$OUT/quickstart_$HIDDEN.pth"
SFT_OUT="$OUT/sft"
NPROC="${QS_NPROC:-2}"
SEQ="${QS_SFT_SEQ:-256}"                # tokens per packed window: a few demo conversations each
BATCH="${QS_SFT_BATCH:-4}"              # windows per process per step
EPOCHS="${QS_SFT_EPOCHS:-2}"            # MiniMind's default: about 350 steps of 8 x 256 tokens here
STEPS="${QS_SFT_STEPS:-0}"              # 0: the epochs decide
LR="${QS_SFT_LR:-3e-4}"                 # AdamW's peak (embedding, norms): the sweep in docs/sft.md
MUON_LR="${QS_SFT_MUON_LR:-2e-3}"       # Muon's peak (the blocks)
QUESTION="${QS_SFT_QUESTION:-What does \`calendar.isleap\` do?}"  # calendar is a held-out module
MAX_NEW_TOKENS="${QS_MAX_NEW_TOKENS:-40}"
if [[ -n "${QS_PORT:-}" ]]; then RDZV=(--master_port="$QS_PORT"); else RDZV=(--standalone); fi

DATA="$SFT_OUT/data"
LOGS="$SFT_OUT/logs"
SFT_PTH="$SFT_OUT/quickstart_sft_$HIDDEN.pth"
HF_DIR="$SFT_OUT/hf"
mkdir -p "$DATA" "$LOGS"
stage() { printf '\n==== [%s] %s  (t=%ss)\n' "$1" "$2" "$SECONDS"; }
value() { grep -oE "(^| )$1=[^ ]*" "${2:--}" | head -n 1 | cut -d= -f2; }  # FILE, or stdin

stage 1/6 "the pre-trained model"
if [[ -s "$PRETRAINED" ]]; then
    echo "using $PRETRAINED"
else
    bash scripts/quickstart.sh
fi

stage 2/6 "demo conversations, packing, the held-out task"
# The demo conversations are built once (about 10 s), as the trainer's default --data_path is;
# the split holds out whole modules by a hash of their names.
if [[ -s "$CONVERSATIONS" ]]; then
    echo "using $CONVERSATIONS ($(wc -l < "$CONVERSATIONS") conversations) and $HELD_OUT"
elif [[ "$CONVERSATIONS" == "$DEFAULT_CONVERSATIONS" ]]; then
    "$PYTHON" scripts/build_demo_corpus.py --sft
else
    echo "error: QS_SFT_CORPUS=$CONVERSATIONS: no such file (or empty)" >&2
    exit 2
fi
"$PYTHON" scripts/build_demo_corpus.py --task "$DATA/task.jsonl" --held_out "$HELD_OUT"
TQDM_DISABLE=1 "$PYTHON" scripts/prepare_data.py --sft --data_path "$CONVERSATIONS" --out_path "$DATA/train.bin"
TQDM_DISABLE=1 "$PYTHON" scripts/prepare_data.py --sft --data_path "$HELD_OUT" --out_path "$DATA/heldout.bin" \
    --num_proc 1

stage 3/6 "the base model: its loss on the held-out replies"
"$PYTHON" scripts/eval_llm.py --weight_path "$PRETRAINED" --device cpu --chat --ppl_data "$HELD_OUT" \
    --max_seq_len "$SEQ" | tee "$LOGS/base.txt"

stage 4/6 "fine-tuning: $NPROC CPU processes (DDP), $EPOCHS epochs of $((BATCH * NPROC)) x $SEQ tokens a step"
rm -rf "$SFT_OUT/checkpoints"
OMP_NUM_THREADS=1 "$TORCHRUN" "${RDZV[@]}" --nproc_per_node="$NPROC" trainer/train_full_sft.py \
    --from_weight "$PRETRAINED" --data_path "$DATA/train.bin" --val_data_path "$DATA/heldout.bin" \
    --eval_task "$DATA/task.jsonl" --max_seq_len "$SEQ" --batch_size "$BATCH" --epochs "$EPOCHS" --max_steps "$STEPS" \
    --learning_rate "$LR" --muon_lr "$MUON_LR" --eval_interval 100 --eval_batches 1000 \
    --log_interval 20 --save_interval 100000 --num_workers 0 --device cpu \
    --save_dir "$SFT_OUT" --save_weight quickstart_sft --checkpoint_dir "$SFT_OUT/checkpoints" \
    2>&1 | tee "$LOGS/train.log"

stage 5/6 "the fine-tuned model: its held-out reply loss, its answer to a held-out question (greedy), \
and the task, item by item against the base model"
"$PYTHON" scripts/eval_llm.py --weight_path "$SFT_PTH" --device cpu --chat --ppl_data "$HELD_OUT" \
    --max_seq_len "$SEQ" --greedy --max_new_tokens "$MAX_NEW_TOKENS" --prompt "$QUESTION" | tee "$LOGS/sft.txt"
"$PYTHON" scripts/compare_task.py --task "$DATA/task.jsonl" --chat --weights "$PRETRAINED" "$SFT_PTH" \
    | tee "$LOGS/task.txt"

stage 6/6 "export to Hugging Face format, with the chat template"
"$PYTHON" scripts/convert_model.py --weight_path "$SFT_PTH" --format native --out_dir "$HF_DIR" | tee "$LOGS/export.txt"

# ---- summary ----------------------------------------------------------------------------
STEPS="$(grep -oE '^done: [0-9]+ steps' "$LOGS/train.log" | grep -oE '[0-9]+')"
ACC="$(grep 'metric=acc ' "$LOGS/task.txt")"
printf '\nquickstart_sft summary: steps=%s base_reply_loss=%s sft_reply_loss=%s base_acc=%s sft_acc=%s acc_gain=%s paired_stderr=%s chance=%s wall=%ss\n' \
    "$STEPS" "$(value loss "$LOGS/base.txt")" "$(value loss "$LOGS/sft.txt")" "$(value a <<< "$ACC")" \
    "$(value b <<< "$ACC")" "$(value b_minus_a <<< "$ACC")" "$(value paired_stderr <<< "$ACC")" \
    "$(value chance <<< "$ACC")" "$SECONDS"

#!/usr/bin/env bash
# The GPU check: one run that ends within GPU_CHECK_BUDGET seconds (default 540), so it fits one
# device command of at most 600 s on a machine with one GPU (sized for an H200), imports and
# compilation included.
#
#   bash scripts/bench/gpu_check.sh        # the report on stdout; with OUT set, also $OUT/gpu_check.txt,
#                                    # $OUT/gpu_check_logs/ (every part's log) and $OUT/variant_*.json
#
# The parts, most wanted first (GPU_CHECK_PLAN orders them; the budget may run out at the end):
#   env        torch, CUDA, the GPU and the bf16 peak MFU is measured against;
#   corpus, pack  the demo corpus and its packed .bin, built only when missing (carry
#              dataset/demo_pretrain.jsonl and .bin to the machine to keep their time);
#   b c i j d  the runs the targets' ratios need: the 64M model (hidden 768, 8 layers) at seq
#              1024, batch 32, bf16, one trainer run each through scripts/bench/bench_train.py throughput:
#              packed eager (b), compiled with the default optimizer (c: Muon) and with AdamW
#              (i), compiled without the document mask (j: --doc_mask 0), torchrun --nproc_per_node=1 on NCCL (d);
#   optimizer  Muon's step alone: scripts/bench/bench_ops.py optimizer --settings cuda (AdamW, torch.optim.Muon, ours);
#   then, as time allows:
#   ddp        what DDP would cost a 1-GPU run, and its settings: scripts/bench/bench_ops.py ddp (world size 1, NCCL;
#              since (d) runs no DDP at all, this row is where DDP's own overhead shows);
#   flash      SDPA forced onto the flash kernel (sdpa_kernel(FLASH_ATTENTION)) for the model's own
#              attention call, forward and backward, in bf16 at our head sizes; then the kernels the
#              profiler sees when SDPA chooses by itself;
#   kernels    the --doc_mask kernels: scripts/bench/bench_ops.py attention --device cuda (dense mask against
#              FlexAttention, forward+backward, outputs and gradients compared);
#   loss       the chunked cross-entropy against F.cross_entropy on upcast logits: scripts/bench/bench_ops.py
#              loss --device cuda at the 64M run's batch x seq (and 8 x 340);
#   f g a      eager without the document mask (f), FSDP under torchrun on 1 GPU (g), padded JSONL (a).
# It ends with a table (tokens/s, MFU and peak memory per variant, from the trainer's metrics) and
# the ratios the targets are stated in: c/i >= 0.90 (Muon's cost), c/j >= 0.95 (the document
# mask's), d/b >= 0.97 (a 1-process torchrun against a plain process), and c's MFU >= 35%.
#
# Time: every part has a cap (CAP below). The parts the ratios need and the optimizer bench also
# have a floor (FLOOR): no part may take the floors of those still to come, so a slow compile
# cannot crowd out a later ratio, and what a quick part leaves goes to the next. Caps and floors
# are sized for the H200 at the default budget and scale with GPU_CHECK_BUDGET. A part that fails
# or runs out of time prints FAILED and the end of its log, and the rest still runs.
#
# Needs only the repo and a Python with torch, transformers, tokenizers, numpy, safetensors, tqdm
# (no network, no pip, no wandb). Environment: PYTHON (default python3); GPU_CHECK_DEVICE=cpu with
# small GPU_CHECK_HIDDEN, GPU_CHECK_LAYERS, GPU_CHECK_SEQ, GPU_CHECK_BATCH, GPU_CHECK_STEPS,
# GPU_CHECK_WARMUP runs the same plumbing on a CPU machine (hidden 64 x 2, seq 64, batch 4, 3
# steps after 2: every part in 107-199 s on 2 cores); GPU_CHECK_PLAN picks and orders the parts
# (e.g. "b c kernels").
# What a CPU run cannot check: the flash kernel (skipped), FlexAttention's backward (none on
# CPU) and its CUDA kernels, NCCL, bf16 tensor-core speed, MFU (no peak on CPU), peak GPU memory,
# and whether the compiles of (c), (i) and (j) fit their caps on the GPU machine.
set -u
cd "$(dirname "$0")/../.."

PYTHON=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
HIDDEN=${GPU_CHECK_HIDDEN:-768}
LAYERS=${GPU_CHECK_LAYERS:-8}
SEQ=${GPU_CHECK_SEQ:-1024}
BATCH=${GPU_CHECK_BATCH:-32}
STEPS=${GPU_CHECK_STEPS:-30}
WARMUP=${GPU_CHECK_WARMUP:-10}
BUDGET=${GPU_CHECK_BUDGET:-540}
PLAN=${GPU_CHECK_PLAN:-b c i j d optimizer ddp flash kernels loss f g a}
RESERVE=10                  # seconds kept for the final table (a Python without torch: about 1 s)
KILL_AFTER=5                # timeout(1) sends SIGKILL this long after its SIGTERM
# Seconds at the default budget of 540. The floors, with the caps of env, corpus and pack and
# KILL_AFTER for each of these 9 parts, sum to 530 = 540 - RESERVE: even if every part before
# it runs to its limit, each part the ratios need gets at least its floor.
# c and j compile the model (j with FlexAttention); i finds c's kernels in inductor's cache.
# env starts CUDA, which took more than 20 s on a machine just started.
declare -A CAP=([env]=30 [corpus]=50 [pack]=25 [b]=90 [c]=170 [i]=120 [j]=150 [d]=90 [optimizer]=90
                [ddp]=60 [flash]=60 [kernels]=90 [loss]=30 [f]=90 [g]=90 [a]=90)
declare -A FLOOR=([b]=50 [c]=90 [i]=60 [j]=90 [d]=50 [optimizer]=40)
# bench_train.py starts (imports) before its --timeout clock, and stops a timed-out trainer
# with SIGTERM and up to 15 s of grace (scripts/dev/launching.py's stop): its --timeout is a
# variant's limit less this margin.
STOP_MARGIN=30
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT_DIR=${OUT:-$WORK}    # the report, the logs and the variants' JSON, kept when OUT is set
REPORT=$REPORT_DIR/gpu_check.txt
LOGS=$REPORT_DIR/gpu_check_logs
mkdir -p "$LOGS"
: > "$REPORT"
rm -f "$REPORT_DIR"/variant_*.json  # an OUT used before: a variant skipped now must not show old figures
export TOKENIZERS_PARALLELISM=false

say() { echo "$*" | tee -a "$REPORT"; }
left() { echo $((BUDGET - SECONDS - RESERVE)); }
scaled() { echo $(($1 * BUDGET / 540)); }

# The floored parts of the plan not started yet.
PENDING=" "
for part in $PLAN; do [[ -n ${FLOOR[$part]:-} ]] && PENDING+="$part "; done

# limit_for PART: sets LIMIT, the seconds PART may take now: its cap, within what is left of the
# budget less the floors of the floored parts after it (each with the KILL_AFTER seconds that
# timeout(1) may add). Not in a subshell: it updates PENDING.
limit_for() {
    local part=$1 reserved=$KILL_AFTER other
    PENDING=${PENDING/ $part / }
    for other in $PENDING; do reserved=$((reserved + $(scaled "${FLOOR[$other]}") + KILL_AFTER)); done
    LIMIT=$(scaled "${CAP[$part]:-60}")
    local room=$(($(left) - reserved))
    (( LIMIT > room )) && LIMIT=$room
}

# run NAME LIMIT CMD...: at most LIMIT seconds (timeout(1)'s SIGTERM, its SIGKILL KILL_AFTER s
# later); the output goes to $LOGS/NAME.log and, on success, into the report; on failure FAILED
# and its last lines.
run() {
    local name=$1 limit=$2; shift 2
    if (( limit < 10 )); then say "[$name] SKIPPED: out of time (${SECONDS}s of ${BUDGET}s used)"; return 1; fi
    local start=$SECONDS
    timeout -k "$KILL_AFTER" "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    if (( rc == 0 )); then
        # without progress bars (tqdm's '\r' updates) and Python warnings
        [[ -z ${QUIET:-} ]] && tr '\r' '\n' < "$LOGS/$name.log" | grep -v -e '%|' -e 'Warning' -e 'warnings.warn' \
            | grep -v '^ *$' | tee -a "$REPORT"
        say "[$name] ok in $((SECONDS - start))s (limit ${limit}s)"
    else
        (( rc == 124 || rc == 137 )) && say "[$name] FAILED: timed out after ${limit}s" || say "[$name] FAILED: rc $rc"
        tr '\r' '\n' < "$LOGS/$name.log" | grep -v '^ *$' | tail -n 20 | sed 's/^/    /' | tee -a "$REPORT"
    fi
    return $rc
}

say "== gpu_check $(date -u +%FT%TZ): device $DEVICE, hidden $HIDDEN x $LAYERS layers, seq $SEQ, batch $BATCH, bf16"
say "   budget ${BUDGET}s; plan: $PLAN"

# ---------------------------------------------------------------- environment
limit_for env
run env "$LIMIT" "$PYTHON" - "$DEVICE" <<'EOF'
import sys, torch
from trainer.metrics import peak_bf16_tflops
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, CUDA {torch.version.cuda}")
if sys.argv[1] == "cuda":
    name = torch.cuda.get_device_name()
    print(f"GPU: {name} x {torch.cuda.device_count()}, capability {torch.cuda.get_device_capability()}, "
          f"bf16 {torch.cuda.is_bf16_supported()}, peak for MFU: {peak_bf16_tflops(name)} TFLOP/s")
try:
    import wandb  # noqa: F401
    print("wandb: installed")
except ImportError:
    print("wandb: not installed (the trainer imports it only with --use_wandb)")
EOF

# ---------------------------------------------------------------- demo corpus and its packed .bin
if [[ ! -s dataset/demo_pretrain.jsonl ]]; then
    limit_for corpus
    run corpus "$LIMIT" "$PYTHON" scripts/build_demo_corpus.py --jobs "$(nproc)"
fi
if [[ -s dataset/demo_pretrain.jsonl && ! -s dataset/demo_pretrain.bin ]]; then
    limit_for pack
    run pack "$LIMIT" "$PYTHON" scripts/prepare_data.py --data_path dataset/demo_pretrain.jsonl \
        --out_path dataset/demo_pretrain.bin --num_proc "$(nproc)"
fi
have_data=0
[[ -s dataset/demo_pretrain.jsonl && -s dataset/demo_pretrain.bin ]] && have_data=1

# ---------------------------------------------------------------- the model, one trainer run per variant
variant() {
    local key=$1
    limit_for "$key"
    if (( ! have_data )); then say "[variant_$key] SKIPPED: no demo corpus (see corpus / pack above)"; return; fi
    if (( LIMIT < STOP_MARGIN + 20 )); then
        say "[variant_$key] SKIPPED: out of time (${SECONDS}s of ${BUDGET}s used)"; return
    fi
    # bench_train.py stops its trainer at --timeout itself (SIGTERM, which torchrun passes on),
    # well inside run's limit, so no trainer keeps the GPU. Its JSON feeds the final table.
    QUIET=1 run "variant_$key" "$LIMIT" "$PYTHON" scripts/bench/bench_train.py throughput --device "$DEVICE" --variants "$key" \
        --nproc 1 --rounds 1 --steps "$STEPS" --warmup "$WARMUP" --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --max_seq_len "$SEQ" --batch_size "$BATCH" --dtype bfloat16 \
        --timeout "$((LIMIT - STOP_MARGIN))" --out "$REPORT_DIR/variant_$key.json" --keep_logs "$LOGS"
}

# ---------------------------------------------------------------- Muon's step alone
optimizer_step() {
    local settings=cuda
    [[ $DEVICE == cpu ]] && settings=one
    limit_for optimizer
    run optimizer "$LIMIT" "$PYTHON" scripts/bench/bench_ops.py optimizer --settings "$settings" --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --steps 5
}

# ---------------------------------------------------------------- DDP's own cost, at world size 1
ddp_cost() {
    limit_for ddp
    run ddp "$LIMIT" "$PYTHON" scripts/bench/bench_ops.py ddp --device "$DEVICE" --worlds 1 --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --max_seq_len "$SEQ" --batch_size "$BATCH" --dtype bfloat16 --steps 5
}

# ---------------------------------------------------------------- does SDPA take the flash kernel?
flash_kernel() {
    if [[ $DEVICE != cuda ]]; then say "[flash] SKIPPED on $DEVICE: the flash kernel exists only on CUDA"; return; fi
    limit_for flash
    run flash "$LIMIT" "$PYTHON" - "$SEQ" <<'EOF'
import sys, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from model.model_minimind import Attention, MiniMindConfig

seq = int(sys.argv[1])
for hidden in (512, 768):
    attn = Attention(MiniMindConfig(hidden_size=hidden, num_attention_heads=8, num_key_value_heads=4))
    shape = lambda heads: (8, heads, seq, attn.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 4, 4))
    try:  # the model's own call: causal, GQA through enable_gqa, bf16
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            attn._attend(q, k, v, None, 0.0, is_causal=True).sum().backward()
        torch.cuda.synchronize()
        print(f"head_dim {attn.head_dim}: flash kernel forced: OK (forward+backward, causal, GQA 8/4 heads, bf16)")
    except RuntimeError as exc:
        print(f"head_dim {attn.head_dim}: flash kernel forced: FAILED: {str(exc).splitlines()[0]}")
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        attn._attend(q, k, v, None, 0.0, is_causal=True).sum().backward()
        torch.cuda.synchronize()
    names = sorted({e.key for e in prof.key_averages()
                    if any(w in e.key.lower() for w in ("flash", "fmha", "attention", "cudnn", "softmax"))})
    chosen = ("flash" if any("flash" in n.lower() for n in names) else
              "cudnn" if any("cudnn" in n.lower() for n in names) else
              "memory-efficient" if any("fmha" in n.lower() or "efficient" in n.lower() for n in names) else "math")
    print(f"head_dim {attn.head_dim}: SDPA left to choose ran: {chosen} ({'; '.join(n[:60] for n in names[:4])})")
EOF
}

# ---------------------------------------------------------------- dense mask vs FlexAttention
doc_mask_kernels() {
    limit_for kernels
    run doc_mask_kernels "$LIMIT" "$PYTHON" scripts/bench/bench_ops.py attention --device "$DEVICE" --hidden_sizes "$HIDDEN" \
        --seq_lens "$SEQ" --batch_size "$BATCH" --repeats 10
}

# ---------------------------------------------------------------- the loss's two implementations
loss_kernels() {
    limit_for loss
    run loss_kernels "$LIMIT" "$PYTHON" scripts/bench/bench_ops.py loss --device "$DEVICE" --tokens "2720,$((BATCH * SEQ))" \
        --repeats 5
}

for step in $PLAN; do
    case $step in
        optimizer) optimizer_step ;;
        ddp) ddp_cost ;;
        flash) flash_kernel ;;
        kernels) doc_mask_kernels ;;
        loss) loss_kernels ;;
        *) variant "$step" ;;
    esac
done

# ---------------------------------------------------------------- the table
say ""
say "== the 64M-class model: hidden $HIDDEN, $LAYERS layers, seq $SEQ, batch $BATCH, bf16, $STEPS timed steps after $WARMUP"
run table "$RESERVE" "$PYTHON" - "$REPORT_DIR" $PLAN <<'EOF'
import json, sys
from pathlib import Path

work, keys = Path(sys.argv[1]), [key for key in sys.argv[2:] if key not in ("kernels", "optimizer", "ddp", "flash", "loss")]
print(f"{'variant':<30}{'tokens/s':>12}{'s/step':>9}{'MFU':>8}{'peak mem':>14}")
done = {}
for key in keys:
    path = work / f"variant_{key}.json"
    if not path.exists():
        print(f"{key}) {'(did not run: see above)':<27}")
        continue
    data = json.loads(path.read_text())
    for r in data["results"]:
        done[key] = r
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['variant']:<30}{r['tokens_per_s']:>12,.0f}{r['s_per_step']:>9.3f}{mfu:>8}{r['peak_mem_mib']:>10,.0f} MiB")
    for k, why in data["failed"].items():
        print(f"{k}) FAILED: {why.splitlines()[0]} (log: gpu_check_logs/variant_{k}.log)")

print()
# (what, numerator, denominator, target): tokens/s ratios of the variants, as the targets state them
for what, top, bottom, target in [("Muon's cost: compiled default (c) / compiled AdamW (i)", "c", "i", ">= 0.90"),
                                  ("--doc_mask's cost: compiled default (c) / compiled without it (j)", "c", "j", ">= 0.95"),
                                  ("1-process torchrun (d) / plain process (b)", "d", "b", ">= 0.97"),
                                  ("eager default (b) / eager without the mask (f)", "b", "f", "")]:
    if top in done and bottom in done:
        ratio = done[top]["tokens_per_s"] / done[bottom]["tokens_per_s"]
        print(f"{what}: {ratio:.3f}" + (f" (target {target})" if target else ""))
    else:
        print(f"{what}: not measured ({', '.join(k for k in (top, bottom) if k not in done)} did not run)")
if "c" in done and done["c"]["mfu"] is not None:
    print(f"MFU of the compiled default (c): {done['c']['mfu']:.1%} (target >= 35% for the 64M model on an H200)")
else:
    print("MFU of the compiled default (c): not measured (" + ("no peak on CPU)" if "c" in done else "c did not run)"))
EOF
say "== gpu_check done in ${SECONDS}s"

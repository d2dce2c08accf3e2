#!/usr/bin/env bash
# The GPU check: one run, at most 10 minutes on a machine with one GPU (sized for an H200).
#
#   bash scripts/gpu_check.sh                 # writes the report to stdout, and to $OUT/gpu_check.txt when OUT is set
#
# 1. environment: torch, CUDA, the GPU and the bf16 peak MFU is measured against;
# 2. flash attention: SDPA forced onto the flash kernel (sdpa_kernel(FLASH_ATTENTION)) for the
#    model's own attention call, forward and backward, in bf16 at our head sizes; then the
#    kernels the profiler sees when SDPA chooses by itself;
# 3. the demo corpus and its packed .bin, built here (scripts/build_demo_corpus.py, prepare_data.py);
# 4. the 64M model (hidden 768, 8 layers) at seq 1024 in bf16, one trainer run per variant
#    through scripts/bench_pretrain.py: packed eager (b), compiled with the default optimizer
#    (c: Muon) and with AdamW (i), compiled with --doc_mask (j), eager doc_mask (f), torchrun
#    --nproc_per_node=1 on NCCL (d), FSDP under torchrun on 1 GPU (g), padded JSONL (a); one
#    table row each (tokens/s, MFU and peak memory from the trainer's metrics jsonl), at the end;
# 5. the --doc_mask kernels: scripts/bench_attention.py --device cuda (dense mask vs
#    FlexAttention, forward+backward, and their outputs and gradients compared), run before (g);
# 6. Muon's step alone: scripts/bench_optimizer.py --settings cuda (torch.optim.Muon against ours);
# 7. the ratios the targets are stated in: c against i (Muon's cost), j against c (the document
#    mask's), d against b (a 1-process torchrun against a plain process), and c's MFU.
# A part that fails prints FAILED and the end of its log, and the rest still runs. Every part
# gets at most what is left of the budget (GPU_CHECK_BUDGET seconds, default 450), and each
# training variant at most GPU_CHECK_VARIANT_LIMIT seconds (default 150, compilation included).
#
# Needs only the repo and a Python with torch, transformers, tokenizers, numpy, safetensors, tqdm
# (no network, no pip, no wandb): the demo corpus and its packed .bin are built here.
# Environment: PYTHON (default python3); GPU_CHECK_DEVICE=cpu with small GPU_CHECK_HIDDEN,
# GPU_CHECK_LAYERS, GPU_CHECK_SEQ, GPU_CHECK_BATCH, GPU_CHECK_STEPS, GPU_CHECK_WARMUP runs the
# same plumbing on a CPU machine; GPU_CHECK_PLAN picks the parts (e.g. "b kernels").
# What a CPU run cannot check: the flash kernel (part 2 is skipped), FlexAttention's backward
# (none on CPU) and its CUDA kernels, NCCL, bf16 tensor-core speed, MFU (no peak on CPU), peak
# GPU memory, and whether the compile of (c) fits its limit on the GPU machine.
set -u
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
DEVICE=${GPU_CHECK_DEVICE:-cuda}
HIDDEN=${GPU_CHECK_HIDDEN:-768}
LAYERS=${GPU_CHECK_LAYERS:-8}
SEQ=${GPU_CHECK_SEQ:-1024}
BATCH=${GPU_CHECK_BATCH:-32}
STEPS=${GPU_CHECK_STEPS:-30}
WARMUP=${GPU_CHECK_WARMUP:-10}
BUDGET=${GPU_CHECK_BUDGET:-540}
# What runs, in order, most wanted first (the budget may run out at the end): bench_pretrain.py's
# variant letters, "kernels" for part 5 and "optimizer" for part 6.
PLAN=${GPU_CHECK_PLAN:-b c i j d optimizer f kernels g a}
VARIANT_LIMIT=${GPU_CHECK_VARIANT_LIMIT:-150}
RESERVE=15                               # seconds kept for the final table
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPORT_DIR=${OUT:-$WORK}
REPORT=$REPORT_DIR/gpu_check.txt
LOGS=$REPORT_DIR/gpu_check_logs
mkdir -p "$LOGS"
: > "$REPORT"
export TOKENIZERS_PARALLELISM=false

say() { echo "$*" | tee -a "$REPORT"; }
left() { echo $((BUDGET - SECONDS - RESERVE)); }

# run NAME LIMIT CMD...: at most LIMIT seconds (and what is left of the budget); the output
# goes to $LOGS/NAME.log and, on success, into the report; on failure FAILED and its last lines.
run() {
    local name=$1 limit=$2; shift 2
    local budget; budget=$(left)
    (( limit > budget )) && limit=$budget
    if (( limit < 10 )); then say "[$name] SKIPPED: out of time (${SECONDS}s of ${BUDGET}s used)"; return 1; fi
    local start=$SECONDS
    timeout -k 5 "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    if (( rc == 0 )); then
        # without progress bars (tqdm's '\r' updates) and Python warnings
        [[ -z ${QUIET:-} ]] && tr '\r' '\n' < "$LOGS/$name.log" | grep -v -e '%|' -e 'Warning' -e 'warnings.warn' \
            | grep -v '^ *$' | tee -a "$REPORT"
        say "[$name] ok in $((SECONDS - start))s"
    else
        (( rc == 124 || rc == 137 )) && say "[$name] FAILED: timed out after ${limit}s" || say "[$name] FAILED: rc $rc"
        tr '\r' '\n' < "$LOGS/$name.log" | grep -v '^ *$' | tail -n 20 | sed 's/^/    /' | tee -a "$REPORT"
    fi
    return $rc
}

say "== gpu_check $(date -u +%FT%TZ): device $DEVICE, hidden $HIDDEN x $LAYERS layers, seq $SEQ, batch $BATCH, bf16"

# ---------------------------------------------------------------- 1. environment
run env 60 "$PYTHON" - "$DEVICE" <<'EOF'
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

# ---------------------------------------------------------------- 2. does SDPA take the flash kernel?
if [[ $DEVICE == cuda ]]; then
    run flash 90 "$PYTHON" - "$SEQ" <<'EOF'
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
else
    say "[flash] SKIPPED on $DEVICE: the flash kernel exists only on CUDA"
fi

# ---------------------------------------------------------------- 3. demo corpus and its packed .bin
if [[ ! -s dataset/demo_pretrain.jsonl ]]; then
    run corpus 180 "$PYTHON" scripts/build_demo_corpus.py --jobs "$(nproc)"
fi
if [[ -s dataset/demo_pretrain.jsonl && ! -s dataset/demo_pretrain.bin ]]; then
    run pack 120 "$PYTHON" scripts/prepare_data.py --data_path dataset/demo_pretrain.jsonl \
        --out_path dataset/demo_pretrain.bin --num_proc "$(nproc)"
fi

# ---------------------------------------------------------------- 4. the 64M model, one run per variant
variant() {
    local key=$1 limit
    limit=$(left)
    (( limit > VARIANT_LIMIT )) && limit=$VARIANT_LIMIT
    if (( limit < 45 )); then say "[variant_$key] SKIPPED: out of time (${SECONDS}s of ${BUDGET}s used)"; return; fi
    # bench_pretrain stops a run at --timeout itself (SIGTERM to torchrun, which passes it on),
    # well inside run's own limit (and stops it on SIGTERM), so no trainer keeps the GPU.
    QUIET=1 run "variant_$key" "$limit" "$PYTHON" scripts/bench_pretrain.py --device "$DEVICE" --variants "$key" \
        --nproc 1 --rounds 1 --steps "$STEPS" --warmup "$WARMUP" --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --max_seq_len "$SEQ" --batch_size "$BATCH" --dtype bfloat16 \
        --timeout "$((limit - 50))" --out "$WORK/variant_$key.json" --keep_logs "$LOGS"
}

# ---------------------------------------------------------------- 5. dense mask vs FlexAttention
doc_mask_kernels() {
    run doc_mask_kernels 120 "$PYTHON" scripts/bench_attention.py --device "$DEVICE" --hidden_sizes "$HIDDEN" \
        --seq_lens "$SEQ" --batch_size "$BATCH" --repeats 10
}

# ---------------------------------------------------------------- 6. Muon's step alone
optimizer_step() {
    local settings=cuda
    [[ $DEVICE == cpu ]] && settings=one
    run optimizer 120 "$PYTHON" scripts/bench_optimizer.py --settings "$settings" --hidden_size "$HIDDEN" \
        --num_hidden_layers "$LAYERS" --steps 5
}

have_data=0
[[ -s dataset/demo_pretrain.jsonl && -s dataset/demo_pretrain.bin ]] && have_data=1
for step in $PLAN; do
    if [[ $step == kernels ]]; then
        doc_mask_kernels
    elif [[ $step == optimizer ]]; then
        optimizer_step
    elif (( have_data )); then
        variant "$step"
    else
        say "[variant_$step] SKIPPED: no demo corpus (see corpus / pack above)"
    fi
done

# ---------------------------------------------------------------- the table
say ""
say "== the 64M-class model: hidden $HIDDEN, $LAYERS layers, seq $SEQ, batch $BATCH, bf16, $STEPS timed steps after $WARMUP"
RESERVE=0 run table 15 "$PYTHON" - "$WORK" $PLAN <<'EOF'
import json, sys
from pathlib import Path

work, keys = Path(sys.argv[1]), [key for key in sys.argv[2:] if key not in ("kernels", "optimizer")]
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
                                  ("--doc_mask's cost: compiled doc_mask (j) / compiled (c)", "j", "c", ">= 0.95"),
                                  ("1-process torchrun (d) / plain process (b)", "d", "b", ">= 0.97"),
                                  ("eager doc_mask (f) / eager (b)", "f", "b", "")]:
    if top in done and bottom in done:
        ratio = done[top]["tokens_per_s"] / done[bottom]["tokens_per_s"]
        print(f"{what}: {ratio:.3f}" + (f" (target {target})" if target else ""))
    else:
        print(f"{what}: not measured ({', '.join(k for k in (top, bottom) if k not in done)} did not run)")
if "c" in done and done["c"]["mfu"] is not None:
    print(f"MFU of the compiled default (c): {done['c']['mfu']:.1%} (target >= 35% for the 64M model on an H200)")
EOF
say "== gpu_check done in ${SECONDS}s"

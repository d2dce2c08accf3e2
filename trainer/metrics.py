"""What rank 0 reports: a log line, a JSONL metrics file, a progress bar, wandb.

MFU (model FLOPs utilisation) uses the usual estimate of training FLOPs per token:

    6 * N  +  12 * L * H * Q * T

N: parameters touched per token (the active ones for MoE; the tied embedding counts
once, as the lm_head matmul), L layers, H heads of size Q, T the sequence length.
The first term is the forward (2N) and backward (4N) matmuls, the second the
attention scores and weighted sums. MFU = FLOPs/token * tokens/s / device peak.
"""
import json
import math
import netrc
import os
import re
import resource
import sys
import time
from contextlib import contextmanager

import torch
from tqdm import tqdm

from trainer.run_files import metrics_path

# Dense (not 2:4 sparse) bf16 tensor-core peaks in TFLOP/s, matched against
# torch.cuda.get_device_name(). The first pattern that matches wins, so a form factor
# (PCIe, NVL) comes before its family, and each name is matched whole ("L40" is not "L40S").
PEAK_BF16_TFLOPS = [
    (r"H[18]00\b.*\bPCIe", 756.0),   # 'NVIDIA H100 PCIe'
    (r"H[12]00\b.*\bNVL", 835.0),    # 'NVIDIA H100 NVL', 'NVIDIA H200 NVL'
    (r"H[128]00\b", 989.0),          # SXM: 'NVIDIA H100 80GB HBM3', 'NVIDIA H200', 'NVIDIA H800'
    (r"A[18]00\b", 312.0),           # 'NVIDIA A100-SXM4-80GB', 'NVIDIA A100 80GB PCIe'
    (r"L40S\b", 362.0),
    (r"L40\b", 181.0),
    (r"L4\b", 121.0),
    (r"A10\b", 125.0),
    (r"RTX 4090\b", 165.0),
    (r"RTX 3090\b", 71.0),
    (r"V100\b", 125.0),              # fp16: no bf16 on V100
    (r"GH200\b", 989.0),             # Grace Hopper: an H100 or H200 SXM-class GPU
]


def peak_memory_mib(device: torch.device) -> float:
    """Rank 0's high-water mark: allocated GPU memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def flops_per_token(config, active_params: int, seq_len: int) -> float:
    attention = 12 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * seq_len
    return 6 * active_params + attention


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named as torch.cuda.get_device_name() names it, or None."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(r"(?<![A-Za-z0-9])" + pattern, device_name, re.IGNORECASE):
            return tflops
    return None


def device_peak_flops(device: torch.device, override_tflops: float = 0) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
    return tflops * 1e12 if tflops else None


class TrainClock:
    """The run's one clock. Wall time since the loop started, and training time: wall time
    less the pauses (validation, checkpoint saves). tokens/s and MFU are rates over training
    time, the ETA extrapolates wall time (the pauses will recur), and time-to-loss plots use
    training time (the val rows' train_s)."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.cuda = device if device.type == "cuda" else None
        self.start, self.paused_s = self._now(), 0.0

    def _now(self) -> float:
        # Wait for queued GPU work, so that it counts on the side of the clock it belongs to.
        # Only read on steps that read the device anyway (logs, validation, saves).
        if self.cuda is not None:
            torch.cuda.synchronize(self.cuda)
        return time.perf_counter()

    def wall_seconds(self) -> float:
        return self._now() - self.start

    def training_seconds(self) -> float:
        return self.wall_seconds() - self.paused_s

    @contextmanager
    def paused(self, active: bool = True):
        """Leave the time of the block out of training time (inactive: no clock read, no GPU sync)."""
        if not active:
            yield
            return
        began = self._now()
        try:
            yield
        finally:
            self.paused_s += self._now() - began


class Throughput:
    """Tokens per second, all positions and real (non-pad) ones, since the last report,
    over the clock's training time."""

    def __init__(self, tokens_per_step: int, clock: TrainClock):
        self.tokens_per_step, self.clock = tokens_per_step, clock
        self._reset()

    def _reset(self):
        self.since, self.steps, self.real_tokens = self.clock.training_seconds(), 0, 0.0

    def add(self, real_tokens: float, steps: int = 1):
        self.steps += steps
        self.real_tokens += real_tokens

    def report(self) -> tuple[float, float]:
        elapsed = self.clock.training_seconds() - self.since
        rates = self.steps * self.tokens_per_step / elapsed, self.real_tokens / elapsed
        self._reset()
        return rates


def _wandb_key_available() -> bool:
    """An API key in the environment or from `wandb login` (stored in ~/.netrc)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


class RunLogger:
    """No-op on ranks other than 0, so the loop can call it unconditionally.

    `state`: the run's TrainState (where it starts, its plan, its wandb run id);
    `config`: the flags as the run resolved them, recorded by wandb."""

    def __init__(self, args, prefix: str, state, config: dict, enabled: bool, clock: TrainClock,
                 device: torch.device = torch.device("cpu")):
        self.enabled = enabled
        self.device, self.clock = device, clock
        self.total_steps = state.plan.total_steps
        self.epochs = state.plan.epochs
        self.start_step = start_step = state.global_step
        self.wandb = None
        self.wandb_run_id = state.wandb_run_id
        if not enabled:
            return
        os.makedirs(args.save_dir, exist_ok=True)
        self.path = metrics_path(args.save_dir, prefix)
        self._truncate_after(start_step if args.from_resume else -1)
        self.bar = tqdm(total=self.total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())
        if args.use_wandb:
            self._start_wandb(args.wandb_project, prefix, args.save_dir, config)

    def _truncate_after(self, step: int):
        """Drop rows a resumed run will redo (all rows for a fresh run)."""
        if step < 0 or not os.path.exists(self.path):
            open(self.path, "w").close()
            return
        with open(self.path) as f:
            kept = [line for line in f if line.strip() and json.loads(line).get("step", 0) <= step]
        with open(self.path, "w") as f:
            f.writelines(kept)

    def _start_wandb(self, project: str, prefix: str, save_dir: str, config: dict):
        import wandb

        if os.environ.get("WANDB_MODE") != "online" and not _wandb_key_available():
            os.environ["WANDB_MODE"] = "offline"  # log locally; `wandb sync` uploads later
        init = dict(project=project, name=prefix, id=self.wandb_run_id, resume="allow", dir=save_dir, config=config)
        try:
            self.wandb = wandb.init(**init)
        except Exception as exc:  # a key but no route to the server must not cost the run
            print(f"wandb: cannot reach the server ({type(exc).__name__}); logging offline instead", flush=True)
            os.environ["WANDB_MODE"] = "offline"
            self.wandb = wandb.init(**init)
        self.wandb_run_id = self.wandb.id
        mode = os.environ.get("WANDB_MODE") or "online"
        print(f"wandb: run {self.wandb.id} ({mode})" + (", sync later with `wandb sync`" if mode == "offline" else ""),
              flush=True)

    def step_done(self):
        if self.enabled:
            self.bar.update(1)

    def log(self, row: dict, line: str):
        if not self.enabled:
            return
        (self.bar.write if not self.bar.disable else print)(line)
        sys.stdout.flush()
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    def log_train(self, step: int, epoch: int, loss: float, aux: float, lrs: dict, tokens_seen: int,
                  tok_s: float, real_tok_s: float, mfu: float | None):
        """One training line and row: "lr" in the row is the first group's, "lr_<name>" each group's."""
        if not self.enabled:
            return
        memory = peak_memory_mib(self.device)
        row = {"kind": "train", "step": step, "epoch": epoch, "tokens_seen": tokens_seen, "loss": loss,
               "aux_loss": aux, "lr": next(iter(lrs.values())), **{f"lr_{k}": v for k, v in lrs.items()},
               "tokens_per_s": tok_s, "nonpad_tokens_per_s": real_tok_s, "peak_mem_mib": memory}
        lr_text = " ".join(f"{k}={v:.2e}" for k, v in lrs.items())
        mfu_text = ""
        if mfu is not None:
            row["mfu"] = mfu
            mfu_text = f" mfu {mfu:.1%}"
        self.log(row, f"epoch {epoch + 1}/{self.epochs} step {step}/{self.total_steps} loss {loss:.4f} "
                      f"aux {aux:.4f} lr {lr_text} tok/s {tok_s:,.0f} (non-pad {real_tok_s:,.0f}){mfu_text} "
                      f"mem {memory:,.0f}MiB eta {self.eta(step)}")

    def log_val(self, step: int, tokens_seen: int, val=None, task=None):
        """A validation row and line: `val` (loss, bits per byte) and/or `task`, a DownstreamResult."""
        row, parts = {"kind": "val", "step": step, "tokens_seen": tokens_seen}, []
        if val is not None:
            val_loss, val_bpb = val
            row.update(val_loss=val_loss, val_bpb=val_bpb)
            parts.append(f"val_loss {val_loss:.4f} (ppl {math.exp(min(val_loss, 50)):.2f}) bits/byte {val_bpb:.4f}")
        if task is not None:
            row.update(task_acc=task.acc, task_acc_norm=task.acc_norm, task_acc_stderr=task.acc_stderr,
                       task_acc_norm_stderr=task.acc_norm_stderr)
            parts.append(f"task acc {task.acc:.4f} ± {task.acc_stderr:.4f} acc_norm {task.acc_norm:.4f} "
                         f"± {task.acc_norm_stderr:.4f} ({task.n} items)")
        row["train_s"] = self.clock.training_seconds()
        self.log(row, f"step {step}: " + " ".join(parts))

    def eta(self, step: int) -> str:
        done = step - self.start_step
        if done <= 0:
            return "?"
        seconds = self.clock.wall_seconds() / done * (self.total_steps - step)
        return time.strftime("%H:%M:%S", time.gmtime(seconds)) if seconds < 86400 else f"{seconds / 86400:.1f}d"

    def close(self):
        if not self.enabled:
            return
        self.bar.close()
        if self.wandb is not None:
            self.wandb.finish()

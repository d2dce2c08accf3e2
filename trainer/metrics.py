"""What a run reports about itself: rank 0's log line, JSONL metrics file, progress bar and
wandb run, its throughput and MFU, and, on request, profiler traces and memory snapshots; and
the FLOPs they rest on, with Muon's share of a step's (what --optimizer auto weighs).

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

from common.errors import StorageError
from common.storage import append_text, atomic_write_text
from model.model_minimind import MiniMindForCausalLM, count_parameters
from trainer.distributed import Logger, peer_lost
from trainer.optim import NS_STEPS, is_block_matrix, newton_schulz_flops

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


def muon_flop_share(config, tokens_per_step: int, seq_len: int, ns_steps: int = NS_STEPS) -> float:
    """Newton-Schulz FLOPs of one Muon step (`ns_steps` iterations) over the forward and backward
    FLOPs of the optimizer step (tokens_per_step tokens in all ranks' micro-batches); per rank too,
    up to rounding, as both are split across the ranks. The model is built on the meta device:
    shapes only."""
    with torch.device("meta"):
        model = MiniMindForCausalLM(config)
    shapes = [tuple(p.shape) for name, p in model.named_parameters() if is_block_matrix(name, p)]
    step_flops = flops_per_token(config, count_parameters(model)[1], seq_len) * tokens_per_step
    return newton_schulz_flops(shapes, ns_steps) / step_flops


def peak_bf16_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named as torch.cuda.get_device_name() names it, or None."""
    for pattern, tflops in PEAK_BF16_TFLOPS:
        if re.search(r"(?<![A-Za-z0-9])" + pattern, device_name, re.IGNORECASE):
            return tflops
    return None


def device_peak_flops(device: torch.device) -> float | None:
    """The GPU's dense bf16 peak in FLOP/s, from PEAK_BF16_TFLOPS (None on a CPU or an unlisted GPU)."""
    if device.type != "cuda":
        return None
    tflops = peak_bf16_tflops(torch.cuda.get_device_name(device))
    return tflops * 1e12 if tflops else None


class Throughput:
    """Tokens per second, all positions and real (non-pad) ones, since the last report, over
    the run clock's training time (trainer/loop.py's TrainClock)."""

    def __init__(self, tokens_per_step: int, clock, step: int = 0, tokens_seen: int = 0):
        self.tokens_per_step, self.clock = tokens_per_step, clock
        self.since, self.step, self.tokens_seen = clock.training_seconds(), step, tokens_seen

    def report(self, step: int, tokens_seen: int) -> tuple[float, float]:
        """(tokens/s, real tokens/s) since the last report, which was at `self.step`."""
        now = self.clock.training_seconds()
        elapsed = now - self.since
        rates = ((step - self.step) * self.tokens_per_step / elapsed, (tokens_seen - self.tokens_seen) / elapsed)
        self.since, self.step, self.tokens_seen = now, step, tokens_seen
        return rates


def _parsed_row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    return row if isinstance(row, dict) else None


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

    `path`: the metrics file; `output`: the config's output group (wandb, resume); `state`: the run's
    TrainState (where it starts, its plan, its wandb run id); `config`: the resolved config, as
    wandb records it."""

    def __init__(self, path: str, output, prefix: str, state, config: dict, enabled: bool, clock,
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
        os.makedirs(output.save_dir, exist_ok=True)
        self.path = path
        self._truncate_after(state.tokens_seen if output.from_resume else -1)
        self.bar = tqdm(total=self.total_steps, initial=start_step, desc="train", dynamic_ncols=True,
                        disable=not sys.stderr.isatty())
        if output.use_wandb:
            self._start_wandb(output.wandb_project, prefix, output.save_dir, config)

    def _truncate_after(self, tokens_seen: int):
        """Drop the rows a resumed run will redo, those past the checkpoint's tokens trained (all
        rows for a fresh run: -1). Tokens, not steps: a resume on another world size renumbers
        the steps, and the rows before it keep the numbers they were logged with."""
        kept, broken = [], 0
        if tokens_seen >= 0 and os.path.exists(self.path):
            with open(self.path, errors="replace") as f:
                for line in filter(str.strip, f):
                    row = _parsed_row(line)
                    broken += row is None
                    if row is not None and row.get("tokens_seen", 0) <= tokens_seen:
                        kept.append(line)
        if broken:  # a line cut off by a full disk or a kill mid-append: the log still holds it
            print(f"warning: {self.path}: dropped {broken} row(s) that are not whole JSON objects", flush=True)
        try:
            atomic_write_text(self.path, "".join(kept), "the metrics")
        except StorageError as exc:
            self._lose_metrics(exc)

    def _lose_metrics(self, exc: StorageError):
        """The metrics file is a copy of the log lines: a disk that refuses it costs the file, not
        the run (a checkpoint save on the same disk stops the run instead: docs/fault-tolerance.md)."""
        print(f"warning: {exc}; training goes on without the metrics file (the log lines hold the same figures)",
              flush=True)
        self.path = None

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
        # Every chart's x axis is the tokens trained, not wandb's count of rows: a resume on another
        # world size renumbers the steps (2 processes' step 100 is 1 process's 200), and a step redone
        # after a resume is logged again. By tokens each row lands where its training was, a redone
        # step on its first logging, and no row is dropped for a step below wandb's last.
        self.wandb.define_metric("tokens_seen")
        self.wandb.define_metric("*", step_metric="tokens_seen")
        mode = os.environ.get("WANDB_MODE") or "online"
        print(f"wandb: run {self.wandb.id} ({mode})" + (", sync later with `wandb sync`" if mode == "offline" else ""),
              flush=True)

    def log(self, row: dict, line: str):
        if not self.enabled:
            return
        (self.bar.write if not self.bar.disable else print)(line)
        sys.stdout.flush()
        if self.path:
            try:
                append_text(self.path, json.dumps(row) + "\n", "the metrics")
            except StorageError as exc:
                self._lose_metrics(exc)
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if isinstance(v, (int, float))})

    def log_train(self, step: int, epoch: int, window: dict, lrs: dict, tokens_seen: int,
                  tok_s: float, real_tok_s: float, mfu: float | None):
        """One training line and row: `window` holds the means since the last line by name (trainer/
        step.py's StepTotals: the training loss's parts and the gradient norm), each in the row and
        the line under its name; "lr" in the row is the first group's, "lr_<name>" each group's."""
        if not self.enabled:
            return
        memory = peak_memory_mib(self.device)
        self.bar.update(step - self.bar.n)  # moved at log steps only, as the log line
        row = {"kind": "train", "step": step, "epoch": epoch, "tokens_seen": tokens_seen, **window,
               "lr": next(iter(lrs.values())), **{f"lr_{k}": v for k, v in lrs.items()},
               "tokens_per_s": tok_s, "nonpad_tokens_per_s": real_tok_s, "peak_mem_mib": memory}
        window_text = " ".join(f"{name} {value:.4f}" for name, value in window.items())
        lr_text = " ".join(f"{k}={v:.2e}" for k, v in lrs.items())
        mfu_text = ""
        if mfu is not None:
            row["mfu"] = mfu
            mfu_text = f" mfu {mfu:.1%}"
        self.log(row, f"epoch {epoch + 1}/{self.epochs} step {step}/{self.total_steps} {window_text} "
                      f"lr {lr_text} tok/s {tok_s:,.0f} (non-pad {real_tok_s:,.0f}){mfu_text} "
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


# ---------------------------------------------------------------------------- profiling
# --profile_steps A:B writes {save_dir}/profile/{prefix}_steps{A}-{B}_rank0.pt.trace.json.gz, a
# Chrome trace (https://ui.perfetto.dev, or TensorBoard with torch-tb-profiler); --memory_snapshot 1
# writes {prefix}_memory_rank{R}.pickle (and ..._memory_oom_step{N}_rank{R}.pickle), the CUDA
# allocator's state with the stack of every allocation (https://pytorch.org/memory_viz), recorded
# over the same steps (1:3 without --profile_steps) and again when the run dies out of memory.
# Steps are counted as the log counts them: step 1 is the first optimizer step of the run.
DEFAULT_MEMORY_WINDOW = (1, 3)
MEMORY_EVENTS = 100_000  # the allocator's history is a ring buffer of the last this many events


class Profiling:
    """Starts and stops the profiler and the memory recorder around the loop's steps. The loop
    calls step_begins(step) before optimizer step `step` and step_ended(step) after it, all
    inside running(); a run that asks for neither has none (requested)."""

    def __init__(self, folder: str, prefix: str, rank: int, device: torch.device, profile_steps, memory_snapshot: bool,
                 start_step: int, total_steps: int):
        self.folder, self.prefix, self.rank, self.cuda = folder, prefix, rank, device.type == "cuda"
        # A window past the run's end ends with the run.
        clip = lambda w: (w[0], min(w[1], total_steps)) if w and w[0] <= total_steps else None  # noqa: E731
        self.window = clip(profile_steps) if rank == 0 else None
        self.memory = bool(memory_snapshot)
        self.memory_window = clip(profile_steps or DEFAULT_MEMORY_WINDOW) if self.memory else None
        self.profiler, self.traced_from, self.recording = None, None, False
        for what, window in (("--profile_steps", profile_steps), ("--memory_snapshot", self.memory_window)):
            if window and window[1] <= start_step:
                Logger(f"profile: {what} covers steps {window[0]}-{window[1]}, already trained (the run "
                       f"resumes at step {start_step}); nothing is recorded")

    @staticmethod
    def requested(system) -> bool:
        """Whether the config's system group asks for a trace or a memory snapshot."""
        return bool(system.profile_steps or system.memory_snapshot)

    def step_begins(self, step: int):
        if self.window and self.profiler is None and self.window[0] <= step <= self.window[1]:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            # A schedule that always records, so that each step is marked (ProfilerStep#N) in the trace.
            self.profiler = torch.profiler.profile(activities=activities, record_shapes=True,
                                                   schedule=lambda _: torch.profiler.ProfilerAction.RECORD)
            self.profiler.step_num = step  # the marks then carry the log's step numbers
            self.traced_from = step  # the window's first step, or the first after a resume inside it
            self.profiler.start()
        if self.memory_window and not self.recording and self.memory_window[0] <= step <= self.memory_window[1]:
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_EVENTS)
            self.recording = True

    def step_ended(self, step: int):
        if self.profiler is not None and step < self.window[1]:
            self.profiler.step()
        elif self.profiler is not None:
            self._write_trace(step)
        if self.recording and step == self.memory_window[1]:
            self._write_memory(step)

    @contextmanager
    def running(self, steps_done):
        """Around the loop. A run that ends inside a window (preempted, stopped by a bad step or
        an error) still writes what was recorded: up to its last finished step, steps_done(),
        which names the file, and the part of the next step it ran. With --memory_snapshot an
        out-of-memory error first writes the allocator's state (what holds the memory at that
        moment; with the stack of each allocation only inside the window, where the history is
        recorded). An error on the way out goes on up unchanged, whatever the writing does."""
        try:
            yield
        except BaseException as exc:
            if isinstance(exc, torch.OutOfMemoryError) and self.memory:
                self._quietly(lambda: self._write_out_of_memory(steps_done() + 1))
            # After a lost peer, stopping the profiler would wait on the GPU's hung collective.
            if not peer_lost(exc):
                self._quietly(lambda: self._close(steps_done()))
            raise
        self._close(steps_done())

    def _close(self, last: int):
        if self.profiler is not None:
            self._write_trace(last)
        if self.recording:
            self._write_memory(last)

    def _quietly(self, write):
        try:
            write()
        except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
            print(f"profile: could not write the profile of a failed run ({exc})", flush=True)

    def _write_out_of_memory(self, step: int):
        path = self._dump_memory(f"memory_oom_step{step}_rank{self.rank}.pickle")
        print(f"profile: out of memory at step {step}; allocator snapshot in {path} (https://pytorch.org/memory_viz)",
              flush=True)

    def _write_trace(self, last: int):
        last = max(last, self.traced_from)  # stopped inside its first step: that step, in part
        self.profiler.stop()
        path = self._path(f"steps{self.traced_from}-{last}_rank{self.rank}.pt.trace.json.gz")
        self.profiler.export_chrome_trace(path)
        self.profiler, self.window = None, None
        Logger(f"profile: steps {self.traced_from}-{last} traced in {path} (https://ui.perfetto.dev, or "
               f"tensorboard --logdir {self.folder})")

    def _write_memory(self, last: int):
        path = self._dump_memory(f"memory_rank{self.rank}.pickle")
        torch.cuda.memory._record_memory_history(enabled=None)
        self.recording, self.memory_window = False, None
        Logger(f"profile: CUDA memory snapshot of steps up to {last} in {path} (https://pytorch.org/memory_viz)")

    def _dump_memory(self, name: str) -> str:
        path = self._path(name)
        torch.cuda.memory._dump_snapshot(path)
        return path

    def _path(self, name: str) -> str:
        os.makedirs(self.folder, exist_ok=True)
        return os.path.join(self.folder, f"{self.prefix}_{name}")

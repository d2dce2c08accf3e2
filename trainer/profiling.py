"""What a step spends its time and memory on: a torch.profiler trace of chosen optimizer
steps (--profile_steps A:B), and a CUDA memory snapshot (--memory_snapshot 1).

    {save_dir}/profile/{prefix}_steps{A}-{B}_rank{R}.pt.trace.json.gz
        Chrome-trace JSON, gzipped: open it at https://ui.perfetto.dev (or chrome://tracing),
        or point TensorBoard at the folder (pip install torch-tb-profiler;
        tensorboard --logdir {save_dir}/profile). Rank 0's, or every rank's with --profile_ranks all.
    {save_dir}/profile/{prefix}_memory_rank{R}.pickle (and ..._memory_oom_step{N}_rank{R}.pickle)
        the CUDA allocator's state with the stack of every allocation: drop it on
        https://pytorch.org/memory_viz. Recorded over the same steps (1:3 when no
        --profile_steps), and written again when the run dies of an out-of-memory error.

Steps are counted as the log counts them: step 1 is the first optimizer step of the run.
"""
import argparse
import os
from contextlib import contextmanager

import torch

from trainer.distributed import Logger, peer_lost

DEFAULT_MEMORY_WINDOW = (1, 3)
MEMORY_EVENTS = 100_000  # the allocator's history is a ring buffer of the last this many events


def step_window(text: str) -> tuple[int, int]:
    """argparse type of --profile_steps: 'A:B' -> (A, B), 1 <= A <= B."""
    first, sep, last = text.partition(":")
    if sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B (optimizer steps, e.g. 10:12), got {text!r}")


class Profiling:
    """Starts and stops the profiler and the memory recorder around the loop's steps. The loop
    calls step_begins(step) before optimizer step `step` and step_ended(step) after it, all
    inside running()."""

    def __init__(self, args, prefix: str, rank: int, device: str, start_step: int, total_steps: int):
        self.folder = os.path.join(args.save_dir, "profile")
        self.prefix, self.rank, self.cuda = prefix, rank, device.type == "cuda"
        # A window past the run's end ends with the run.
        clip = lambda w: (w[0], min(w[1], total_steps)) if w and w[0] <= total_steps else None  # noqa: E731
        self.window = clip(args.profile_steps) if args.profile_ranks == "all" or rank == 0 else None
        self.memory = bool(args.memory_snapshot)
        self.memory_window = clip(args.profile_steps or DEFAULT_MEMORY_WINDOW) if self.memory else None
        self.profiler, self.traced_from, self.recording = None, None, False
        for what, window in (("--profile_steps", args.profile_steps), ("--memory_snapshot", self.memory_window)):
            if window and window[1] <= start_step:
                Logger(f"profile: {what} covers steps {window[0]}-{window[1]}, already trained (the run "
                       f"resumes at step {start_step}); nothing is recorded")

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

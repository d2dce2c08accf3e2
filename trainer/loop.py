"""The training loop both stages run: pre-training (trainer/train_pretrain.py) and supervised
fine-tuning (trainer/train_full_sft.py) are this loop with their own data, first weights and
defaults, which a Stage names.

Read it top to bottom: train() sets up (sections 1-5), then trains (section 6); the pieces
it calls follow it, and run() (the command line, the device, the process group) comes last.
The config is trainer/config.py, and the one a run trains with trainer/resume_config.py's
settle_config; one optimizer step trainer/step.py; where the run is and
what a checkpoint holds trainer/train_state.py; how a checkpoint is written and chosen
trainer/checkpoint.py.
"""
import os
import signal
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from common.errors import UserError, os_error_line
from common.storage import check_output_dirs
from dataset.lm_dataset import load_tokenizer
from dataset.token_bytes import token_byte_lengths
from model.model_minimind import count_parameters
from trainer.checkpoint import CheckpointManager
from trainer.config import PRETRAIN_GROUPS, TrainConfig, metrics_path, parse_config, run_prefix, weights_path
from trainer.data import (
    LoaderStalled, ResumableDistributedSampler, TrainData, check_worker_tmpdir, global_batches, make_train_loader,
    make_val_loader,
)
from trainer.device import autocast, configure_cuda, resolve_device
from trainer.distributed import (
    TORCH_COLLECTIVES, Logger, barrier, cleanup_distributed, exit_peer_lost, fail, init_distributed_mode,
    is_main_process, local_state_mib, peer_lost, replica_group, teardown_after_crash, wrap_model,
)
from trainer.evaluate import encode_task, load_task, validate
from trainer.metrics import Profiling, RunLogger, Throughput, device_peak_flops, flops_per_token
from trainer.optim import build_optimizer, describe, set_lr
from trainer.resume_config import settle_config
from trainer.step import Requests, StepTotals, TrainParts, optimizer_step
from trainer.train_state import ModelState, RNGState, ScalerState, TrainState, plan_steps
from trainer.trainer_utils import init_model, initial_weights, setup_seed, zero_output_projections


@dataclass(frozen=True)
class Stage:
    """What a training script brings to the shared loop."""
    description: str  # its --help's first line
    build_data: Callable[..., TrainData]  # (config, tokenizer, vocab_size) -> its samples
    demo_data: Path  # the default --data_path, built on first use by build_demo(path)
    build_demo: Callable[[Path], object]
    groups: tuple = PRETRAIN_GROUPS  # its flags' groups (trainer/config.py)
    defaults: dict = field(default_factory=dict)  # flag defaults other than pre-training's
    help: dict = field(default_factory=dict)  # --help texts other than pre-training's, by flag
    chat: bool = False  # the model it trains answers in turns: --eval_task asks it so (trainer/evaluate.py)


def train(cfg: TrainConfig, typed: frozenset, env, stage: Stage) -> int:
    # ------------------------------------------------------------------ 1. the config the run trains with
    cfg, lm_config, resuming = settle_config(cfg, typed, env)
    sharded = cfg.system.parallel == "fsdp" and env.distributed
    prefix = run_prefix(cfg.output.save_weight, lm_config.hidden_size, lm_config.use_moe)
    configure_cuda(env.device, getattr(torch, cfg.system.dtype))

    # ------------------------------------------------------------------ 2. output folders, tokenizer, data
    check_output_dirs(cfg.output.save_dir, cfg.output.checkpoint_dir, sharded, TORCH_COLLECTIVES)
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    check_model_fits(cfg, tokenizer, lm_config)
    ensure_data(cfg, env.local_rank, stage)
    data = stage.build_data(cfg, tokenizer, lm_config.vocab_size)
    # A bad task file stops here. A chat model's stage asks the task's questions as chat turns.
    task = encode_task(tokenizer, load_task(cfg.data.eval_task), chat=stage.chat) if cfg.data.eval_task else None
    plan = plan_steps(cfg.optim, cfg.data.data_path, len(data.train), env.world_size)

    # ------------------------------------------------------------------ 3. model, parallelism, optimizer
    parts = build_parts(cfg, env, lm_config, None if resuming else initial_weights(cfg), tokenizer.bos_token_id,
                        data.packed)

    # ------------------------------------------------------------------ 4. checkpoints, resume
    state, model_state = TrainState(plan), ModelState(parts.model, parts.optimizer)
    checkpoints = CheckpointManager(cfg.output.checkpoint_dir, prefix, lm_config.to_dict(), model_state,
                                    {"train_state": state, "scaler": ScalerState(parts.scaler), "rng": RNGState()},
                                    cfg.output.keep_last, sharded, weights_path(cfg.output.save_dir, prefix),
                                    config=cfg.record())
    checkpoints.tidy(model_state.estimated_bytes())
    saved = None
    if cfg.output.from_resume:  # the same flag on every rank: resume() is a collective
        saved = checkpoints.resume()
    if saved is None:  # every rank alike (rank 0's pick is broadcast): a collective
        state.run_number = checkpoints.next_run_number()
    else:
        Logger(f"resumed from {saved['path']} at step {state.global_step}/{plan.total_steps}")
        if state.global_step >= plan.total_steps:
            # Saving now would re-label the checkpoint in this run's step units; leave it be.
            Logger(f"nothing left to train: the checkpoint is at step {state.global_step} of {plan.total_steps} "
                   f"(raise --max_steps or --epochs to train further)")
            return 0
    start_step = state.global_step

    # ------------------------------------------------------------------ 5. loaders, logging, signals
    pin = env.device.type == "cuda"
    sampler = ResumableDistributedSampler(data.train, env.world_size, env.rank, seed=cfg.optim.seed)
    loader = make_train_loader(data.train, sampler, cfg.optim.batch_size, cfg.system.num_workers,
                               cfg.system.dist_timeout, pin)
    val_loader = None if data.val is None else make_val_loader(data.val, cfg.optim.batch_size, cfg.data.eval_batches,
                                                               env.rank, env.world_size, pin)
    byte_lengths = token_byte_lengths(tokenizer, lm_config.vocab_size).to(env.device)
    clock = TrainClock(env.device)
    resolved = {**cfg.flags(), "accumulation_steps": plan.accumulation_steps}  # what wandb records
    log = RunLogger(metrics_path(cfg.output.save_dir, prefix), cfg.output, prefix, state, resolved, is_main_process(),
                    clock, env.device)
    state.wandb_run_id = log.wandb_run_id
    preempt, save_clock = PreemptionFlag(), SaveClock(cfg.output.save_every_minutes, is_main_process())
    preempt.install()
    profiling = None
    if Profiling.requested(cfg.system):
        profiling = Profiling(os.path.join(cfg.output.save_dir, "profile"), prefix, env.rank, env.device,
                              cfg.system.profile_steps, cfg.system.memory_snapshot, start_step, plan.total_steps)
    throughput = Throughput(plan.samples_per_step * cfg.model.max_seq_len, clock, start_step, state.tokens_seen)
    peak_flops = device_peak_flops(env.device)
    flops_token = flops_per_token(lm_config, count_parameters(parts.model)[1], cfg.model.max_seq_len)
    Logger(f"world_size={env.world_size} micro_batch={cfg.optim.batch_size} accumulation={plan.accumulation_steps} "
           f"global_batch={plan.samples_per_step} steps/epoch={plan.steps_per_epoch} total_steps={plan.total_steps} "
           f"dtype={cfg.system.dtype} device={env.device} parallel={parallelism(cfg, env)}")

    # ------------------------------------------------------------------ 6. train
    bad_steps, totals = 0, StepTotals(env.device)
    state.unread_tokens = torch.zeros((), dtype=torch.float64, device=env.device)
    steps = global_batches(loader, sampler, plan, start_step, cfg.system.dist_timeout, env.rank)
    with profiling.running(lambda: state.global_step) if profiling else nullcontext():
        while state.global_step < plan.total_steps:
            epoch, micro_batches = next(steps)
            if profiling:
                profiling.step_begins(state.global_step + 1)
            lrs = set_lr(parts.optimizer, cfg.optim, state.global_step, plan.total_steps)
            result = optimizer_step(parts, micro_batches, cfg.optim.grad_clip,
                                    Requests(stop=preempt.requested, save=save_clock.due()))
            if state.global_step == start_step:
                weights_mib, optimizer_mib = local_state_mib(parts.model, parts.optimizer)
                Logger(f"state per rank: weights {weights_mib:,.0f} MiB, optimizer {optimizer_mib:,.0f} MiB")
            state.global_step += 1
            step = state.global_step
            if profiling:
                profiling.step_ended(step)
            state.unread_tokens += result.figures["tokens"]  # on the device, read on steps that read it anyway
            totals.add(result)
            bad_steps = count_bad_step(result.skipped, bad_steps, step, cfg.optim.max_bad_steps)

            last = step == plan.total_steps
            log_now = step % cfg.output.log_interval == 0 or last
            eval_now = (val_loader or task) is not None and (last or (cfg.data.eval_interval and
                                                                       step % cfg.data.eval_interval == 0))
            save_now = step % cfg.output.save_interval == 0 or result.save or last or result.stop
            if log_now or eval_now:
                state.read_tokens()
            if log_now:
                window = totals.take_window()
                tok_s, real_tok_s = throughput.report(step, state.tokens_seen)
                mfu = flops_token * tok_s / env.world_size / peak_flops if peak_flops else None
                log.log_train(step, epoch, window, lrs, state.tokens_seen, tok_s, real_tok_s, mfu)
            if eval_now or save_now:
                with clock.paused():  # tokens/s, MFU and train_s count training time only
                    if eval_now:
                        val, scores = validate(parts, val_loader, task, env.device, env.rank, env.world_size,
                                               byte_lengths, sharded)
                    if save_now:
                        checkpoints.save(step)
                        save_clock.saved()
            if eval_now:
                log.log_val(step, state.tokens_seen, val, scores)
            if result.stop:
                Logger(f"preempted: saved step {step} to {cfg.output.checkpoint_dir}; resume with --from_resume 1")
                log.close()
                return 128 + (preempt.signum or 15)
    log.close()
    Logger(f"done: {state.global_step} steps, {state.tokens_seen:,} tokens; weights in "
           f"{weights_path(cfg.output.save_dir, prefix)}")
    return 0


# ---------------------------------------------------------------------------- the pieces train() calls
def check_model_fits(cfg: TrainConfig, tokenizer, lm_config):
    if len(tokenizer) > lm_config.vocab_size:
        raise UserError(f"--tokenizer_path {cfg.model.tokenizer_path} has {len(tokenizer)} tokens but the model's "
                        f"--vocab_size is {lm_config.vocab_size}; pass --vocab_size {len(tokenizer)} or a smaller "
                        f"tokenizer")
    if cfg.model.max_seq_len > lm_config.max_position_embeddings:
        raise UserError(f"--max_seq_len {cfg.model.max_seq_len} exceeds the model's max_position_embeddings "
                        f"{lm_config.max_position_embeddings}")


def ensure_data(cfg: TrainConfig, local_rank: int, stage: Stage):
    """The stage's demo data is built on first use. Nodes may each have their own disk, so
    the first process of every node builds its node's copy (the write is atomic, so
    nodes sharing a disk merely race to write the same bytes). Every rank waits in the
    same barrier, whatever it found on its own disk."""
    if Path(cfg.data.data_path) == stage.demo_data and local_rank == 0 and not stage.demo_data.exists():
        stage.build_demo(stage.demo_data)
    barrier()


def build_parts(cfg: TrainConfig, env, lm_config, from_weight: str | None, bos_id: int, packed: bool) -> TrainParts:
    # The same initial weights on every rank: FSDP shards them as they are, with no
    # broadcast from rank 0 as DDP does. Per-rank streams (dropout) are seeded after.
    setup_seed(cfg.optim.seed)
    model = init_model(lm_config, from_weight, env.device)
    if cfg.model.zero_init_outputs and from_weight is None:  # a fresh model only (a resume loads over it anyway)
        zero_output_projections(model)
    setup_seed(cfg.optim.seed + env.rank)
    system = cfg.system
    # FSDP shards `model` in place, so the optimizer comes after.
    net = wrap_model(model, env, system.parallel, system.dtype, bool(system.use_compile),
                     bool(system.grad_checkpointing))
    optimizer = build_optimizer(model, cfg.optim, torch.bfloat16 if system.dtype == "bfloat16" else torch.float32,
                                compile_update=env.device.type == "cuda",
                                replica_group=replica_group(env, system.parallel))
    Logger(describe(optimizer, cfg.optim))
    scaler = torch.amp.GradScaler(env.device.type, enabled=system.dtype == "float16")
    # A padded sample holds one document: only packed windows need the document mask.
    return TrainParts(model, net, optimizer, scaler, autocast(system.dtype, env.device), env.device, env.world_size,
                      doc_mask=bool(cfg.data.doc_mask) and packed, bos_id=bos_id)


def parallelism(cfg: TrainConfig, env) -> str:
    """How the model is spread, for the start-up line (trainer/distributed.py decides it)."""
    if cfg.system.parallel == "fsdp" and env.distributed:
        return "fsdp"
    return "ddp" if replica_group(env, cfg.system.parallel) is not None else "none"


def count_bad_step(skipped: bool, bad_steps: int, step: int, max_bad_steps: int) -> int:
    """Consecutive skipped updates so far; too many in a row end the run."""
    if not skipped:
        return 0
    bad_steps += 1
    Logger(f"step {step}: non-finite loss or gradient norm on some rank; update skipped "
           f"({bad_steps}/{max_bad_steps} in a row)")
    if bad_steps >= max_bad_steps:
        raise UserError(f"{bad_steps} consecutive non-finite steps (--max_bad_steps {max_bad_steps}); "
                        f"lower --learning_rate or check the data; the last good checkpoint is kept")
    return bad_steps


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
    def paused(self):
        """Leave the time of the block out of training time."""
        began = self._now()
        try:
            yield
        finally:
            self.paused_s += self._now() - began


class SaveClock:
    """--save_every_minutes, on rank 0's clock alone: clocks of nodes drift, and a save is a
    collective every rank must join at the same step, so rank 0 asks for it through the step's
    one all-reduce (trainer/step.py's Requests.save), which every rank reads at the same step."""

    def __init__(self, minutes: float, is_main: bool, clock=time.monotonic):
        self.seconds, self.clock = minutes * 60 if is_main else 0, clock
        self.last_save = clock()

    def due(self) -> bool:
        return bool(self.seconds) and self.clock() - self.last_save >= self.seconds

    def saved(self):
        """A checkpoint was just written (for whatever reason): the interval starts again."""
        self.last_save = self.clock()


class PreemptionFlag:
    """SIGTERM (spot reclaim, SLURM, `kill`) or SIGINT (Ctrl-C) only raises this flag; it travels
    in the step's all-reduce, so every rank saves at the same step and exits together (a rank
    that acted alone would leave its peers waiting in a collective)."""
    SIGNALS = (signal.SIGTERM, signal.SIGINT)
    # One request often arrives twice: Ctrl-C (or scancel) signals torchrun and every worker,
    # then torchrun forwards its own copy. Repeats this soon after the first are that echo.
    repeat_grace_s = 2.0

    def __init__(self):
        self.signum, self._first_at = 0, 0.0

    def install(self):
        for sig in self.SIGNALS:
            signal.signal(sig, self._on_signal)

    def _on_signal(self, signum, frame):
        now = time.monotonic()
        if not self.signum:
            self.signum, self._first_at = signum, now
        elif now - self._first_at >= self.repeat_grace_s:  # a second Ctrl-C later on kills at once
            for sig in self.SIGNALS:
                signal.signal(sig, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    @property
    def requested(self) -> bool:
        return self.signum != 0


# ---------------------------------------------------------------------------- the entry point
def run(stage: Stage, argv=None):
    try:
        # Flags and device alone, before any process group: every rank stops the same way, at once.
        # (The combinations are checked once the config is final: settle_config.)
        cfg, typed = parse_config(argv, stage)
        device = resolve_device(cfg.system.device, cfg.system.local_rank)
        check_worker_tmpdir(cfg.system.num_workers)
    except UserError as exc:
        fail(str(exc))
    env = init_distributed_mode(device, cfg.system.dist_timeout, cfg.system.local_rank)
    try:
        exit_code = train(cfg, typed, env, stage)
    except UserError as exc:  # DataError, WeightsError and StorageError are UserErrors too
        fail(str(exc))
    except LoaderStalled as exc:
        fail(str(exc), code=1, this_rank_only=True)
    except OSError as exc:  # a file or disk the run could not use, where no write caught it: one line too
        fail(os_error_line(exc), this_rank_only=True)
    except BaseException as exc:
        if env.distributed and peer_lost(exc):
            exit_peer_lost(exc, bool(cfg.output.from_resume))
        teardown_after_crash(exc)
        raise
    cleanup_distributed(clean=True)
    sys.exit(exit_code)

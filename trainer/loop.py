"""The training loop every stage shares: pre-training (trainer/train_pretrain.py) and
supervised fine-tuning (trainer/train_full_sft.py) are this loop with their own data, first
weights and flag defaults, which a Stage names.

Read it top to bottom: train() sets up (sections 1-5), then trains (section 6); the
pieces it calls follow it, and run() (flags, device, process group) comes last. One
optimizer step is trainer/step.py; where the run is, and where that is in the data, is
trainer/train_state.py; what a checkpoint holds is trainer/checkpoint.py.
"""
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from common.errors import UserError
from common.labels import IGNORE_INDEX
from dataset.lm_dataset import load_tokenizer
from dataset.token_bytes import bits_per_byte, target_bytes, token_byte_lengths
from model.model_minimind import count_parameters
from trainer.args import check_args, parse_args
from trainer.checkpoint import CheckpointManager, newest_record
from trainer.data import LoaderStalled, ResumableDistributedSampler, TrainData, delivered_batches, make_train_loader, \
    make_val_loader
from trainer.device import configure_cuda, resolve_device
from trainer.distributed import all_reduce_sum, barrier, cleanup_distributed, exit_peer_lost, fail, peer_lost
from trainer.downstream import encode_task, evaluate_task_in_group, load_task
from trainer.hooks import load_step_hooks
from trainer.metrics import RunLogger, Throughput, TrainClock, device_peak_flops, flops_per_token
from trainer.optim import OptimConfig, Schedule, build_optimizer, describe, set_lr
from trainer.parallel import local_state_mib, replica_group, wrap_model
from trainer.preemption import PreemptionFlag
from trainer.preflight import check_output_dirs, check_worker_tmpdir
from trainer.profiling import Profiling
from trainer.run_files import initial_weights, run_prefix, weights_path
from trainer.save_schedule import SaveSchedule
from trainer.settings import RunSettings, is_sharded, resolve_settings
from trainer.stateful import ModelState, RNGState, ScalerState
from trainer.step import Requests, StepContext, StepTotals, attention_mask, optimizer_step
from trainer.train_state import TrainState, plan_steps
from trainer.trainer_utils import (  # MiniMind's entry points
    Logger, init_distributed_mode, init_model, is_main_process, model_config_from_args, setup_seed,
)
from trainer.trainer_utils import zero_output_projections


@dataclass(frozen=True)
class Stage:
    """What a training script brings to the shared loop."""
    name: str  # the script's, for its --help
    description: str
    build_data: Callable[..., TrainData]  # (args, tokenizer, vocab_size) -> its samples
    demo_data: Path  # the default --data_path, built on first use by build_demo(path)
    build_demo: Callable[[Path], object]
    defaults: dict = field(default_factory=dict)  # flag defaults other than pre-training's
    help: dict = field(default_factory=dict)  # --help texts other than pre-training's, by flag
    add_flags: Callable | None = None  # (parser) -> None: the stage's own flags
    check_args: Callable | None = None  # (args) -> None, raising UserError
    chat: bool = False  # the model it trains answers in turns: --eval_task asks it so (trainer/downstream.py)


def train(args, env, stage: Stage) -> int:
    # ------------------------------------------------------------------ 1. output folders, tokenizer, model config, data
    world_size, rank = env.world_size, env.rank
    check_output_dirs(args.save_dir, args.checkpoint_dir, is_sharded(args, env))
    tokenizer = load_tokenizer(args.tokenizer_path)
    from_weight = initial_weights(args)
    config = model_config_from_args(args, args.vocab_size)
    check_model_fits(args, tokenizer, config)
    ensure_data(args, env.local_rank, stage)
    data = stage.build_data(args, tokenizer, config.vocab_size)
    # A bad task file stops here. A chat model's stage asks the task's questions as chat turns.
    task = encode_task(tokenizer, load_task(args.eval_task), chat=stage.chat) if args.eval_task else None
    plan = plan_steps(args, len(data.train), world_size)
    total_steps = plan.total_steps

    # ------------------------------------------------------------------ 2. settings: what auto becomes here
    prefix = run_prefix(args.save_weight, config.hidden_size, config.use_moe)
    resuming = {}
    if args.from_resume:  # the same flag on every rank: all of them join newest_record()'s broadcast, or none does
        resuming = newest_record(args.checkpoint_dir, prefix)
    settings = resolve_settings(args, env, config, plan.samples_per_step * args.max_seq_len, resuming)
    configure_cuda(env.device, settings.torch_dtype)
    autocast = settings.autocast(env.device)

    # ------------------------------------------------------------------ 3. model, parallelism, optimizer
    parts = build_parts(args, env, config, settings, from_weight)
    model, optimizer = parts.model, parts.optimizer
    flops_token = flops_per_token(config, count_parameters(model)[1], args.max_seq_len)

    # ------------------------------------------------------------------ 4. checkpoints, resume
    state = TrainState(plan)
    checkpoints = CheckpointManager(args.checkpoint_dir, prefix, config.to_dict(), ModelState(model, optimizer),
                                    {"train_state": state, "scaler": ScalerState(parts.scaler), "rng": RNGState()},
                                    args.keep_last, settings.sharded, weights_path(args.save_dir, prefix),
                                    run_record=settings.record)
    saved = None
    if args.from_resume:  # the same flag on every rank: all of them join resume()'s broadcasts, or none does
        saved = checkpoints.resume()
    if saved is not None:
        Logger(f"resumed from {saved['path']} at step {state.global_step}/{total_steps}")
        if state.global_step >= total_steps:
            # Saving now would re-label the checkpoint in this run's step units; leave it be.
            Logger(f"nothing left to train: the checkpoint is at step {state.global_step} of {total_steps} "
                   f"(raise --max_steps or --epochs to train further)")
            return 0
    start_step = state.global_step

    # ------------------------------------------------------------------ 5. loaders, logging
    pin = env.device.type == "cuda"
    sampler = ResumableDistributedSampler(data.train, world_size, rank, seed=args.seed)
    loader = make_train_loader(data.train, sampler, args, pin)
    val_loader = make_val_loader(data.val, args, rank, world_size, pin) if data.val is not None else None
    byte_lengths = token_byte_lengths(tokenizer, config.vocab_size).to(env.device)
    clock = TrainClock(env.device)
    log = RunLogger(args, prefix, state, settings.as_flags(args, plan.accumulation_steps), is_main_process(), clock,
                    env.device)
    state.wandb_run_id = log.wandb_run_id
    saves = SaveSchedule(args.save_interval, args.save_every_minutes, is_main=is_main_process())
    preempt, hooks = PreemptionFlag(), load_step_hooks(rank)
    preempt.install()
    profiling = Profiling(args, prefix, rank, env.device, start_step, total_steps)
    throughput = Throughput(plan.samples_per_step * args.max_seq_len, clock)
    peak_flops = device_peak_flops(env.device, args.peak_tflops)
    Logger(f"world_size={world_size} micro_batch={args.batch_size} accumulation={plan.accumulation_steps} "
           f"global_batch={plan.samples_per_step} steps/epoch={plan.steps_per_epoch} total_steps={total_steps} "
           f"dtype={settings.dtype} device={env.device} parallel={parallelism(args, env)}")
    # A padded sample holds one document: only packed windows need the document mask.
    step_context = StepContext(parts.net, optimizer, parts.scaler, env.device, world_size, autocast,
                               doc_mask=bool(args.doc_mask) and data.packed, bos_id=tokenizer.bos_token_id,
                               grad_clip=args.grad_clip, hooks=hooks)

    # ------------------------------------------------------------------ 6. train
    bad_steps, totals = 0, StepTotals(env.device)
    steps = global_batches(loader, sampler, plan, start_step, args.dist_timeout, rank)
    with profiling.running(lambda: state.global_step):
        while state.global_step < total_steps:
            epoch, micro_batches = next(steps)
            hooks.before_step(state.global_step)
            profiling.step_begins(state.global_step + 1)
            lrs = set_lr(optimizer, parts.schedule, state.global_step, total_steps)
            result = optimizer_step(step_context, micro_batches,
                                    Requests(stop=preempt.requested, save=saves.clock_asks()))
            if state.global_step == start_step:
                weights_mib, optimizer_mib = local_state_mib(model, optimizer)
                Logger(f"state per rank: weights {weights_mib:,.0f} MiB, optimizer {optimizer_mib:,.0f} MiB")
            state.global_step += 1
            step = state.global_step
            profiling.step_ended(step)
            totals.add(result)
            log.step_done()
            bad_steps = count_bad_step(result.skipped, bad_steps, step, args.max_bad_steps)

            last = step == total_steps
            log_now = step % args.log_interval == 0 or last
            eval_now = (val_loader or task) is not None and (last or (args.eval_interval and
                                                                       step % args.eval_interval == 0))
            save_now = saves.due(step, result.save) or last or result.stop
            if log_now or eval_now or save_now:  # steps that read the device anyway
                new_tokens, steps_done = totals.take_tokens()
                state.tokens_seen += new_tokens
                throughput.add(new_tokens, steps=steps_done)
            if log_now:
                loss, aux = totals.take_window()
                tok_s, real_tok_s = throughput.report()
                mfu = flops_token * tok_s / world_size / peak_flops if peak_flops else None
                log.log_train(step, epoch, loss, aux, lrs, state.tokens_seen, tok_s, real_tok_s, mfu)
            with clock.paused(eval_now or save_now):  # tokens/s, MFU and train_s count training time only
                if eval_now:
                    val, scores = validate(step_context, val_loader, task, env, byte_lengths, settings.sharded)
                if save_now:
                    checkpoints.save(step)
                    saves.saved()
            if eval_now:
                log.log_val(step, state.tokens_seen, val, scores)
            if result.stop:
                Logger(f"preempted: saved step {step} to {args.checkpoint_dir}; resume with --from_resume 1")
                log.close()
                return 128 + (preempt.signum or 15)
    log.close()
    Logger(f"done: {state.global_step} steps, {state.tokens_seen:,} tokens; weights in "
           f"{weights_path(args.save_dir, prefix)}")
    return 0


# ---------------------------------------------------------------------------- the pieces train() calls
def check_model_fits(args, tokenizer, config):
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"--tokenizer_path {args.tokenizer_path} has {len(tokenizer)} tokens but the model's "
                        f"--vocab_size is {config.vocab_size}; pass --vocab_size {len(tokenizer)} or a smaller tokenizer")
    if args.max_seq_len > config.max_position_embeddings:
        raise UserError(f"--max_seq_len {args.max_seq_len} exceeds the model's max_position_embeddings "
                        f"{config.max_position_embeddings}")


def ensure_data(args, local_rank: int, stage: Stage):
    """The stage's demo data is built on first use. Nodes may each have their own disk, so
    the first process of every node builds its node's copy (the write is atomic, so
    nodes sharing a disk merely race to write the same bytes). Every rank waits in the
    same barrier, whatever it found on its own disk."""
    if Path(args.data_path) == stage.demo_data and local_rank == 0 and not stage.demo_data.exists():
        stage.build_demo(stage.demo_data)
    barrier()


@dataclass(frozen=True)
class TrainParts:
    """What the optimizer updates, and how."""
    model: torch.nn.Module  # the MiniMindForCausalLM (sharded in place under FSDP)
    net: torch.nn.Module  # the module the loop calls: DDP, FSDP or torch.compile around the model
    optimizer: torch.optim.Optimizer
    schedule: Schedule  # each parameter group's peak lr and its schedule, and Muon's momentum
    scaler: torch.amp.GradScaler


def build_parts(args, env, config, settings: RunSettings, from_weight: str | None) -> TrainParts:
    # The same initial weights on every rank: FSDP shards them as they are, with no
    # broadcast from rank 0 as DDP does. Per-rank streams (dropout) are seeded after.
    setup_seed(args.seed)
    model = init_model(config, from_weight, env.device)
    if args.zero_init_outputs and from_weight is None:  # a fresh model only (a resume loads over it anyway)
        zero_output_projections(model)
    setup_seed(args.seed + env.rank)
    # FSDP shards `model` in place, so the optimizer comes after.
    net = wrap_model(model, env, args.parallel, settings.dtype, bool(args.use_compile), bool(args.grad_checkpointing))
    optim_config = OptimConfig.from_args(args, settings, env.device, config.hidden_size)
    optimizer = build_optimizer(model, optim_config, replica_group(env, args.parallel))
    Logger(describe(optimizer, optim_config))
    scaler = torch.amp.GradScaler(env.device.type, enabled=settings.dtype == "float16")
    return TrainParts(model, net, optimizer, Schedule.of(optim_config), scaler)


def parallelism(args, env) -> str:
    """How the model is spread, for the start-up line (trainer/parallel.py decides it)."""
    if args.parallel == "fsdp" and env.distributed:
        return "fsdp"
    return "ddp" if replica_group(env, args.parallel) is not None else "none"


def global_batches(loader, sampler, plan, start_step: int, dist_timeout: float, rank: int):
    """(epoch, micro-batches) of every optimizer step from `start_step` on, epoch after epoch:
    each epoch's loader starts where that step's samples start (trainer/train_state.py)."""
    step = start_step
    while True:
        where = plan.position(step)
        sampler.set_epoch(where.epoch)
        sampler.set_start(where.sampler_start)
        batches = delivered_batches(loader, dist_timeout, rank)
        for _ in range(plan.steps_per_epoch - where.step_in_epoch):
            yield where.epoch, [next(batches) for _ in range(plan.accumulation_steps)]
            step += 1


def validate(step_context: StepContext, val_loader, task, env, byte_lengths, sharded: bool):
    """(val loss and bits per byte, the task's scores), each None where the run has no such data.
    Both are collectives: every rank calls this at the same steps."""
    val, scores = None, None
    net, autocast = step_context.net, step_context.autocast
    if val_loader is not None:
        val = evaluate(net, val_loader, autocast, env.device, byte_lengths, step_context.doc_mask, step_context.bos_id)
    if task is not None:
        scores = evaluate_task_in_group(net, task, env.device, autocast, env.rank, env.world_size, sharded)
    return val, scores


@torch.no_grad()
def evaluate(net, val_loader, ctx, device, byte_lengths, doc_mask: bool = False,
             bos_id: int | None = None) -> tuple[float, float]:
    """(mean token loss, bits per byte) over the fixed validation slice of (input ids, next-token
    targets[, document starts]), summed over all ranks, with the attention training has;
    dataset/token_bytes.py says which targets and bytes count."""
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for batch in val_loader:
        batch = [t.to(device) for t in batch]
        x, targets = batch[0], batch[1]
        with ctx:
            out = net(x, attention_mask=attention_mask(batch, doc_mask, bos_id), shift_labels=targets,
                      num_items_in_batch=1)  # a sum, not a mean
        totals += torch.stack([out.loss.double(), (targets != IGNORE_INDEX).sum().double(),
                               target_bytes(targets, byte_lengths).double()])
    net.train()
    all_reduce_sum(totals)
    nll, tokens, n_bytes = totals.tolist()
    return nll / max(tokens, 1), bits_per_byte(nll, n_bytes)


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


# ---------------------------------------------------------------------------- the entry point
def run(stage: Stage, argv=None):
    args = parse_args(argv, stage)
    try:
        # Flags and device alone, before any process group: every rank stops the same way, at once.
        device = resolve_device(args.device, args.local_rank)
        check_args(args, device)
        if stage.check_args:
            stage.check_args(args)
        check_worker_tmpdir(args.num_workers)
    except UserError as exc:
        fail(str(exc))
    env = init_distributed_mode(device, args.dist_timeout, args.local_rank)
    try:
        exit_code = train(args, env, stage)
    except UserError as exc:  # DataError and WeightsError are UserErrors too
        fail(str(exc))
    except LoaderStalled as exc:
        fail(str(exc), code=1, this_rank_only=True)
    except BaseException as exc:
        if env.distributed and peer_lost(exc):
            exit_peer_lost(exc, bool(args.from_resume))
        cleanup_distributed(clean=False)
        raise
    cleanup_distributed(clean=True)
    sys.exit(exit_code)

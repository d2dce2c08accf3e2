"""Pre-train MiniMind. One script for every launch:

    python trainer/train_pretrain.py                          # one process, CPU or GPU
    torchrun --nproc_per_node=N trainer/train_pretrain.py     # N processes, DDP
    torchrun --nnodes=2 --node_rank=R --master_addr=A --master_port=P --nproc_per_node=N trainer/train_pretrain.py
    python -m torch.distributed.launch --nproc_per_node=N trainer/train_pretrain.py   # legacy launcher

Read it top to bottom: train() sets up (sections 1-5), then trains (section 6). One
optimizer step is trainer/step.py; where the run is, and where that is in the data,
is trainer/train_state.py.
"""
import os
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.atomic import atomic_torch_save, atomic_write_text  # noqa: E402
from common.errors import UserError  # noqa: E402
from dataset.demo_corpus import DEMO_CORPUS  # noqa: E402
from dataset.lm_dataset import load_tokenizer  # noqa: E402
from dataset.token_bytes import bits_per_byte, target_bytes, token_byte_lengths  # noqa: E402
from model.model_minimind import count_parameters  # noqa: E402
from model.weights import run_prefix, sidecar_path, sidecar_text  # noqa: E402
from trainer.args import check_args, parse_args  # noqa: E402
from trainer.checkpoint import (  # noqa: E402
    load_latest_checkpoint, restore_model_and_optimizer, restore_rng_state, save_checkpoint,
)
from trainer.data import (  # noqa: E402
    LoaderStalled, ResumableDistributedSampler, build_data, delivered_batches, make_train_loader, make_val_loader,
    to_targets,
)
from trainer.distributed import (  # noqa: E402
    Logger, all_reduce_sum, barrier, cleanup_distributed, exit_peer_lost, fail, init_distributed_mode,
    is_main_process, peer_lost,
)
from trainer.metrics import RunLogger, Throughput, TrainRow, device_peak_flops, flops_per_token  # noqa: E402
from trainer.optim import OptimConfig, build_optimizer, describe, peak_lrs, set_lr  # noqa: E402
from trainer.parallel import full_state_dict, local_state_mib, replica_group, weights_finite, wrap_model  # noqa: E402
from trainer.preflight import check_device, check_output_dirs, check_worker_tmpdir  # noqa: E402
from trainer.profiling import Profiling  # noqa: E402
from trainer.resilience import FaultPlan, PreemptionFlag  # noqa: E402
from trainer.save_schedule import SaveSchedule  # noqa: E402
from trainer.settings import RunSettings, resolve_settings  # noqa: E402
from trainer.step import StepContext, StepTotals, optimizer_step  # noqa: E402
from trainer.train_state import TrainState, plan_steps  # noqa: E402
from trainer.trainer_utils import init_model, model_config_from_args, setup_seed  # noqa: E402


def ensure_data(args, local_rank: int):
    """The default corpus is built on first use. Nodes may each have their own disk, so
    the first process of every node builds its node's copy (the write is atomic, so
    nodes sharing a disk merely race to write the same bytes). Every rank waits in the
    same barrier, whatever it found on its own disk."""
    if Path(args.data_path) == DEMO_CORPUS and local_rank == 0 and not DEMO_CORPUS.exists():
        from dataset.demo_corpus import ensure_demo_corpus

        ensure_demo_corpus(DEMO_CORPUS)
    barrier()


def configure_cuda(device: str, dtype: torch.dtype):
    """Per-process CUDA settings (nothing to do on CPU)."""
    if not device.startswith("cuda"):
        return
    if torch.device(device).index is not None:
        # One process started with --device cuda:N: make N the current device, or CUDA
        # contexts, compiled kernels and memory stats land on cuda:0 (torchrun ranks have
        # set theirs in init_distributed_mode already).
        torch.cuda.set_device(torch.device(device))
    if dtype == torch.float32:
        # fp32 matmuls on TF32 tensor cores: fp32 storage and accumulation, 10-bit mantissa
        # products, several times the plain fp32 rate on Ampere and later.
        torch.set_float32_matmul_precision("high")


def save_weights(model, args, prefix):
    """MiniMind's inference format: a half-precision state_dict, written atomically by rank 0
    to {args.save_dir}/{prefix}.pth (every rank takes part in gathering it when the model is
    sharded), with the model config beside it as {prefix}.json so that the scripts need no
    shape flags. `args`: the flags, or anything else with a save_dir (RunFiles)."""
    weights = full_state_dict(model)
    if is_main_process():
        os.makedirs(args.save_dir, exist_ok=True)
        path = os.path.join(args.save_dir, f"{prefix}.pth")
        atomic_torch_save({k: v.half() for k, v in weights.items()}, path)
        atomic_write_text(sidecar_path(path), sidecar_text(model.config))


@torch.no_grad()
def evaluate(net, val_loader, ctx, device, shifted, byte_lengths) -> tuple[float, float]:
    """(mean token loss, bits per byte) over the fixed validation slice, summed over all
    ranks; dataset/token_bytes.py says which targets and bytes count."""
    net.eval()
    totals = torch.zeros(3, dtype=torch.float64, device=device)
    for x, y in val_loader:
        x, targets = x.to(device), to_targets(y, shifted).to(device)
        with ctx:
            out = net(x, shift_labels=targets, num_items_in_batch=1)  # a sum, not a mean
        totals += torch.stack([out.loss.double(), (targets != -100).sum().double(),
                               target_bytes(targets, byte_lengths).double()])
    net.train()
    all_reduce_sum(totals)
    nll, tokens, n_bytes = totals.tolist()
    return nll / max(tokens, 1), bits_per_byte(nll, n_bytes)


def main(argv=None):
    args = parse_args(argv)
    try:
        # Flags alone, before any process group: every rank stops the same way, at once.
        # The float16 check is about the run's device (a CUDA machine may still run --device cpu).
        check_args(args, (args.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"))
        check_device(args.device, args.local_rank)
        check_worker_tmpdir(args.num_workers)
    except UserError as exc:
        fail(str(exc))
    env = init_distributed_mode(args.device, args.local_rank, args.dist_timeout)
    try:
        exit_code = train(args, env)
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


def check_model_fits(args, tokenizer, config):
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"--tokenizer_path {args.tokenizer_path} has {len(tokenizer)} tokens but the model's "
                        f"--vocab_size is {config.vocab_size}; pass --vocab_size {len(tokenizer)} or a smaller tokenizer")
    if args.max_seq_len > config.max_position_embeddings:
        raise UserError(f"--max_seq_len {args.max_seq_len} exceeds the model's max_position_embeddings "
                        f"{config.max_position_embeddings}")


@dataclass(frozen=True)
class RunFiles:
    """Where the run writes: {save_dir}/{prefix}.pth, and its checkpoints in checkpoint_dir."""
    save_dir: str
    checkpoint_dir: str
    prefix: str
    keep_last: int
    sharded: bool  # FSDP: every rank writes its own shards (DCP)


@dataclass(frozen=True)
class TrainParts:
    """What the optimizer updates, and what a checkpoint saves besides the TrainState."""
    model: torch.nn.Module  # the MiniMindForCausalLM (sharded in place under FSDP)
    net: torch.nn.Module  # the module the loop calls: DDP, FSDP or torch.compile around the model
    optimizer: torch.optim.Optimizer
    peaks: dict  # each parameter group's peak learning rate
    scaler: torch.amp.GradScaler


def build_parts(args, env, config, settings: RunSettings) -> TrainParts:
    # The same initial weights on every rank: FSDP shards them as they are, with no
    # broadcast from rank 0 as DDP does. Per-rank streams (dropout) are seeded after.
    setup_seed(args.seed)
    model = init_model(config, args.from_weight, env.device)
    setup_seed(args.seed + env.rank)
    # FSDP shards `model` in place, so the optimizer comes after.
    net = wrap_model(model, env, args.parallel, settings.dtype, bool(args.use_compile), bool(args.grad_checkpointing))
    optim_config = OptimConfig.from_args(args, settings)
    optimizer = build_optimizer(model, optim_config, replica_group(env, args.parallel))
    peaks = peak_lrs(optim_config)
    Logger(describe(optimizer, peaks))
    scaler = torch.amp.GradScaler(settings.device_type, enabled=settings.dtype == "float16")
    return TrainParts(model, net, optimizer, peaks, scaler)


def resume(state: TrainState, parts: TrainParts, config, files: RunFiles, rank: int) -> bool:
    """Load the newest usable checkpoint into the state, model, optimizer and scaler;
    False when there is none."""
    saved = load_latest_checkpoint(files.checkpoint_dir, files.prefix, config.to_dict())
    if saved is None:
        return False
    restore_model_and_optimizer(saved, parts.model, parts.optimizer)
    parts.scaler.load_state_dict(saved["scaler"])
    plan = state.plan
    if saved["world_size"] == plan.world_size:
        restore_rng_state(saved["rng"][rank])
    state.load_state_dict(saved)
    if saved["samples_per_step"] != plan.samples_per_step:
        step_in_epoch = state.global_step - saved["epoch"] * plan.steps_per_epoch
        Logger(f"resume: world size {saved['world_size']} -> {plan.world_size}, step {saved['step_in_epoch']} -> "
               f"{step_in_epoch} of epoch {saved['epoch']} (step * {saved['samples_per_step']} samples "
               f"// {plan.samples_per_step} samples per step)")
    Logger(f"resumed from {saved['path']} at step {state.global_step}/{plan.total_steps}")
    return True


def save_run(state: TrainState, parts: TrainParts, config, files: RunFiles):
    """The inference weights and a resume checkpoint at state.global_step (every rank calls it)."""
    # A checkpoint of NaNs would push a good one out of the rotation: refuse to write it.
    if not weights_finite(parts.model):
        raise RuntimeError("model weights are not finite; refusing to save a checkpoint")
    save_weights(parts.model, files, files.prefix)
    save_checkpoint({"scaler": parts.scaler.state_dict(), **state.state_dict(), "model_config": config.to_dict()},
                    parts.model, parts.optimizer, files.checkpoint_dir, files.prefix, files.keep_last, files.sharded)


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


def train(args, env) -> int:
    # ------------------------------------------------------------------ 1. settings
    settings = resolve_settings(args, env)
    configure_cuda(env.device, settings.torch_dtype)
    autocast = settings.autocast()
    world_size, rank = env.world_size, env.rank
    check_output_dirs(args.save_dir, args.checkpoint_dir, settings.sharded)

    # ------------------------------------------------------------------ 2. tokenizer, model config, data
    tokenizer = load_tokenizer(args.tokenizer_path)
    config = model_config_from_args(args, args.vocab_size)
    check_model_fits(args, tokenizer, config)
    ensure_data(args, env.local_rank)
    data = build_data(args, tokenizer, config.vocab_size)
    plan = plan_steps(args, len(data.train), world_size)
    total_steps = plan.total_steps

    # ------------------------------------------------------------------ 3. model, parallelism, optimizer
    parts = build_parts(args, env, config, settings)
    model, optimizer = parts.model, parts.optimizer
    flops_token = flops_per_token(config, count_parameters(model)[1], args.max_seq_len)

    # ------------------------------------------------------------------ 4. resume
    prefix = run_prefix(args.save_weight, config.hidden_size, config.use_moe)
    files = RunFiles(args.save_dir, args.checkpoint_dir, prefix, args.keep_last, settings.sharded)
    state = TrainState(plan)
    if args.from_resume and resume(state, parts, config, files, rank):
        if state.global_step >= total_steps:
            # Saving now would re-label the checkpoint in this run's step units; leave it be.
            Logger(f"nothing left to train: the checkpoint is at step {state.global_step} of {total_steps} "
                   f"(raise --max_steps or --epochs to train further)")
            return 0
    start_step = state.global_step

    # ------------------------------------------------------------------ 5. loaders, logging
    pin = settings.device_type == "cuda"
    sampler = ResumableDistributedSampler(data.train, world_size, rank, seed=args.seed)
    loader = make_train_loader(data.train, sampler, args, pin)
    val_loader = make_val_loader(data.val, args, rank, world_size, pin) if data.val is not None else None
    byte_lengths = token_byte_lengths(tokenizer, config.vocab_size).to(env.device)
    log = RunLogger(args, prefix, state, settings.as_flags(args, plan.accumulation_steps), is_main_process(), env.device)
    state.wandb_run_id = log.wandb_run_id
    saves = SaveSchedule(args.save_interval, args.save_every_minutes, args.log_interval, env.device)
    preempt, faults = PreemptionFlag(), FaultPlan.from_env(rank)
    preempt.install()
    profiling = Profiling(args, prefix, rank, env.device, start_step, total_steps)
    throughput = Throughput(plan.samples_per_step * args.max_seq_len, env.device)
    peak = device_peak_flops(env.device, args.peak_tflops)
    Logger(f"world_size={world_size} micro_batch={args.batch_size} accumulation={plan.accumulation_steps} "
           f"global_batch={plan.samples_per_step} steps/epoch={plan.steps_per_epoch} total_steps={total_steps} "
           f"dtype={settings.dtype} device={env.device} parallel={args.parallel if env.distributed else 'none'}")
    # Packed windows have no padding: every position is a target, so the token count is known.
    step_context = StepContext(parts.net, optimizer, parts.scaler, env.device, world_size, autocast,
                               labels_are_shifted=data.labels_are_shifted, doc_mask=bool(args.doc_mask),
                               bos_id=tokenizer.bos_token_id, tokens_known=data.labels_are_shifted,
                               grad_clip=args.grad_clip)

    # ------------------------------------------------------------------ 6. train
    bad_steps, totals = 0, StepTotals(env.device)
    with profiling.out_of_memory_snapshot(lambda: state.global_step + 1):
        while state.global_step < total_steps:
            where = plan.position(state.global_step)
            sampler.set_epoch(where.epoch)
            sampler.set_start(where.sampler_start)
            batches = delivered_batches(loader, args.dist_timeout, rank)
            for _ in range(min(plan.steps_per_epoch - where.step_in_epoch, total_steps - state.global_step)):
                faults.crash_before(state.global_step, rank)
                profiling.step_begins(state.global_step + 1)
                lrs = set_lr(optimizer, parts.peaks, state.global_step, total_steps, args.warmup_steps)
                micro_batches = [next(batches) for _ in range(plan.accumulation_steps)]
                result = optimizer_step(step_context, micro_batches, poison=faults.poisons(state.global_step),
                                        preempt_requested=preempt.requested)
                if state.global_step == start_step:
                    weights_mib, optimizer_mib = local_state_mib(model, optimizer)
                    Logger(f"state per rank: weights {weights_mib:,.0f} MiB, optimizer {optimizer_mib:,.0f} MiB")
                state.global_step += 1
                step = state.global_step
                profiling.step_ended(step)
                totals.add(result)
                log.step_done()
                bad_steps = count_bad_step(result.skipped, bad_steps, step, args.max_bad_steps)

                last, stop = step == total_steps, result.stop
                log_now = step % args.log_interval == 0 or last
                eval_now = val_loader is not None and (last or (args.eval_interval and step % args.eval_interval == 0))
                save_now = saves.due(step) or last or stop  # due() first: every rank calls it every step
                if log_now or eval_now or save_now:  # steps that read the device anyway
                    new_tokens, steps = totals.take_tokens()
                    state.tokens_seen += new_tokens
                    throughput.add(new_tokens, steps=steps)
                if log_now:
                    loss, aux = totals.take_window()
                    tok_s, real_tok_s = throughput.report()
                    mfu = flops_token * tok_s / world_size / peak if peak else None
                    log.log_train(TrainRow(step, where.epoch, loss, aux, lrs, state.tokens_seen, tok_s, real_tok_s, mfu))
                with throughput.paused(eval_now or save_now):  # tokens/s and MFU count training time only
                    if eval_now:
                        with log.untimed():
                            val_loss, val_bpb = evaluate(parts.net, val_loader, autocast, env.device,
                                                         data.val_labels_are_shifted, byte_lengths)
                        log.log_val(step, state.tokens_seen, val_loss, val_bpb)
                    if save_now:
                        save_run(state, parts, config, files)
                        saves.saved()
                if stop:
                    Logger(f"preempted: saved step {step} to {args.checkpoint_dir}; resume with --from_resume 1")
                    log.close()
                    return 128 + (preempt.signum or 15)
    log.close()
    Logger(f"done: {state.global_step} steps, {state.tokens_seen:,} tokens; weights in {args.save_dir}/{prefix}.pth")
    return 0


if __name__ == "__main__":
    main()

"""Pre-train MiniMind. One script for every launch:

    python trainer/train_pretrain.py                          # one process, CPU or GPU
    torchrun --nproc_per_node=N trainer/train_pretrain.py     # N processes, DDP
    torchrun --nnodes=2 --node_rank=R --master_addr=A --master_port=P --nproc_per_node=N trainer/train_pretrain.py
    python -m torch.distributed.launch --nproc_per_node=N trainer/train_pretrain.py   # legacy launcher

Read it top to bottom: main() sets up (sections 1-5), then trains (section 6).
"""
import argparse
import math
import os
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from common.atomic import atomic_torch_save, atomic_write_text  # noqa: E402
from common.errors import UserError  # noqa: E402
from dataset.lm_dataset import DataError, load_tokenizer  # noqa: E402
from dataset.packed_dataset import document_causal_mask  # noqa: E402
from dataset.token_bytes import bits_per_byte, target_bytes, token_byte_lengths  # noqa: E402
from model.model_minimind import count_parameters  # noqa: E402
from model.weights import run_prefix, sidecar_path, sidecar_text  # noqa: E402
from dataset.demo_corpus import DEMO_CORPUS  # noqa: E402
from trainer.args import check_args, parse_args  # noqa: E402
from trainer.checkpoint import (  # noqa: E402
    load_latest_checkpoint, restore_model_and_optimizer, restore_rng_state, save_checkpoint,
)
from trainer.data import (  # noqa: E402
    ResumableDistributedSampler, build_data, make_train_loader, make_val_loader, plan_steps, resume_step, to_targets,
)
from trainer.metrics import RunLogger, Throughput, device_peak_flops, flops_per_token  # noqa: E402
from trainer.optim import (  # noqa: E402
    OptimConfig, build_optimizer, describe, detect_dtype, detect_optimizer, peak_lrs, set_lr,
)
from trainer.parallel import (  # noqa: E402
    as_local_scalar, full_state_dict, gradient_sync, local_state_mib, weights_finite, wrap_model,
)
from trainer.preflight import check_device, check_output_dirs  # noqa: E402
from trainer.resilience import PreemptionFlag, inject_crash, inject_nan  # noqa: E402
from trainer.save_schedule import SaveSchedule  # noqa: E402
from trainer.distributed import (  # noqa: E402
    Logger, all_reduce_sum, barrier, cleanup_distributed, exit_peer_lost, fail, init_distributed_mode,
    is_main_process, peer_lost,
)
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
    (every rank takes part in gathering it when the model is sharded), with the model config
    beside it as {prefix}.json so that the scripts need no shape flags."""
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
    except UserError as exc:
        fail(str(exc))
    env = init_distributed_mode(args.device, args.local_rank, args.dist_timeout)
    try:
        exit_code = train(args, env)
    except (UserError, DataError) as exc:
        fail(str(exc))
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


def resume(args, prefix, config, model, optimizer, scaler, plan, env):
    """Load the newest usable checkpoint into the model, optimizer and scaler.
    Returns (start_step, tokens_seen, wandb_run_id), or None with no checkpoint."""
    state = load_latest_checkpoint(args.checkpoint_dir, prefix, config.to_dict())
    if state is None:
        return None
    restore_model_and_optimizer(state, model, optimizer)
    scaler.load_state_dict(state["scaler"])
    if state["world_size"] == env.world_size:
        restore_rng_state(state["rng"][env.rank])
    # Samples already consumed in the saved epoch, re-expressed in this run's step size.
    step_in_epoch = resume_step(state["step_in_epoch"], state["samples_per_step"], plan.samples_per_step)
    start_step = state["epoch"] * plan.steps_per_epoch + step_in_epoch
    if state["samples_per_step"] != plan.samples_per_step:
        Logger(f"resume: world size {state['world_size']} -> {env.world_size}, step {state['step_in_epoch']} -> "
               f"{step_in_epoch} of epoch {state['epoch']} (step * {state['samples_per_step']} samples "
               f"// {plan.samples_per_step} samples per step)")
    Logger(f"resumed from {state['path']} at step {start_step}/{plan.total_steps}")
    return start_step, state["tokens_seen"], state.get("wandb_run_id")


def train(args, env) -> int:
    # ------------------------------------------------------------------ 1. settings
    dtype_name, why = detect_dtype(args.dtype, env.device, sharded=args.parallel == "fsdp" and env.distributed)
    Logger(f"dtype: {dtype_name} ({why})")
    optimizer_name, why = detect_optimizer(args.optimizer, env.device, args.param_groups)
    Logger(f"optimizer: {optimizer_name} ({why})")
    # The resolved names from here on.
    args = argparse.Namespace(**{**vars(args), "dtype": dtype_name, "optimizer": optimizer_name})
    dtype = getattr(torch, dtype_name)
    configure_cuda(env.device, dtype)
    device_type = "cuda" if env.device.startswith("cuda") else "cpu"
    autocast = nullcontext() if dtype == torch.float32 else torch.autocast(device_type, dtype=dtype)
    world_size, rank = env.world_size, env.rank
    sharded = args.parallel == "fsdp" and env.distributed
    check_output_dirs(args.save_dir, args.checkpoint_dir, sharded)

    # ------------------------------------------------------------------ 2. tokenizer, model config, data
    tokenizer = load_tokenizer(args.tokenizer_path)
    config = model_config_from_args(args, args.vocab_size)
    check_model_fits(args, tokenizer, config)
    ensure_data(args, env.local_rank)
    data = build_data(args, tokenizer, config.vocab_size)
    plan = plan_steps(args, len(data.train), world_size)
    total_steps = plan.total_steps

    # ------------------------------------------------------------------ 3. model, parallelism, optimizer
    # The same initial weights on every rank: FSDP shards them as they are, with no
    # broadcast from rank 0 as DDP does. Per-rank streams (dropout) are seeded after.
    setup_seed(args.seed)
    model = init_model(config, args.from_weight, env.device)
    setup_seed(args.seed + rank)
    active_params = count_parameters(model)[1]
    net = wrap_model(model, args, env)  # FSDP shards `model` in place, so the optimizer comes after
    optim_config = OptimConfig.from_args(args)
    optimizer, peaks = build_optimizer(model, optim_config), peak_lrs(optim_config)
    Logger(describe(optimizer, peaks))
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)

    # ------------------------------------------------------------------ 4. resume
    prefix = run_prefix(args.save_weight, config.hidden_size, config.use_moe)
    start_step, tokens_seen, wandb_id = 0, 0, None
    resumed = resume(args, prefix, config, model, optimizer, scaler, plan, env) if args.from_resume else None
    if resumed:
        start_step, tokens_seen, wandb_id = resumed
        if start_step >= total_steps:
            # Saving now would re-label the checkpoint in this run's step units; leave it be.
            Logger(f"nothing left to train: the checkpoint is at step {start_step} of {total_steps} "
                   f"(raise --max_steps or --epochs to train further)")
            return 0

    # ------------------------------------------------------------------ 5. loaders, logging
    pin = device_type == "cuda"
    sampler = ResumableDistributedSampler(data.train, world_size, rank, seed=args.seed)
    loader = make_train_loader(data.train, sampler, args, pin)
    val_loader = make_val_loader(data.val, args, rank, world_size, pin) if data.val is not None else None
    byte_lengths = token_byte_lengths(tokenizer, config.vocab_size).to(env.device)
    log = RunLogger(args, prefix, is_main_process(), start_step, total_steps, wandb_id, env.device)
    saves = SaveSchedule(args.save_interval, args.save_every_minutes, args.log_interval, env.device)
    preempt = PreemptionFlag()
    preempt.install()
    throughput = Throughput(plan.samples_per_step * args.max_seq_len, env.device)
    peak = device_peak_flops(env.device, args.peak_tflops)
    flops_token = flops_per_token(config, active_params, args.max_seq_len)
    epochs = math.ceil(total_steps / plan.steps_per_epoch)
    Logger(f"world_size={world_size} micro_batch={args.batch_size} accumulation={plan.accumulation_steps} "
           f"global_batch={plan.samples_per_step} steps/epoch={plan.steps_per_epoch} total_steps={total_steps} "
           f"dtype={args.dtype} device={env.device} parallel={args.parallel if env.distributed else 'none'}")

    def checkpoint(step):
        # A checkpoint of NaNs would push a good one out of the rotation: refuse to write it.
        if not weights_finite(model):
            raise RuntimeError("model weights are not finite; refusing to save a checkpoint")
        save_weights(model, args, prefix)
        epoch, step_in_epoch = divmod(step, plan.steps_per_epoch)
        save_checkpoint({
            "scaler": scaler.state_dict(), "global_step": step, "epoch": epoch, "step_in_epoch": step_in_epoch,
            "samples_per_step": plan.samples_per_step, "world_size": world_size, "tokens_seen": tokens_seen,
            "wandb_run_id": log.wandb_run_id, "model_config": config.to_dict(),
        }, model, optimizer, args.checkpoint_dir, prefix, args.keep_last, sharded)
        saves.saved()

    # ------------------------------------------------------------------ 6. train
    global_step, bad_steps = start_step, 0
    totals, read_at_step = StepTotals(env.device), start_step
    tokens_known = data.labels_are_shifted  # packed windows: no padding, every position is a target
    while global_step < total_steps:
        epoch, step_in_epoch = divmod(global_step, plan.steps_per_epoch)
        sampler.set_epoch(epoch)
        sampler.set_start(step_in_epoch * args.batch_size * plan.accumulation_steps)
        batches = iter(loader)
        for _ in range(step_in_epoch, min(plan.steps_per_epoch, step_in_epoch + total_steps - global_step)):
            inject_crash(global_step, rank)
            lrs = set_lr(optimizer, peaks, global_step, total_steps, args.warmup_steps)
            micro_batches = [next(batches) for _ in range(plan.accumulation_steps)]
            result = optimizer_step(
                net, optimizer, scaler, micro_batches, args, env, data.labels_are_shifted, autocast,
                poison=inject_nan(global_step, rank), preempt_requested=preempt.requested,
                bos_id=tokenizer.bos_token_id, tokens_known=tokens_known,
            )
            if global_step == start_step:
                weights_mib, optimizer_mib = local_state_mib(model, optimizer)
                Logger(f"state per rank: weights {weights_mib:,.0f} MiB, optimizer {optimizer_mib:,.0f} MiB")
            global_step += 1
            totals.add(result)
            log.step_done()
            bad_steps = bad_steps + 1 if result.skipped else 0
            if result.skipped:
                Logger(f"step {global_step}: non-finite loss or gradient norm on some rank; update skipped "
                       f"({bad_steps}/{args.max_bad_steps} in a row)")
                if bad_steps >= args.max_bad_steps:
                    raise UserError(f"{bad_steps} consecutive non-finite steps (--max_bad_steps {args.max_bad_steps}); "
                                    f"lower --learning_rate or check the data; the last good checkpoint is kept")

            last, stop = global_step == total_steps, result.stop
            log_now = global_step % args.log_interval == 0 or last
            eval_now = val_loader is not None and (
                last or (args.eval_interval and global_step % args.eval_interval == 0))
            save_now = saves.due(global_step) or last or stop  # due() first: every rank calls it every step
            if log_now or eval_now or save_now:  # steps that read the device anyway
                new_tokens = totals.take_tokens()
                tokens_seen += new_tokens
                throughput.add(new_tokens, steps=global_step - read_at_step)
                read_at_step = global_step
            if log_now:
                loss, aux = totals.take_window()
                tok_s, real_tok_s = throughput.report()
                mfu = flops_token * tok_s / world_size / peak if peak else None
                log.log_train(global_step, epoch, epochs, loss, aux, lrs, tokens_seen, tok_s, real_tok_s, mfu)
            with throughput.paused(eval_now or save_now):  # tokens/s and MFU count training time only
                if eval_now:
                    with log.untimed():
                        val_loss, val_bpb = evaluate(net, val_loader, autocast, env.device,
                                                     data.val_labels_are_shifted, byte_lengths)
                    log.log_val(global_step, tokens_seen, val_loss, val_bpb)
                if save_now:
                    checkpoint(global_step)
            if stop:
                Logger(f"preempted: saved step {global_step} to {args.checkpoint_dir}; resume with --from_resume 1")
                log.close()
                return 128 + (preempt.signum or 15)
    log.close()
    Logger(f"done: {global_step} steps, {tokens_seen:,} tokens; weights in {args.save_dir}/{prefix}.pth")
    return 0


@dataclass
class StepResult:
    stats: torch.Tensor  # on the device, summed over ranks: (loss x tokens, aux loss, tokens)
    skipped: bool  # a non-finite loss or gradient norm on some rank: no update was made
    stop: bool  # some rank was asked to stop (preemption)

    def mean_loss(self) -> float:
        return (self.stats[0] / self.stats[2]).item()


def optimizer_step(net, optimizer, scaler, micro_batches, args, env, shifted, autocast, poison,
                   preempt_requested, bos_id, tokens_known=False) -> StepResult:
    """Forward/backward over the micro-batches and one optimizer update.

    Every token of the global batch weighs the same: each micro-batch's summed loss
    is divided by the batch's token count over all ranks (DDP then averages the
    ranks' gradients, hence the world_size factor). With padding, the per-micro-batch
    mean of the seed would weigh short documents more, and differently per world size.
    `tokens_known`: every target is real (packed windows), so the count needs no all-reduce.

    The host reads the device once, for the skip/stop decision agreed by all ranks: on a
    GPU every read waits for the queued work to finish, so the next step cannot be queued.
    """
    device, accum = env.device, len(micro_batches)
    batches = [(x.to(device, non_blocking=True), to_targets(y, shifted).to(device, non_blocking=True))
               for x, y in micro_batches]
    if tokens_known:
        # torch.full fills on the device; torch.tensor(x, device=...) would be a blocking copy.
        tokens = torch.full((), sum(t.numel() for _, t in batches) * env.world_size, dtype=torch.float64,
                            device=device)
    else:
        tokens = all_reduce_sum(sum((t != -100).sum() for _, t in batches).double())
    per_rank_tokens = (tokens / env.world_size).float()
    loss_sum = torch.zeros((), device=device)
    aux_sum = torch.zeros((), device=device)
    for i, (x, targets) in enumerate(batches):
        # Only the last micro-batch all-reduces gradients; the others accumulate locally.
        with gradient_sync(net, enabled=i == accum - 1):
            with autocast:
                mask = document_causal_mask(x, bos_id) if args.doc_mask else None
                out = net(x, attention_mask=mask, shift_labels=targets, num_items_in_batch=per_rank_tokens)
                loss = out.loss + out.aux_loss / accum
                if poison:
                    loss = loss * float("nan")
            scaler.scale(loss).backward()
        loss_sum += out.loss.detach().float() * per_rank_tokens
        aux_sum += out.aux_loss.detach().float() / accum

    scaler.unscale_(optimizer)
    grad_norm = as_local_scalar(
        torch.nn.utils.clip_grad_norm_(net.parameters(), args.grad_clip if args.grad_clip > 0 else math.inf))
    # Under fp16 the GradScaler owns inf gradients: it skips the step and lowers its scale.
    bad_grad = torch.zeros((), device=device) if scaler.is_enabled() else (~torch.isfinite(grad_norm)).float()
    # One collective carries every per-step agreement: the loss for logging, a non-finite
    # loss or gradient norm on any rank, and a preemption request seen by any rank.
    flags = torch.stack([loss_sum, aux_sum, (~torch.isfinite(loss_sum)).float(), bad_grad.to(loss_sum.dtype),
                         torch.full((), float(preempt_requested), device=device)])
    all_reduce_sum(flags)
    bad_loss, bad_grad, stop = read_flags(flags[2:])
    skipped = bad_loss or bad_grad
    if not skipped:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(torch.stack([flags[0].double(), flags[1].double() / env.world_size, tokens]), skipped, stop)


def read_flags(flags: torch.Tensor) -> list[bool]:
    """flags > 0, read off the device in ONE host sync (as the bits of one integer)."""
    bits = (flags > 0).long() << torch.arange(len(flags), device=flags.device)
    code = int(bits.sum().item())
    return [bool(code >> i & 1) for i in range(len(flags))]


class StepTotals:
    """Per-step figures summed on the device and read by the host only when it logs or
    saves anyway, so that ordinary steps stay free of device-to-host reads."""

    def __init__(self, device):
        self.window = torch.zeros(3, dtype=torch.float64, device=device)  # StepResult.stats summed over updates
        self.updates = 0
        self.tokens = torch.zeros((), dtype=torch.float64, device=device)  # every step's, since the last read

    def add(self, result: StepResult):
        self.tokens += result.stats[2]
        if not result.skipped:  # a skipped step's NaN loss would hide the others' in the mean
            self.window += result.stats
            self.updates += 1

    def take_tokens(self) -> int:
        tokens = int(self.tokens.item())
        self.tokens.zero_()
        return tokens

    def take_window(self) -> tuple[float, float]:
        """(token-weighted mean loss, mean aux loss) over the updates since the last call."""
        loss_x_tokens, aux, tokens = self.window.tolist()
        updates, self.updates = self.updates, 0
        self.window.zero_()
        if not updates:
            return math.nan, math.nan
        return loss_x_tokens / tokens, aux / updates


if __name__ == "__main__":
    main()

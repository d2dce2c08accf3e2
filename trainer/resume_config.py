"""The config a run trains with (settle_config): a resume's stored config merged in by one rule,
every auto decided (trainer/auto.py), and the whole checked, before any work.

The rule (resume_config): the run's groups come from the checkpoint's stored config, and a flag
typed on this command line changes them, except that a typed value the checkpoint's state
contradicts (trainer/config.py's FIXED: the model's shape, the optimizer's layout, the shape of the
schedule) stops the run. The launch's groups (LAUNCH_GROUPS) are always this command line's: they
say where the checkpoint lies and what machine the run is on.
"""
from common.errors import UserError
from trainer.auto import resolve_auto
from trainer.checkpoint import newest_record
from trainer.config import FIXED, GROUP_OF, LAUNCH_GROUPS, MODEL_SHAPE_FLAGS, TrainConfig, check_config, run_prefix
from trainer.distributed import Logger
from trainer.optim import NS_STEPS
from trainer.train_state import global_batch
from trainer.trainer_utils import initial_weights, model_config


def resume_config(cfg: TrainConfig, typed: frozenset, stored: dict, source: str = "the checkpoint") -> tuple:
    """The config a resume trains with, and where each flag's value came from ("typed",
    "stored" or "default"). `stored`: the checkpoint's record of its config, {group: {flag:
    value}} (a record written before configs were stored holds only its optimizer's entries);
    `source`: that checkpoint, for the error line.

    The run's groups take the stored values, but for the flags typed here; "auto" typed is
    no value and leaves the stored one. A typed value in FIXED that the checkpoint contradicts
    stops the run. The launch's groups are this command line's."""
    values, origin, flags = {}, {}, cfg.flags()
    for group, entries in stored.items():
        for name, was in entries.items():
            if group in LAUNCH_GROUPS or GROUP_OF.get(name) != group:
                continue
            was = tuple(was) if isinstance(was, list) else was
            now = flags[name]
            if name in typed and now != "auto":
                if name in FIXED and now != was:
                    raise UserError(f"--{name} {now}: {source} this run resumes trained with --{name} {was}; "
                                    f"pass that (or leave the flag out), or start anew")
                origin[name] = "typed"
                continue
            values[name], origin[name] = was, "stored"
    for name in typed:
        origin.setdefault(name, "typed")
    return cfg.replace(**values), origin


# What a record that does not name these flags trained with: torch.optim.Muon's Newton-Schulz steps
# (before --muon_ns_steps), and AdamW's betas before --adam_betas auto (fixed at 0.9,0.95, then the default).
EARLIER_VALUES = {"muon_ns_steps": NS_STEPS, "adam_betas": (0.9, 0.95)}


def legacy_record(record: dict) -> dict:
    """The stored config of a checkpoint record: a whole config, or what an earlier version's
    record named of the run (its optimizer, schedule, NorMuon and Muon lr). A record written
    before --muon_ns_steps trained with torch.optim.Muon's 5 Newton-Schulz steps, and one without
    AdamW's betas with 0.9,0.95, their default before --adam_betas auto."""
    if isinstance(record.get("config"), dict):
        stored = record["config"]
    else:
        recorded = {k: record[k] for k in ("optimizer", "lr_schedule", "normuon", "muon_lr") if k in record}
        stored = {"optim": recorded} if recorded else {}
    optim = stored.get("optim")
    if not optim:
        return stored
    missing = {name: value for name, value in EARLIER_VALUES.items() if name not in optim}
    return {**stored, "optim": {**optim, **missing}} if missing else stored


def max_steps_in_this_step_size(cfg: TrainConfig, saved_step_size, step_size: int) -> TrainConfig:
    """A checkpoint's --max_steps counts its steps; where this run's steps hold another number of
    samples (another world size, batch or accumulation), the same samples in this run's steps, as
    the step the checkpoint reached is (TrainState). A --max_steps typed again counts this run's."""
    if not cfg.optim.max_steps or not isinstance(saved_step_size, int) or saved_step_size == step_size:
        return cfg
    max_steps = max(1, cfg.optim.max_steps * saved_step_size // step_size)
    Logger(f"resume: --max_steps {cfg.optim.max_steps} (the checkpoint's, in steps of {saved_step_size} samples) is "
           f"{max_steps} steps of {step_size} here")
    return cfg.replace(max_steps=max_steps)


def check_initial_weights_there(cfg: TrainConfig, lm_config):
    """A --from_resume run with no checkpoint to resume starts from --from_weight, which must be
    there. Where that file had given a run its shape, the shape also named its checkpoints: gone, it
    leaves them unfound (pretrain_768 looked for, pretrain_64 written), which the line says."""
    if cfg.model.from_weight.lower() == "none" or initial_weights(cfg, must_exist=False) is not None:
        return
    prefix = run_prefix(cfg.output.save_weight, lm_config.hidden_size, lm_config.use_moe)
    raise UserError(f"--from_weight {cfg.model.from_weight}: not there, and --checkpoint_dir "
                    f"{cfg.output.checkpoint_dir} holds no checkpoint of {prefix} to resume: where that file gave the "
                    f"run its shape, pass the shape flags (--hidden_size, ...), which name its checkpoints; else pass "
                    f"weights that exist")


def settle_config(cfg: TrainConfig, typed: frozenset, env) -> tuple:
    """(the config the run trains with, its model's MiniMindConfig, whether it resumes a checkpoint):
    a resume's stored values merged in (trainer/resume_config.py), every auto decided
    (trainer/auto.py), and the whole checked, before any work. Every rank reads the same record (a
    broadcast) and decides alike, so a bad combination stops every rank with the same line. A
    resume's weights are its checkpoint's: the --from_weight file then need not be there any more."""
    resuming = False
    lm_config = model_config(cfg, typed, need_weights=not cfg.output.from_resume)
    origin = dict.fromkeys(typed, "typed")
    if cfg.output.from_resume:  # the same flag on every rank: all join newest_record()'s broadcast, or none does
        prefix = run_prefix(cfg.output.save_weight, lm_config.hidden_size, lm_config.use_moe)
        record = newest_record(cfg.output.checkpoint_dir, prefix)
        resuming = bool(record)  # a checkpoint is there: it resumes, or the run stops (none usable)
        cfg, origin = resume_config(cfg, typed, legacy_record(record), f"checkpoint {record.get('path')}")
        lm_config = model_config(cfg, typed, need_weights=not resuming)
        if origin.get("max_steps") == "stored":
            cfg = max_steps_in_this_step_size(cfg, record.get("samples_per_step"), global_batch(cfg.optim,
                                                                                              env.world_size))
    if cfg.output.from_resume and not resuming:
        check_initial_weights_there(cfg, lm_config)
    # The shape flags say the model's shape, which a --from_weight's stored config decides where not
    # typed: the checkpoint's record and wandb then hold the shape trained, and a resume may type it.
    cfg = cfg.replace(**{name: int(getattr(lm_config, name)) for name in MODEL_SHAPE_FLAGS})
    sharded = cfg.system.parallel == "fsdp" and env.distributed
    if "accumulation_steps" in typed and cfg.optim.global_batch_size:  # not an error: an elastic restart reruns it
        Logger(f"warning: --accumulation_steps {cfg.optim.accumulation_steps} is left aside: --global_batch_size "
               f"{cfg.optim.global_batch_size} decides the micro-batches per step at each world size")
    tokens_per_step = global_batch(cfg.optim, env.world_size) * cfg.model.max_seq_len
    cfg = resolve_auto(cfg, origin, env.device, sharded, lm_config, tokens_per_step)
    check_config(cfg, cuda=env.device.type == "cuda")
    return cfg, lm_config, resuming

"""The one rule a resume follows for its config: the run's groups come from the checkpoint's
stored config, and a flag typed on this command line changes them, except that a typed value the
checkpoint's state contradicts (trainer/config.py's FIXED: the model's shape, the optimizer's
layout, the shape of the schedule) stops the run. The launch's groups (LAUNCH_GROUPS) are always
this command line's: they say where the checkpoint lies and what machine the run is on.
"""
from common.errors import UserError
from trainer.config import FIXED, GROUP_OF, LAUNCH_GROUPS, TrainConfig
from trainer.optim import NS_STEPS


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


def legacy_record(record: dict) -> dict:
    """The stored config of a checkpoint record: a whole config, or what an earlier version's
    record named of the run (its optimizer, schedule, NorMuon and Muon lr). A record written
    before --muon_ns_steps trained with torch.optim.Muon's 5 Newton-Schulz steps."""
    if isinstance(record.get("config"), dict):
        stored = record["config"]
    else:
        recorded = {k: record[k] for k in ("optimizer", "lr_schedule", "normuon", "muon_lr") if k in record}
        stored = {"optim": recorded} if recorded else {}
    optim = stored.get("optim")
    if optim and "muon_ns_steps" not in optim:
        stored = {**stored, "optim": {**optim, "muon_ns_steps": NS_STEPS}}
    return stored

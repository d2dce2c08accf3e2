"""The flag reference of trainer/train_pretrain.py, and what trainer/train_full_sft.py changes,
generated from the config's fields (trainer/config.py), so that the documentation cannot drift
from --help:

    python scripts/dev/flags_table.py > docs/flags.md     # tests/test_docs.py fails when they differ
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trainer.config import LAUNCH_GROUPS, MINIMIND_FLAGS, shown, stage_fields  # noqa: E402
from trainer.train_full_sft import SFT  # noqa: E402

GROUP_TITLES = {"output": "output: files, saving, logging, resuming", "optim": "optim: batch, optimizer, schedule",
                "model": "model", "data": "data and validation", "system": "system: device, precision, parallelism",
                "chat": "chat"}


def default_text(value) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return shown(value)


def cell(text: str) -> str:
    return text.replace("%%", "%").replace("|", "\\|")


def table() -> str:
    lines = ["# Flags of trainer/train_pretrain.py", "",
             "Generated from the config's fields (trainer/config.py) by `python scripts/dev/flags_table.py > "
             "docs/flags.md` (a test fails when the two differ); `python trainer/train_pretrain.py --help` says "
             "the same. The flags marked in the MiniMind column are MiniMind's own, with its names and meanings. "
             "On `--from_resume 1` the flags of the optim, model, data and chat groups are the checkpoint's "
             "unless typed again; those of the output and system groups are always this launch's.", ""]
    group = None
    for name, f, default in stage_fields():
        if f.metadata["help"] == argparse.SUPPRESS:
            continue
        if name != group:
            group = name
            scope = "this launch's" if name in LAUNCH_GROUPS else "the run's: a resume keeps the checkpoint's"
            lines += ([""] if len(lines) > 6 else []) + [f"## {GROUP_TITLES[name]} ({scope})", "",
                                                          "| flag | default | MiniMind | meaning |", "|---|---|---|---|"]
        choices = f" (one of {', '.join(map(str, f.metadata['choices']))})" if f.metadata["choices"] else ""
        minimind = "yes" if f.name in MINIMIND_FLAGS else ""
        lines.append(f"| `--{f.name}` | {default_text(default)} | {minimind} | {cell(f.metadata['help'])}{choices} |")
    return "\n".join(lines + [""] + sft_section())


def sft_section() -> list[str]:
    """train_full_sft.py: the same flags, but for the defaults it changes and the flags it adds."""
    before = {f.name: default for _, f, default in stage_fields()}
    lines = ["## trainer/train_full_sft.py", "",
             "Supervised fine-tuning takes every flag above, with these defaults changed (MiniMind's "
             "`train_full_sft.py` defaults but for the learning rates, docs/sft.md) and these flags added.", "",
             "| flag | default | pre-training's | meaning |", "|---|---|---|---|"]
    for _, f, default in stage_fields(SFT):
        help_text = SFT.help.get(f.name, f.metadata["help"])
        if f.name in before and (before[f.name], f.metadata["help"]) == (default, help_text):
            continue
        was = default_text(before[f.name]) if f.name in before else "(fine-tuning only)"
        lines.append(f"| `--{f.name}` | {default_text(default)} | {was} | {cell(help_text)} |")
    return lines + [""]


if __name__ == "__main__":
    print(table())

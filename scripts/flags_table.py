"""The flag reference of trainer/train_pretrain.py, and what trainer/train_full_sft.py changes,
generated from their parsers, so that the documentation cannot drift from --help:

    python scripts/flags_table.py > docs/flags.md     # tests/test_docs.py fails when they differ
"""
import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.args import MINIMIND_FLAGS, build_parser  # noqa: E402
from trainer.train_full_sft import SFT  # noqa: E402


def default_text(action, repo_root: str) -> str:
    if action.default is None or action.default is argparse.SUPPRESS:
        return ""
    if isinstance(action.default, bool):
        return "off" if not action.default else "on"
    if isinstance(action.default, tuple):
        return ",".join(f"{v:g}" for v in action.default)
    text = str(action.default)
    return text.replace(repo_root, "<repo>")  # machine-independent


def table() -> str:
    from trainer.args import REPO_ROOT

    parser = build_parser()
    lines = ["# Flags of trainer/train_pretrain.py", "",
             "Generated from the parser by `python scripts/flags_table.py > docs/flags.md` (a test fails "
             "when the two differ); `python trainer/train_pretrain.py --help` says the same. The flags "
             "marked in the MiniMind column are MiniMind's own, with its names and meanings.", ""]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.help is not argparse.SUPPRESS and a.option_strings]
        if not actions or group.title in ("options", "optional arguments"):
            continue  # argparse's own group: --help
        lines += [f"## {group.title}", "", "| flag | default | MiniMind | meaning |", "|---|---|---|---|"]
        for action in actions:
            flag = action.option_strings[0]
            choices = f" (one of {', '.join(map(str, action.choices))})" if action.choices else ""
            minimind = "yes" if flag.lstrip("-") in MINIMIND_FLAGS else ""
            help_text = (action.help or "").replace("%%", "%").replace("|", "\\|")
            lines.append(f"| `{flag}` | {default_text(action, str(REPO_ROOT))} | {minimind} | {help_text}{choices} |")
        lines.append("")
    return "\n".join(lines + sft_section(parser))


def sft_section(pretrain) -> list[str]:
    """train_full_sft.py: the same flags, but for the defaults it changes and the flags it adds."""
    from trainer.args import REPO_ROOT

    sft = build_parser(SFT)
    before = {a.dest: a for a in pretrain._actions}
    lines = ["## trainer/train_full_sft.py", "",
             "Supervised fine-tuning takes every flag above, with these defaults changed (MiniMind's "
             "`train_full_sft.py` defaults but for the learning rates, docs/sft.md) and these flags added.", "",
             "| flag | default | pre-training's | meaning |", "|---|---|---|---|"]
    for action in sft._actions:
        old = before.get(action.dest)
        if not action.option_strings or (old is not None and (old.default, old.help) == (action.default, action.help)):
            continue
        was = default_text(old, str(REPO_ROOT)) if old is not None else "(fine-tuning only)"
        help_text = (action.help or "").replace("%%", "%").replace("|", "\\|")
        lines.append(f"| `{action.option_strings[0]}` | {default_text(action, str(REPO_ROOT))} | {was} | {help_text} |")
    return lines + [""]


if __name__ == "__main__":
    print(table())

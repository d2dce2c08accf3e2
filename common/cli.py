"""The argument parser every script shares (a bad flag gets one line, not a usage dump), and
the types and checks of the trainer's flags, which trainer/config.py declares as fields.

Free of heavy imports, so that light scripts (plot_loss.py) stay quick to start.
"""
import argparse
import math
import sys
from dataclasses import field

from common.errors import say_error


class OneLineArgumentParser(argparse.ArgumentParser):
    """An unknown flag or a bad value gets one line naming it instead of the whole usage
    (which under torchrun every rank would print); --help still shows the usage."""

    def error(self, message):
        say_error(f"{self.prog}: error: {message} (see --help)")
        sys.exit(2)


# ---------------------------------------------------------------------------- flag types and checks
# A type parses the text argparse is given; a check takes the parsed value and returns None, or
# what is wrong with it (trainer/config.py's check_config names the flag).
def auto_or(number):
    """The argparse type of a flag that is "auto" or a number."""
    def parse(text: str):
        if text == "auto":
            return text
        try:
            return number(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected auto or a number, got {text!r}") from None
    return parse


def adam_betas(text: str) -> tuple[float, float]:
    """--adam_betas: 'B1,B2' with 0 <= B1, B2 < 1."""
    try:
        betas = tuple(float(part) for part in text.split(","))
    except ValueError:
        betas = ()
    if len(betas) != 2 or not all(0 <= b < 1 for b in betas):
        raise argparse.ArgumentTypeError(f"expected two numbers in [0, 1) as B1,B2 (e.g. 0.9,0.95), got {text!r}")
    return betas


def step_window(text: str) -> tuple[int, int]:
    """--profile_steps: 'A:B' -> (A, B), 1 <= A <= B."""
    first, sep, last = text.partition(":")
    if sep and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last):
        return int(first), int(last)
    raise argparse.ArgumentTypeError(f"expected A:B with 1 <= A <= B (optimizer steps, e.g. 10:12), got {text!r}")


def at_least(low: int):
    return lambda v: None if v >= low else f"must be at least {low}, got {v}"


def number_from(low: float, meaning: str, *, strict: bool = False):
    """A finite number at or (strict) above `low`; "auto" passes (resolved later)."""
    def check(v):
        if v == "auto" or (math.isfinite(v) and (v > low if strict else v >= low)):
            return None
        return f"must be a finite number {'above' if strict else 'at least'} {low:g} ({meaning}), got {v}"
    return check


def share(meaning: str, *, one: bool = True):
    top = "]" if one else ")"
    return lambda v: None if 0 <= v < 1 or (one and v == 1) else f"must be in [0, 1{top} ({meaning}), got {v}"


def flag(default, help: str, *, type=None, choices=None, check=None):
    """A config field that is a flag: its default, its --help, its argparse type and choices, its check."""
    return field(default=default, metadata={"help": help, "type": type, "choices": choices, "check": check})

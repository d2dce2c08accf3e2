"""The argument parser every script shares: a bad flag gets one line, not a usage dump.

Free of heavy imports, so that light scripts (plot_loss.py) stay quick to start.
"""
import argparse
import sys


class OneLineArgumentParser(argparse.ArgumentParser):
    """An unknown flag or a bad value gets one line naming it instead of the whole usage
    (which under torchrun every rank would print); --help still shows the usage."""

    def error(self, message):
        print(f"{self.prog}: error: {message} (see --help)", file=sys.stderr)
        sys.exit(2)

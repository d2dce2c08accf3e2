"""The documentation tells the truth about the code it describes: the flag reference is the
parser's own text, the README names MiniMind's flags and stays a short path for a user, and
every file the README and docs/ link to exists."""
import re

from scripts.dev.flags_table import table
from tests.support import REPO_ROOT
from trainer.config import MINIMIND_FLAGS, build_parser
from trainer.train_full_sft import SFT

README = (REPO_ROOT / "README.md").read_text()
DOCS = {path: path.read_text() for path in sorted((REPO_ROOT / "docs").glob("*.md"))}


def test_the_flag_reference_is_generated_from_the_parser():
    assert (REPO_ROOT / "docs" / "flags.md").read_text() == table() + "\n", \
        "docs/flags.md is stale: run python scripts/dev/flags_table.py > docs/flags.md"
    documented = set(re.findall(r"^\| `(--[\w-]+)`", DOCS[REPO_ROOT / "docs" / "flags.md"], re.M))
    parsed = {a.option_strings[0] for stage in (None, SFT) for a in build_parser(stage)._actions
              if a.option_strings and a.help != "==SUPPRESS=="}
    assert documented == parsed - {"-h"}


def test_the_readme_names_minimind_s_flags_and_stays_short():
    assert len(MINIMIND_FLAGS) == 22
    missing = [flag for flag in MINIMIND_FLAGS if f"--{flag}" not in README]
    assert not missing, missing
    # A guard against the README growing into the docs, with room to write clearly: not today's length.
    assert len(README.splitlines()) <= 360


def test_the_pages_of_figures_stay_within_their_bounds():
    """The design and one table of today's figures each, not a notebook of every run (a bound with room)."""
    for name in ("performance.md", "time-to-quality.md"):
        assert len(DOCS[REPO_ROOT / "docs" / name].splitlines()) <= 300, name


def test_every_linked_file_exists():
    for path, text in [(REPO_ROOT / "README.md", README), *DOCS.items()]:
        for target in re.findall(r"\]\((?!https?://|#)([^)#]+)", text):
            assert (path.parent / target).exists(), f"{path.name} links to {target}, which does not exist"


def test_no_placeholder_is_left_unfilled():
    for path, text in [(REPO_ROOT / "README.md", README), *DOCS.items()]:
        prose = re.sub(r"```.*?```", "", text, flags=re.S)  # a code block's {{ }} is a template's (Ollama's)
        left = re.findall(r"\{\{[^{}]*\}\}", prose)
        assert not left, f"{path.name} still holds {left}: fill them with measured figures"

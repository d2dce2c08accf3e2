"""Fixtures shared by the test modules. Shared plain functions (launching the trainer,
tiny models) live in tests/launch_utils.py, which the modules import; no test module
imports another."""
import pytest

from tests.fault_helpers import SharedRuns
from tests.launch_utils import REPO_ROOT, build_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir():
    """The committed tokenizer's folder (model/)."""
    return REPO_ROOT / "model"


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory):
    """build_tokenizer's 6400-id BPE, built once for the whole session."""
    return build_tokenizer(tmp_path_factory.mktemp("tiny_tokenizer"))


@pytest.fixture(scope="session")
def shared_runs(tmp_path_factory):
    """Call it with {name: (nproc, args)}: fault_helpers.SharedRuns."""
    return SharedRuns(tmp_path_factory)

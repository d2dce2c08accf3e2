"""Fixtures shared by the test modules, and the order the files run in. Shared plain
functions live in modules the tests import: jobs.py (running the trainer, the one way),
forked_ranks.py, tiny.py (tiny runs and models), run_outputs.py, assertions.py,
host_reads.py and fault_injection.py, in tests/support/; no test module imports another."""
import pytest

from tests.support import REPO_ROOT
from tests.support.fault_injection import SmallDisk
from tests.support.jobs import SharedRuns
from tests.support.tiny import build_tokenizer, ensure_demo_corpus


# The files that take longest, longest first, by their tests' time in `-n 3 --durations` runs on 2 cores
# (test_storage.py about 80 s, test_serve.py 47 s and test_web_demo.py 37 s, test_imports_and_bounds.py 20 s;
# test_slurm.py about 85 s where SLURM installs).
# With -n, pytest-xdist hands whole files to the workers in collection order (pytest.ini), so a long file
# collected last would run alone at the end while the other workers sit idle.
LONGEST_FIRST = ("test_quickstart.py", "test_fault_tolerance.py", "test_elastic.py", "test_slurm.py",
                 "test_storage.py", "test_serve.py", "test_web_demo.py", "test_launch.py", "test_compile.py",
                 "test_sft.py", "test_downstream.py", "test_node_local_disks.py", "test_convert.py", "test_gguf.py",
                 "test_clean_shutdown.py", "test_bad_input.py", "test_untrusted_input.py", "test_muon.py",
                 "test_shards.py", "test_scaling.py", "test_imports_and_bounds.py", "test_config.py")


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest keep their order


@pytest.fixture(scope="session", autouse=True)
def demo_corpus():
    """The trainer's default corpus, built before the first test of every pytest-xdist worker
    (under tests/support/tiny.py's lock, so once). A launched or forked rank that found it missing would
    build it inside its job, and on a loaded machine that outlasts the tiny runs'
    --dist_timeout of 60 s: rank 1's barrier then fails the job."""
    return ensure_demo_corpus()


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
    """Call it with {name: (nproc, args)}: tests/support/jobs.py's SharedRuns."""
    return SharedRuns(tmp_path_factory)


@pytest.fixture
def small_disk(tmp_path):
    """Call it with (size, name="disk") for a SmallDisk under tmp_path; each is unmounted after the test."""
    disks = []

    def make(size: int, name: str = "disk") -> SmallDisk:
        disks.append(SmallDisk(tmp_path / name, size))
        return disks[-1]
    yield make
    for disk in disks:
        disk.close()

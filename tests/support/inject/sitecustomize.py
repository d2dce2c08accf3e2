"""Run by every Python process whose PYTHONPATH starts with this folder (tests/support/fault_injection.py's
fault_env and SmallDisk put it there): installs the quota, and in a trainer's process the fault,
that its environment plans, before the trainer runs. A launcher (torchrun's agent, the legacy
launcher, srun's) trains nothing: it is spared the trainer's imports, seconds of CPU each. The
trainer's own repository comes first on the path (a node of tests/resume/test_node_local_disks.py runs
a copy of it), so the functions wrapped are the ones it runs."""
import os
import sys
from pathlib import Path

TRAINERS = ("train_pretrain.py", "train_full_sft.py")
faults = os.environ.get("MINIMIND_FAULT_AT_STEP") is not None and sys.argv[0].endswith(TRAINERS)
if faults or os.environ.get("MINIMIND_TEST_QUOTA"):
    root = Path(sys.argv[0]).resolve().parents[1] if faults else Path(__file__).resolve().parents[3]
    sys.path.insert(0, str(root))
    from tests.support.fault_injection import install_from_env

    install_from_env(faults=faults)

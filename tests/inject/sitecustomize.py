"""Run by every Python process whose PYTHONPATH starts with this folder (tests/fault_injection.py's
fault_env and SmallDisk put it there): installs the fault or quota its environment plans, before
the trainer runs."""
import os
import sys

if os.environ.get("MINIMIND_FAULT_AT_STEP") is not None or os.environ.get("MINIMIND_TEST_QUOTA"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from tests.fault_injection import install_from_env

    install_from_env()

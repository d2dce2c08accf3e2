"""What the test modules share: running the trainer every way (jobs.py, forked_ranks.py), tiny
runs and models (tiny.py), reading a run's outputs (run_outputs.py), assertions, host-read
counting, fault injection (fault_injection.py, inject/) and the workers some tests launch.
No test module imports another; they import from here."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]

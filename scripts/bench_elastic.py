"""How long an elastic torchrun job needs to go on after losing a node, per rendezvous setting.

    python scripts/bench_elastic.py [--steps 300] [--only "tuned (README)"]

Two torchrun agents on 127.0.0.1 (--nnodes=1:2, c10d rendezvous) train the tiny model;
after the first checkpoint of the group of 2, the second agent and its worker are
SIGKILLed. The table splits the survivor's recovery into phases, timed from the kill:
its worker's "lost a peer process" line, its agent seeing the failure, the new
rendezvous done, the new worker's first step after the resume.
"""
import argparse
import os
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.elastic_agents import ElasticAgent, agreed_port, wait_until  # noqa: E402

# The tiny model of the tests, on CPU: recovery time is start-up and rendezvous, not training.
TINY = ["--hidden_size", "64", "--num_hidden_layers", "2", "--max_seq_len", "64", "--batch_size", "4",
        "--num_workers", "0", "--log_interval", "1", "--val_fraction", "0", "--dist_timeout", "60",
        "--device", "cpu", "--dtype", "float32"]

CONFIGS = {
    "torchrun defaults": "",
    "tuned (README)": "join_timeout=120,last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3",
}
PHASES = [("peer lost line", r"error: lost a peer process"), ("agent sees failure", r"Worker group FAILED"),
          ("rendezvous done", r"Rendezvous complete for workers"), ("first step after resume", r"resumed from")]


def measure(port: int, conf: str, steps: int, work: Path) -> dict:
    args = [*TINY, "--max_steps", str(steps), "--save_interval", "10", "--global_batch_size", "8",
            "--from_resume", "1", "--save_dir", str(work / "out"), "--checkpoint_dir", str(work / "ckpt")]
    # One thread per process; the agent's rendezvous log lines (LOGLEVEL INFO) mark the phases.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "", "LOGLEVEL": "INFO"}
    survivor = ElasticAgent(port, args, work, env, conf)
    wait_until(lambda: survivor.first_line_after(r"Rendezvous complete", 0), 120, "first rendezvous", [survivor])
    doomed = ElasticAgent(port, args, work, env, conf)
    agents = [survivor, doomed]
    wait_until(lambda: "world_size=2" in survivor.output, 180, "group of 2", agents)
    wait_until(lambda: any((work / "ckpt").glob("*_step*.pth")), 180, "checkpoint", agents)
    killed_at = time.monotonic()
    doomed.kill_node()
    wait_until(lambda: survivor.first_line_after(r"^epoch \d+/\d+ step", survivor.first_line_after(r"resumed from", killed_at) or 1e18),
               300, "step after the resume", [survivor])
    times, since = {}, killed_at
    for name, pattern in PHASES:
        at = survivor.first_line_after(pattern, since)
        if name == "first step after resume":
            at = survivor.first_line_after(r"^epoch \d+/\d+ step", at)
        times[name], since = at - killed_at, at
    survivor.kill_node()
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--only", choices=list(CONFIGS), help="measure one setting")
    args = parser.parse_args()
    rows = {}
    for name, conf in CONFIGS.items():
        if args.only and name != args.only:
            continue
        with TemporaryDirectory() as tmp, agreed_port() as port:
            rows[name] = measure(port, conf, args.steps, Path(tmp))
            print(f"{name}: {rows[name]}", flush=True)
    print("\nseconds after the node is killed:")
    print("| --rdzv_conf | " + " | ".join(name for name, _ in PHASES) + " |")
    print("|---|" + "---|" * len(PHASES))
    for name, times in rows.items():
        print(f"| {name}: `{CONFIGS[name] or '-'}` | " + " | ".join(f"{times[p]:.1f}" for p, _ in PHASES) + " |")


if __name__ == "__main__":
    main()

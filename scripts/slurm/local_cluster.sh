#!/usr/bin/env bash
# A one-node SLURM cluster on this machine, for tests/test_slurm.py (and .ci/run).
#
#   scripts/slurm/local_cluster.sh install      # apt-get the daemons if missing (root)
#   scripts/slurm/local_cluster.sh start DIR    # munged + slurmctld + slurmd, all state in DIR
#   scripts/slurm/local_cluster.sh stop DIR     # stop the daemons started in DIR, by pid file
#
# After start, DIR/slurm.conf is the cluster's config: export SLURM_CONF=DIR/slurm.conf
# before sbatch/squeue/scontrol. Nothing is written outside DIR: its own munge key and
# socket, no cgroups (proctrack/linuxproc, task/none), so it runs in a plain container.
set -euo pipefail

PACKAGES=(slurmctld slurmd slurm-client munge)
export PATH="$PATH:/usr/sbin:/sbin"  # the daemons live there; a user PATH may lack it

install() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
        && command -v munged >/dev/null; then
        return 0
    fi
    if [ "$(id -u)" != 0 ]; then
        echo "cannot install ${PACKAGES[*]}: not root" >&2
        return 1
    fi
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq && apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

start() {
    local dir host
    dir=$(realpath -m "$1")
    host=$(hostname -s)
    mkdir -p "$dir/state" "$dir/spool" "$dir/munge"
    chmod 700 "$dir/munge"
    # munge: a 1024-byte key of our own; --force since it refuses to run as root otherwise.
    head -c 1024 /dev/urandom > "$dir/munge/munge.key"
    chmod 400 "$dir/munge/munge.key"
    munged --force --key-file="$dir/munge/munge.key" --socket="$dir/munge/munge.socket" \
        --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    # KillWait: how long a job has, after SIGTERM (scancel, requeue, time limit), before
    # SIGKILL; srun waits that long plus 2 s before a requeued job leaves the node. SLURM's
    # default is 30 s; a tiny model saves in well under a second, so 10 s keeps a requeue short.
    cat > "$dir/slurm.conf" <<CONF
ClusterName=minimind_test
SlurmctldHost=$host
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
MpiDefault=none
ReturnToService=2
KillWait=10
SchedulerParameters=sched_interval=1
NodeName=$host CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
CONF
    export SLURM_CONF="$dir/slurm.conf"
    slurmctld -i
    slurmd
    # Ready once the node is idle (slurmd registered with slurmctld).
    for _ in $(seq 60); do
        if sinfo -h -o '%T' 2>/dev/null | grep -q '^idle'; then
            return 0
        fi
        sleep 0.5
    done
    echo "the local SLURM node did not come up; sinfo says: $(sinfo -h -o '%T %E' 2>&1)" >&2
    tail -5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
    return 1
}

stop() {
    local dir pidfile pid
    dir=$(realpath -m "$1")
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid" "$dir/munge/munged.pid"; do
        [ -f "$pidfile" ] || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || continue
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -9 "$pid" 2>/dev/null || true
    done
}

case "${1:-}" in
    install) install ;;
    start) start "${2:?usage: $0 start DIR}" ;;
    stop) stop "${2:?usage: $0 stop DIR}" ;;
    *) echo "usage: $0 install | start DIR | stop DIR" >&2; exit 2 ;;
esac

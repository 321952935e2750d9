#!/usr/bin/env bash
# Best-effort single-node SLURM on a Debian CI machine (root, apt reachable, no systemd), so that
# tests/jobs/test_slurm.py can submit jobs/fourindex.sbatch for real.
#
# Contract with .ci/run: this script ALWAYS exits 0. If anything goes wrong it prints one warning
# line and stops; the SLURM test then finds no idle node and skips. A broken SLURM install must
# never fail CI. Running it again is harmless: packages, key and config are only created when
# missing, and daemons only started when not running.
#
# Layout (all standard Debian paths of slurm-wlm 22.05 / munge 0.5):
#   /etc/munge/munge.key, /etc/slurm/slurm.conf, /etc/slurm/gres.conf
#   logs: /var/log/slurm/{slurmctld,slurmd}.log   state: /var/lib/slurm/{slurmctld,slurmd}
set -Euo pipefail   # no -e: failures are handled one by one; -E: the ERR trap below reaches functions

APT_TIMEOUT=${SLURM_SETUP_APT_TIMEOUT:-600}   # seconds for apt-get update + install together
WAIT_IDLE=${SLURM_SETUP_WAIT_IDLE:-60}        # seconds to wait for the node to become idle
CPUS=4                                        # advertised CPUs: 2-4 task jobs fit on any box
MARKER="# written by chainexec .ci/slurm-setup.sh"
CONF=/etc/slurm/slurm.conf

give_up() {
    echo "slurm-setup: WARNING: $* -- no SLURM here, the SLURM tests will skip" >&2
    exit 0
}

node_idle() {
    # The single node is up and accepting work ("idle", or "mix"/"alloc" when jobs already run).
    timeout 10 sinfo -h -N -n localhost -o %t 2>/dev/null | grep -Eq '^(idle|mix|alloc)$'
}

install_packages() {
    command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null \
        && command -v sbatch >/dev/null && return 0
    command -v apt-get >/dev/null || give_up "apt-get not found (not Debian?)"
    # Maintainer scripts must not try to start daemons (no init system here): policy-rc.d 101
    # forbids it. Only remove the file if this script created it.
    local created_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d \
            && created_policy=1
    fi
    local deadline=$((SECONDS + APT_TIMEOUT)) rc=0
    export DEBIAN_FRONTEND=noninteractive
    timeout "$APT_TIMEOUT" apt-get update -q >/tmp/slurm-setup-apt.log 2>&1 || rc=$?
    if [ "$rc" = 0 ]; then
        local left=$((deadline - SECONDS))
        [ "$left" -gt 10 ] || left=10
        # slurm-wlm pulls slurmctld, slurmd, slurm-client and the basic plugins (mpi_pmi2 among them).
        timeout "$left" apt-get install -y -q --no-install-recommends slurm-wlm munge \
            >>/tmp/slurm-setup-apt.log 2>&1 || rc=$?
    fi
    [ "$created_policy" = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ "$rc" = 124 ] && give_up "apt-get ran past its ${APT_TIMEOUT}s time box (log: /tmp/slurm-setup-apt.log)"
    [ "$rc" = 0 ] || give_up "apt-get failed with status $rc (log: /tmp/slurm-setup-apt.log)"
}

start_munge() {
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge || give_up "cannot create munge directories"
    if [ ! -s /etc/munge/munge.key ]; then
        # 1024 random bytes is what mungekey(8) writes by default.
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none \
            || give_up "cannot write /etc/munge/munge.key"
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null \
        || give_up "no 'munge' user (munge package incomplete?)"
    chmod 0700 /etc/munge && chmod 0400 /etc/munge/munge.key && chmod 0755 /run/munge
    if ! timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1; then
        # munged drops to no privileges itself only via the init system; start it as its own user.
        timeout 10 runuser -u munge -- munged --force >/dev/null 2>&1 || give_up "munged did not start"
        local i
        for i in $(seq 20); do
            timeout 5 munge -n 2>/dev/null | timeout 5 unmunge >/dev/null 2>&1 && return 0
            sleep 0.5
        done
        give_up "munged runs but munge -n | unmunge fails"
    fi
}

write_config() {
    if [ -e "$CONF" ] && ! grep -qF "$MARKER" "$CONF"; then
        give_up "$CONF exists and was not written by this script; leaving it alone"
    fi
    mkdir -p /etc/slurm /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm \
        || give_up "cannot create SLURM directories"
    # One node called "localhost" (not the hostname, which varies between CI machines), daemons
    # as root, no cgroups, no systemd, no accounting database. SlurmdParameters=config_overrides
    # lets slurmd advertise CPUS even on a 2-core machine (oversubscription is fine for tests).
    # No GPUs here: jobs submitted by the tests override the scripts' --gpus-per-task.
    # MpiDefault=none: the batch scripts pass --mpi explicitly, as they must on real clusters.
    cat >"$CONF.new" <<EOF || give_up "cannot write $CONF"
$MARKER
ClusterName=ci
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
# keep finished jobs visible to 'scontrol show job' for 10 minutes (there is no sacct)
MinJobAge=600
KillWait=5
InactiveLimit=0
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$CPUS State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
EOF
    if ! cmp -s "$CONF.new" "$CONF"; then
        mv "$CONF.new" "$CONF"
    else
        rm -f "$CONF.new"
    fi
}

running() {  # running PIDFILE: the daemon whose pid the file holds is alive
    [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null
}

start_slurm() {
    if ! running /run/slurmctld.pid; then
        timeout 30 slurmctld || give_up "slurmctld did not start (see /var/log/slurm/slurmctld.log)"
    fi
    if ! running /run/slurmd.pid; then
        timeout 30 slurmd || give_up "slurmd did not start (see /var/log/slurm/slurmd.log)"
    fi
    local i
    for i in $(seq "$WAIT_IDLE"); do
        node_idle && return 0
        sleep 1
    done
    # A node left DOWN/DRAIN by an earlier run of the daemons comes back with RESUME.
    timeout 10 scontrol update NodeName=localhost State=RESUME >/dev/null 2>&1 || true
    for i in $(seq 10); do
        node_idle && return 0
        sleep 1
    done
    give_up "node 'localhost' not idle after ${WAIT_IDLE}s: $(timeout 10 sinfo -h -N -o '%N %t %E' 2>&1 | head -1)"
}

main() {
    [ "$(id -u)" = 0 ] || give_up "not root"
    if command -v sinfo >/dev/null && node_idle; then
        echo "slurm-setup: SLURM already running, node localhost idle"
        return 0
    fi
    install_packages
    start_munge
    write_config
    start_slurm
    echo "slurm-setup: SLURM ready in ${SECONDS}s: $(sinfo -h -N -o '%N %P %t %c CPUs')"
}

# Any command that fails unexpectedly (an error not handled above) also just warns: the ERR trap
# turns it into give_up, so the exit status stays 0.
trap 'give_up "unexpected failure at line $LINENO"' ERR
main
exit 0

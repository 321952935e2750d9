# Sourced by jobs/*.sbatch: the checks and steps both jobs take (docs/jobs.md).
#
# check_nodes PYTHON FOLDER...: on a job of more than one node, one task per node checks that it
# can run PYTHON (the venv's) and sees, in every FOLDER, a file this script has just left there
# from the first node: so each FOLDER is one folder of a file system that every node mounts, not
# a node's own folder of the same name. Prints what it checked; on a node that fails, names the
# node and what it lacks and returns 2, as where the first node cannot write in a FOLDER (the
# marks it left are removed). On one node it does nothing.
check_nodes() {
    local python=$1 nodes=${SLURM_JOB_NUM_NODES:-1} folder mark marks=() status=0
    shift
    [ "$nodes" -gt 1 ] || return 0
    for folder in "$@"; do
        if ! mark=$(mktemp "$folder/.chainexec-shared-XXXXXX" 2>/dev/null); then
            echo "chainexec-job: cannot write in $folder (the job writes there)" >&2
            rm -f ${marks[@]+"${marks[@]}"}
            return 2
        fi
        marks+=("$mark")
    done
    srun --nodes="$nodes" --ntasks="$nodes" --ntasks-per-node=1 bash -c '
        [ -x "$1" ] || { echo "chainexec-job: node $(hostname) cannot run $1" >&2; exit 2; }
        for mark in "${@:2}"; do
            [ -f "$mark" ] || { echo "chainexec-job: node $(hostname) does not see ${mark%/*} (not on a shared file system)" >&2; exit 2; }
        done' check "$python" "${marks[@]}" || status=2
    rm -f "${marks[@]}"
    [ "$status" = 0 ] && echo "chainexec-job: all $nodes nodes run $python and see $*"
    return "$status"
}

# check_stop_settings: STOP_AFTER is empty or a whole number of seconds (at most 9 digits: bash's
# arithmetic wraps larger ones), CHECKPOINT_EVERY a number of seconds, STALL_TIMEOUT empty or a
# positive number of seconds; otherwise one line and status 2, before anything runs (bash's
# arithmetic dropped a STOP_AFTER with a unit, "1h", without a word, and the job ran into its
# time limit).
check_stop_settings() {
    [[ "$STOP_AFTER" =~ ^[0-9]{0,9}$ ]] || { echo "chainexec-job: STOP_AFTER=$STOP_AFTER is not a whole number of seconds (at most 9 digits)" >&2; return 2; }
    [[ "$CHECKPOINT_EVERY" =~ ^[0-9]+([.][0-9]+)?$ ]] || { echo "chainexec-job: CHECKPOINT_EVERY=$CHECKPOINT_EVERY is not a number of seconds" >&2; return 2; }
    [[ -z "$STALL_TIMEOUT" || ( "$STALL_TIMEOUT" =~ ^[0-9]+([.][0-9]+)?$ && "$STALL_TIMEOUT" =~ [1-9] ) ]] \
        || { echo "chainexec-job: STALL_TIMEOUT=$STALL_TIMEOUT is not a positive number of seconds (empty: no stall timeout)" >&2; return 2; }
}

# check_world PYTHON: srun (--mpi=$SRUN_MPI) starts one MPI world of SLURM_NTASKS ranks. If srun
# and the MPI library disagree on PMI, every task starts as its own world of one rank and they
# would all write the same output: a one-line MPI program under the same srun prints the
# world's size first. Prints the sizes; returns 2 unless they are one world of SLURM_NTASKS (a
# setting to change, SRUN_MPI, not a run to submit again).
check_world() {
    local world
    world=$(srun --mpi="$SRUN_MPI" "$1" -c \
        'from mpi4py import MPI; c = MPI.COMM_WORLD; c.rank or print(c.size, flush=True)') || world="none (srun failed)"
    echo "chainexec-job: srun --mpi=$SRUN_MPI gives MPI world size(s): ${world//$'\n'/ }"
    if [ "$world" != "${SLURM_NTASKS:-1}" ]; then
        echo "chainexec-job: expected one world of ${SLURM_NTASKS:-1} ranks; set SRUN_MPI (srun --mpi=list)" >&2
        return 2
    fi
}

# run_options CHECKPOINT: the run's checkpoint options into the array RUN_OPTIONS: the folder
# CHECKPOINT, every CHECKPOINT_EVERY seconds, with STOP_AFTER a stop that many seconds after
# the job's start (bash's SECONDS: the steps before the run took some), and with STALL_TIMEOUT
# the run's stall timeout.
run_options() {
    RUN_OPTIONS=(--checkpoint "$1" --checkpoint-every "$CHECKPOINT_EVERY")
    [ -z "$STOP_AFTER" ] || RUN_OPTIONS+=(--stop-after "$(( 10#$STOP_AFTER > SECONDS ? 10#$STOP_AFTER - SECONDS : 0 ))")
    [ -z "$STALL_TIMEOUT" ] || RUN_OPTIONS+=(--stall-timeout "$STALL_TIMEOUT")
}

# stopped CHECKPOINT: after a run that stopped at a checkpoint (its status 3, STOP_AFTER): says
# so and, with REQUEUE=1, requeues the job (scontrol requeue), saying so where the cluster
# refuses; the job then exits 3 (not finished: afterok dependents wait) either way.
stopped() {
    if [ "$REQUEUE" = 1 ] && [ -n "${SLURM_JOB_ID:-}" ]; then
        echo "chainexec-job: stopped at a checkpoint in $1; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID" \
            || echo "chainexec-job: scontrol requeue $SLURM_JOB_ID failed (does the cluster allow requeueing?): submit again to go on" >&2
    else
        echo "chainexec-job: stopped at a checkpoint in $1; submit again to go on"
    fi
}

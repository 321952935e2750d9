# Sourced by jobs/*.sbatch: what a job on several nodes needs of them (docs/jobs.md, "Several
# nodes").
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

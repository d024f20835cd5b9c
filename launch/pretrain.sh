#!/usr/bin/env bash
# Launches `python -m megatron_mtraining.pretrain` under torchrun on this node, alone or as one
# node of several. See launch/README.md for the environment variables and examples.
set -euo pipefail

usage() {
  cat <<'EOF'
usage: launch/pretrain.sh [--print-command] [--dry-run] CONFIG [key=value ...]

Runs `python -m megatron_mtraining.pretrain --config CONFIG [key=value ...]` under torchrun.
Overrides are passed to the entry point unchanged.

options:
  -h, --help        print this help and exit
  --print-command   check everything, write the run directory, print the torchrun command
                    and exit without running it (same as DRY_LAUNCH=1)
  --dry-run         run the entry point's --dry-run once, without torchrun and without
                    needing a GPU: validate the config for NNODES x processes per node
                    (the recipe's own world size where no GPU count is known); no run directory
  --                end of launcher options; everything after it is CONFIG and overrides

environment (defaults in brackets):
  NNODES [1]  NODE_RANK [0]  MASTER_ADDR [127.0.0.1; required when NNODES > 1]
  MASTER_PORT [29500]  GPUS_PER_NODE [visible GPUs]  ALLOW_CPU [0]  NPROC [2, with ALLOW_CPU=1]
  PYTHON [<repo>/.venv/bin/python]  LOG_ROOT [runs]  RUN_NAME [<config stem>-<UTC time>]
  DRY_LAUNCH [0]  MAX_RESTARTS [3]  SHUTDOWN_TIMEOUT [180]

auto-resume: a failed torchrun is started again, up to MAX_RESTARTS times; with megatron.save
set and megatron.load unset, load is set to save so that a restart resumes from the last
complete checkpoint. megatron.exit_signal_handler is on unless the config sets it:
SIGTERM (forwarded by this script to torchrun, then to the workers) saves a checkpoint at the
end of the current iteration and stops; workers get SHUTDOWN_TIMEOUT seconds for it.

exit codes: 0 success (or the training's own status), 1 environment check failed,
            2 usage error (arguments or environment variable values)
EOF
}

usage_error() {
  echo "launch/pretrain.sh: error: $*" >&2
  echo "run 'launch/pretrain.sh --help' for usage" >&2
  exit 2
}

env_error() {
  echo "launch/pretrain.sh: error: $*" >&2
  exit 1
}

# ---- arguments --------------------------------------------------------------------------------
config=""
dry_run=0
print_only="${DRY_LAUNCH:-0}"
overrides=()
options_done=0
for arg in "$@"; do
  if [ "$options_done" = 0 ]; then
    case "$arg" in
      -h | --help) usage; exit 0 ;;
      --print-command) print_only=1; continue ;;
      --dry-run) dry_run=1; continue ;;
      --) options_done=1; continue ;;
    esac
  fi
  if [ -z "$config" ]; then
    # An option we do not know, given where CONFIG belongs, is a typo rather than a file name.
    if [ "$options_done" = 0 ] && [[ "$arg" == -* ]]; then
      usage_error "unknown option '$arg'"
    fi
    config="$arg"
  else
    # Overrides go to the entry point verbatim, spaces and '=' in values included.
    overrides+=("$arg")
  fi
done

[ -n "$config" ] || usage_error "missing CONFIG (a YAML file, e.g. configs/tiny_cpu.yaml)"
[ -f "$config" ] || usage_error "config file '$config' does not exist (relative paths are taken from $(pwd))"
[ "$print_only" = 0 ] || [ "$print_only" = 1 ] || usage_error "DRY_LAUNCH must be 0 or 1, got '$print_only'"

# ---- node layout: cheap checks first, so that a typo fails before Python starts ---------------
is_uint() { [[ "$1" =~ ^[0-9]+$ ]]; }

nnodes="${NNODES:-1}"
node_rank="${NODE_RANK:-0}"
master_port="${MASTER_PORT:-29500}"
is_uint "$nnodes" && [ "$nnodes" -ge 1 ] || usage_error "NNODES must be an integer >= 1, got '$nnodes'"
is_uint "$node_rank" || usage_error "NODE_RANK must be an integer >= 0, got '$node_rank'"
[ "$node_rank" -lt "$nnodes" ] || usage_error "NODE_RANK ($node_rank) must be < NNODES ($nnodes)"
is_uint "$master_port" && [ "$master_port" -ge 1 ] && [ "$master_port" -le 65535 ] ||
  usage_error "MASTER_PORT must be an integer in 1..65535, got '$master_port'"
if [ "$nnodes" -gt 1 ]; then
  # Every node must reach the same rendezvous; a default would silently start separate jobs.
  [ -n "${MASTER_ADDR:-}" ] || usage_error "MASTER_ADDR is required when NNODES > 1 (the address of node rank 0)"
fi
master_addr="${MASTER_ADDR:-127.0.0.1}"
if [ -n "${GPUS_PER_NODE:-}" ]; then
  is_uint "$GPUS_PER_NODE" && [ "$GPUS_PER_NODE" -ge 1 ] ||
    usage_error "GPUS_PER_NODE must be an integer >= 1, got '$GPUS_PER_NODE'"
fi
allow_cpu="${ALLOW_CPU:-0}"
[ "$allow_cpu" = 0 ] || [ "$allow_cpu" = 1 ] || usage_error "ALLOW_CPU must be 0 or 1, got '$allow_cpu'"
max_restarts="${MAX_RESTARTS:-3}"
is_uint "$max_restarts" || usage_error "MAX_RESTARTS must be an integer >= 0 (0: no restart), got '$max_restarts'"
shutdown_timeout="${SHUTDOWN_TIMEOUT:-180}"
is_uint "$shutdown_timeout" && [ "$shutdown_timeout" -ge 1 ] ||
  usage_error "SHUTDOWN_TIMEOUT must be an integer >= 1 (seconds), got '$shutdown_timeout'"

# ---- run directory: named now, created once every check has passed (not for --dry-run) -------
config_stem="$(basename "$config")"
config_stem="${config_stem%.*}"
# Nodes of one job share RUN_NAME (the SLURM script sets it from the job id), so their logs
# land in one directory, one file set per node rank.
run_name="${RUN_NAME:-$config_stem-$(date -u +%Y%m%d-%H%M%S)}"
run_dir="${LOG_ROOT:-runs}/$run_name"
command_file="$run_dir/command.node$node_rank.sh"
env_file="$run_dir/env.node$node_rank.txt"
log_file="$run_dir/train.node$node_rank.log"
if [ "$dry_run" = 0 ] && [ -e "$command_file" ]; then
  usage_error "$run_dir already holds a run of node rank $node_rank; set RUN_NAME or LOG_ROOT to another directory"
fi

# ---- Python, the package and torchrun ---------------------------------------------------------
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
python="${PYTHON:-$repo/.venv/bin/python}"
if [ -z "${PYTHON:-}" ] && [ ! -x "$python" ]; then
  env_error "no $python; run 'bash scripts/setup.sh' in $repo, or set PYTHON=/path/to/python"
fi
command -v "$python" >/dev/null 2>&1 || env_error "PYTHON='$python' is not an executable"
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 12))' ||
  env_error "$python is Python $("$python" -c 'import platform; print(platform.python_version())'); megatron-core 0.19 needs >= 3.12"
# torchrun is run as `python -m torch.distributed.run` (what the torchrun script does), so its
# workers use the interpreter checked here and not whichever torchrun comes first on PATH.
# One Python start checks the installation and gathers the versions for the run's env summary.
# It only locates torch and megatron.core: importing them takes seconds, and a broken install
# is reported by torchrun and the entry point themselves.
versions="$("$python" - 2>&1 <<'EOF'
import importlib.metadata as md
import importlib.util
import os
import platform
import runpy
import sys

torch_spec = importlib.util.find_spec("torch")
if torch_spec is None:
    sys.exit("torch is not installed")
torch_dir = torch_spec.submodule_search_locations[0]
if not os.path.isfile(os.path.join(torch_dir, "distributed", "run.py")):
    sys.exit(f"torch at {torch_dir} has no torch.distributed.run (torchrun)")
for module in ("megatron_mtraining", "megatron.core"):
    if importlib.util.find_spec(module) is None:
        sys.exit(f"no module {module}")
print(f"python {platform.python_version()} ({sys.executable})")
for dist in ("megatron-mtraining", "torch", "megatron-core", "triton", "transformer-engine"):
    try:
        print(f"{dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        print(f"{dist} not installed")
# torch/version.py is plain assignments: the CUDA build without importing torch.
print(f"torch built for CUDA {runpy.run_path(os.path.join(torch_dir, 'version.py'))['cuda']}")
EOF
)" || env_error "$python cannot run the launch: ${versions:-no output}. Run 'bash scripts/setup.sh' in $repo"

# ---- processes per node ------------------------------------------------------------------------
# GPUs this node would give the job: CUDA_VISIBLE_DEVICES when set (empty or -1 hides all),
# otherwise what nvidia-smi lists.
count_visible_gpus() {
  if [ -n "${CUDA_VISIBLE_DEVICES+set}" ]; then
    case "$CUDA_VISIBLE_DEVICES" in
      "" | -1) echo 0 ;;
      *) awk -F, '{print NF}' <<<"$CUDA_VISIBLE_DEVICES" ;;
    esac
  elif command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true
  else
    echo 0
  fi
}
visible_gpus="$(count_visible_gpus)"
if [ -n "${GPUS_PER_NODE:-}" ]; then
  # More processes than visible GPUs would fail later in every worker, less clearly.
  if [ "$visible_gpus" -gt 0 ] && [ "$GPUS_PER_NODE" -gt "$visible_gpus" ]; then
    usage_error "GPUS_PER_NODE=$GPUS_PER_NODE but only $visible_gpus GPUs are visible on $(hostname)"
  fi
  nproc_per_node="$GPUS_PER_NODE"
  mode="gpu"
elif [ "$visible_gpus" -gt 0 ]; then
  nproc_per_node="$visible_gpus"
  mode="gpu"
elif [ "$dry_run" = 1 ] && [ "$allow_cpu" = 0 ]; then
  # A dry run needs no GPU; with no count known the recipe's own world size applies.
  nproc_per_node=""
elif [ "$allow_cpu" = 1 ]; then
  # The entry point itself falls back to the CPU and gloo when CUDA is absent.
  nproc_per_node="${NPROC:-2}"
  is_uint "$nproc_per_node" && [ "$nproc_per_node" -ge 1 ] ||
    usage_error "NPROC must be an integer >= 1, got '$nproc_per_node'"
  mode="cpu (gloo)"
else
  env_error "no GPU visible (nvidia-smi -L lists none, or CUDA_VISIBLE_DEVICES hides them all). Set GPUS_PER_NODE if nvidia-smi is not on PATH, or ALLOW_CPU=1 to run NPROC (default 2) CPU processes over gloo"
fi

# ---- --dry-run ---------------------------------------------------------------------------------
if [ "$dry_run" = 1 ]; then
  # The entry point's dry run is one process that starts no process group: no torchrun, and
  # nothing to keep, so no run directory.
  cmd=("$python" -m megatron_mtraining.pretrain --config "$config" --dry-run)
  [ -z "$nproc_per_node" ] || cmd+=(--world-size "$((nnodes * nproc_per_node))")
  cmd+=("${overrides[@]}")
  if [ "$print_only" = 1 ]; then
    printf '%q ' "${cmd[@]}"
    echo
    exit 0
  fi
  exec "${cmd[@]}"
fi

# ---- launch: environment defaults, only where unset -------------------------------------------
# Megatron needs one CUDA work queue for its tensor/sequence-parallel communication overlap.
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
# A failed or timed-out NCCL collective aborts the job instead of hanging every rank.
export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
# torchrun would set 1 thread per process; share this node's cores between its processes.
threads=$(($(nproc) / nproc_per_node))
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-$((threads > 0 ? threads : 1))}"
# Log lines reach the tee'd file as they are printed, not when a buffer fills.
export PYTHONUNBUFFERED="${PYTHONUNBUFFERED:-1}"

# ---- auto-resume: what a restart loads, and a save on SIGTERM -----------------------------------
# torchrun restarts the workers with the same arguments, so they resume only if `load` names the
# directory they save to. The config is read here with PyYAML alone (the entry point validates
# it, seconds later); any problem reading it leaves the overrides alone for the entry point to
# report. Printed: save, load (empty when unset or null) and whether exit_signal_handler is set.
resume_settings="$("$python" - "$config" "${overrides[@]}" 2>/dev/null <<'EOF'
import os
import sys

import yaml


def megatron_section(path, depth=0):
    data = yaml.safe_load(open(path, encoding="utf-8")) or {}
    base = data.get("base")
    values = megatron_section(os.path.join(os.path.dirname(path), base), depth + 1) if base and depth < 16 else {}
    values.update(data.get("megatron") or {})
    return values


try:
    values = megatron_section(sys.argv[1])
    for text in sys.argv[2:]:
        key, sep, raw = text.partition("=")
        if sep and key.startswith("megatron."):
            values[key.split(".", 1)[1]] = yaml.safe_load(raw) if raw else None
except Exception:
    sys.exit(1)
for key in ("save", "load"):
    print("" if values.get(key) is None else values[key])
print(int("exit_signal_handler" in values))
EOF
)" || resume_settings=""
resume_overrides=()
# After the user's overrides, where the launcher must win over their megatron.load.
resume_last=()
if [ -n "$resume_settings" ]; then
  { read -r save_dir; read -r load_dir; read -r signal_handler_set; } <<<"$resume_settings"
else
  save_dir="" load_dir="" signal_handler_set=1
fi
# Prepended, so that the user's own overrides (applied later) win.
if [ "$signal_handler_set" = 0 ]; then
  resume_overrides+=(megatron.exit_signal_handler=true)
fi
# A JSON string is a YAML double-quoted scalar: the path stays a string whatever it looks like.
json_string() { "$python" -c 'import json, sys; print(json.dumps(sys.argv[1]))' "$1"; }
resume_note="megatron.save is not set: a restart starts again from megatron.load (${load_dir:-none, iteration 0})"
if [ -n "$save_dir" ] && { [ -z "$load_dir" ] || [ "$load_dir" = "$save_dir" ]; }; then
  how="as configured"
  if [ -z "$load_dir" ]; then
    resume_overrides+=("megatron.load=$(json_string "$save_dir")")
    how="set by the launcher to megatron.save, as megatron.load was not set"
  fi
  resume_note="megatron.load=$save_dir ($how): each start resumes from its latest complete checkpoint"
elif [ -n "$save_dir" ] && [ -f "$save_dir/latest_checkpointed_iteration.txt" ]; then
  # A relaunch (a requeued SLURM job, a rerun of command.node<R>.sh) of a run that has saved:
  # going back to megatron.load would redo, and then overwrite, the iterations saved since.
  resume_last+=("megatron.load=$(json_string "$save_dir")")
  resume_note="megatron.save=$save_dir already holds a checkpoint (iteration $(cat "$save_dir/latest_checkpointed_iteration.txt")): resuming from it instead of megatron.load=$load_dir"
elif [ -n "$save_dir" ]; then
  resume_note="megatron.load=$load_dir differs from megatron.save=$save_dir: a restart within this launch loads $load_dir again (a relaunch once $save_dir holds a checkpoint resumes from it)"
fi
restart_policy="restart policy: up to $max_restarts restarts of this node's torchrun after a failure (MAX_RESTARTS); $resume_note; SIGTERM saves a checkpoint and stops (megatron.exit_signal_handler; workers get ${shutdown_timeout}s, SHUTDOWN_TIMEOUT)"

cmd=("$python" -m torch.distributed.run
  --nnodes "$nnodes" --node-rank "$node_rank" --nproc-per-node "$nproc_per_node"
  --master-addr "$master_addr" --master-port "$master_port"
  --shutdown-timeout "$shutdown_timeout"
  -m megatron_mtraining.pretrain --config "$config" "${resume_overrides[@]}" "${overrides[@]}" "${resume_last[@]}")

mkdir -p "$run_dir" || env_error "cannot create the run directory $run_dir (LOG_ROOT='${LOG_ROOT:-runs}')"

# The command as a script that reruns it: same directory, same defaults (values shell-quoted).
{
  echo "# $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(hostname), node rank $node_rank of $nnodes"
  printf 'export CUDA_DEVICE_MAX_CONNECTIONS=%q TORCH_NCCL_ASYNC_ERROR_HANDLING=%q OMP_NUM_THREADS=%q PYTHONUNBUFFERED=%q\n' \
    "$CUDA_DEVICE_MAX_CONNECTIONS" "$TORCH_NCCL_ASYNC_ERROR_HANDLING" "$OMP_NUM_THREADS" "$PYTHONUNBUFFERED"
  printf 'cd %q &&' "$(pwd)"
  printf ' %q' "${cmd[@]}"
  echo
} >"$command_file"

{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "host: $(hostname)"
  # --no-optional-locks: reading the status must not rewrite the index of a shared checkout.
  if commit="$(git -C "$repo" rev-parse HEAD 2>/dev/null)"; then
    changed="$(git -C "$repo" --no-optional-locks status --porcelain 2>/dev/null | wc -l)"
    echo "git: $commit ($changed changed files)"
  else
    echo "git: $repo is not a git checkout"
  fi
  echo "mode: $mode, $nproc_per_node processes on this node, node rank $node_rank of $nnodes, master $master_addr:$master_port"
  echo "$restart_policy"
  echo "$versions"
  echo "gpus:"
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>&1 || true
    echo "driver $(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | sed -n 1p)"
  else
    echo "(no nvidia-smi)"
  fi
  echo "environment:"
  env | grep -E '^(CUDA_|NCCL_|TORCH_|OMP_NUM_THREADS|PYTHON|SLURM_JOB_ID|SLURM_NODELIST|SLURM_JOB_NODELIST)' | sort || true
} >"$env_file"

if [ "$print_only" = 1 ]; then
  printf '%q ' "${cmd[@]}"
  echo
  echo "run directory: $run_dir" >&2
  echo "$restart_policy" >&2
  exit 0
fi

echo "run directory: $run_dir (node rank $node_rank: $(basename "$log_file"))"
echo "$restart_policy" | tee -a "$log_file"
# tee ignores SIGTERM / SIGINT (a SLURM step signal reaches every process of the task): it must
# outlive the signal to log the save that follows, and ends when the last writer closes the pipe.
exec {log_fd}> >(trap '' TERM INT; exec tee -a "$log_file")
tee_pid=$!
# shellcheck disable=SC2329  # called by the traps below
forward() {
  signalled=1
  echo "launch/pretrain.sh: got SIG$1, forwarding it to torchrun (pid $torchrun_pid): the workers save a checkpoint and stop" >&"$log_fd"
  kill -s "$1" "$torchrun_pid" 2>/dev/null || true
}
trap 'forward TERM' TERM
trap 'forward INT' INT
# Restarts are fresh torchrun launches, not torchrun's own --max-restarts: its restarted workers
# reuse the agent's store, whose keys from the failed attempt make Megatron's gloo process
# groups connect to the dead workers' addresses (torch 2.13), so they never start.
signalled=0
attempt=0
torchrun_pid=""
while :; do
  # In the background, so that a signal runs the trap now rather than when torchrun has ended.
  "${cmd[@]}" >&"$log_fd" 2>&1 &
  torchrun_pid=$!
  # `wait` also returns when a trapped signal arrives; wait again until torchrun itself has ended.
  while :; do
    status=0
    wait "$torchrun_pid" || status=$?
    kill -0 "$torchrun_pid" 2>/dev/null || break
  done
  # A stop asked for by a signal is not a failure to recover from.
  if [ "$status" = 0 ] || [ "$signalled" = 1 ]; then
    break
  fi
  if [ "$attempt" -ge "$max_restarts" ]; then
    echo "launch/pretrain.sh: torchrun failed (status $status) and MAX_RESTARTS=$max_restarts restarts are used up; giving up" >&"$log_fd"
    break
  fi
  attempt=$((attempt + 1))
  echo "launch/pretrain.sh: torchrun failed (status $status); restart $attempt of $max_restarts (MAX_RESTARTS), resuming from ${save_dir:-nothing: no megatron.save}" >&"$log_fd"
done
exec {log_fd}>&-
# The helper processes of a killed worker (Megatron's checkpoint writer) can outlive it and
# keep the pipe open: give tee a few seconds to drain, then end it rather than wait forever.
for _ in $(seq 50); do
  kill -0 "$tee_pid" 2>/dev/null || break
  sleep 0.1
done
kill -s KILL "$tee_pid" 2>/dev/null || true
exit "$status"

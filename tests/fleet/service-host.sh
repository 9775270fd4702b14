#!/usr/bin/env bash
# service-host.sh: one more fleet host whose PID 1 is a real systemd, for the `systemd` and `docker`
# runtimes. sshd runs as a unit of that systemd (so a login session sees the same systemctl and
# journal a production host's would); with --docker, dockerd (vfs storage, no iptables, no bridge)
# runs as another unit and `docker` works in that host's own namespaces; with --containerd, containerd
# (native snapshotter, its CRI plugin off: `ctr` only, as a Kubernetes node's runtime under the k8s.io
# namespace) runs as a unit on its default socket /run/containerd/containerd.sock; with --podman, podman's
# storage (/var/lib/containers) is the host's own directory (podman needs no daemon).
#
# Usage (as root, a netns fleet from up.sh must be up: its bridge, client key, known_hosts):
#   FLEET_DIR=... service-host.sh up NAME I [--docker] [--containerd] [--podman]   address 198.18.0.(10+I), port 22
#   FLEET_DIR=... service-host.sh down NAME
# down.sh also stops it (its host.env is like any host's).
#
# Isolation from the machine: new mount, PID, UTS, cgroup and network namespaces; a private tmpfs on
# /run (units, journal, docker's sockets live there and vanish with the host); journald volatile; the
# units have DefaultDependencies=no so nothing of sysinit (tmpfiles, udev) runs against the shared
# filesystem; the host's cgroups are created under mla-NAME in each hierarchy and removed by down.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"
FLEET_DIR=${FLEET_DIR:-/tmp/mla-fleet}
[ -f "$FLEET_DIR/fleet.env" ] || { echo "no fleet in $FLEET_DIR (run up.sh first)" >&2; exit 2; }
# shellcheck disable=SC1091
. "$FLEET_DIR/fleet.env"
SYSTEMD=${SYSTEMD:-/lib/systemd/systemd}
cmd=${1:-}; name=${2:-}
case "$name" in [a-z]*) ;; *) echo "usage: service-host.sh up NAME I [--docker] [--containerd] [--podman] | down NAME" >&2; exit 2 ;; esac
hd="$FLEET_DIR/hosts/$name"

cgroup_dirs() { for h in /sys/fs/cgroup/*/; do [ -d "$h/mla-$name" ] && echo "$h/mla-$name"; done; true; }

if [ "$cmd" = down ]; then
  [ -d "$hd" ] || exit 0
  p=$(fleet_signal "$hd")
  spid=$(cat "$hd/sshd.pid" 2>/dev/null || true)
  # systemd as PID 1 re-executes itself on SIGTERM: KILL it, which ends its whole PID namespace
  [ -n "$spid" ] && kill -KILL "$spid" 2>/dev/null
  [ -n "$p" ] && fleet_reap "$p"
  # shellcheck disable=SC1091
  ( . "$hd/host.env"; ip link del "$VETH" 2>/dev/null; ip netns del "$NETNS" 2>/dev/null; true )
  for _ in $(seq 50); do
    left=$(cgroup_dirs)
    [ -z "$left" ] && break
    for d in $left; do find "$d" -depth -type d -exec rmdir {} + 2>/dev/null; done
    sleep 0.1
  done
  # shellcheck disable=SC1091
  addr=$(. "$hd/host.env"; echo "$ADDR")
  grep -v "^$addr " "$FLEET_DIR/known_hosts" > "$FLEET_DIR/known_hosts.tmp" || true
  mv "$FLEET_DIR/known_hosts.tmp" "$FLEET_DIR/known_hosts"
  rm -f "$FLEET_DIR/ssh_config.d/$name.conf"
  rm -rf "$hd"
  left=$(cgroup_dirs)
  [ -z "$left" ] || { echo "left: cgroups $left" >&2; exit 1; }
  exit 0
fi

[ "$cmd" = up ] || { echo "usage: service-host.sh up NAME I [--docker] [--containerd] [--podman] | down NAME" >&2; exit 2; }
i=${3:?index}; docker=; containerd=; podman=
for opt in "${@:4}"; do
  case "$opt" in
    --docker) docker=--docker ;; --containerd) containerd=--containerd ;; --podman) podman=--podman ;;
    *) echo "service-host.sh: unknown option $opt" >&2; exit 2 ;;
  esac
done
[ "$FLEET_MODE" = netns ] || { echo "a service host needs FLEET_MODE=netns" >&2; exit 2; }
[ -x "$SYSTEMD" ] || { echo "no systemd at $SYSTEMD: apt-get install -y systemd" >&2; exit 2; }
if [ "$docker" = --docker ]; then
  command -v dockerd >/dev/null && command -v docker >/dev/null \
    || { echo "--docker needs dockerd and docker: apt-get install -y docker.io" >&2; exit 2; }
fi
if [ -n "$containerd" ]; then
  command -v containerd >/dev/null && command -v ctr >/dev/null \
    || { echo "--containerd needs containerd and ctr: apt-get install -y containerd" >&2; exit 2; }
fi
if [ -n "$podman" ]; then
  command -v podman >/dev/null || { echo "--podman needs podman: apt-get install -y podman" >&2; exit 2; }
fi
[ ! -e "$hd" ] || { echo "$hd exists (service-host.sh down $name first)" >&2; exit 1; }
addr=198.18.0.$((10 + i)); netns=mla-$name; veth=mla-v$i
mkdir -p "$hd/fs" "$hd/units"
for d in $FLEET_BIND_DIRS; do mkdir -p "$hd/fs$d"; done
if [ -d "$hd/fs/root" ]; then cp -a /etc/skel/. "$hd/fs/root/" 2>/dev/null || true; chmod 700 "$hd/fs/root"; fi
printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n' "$name" > "$hd/etc_hosts"
ssh-keygen -q -t ed25519 -N '' -C "$name" -f "$hd/ssh_host_ed25519_key"
known_drop() { grep -v "^$1 " "$FLEET_DIR/known_hosts" > "$FLEET_DIR/known_hosts.tmp" || true; mv "$FLEET_DIR/known_hosts.tmp" "$FLEET_DIR/known_hosts"; }
known_drop "$addr"
echo "$addr $(cut -d' ' -f1,2 "$hd/ssh_host_ed25519_key.pub")" >> "$FLEET_DIR/known_hosts"
printf 'Host %s\n  HostName %s\n  Port 22\n' "$name" "$addr" > "$FLEET_DIR/ssh_config.d/$name.conf"
cat > "$hd/host.env" <<EOF
NAME=$name
ADDR=$addr
PORT=22
NETNS=$netns
OWN_NETNS=1
VETH=$veth
EOF
# the same sshd settings as every fleet host (lib.sh)
fleet_sshd_config "$hd" "$name" "$addr" 22 "PermitRootLogin prohibit-password
AuthorizedKeysFile $FLEET_DIR/authorized_keys" "AllowTcpForwarding local" "$(fleet_sshd_extra "$SSHD")"
want="systemd-journald.socket systemd-journald-dev-log.socket systemd-journald.service mla-sshd.service"
cat > "$hd/units/mla-sshd.service" <<EOF
[Unit]
Description=fleet host sshd
DefaultDependencies=no
[Service]
ExecStart=$SSHD -D -e -f $hd/sshd_config
StandardOutput=append:$hd/sshd.log
StandardError=append:$hd/sshd.log
KillMode=process
EOF
if [ "$docker" = --docker ]; then
  want="$want mla-docker.service"
  mkdir -p "$hd/docker-data"
  cat > "$hd/units/mla-docker.service" <<EOF
[Unit]
Description=fleet host dockerd
DefaultDependencies=no
[Service]
ExecStart=$(command -v dockerd) --data-root $hd/docker-data --exec-root /run/docker-exec --storage-driver vfs --iptables=false --ip6tables=false --bridge=none --ip-masq=false -H unix:///run/docker.sock --pidfile /run/docker.pid
StandardOutput=append:$hd/dockerd.log
StandardError=append:$hd/dockerd.log
Delegate=yes
KillMode=process
EOF
fi
if [ -n "$containerd" ]; then
  want="$want mla-containerd.service"
  mkdir -p "$hd/containerd-data"
  printf 'version = 2\nroot = "%s"\nstate = "/run/containerd"\ndisabled_plugins = ["io.containerd.grpc.v1.cri"]\n[grpc]\n  address = "/run/containerd/containerd.sock"\n' \
    "$hd/containerd-data" > "$hd/containerd.toml"
  cat > "$hd/units/mla-containerd.service" <<EOF
[Unit]
Description=fleet host containerd
DefaultDependencies=no
[Service]
ExecStart=$(command -v containerd) --config $hd/containerd.toml
StandardOutput=append:$hd/containerd.log
StandardError=append:$hd/containerd.log
Delegate=yes
KillMode=process
EOF
fi
cat > "$hd/units/mla-fleet.target" <<EOF
[Unit]
Description=fleet service host
DefaultDependencies=no
Wants=$want
EOF
{
  echo '#!/bin/sh'
  echo 'set -e'
  echo 'ip link set lo up'
  for d in $FLEET_BIND_DIRS; do echo "mount --bind '$hd/fs$d' '$d'"; done
  echo "mount --bind '$hd/etc_hosts' /etc/hosts"
  if [ -n "$podman" ]; then
    mkdir -p "$hd/containers-storage"
    echo "mkdir -p /var/lib/containers && mount --bind '$hd/containers-storage' /var/lib/containers"
  fi
  echo "hostname '$name'"
  echo 'mount -t tmpfs -o mode=755 mla-run /run'
  echo 'mkdir -p /run/sshd /run/systemd/system /run/systemd/journald.conf.d'
  echo "cp '$hd/units/'* /run/systemd/system/"
  # nothing that acts on the machine's devices or shared files
  echo 'for u in systemd-udevd.service systemd-udevd-control.socket systemd-udevd-kernel.socket proc-sys-fs-binfmt_misc.automount systemd-journald-audit.socket; do ln -sf /dev/null /run/systemd/system/$u; done'
  echo 'printf "[Journal]\nStorage=volatile\n" > /run/systemd/journald.conf.d/mla-fleet.conf'
  echo "exec env container=mla-fleet '$SYSTEMD' --system --unit=mla-fleet.target --log-target=console"
} > "$hd/start.sh"
: > "$hd/sshd.log"
# a namespace of that name left by a killed run (no process in it) is stale: remove it; one in use is refused
if ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$netns"; then
  [ -z "$(ip netns pids "$netns" 2>/dev/null)" ] || { echo "netns $netns is in use" >&2; exit 1; }
  ip netns del "$netns"
fi
ip netns add "$netns"
ip -n "$netns" link set lo up
ip link add "$veth" type veth peer name eth0 netns "$netns"
ip link set "$veth" master mla-br0 up
ip -n "$netns" addr add "$addr/24" dev eth0
ip -n "$netns" link set eth0 up
# the host's cgroups, under mla-NAME in every hierarchy: its cgroup namespace starts there (this
# script joins them for the launch only, then goes back)
for h in /sys/fs/cgroup/*/; do
  [ -f "$h/cgroup.procs" ] || continue
  mkdir -p "$h/mla-$name" || continue
  # a new cpuset cgroup has no CPUs or memory nodes: no task may join it until it inherits them
  for f in cpuset.cpus cpuset.mems; do
    if [ -f "$h/$f" ]; then cat "$h/$f" > "$h/mla-$name/$f" 2>/dev/null || true; fi
  done
  { echo $$ > "$h/mla-$name/cgroup.procs"; } 2>/dev/null || true
done
setsid ip netns exec "$netns" unshare --mount --uts --pid --cgroup --fork --mount-proc --kill-child=KILL \
    sh "$hd/start.sh" >> "$hd/systemd.log" 2>&1 < /dev/null &
echo $! > "$hd/unshare.pid"
for h in /sys/fs/cgroup/*/; do { echo $$ > "$h/cgroup.procs"; } 2>/dev/null || true; done
fleet_wait_ready "$hd" $(( $(date +%s) + 30 )) || { cat "$hd/systemd.log" >&2; exit 1; }
# fleet_wait_ready recorded unshare's child (systemd) as sshd.pid: down KILLs it
if [ "$docker" = --docker ]; then
  for _ in $(seq 300); do
    ip netns exec "$netns" nsenter -t "$(cat "$hd/sshd.pid")" -m docker -H unix:///run/docker.sock info >/dev/null 2>&1 && break
    sleep 0.1
  done
  ip netns exec "$netns" nsenter -t "$(cat "$hd/sshd.pid")" -m docker -H unix:///run/docker.sock info >/dev/null \
    || { echo "dockerd did not come up:" >&2; tail -20 "$hd/dockerd.log" >&2; exit 1; }
fi
if [ -n "$containerd" ]; then
  for _ in $(seq 300); do
    ip netns exec "$netns" nsenter -t "$(cat "$hd/sshd.pid")" -m ctr version >/dev/null 2>&1 && break
    sleep 0.1
  done
  ip netns exec "$netns" nsenter -t "$(cat "$hd/sshd.pid")" -m ctr version >/dev/null \
    || { echo "containerd did not come up:" >&2; tail -20 "$hd/containerd.log" >&2; exit 1; }
fi
echo "service host $name up at $addr (systemd pid $(cat "$hd/sshd.pid")${docker:+, docker}${containerd:+, containerd}${podman:+, podman})"

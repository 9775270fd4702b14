#!/usr/bin/env bash
# up.sh: start a fleet of N real OpenSSH servers ("hosts") on this machine, no Docker.
# mla-doctor's own copy of the recipe in the project's shared docs (test-fleet.md).
#
# Each host is one `sshd -D` running as PID 1 of its own mount + PID + UTS namespace
# (and, in netns mode, its own network namespace). Every directory in FLEET_BIND_DIRS
# (default: /opt/ml-env /root /dev/shm) is bind-mounted privately per host, so the same path
# shows different content on each host; /etc/hosts is per host too (it names the host, so
# `sudo` does not warn). The rest of the filesystem (/usr, /etc, /tmp, /home, python, grep...)
# is the machine's own and shared.
#
# Usage (as root):  ./up.sh N            then   ./down.sh        (FLEET_DIR the same for both)
# Environment:
#   FLEET_DIR        state dir (keys, configs, per-host trees, logs)   default /tmp/mla-fleet
#   FLEET_MODE       netns | loopback                                  default netns
#                    netns:    host i = 198.18.0.(10+i):22, own netns + veth on bridge mla-br0,
#                              own loopback (each host can run a server on localhost:8000)
#                    loopback: host i = 127.0.10.i:2222, shared network stack
#                              (FLEET_LOOPBACK_PREFIX, default 127.0.10)
#   FLEET_BIND_DIRS  space-separated absolute dirs made per-host        default "/opt/ml-env /root /dev/shm"
#                    (/root is seeded from /etc/skel). Never the dir holding FLEET_DIR (so not /tmp).
#   FLEET_NOFWD_HOSTS hosts whose sshd refuses TCP forwarding (AllowTcpForwarding no)   default none
#   FLEET_PORT       sshd port                                         default 2222 (loopback), 22 (netns)
#   FLEET_SUDO_HOSTS space-separated host names where root may NOT log in: only user
#                    $FLEET_SUDO_USER (default mlaops), with passwordless sudo
#                    (/etc/sudoers.d/mla-doctor-fleet). The user is created if missing and
#                    removed by down.sh if up.sh created it.
#   FLEET_HIDDEN_HOSTS space-separated host names reachable only through the bastion
#                    (netns mode only): sshd runs in the bastion's network namespace on its
#                    127.0.0.1:(2200+i); ssh_config gives it `ProxyJump <bastion>`.
#   FLEET_BASTION    the bastion for hidden hosts                      default h01
#   FLEET_REKEYED_HOSTS space-separated host names whose known_hosts line carries a WRONG
#                    (freshly generated, unrelated) ed25519 key: strict checking must refuse them.
#                    (rekey.sh NAME changes a running host's real key instead.)
#   SSHD             sshd binary (must be an absolute path)            default: command -v sshd
#
# Outputs in $FLEET_DIR:
#   id_ed25519            client key (authorized for root and the sudo user on every host)
#   known_hosts           real per-host ed25519 keys (hidden hosts as [127.0.0.1]:PORT)
#   ssh_config            `Include <FLEET_DIR>/ssh_config.d/*.conf` + `Host *` defaults
#   ssh_config.d/hosts.conf  one `Host hNN` block per host (HostName, Port, User, ProxyJump)
#   hosts.txt             "name addr port user proxy_jump sudo" lines ('-' = none)
#   hosts.json            [{"name","host","port","user","proxy_jump","sudo"}, ...]
#   hosts/<name>/fs/<dir> per-host trees (start empty: seed them before or after up.sh)
#   hosts/<name>/sshd.log sshd at LogLevel VERBOSE
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=lib.sh
. "$HERE/lib.sh"

N=${1:-${FLEET_N:-10}}
FLEET_DIR=${FLEET_DIR:-/tmp/mla-fleet}
MODE=${FLEET_MODE:-netns}
BIND_DIRS=${FLEET_BIND_DIRS:-/opt/ml-env /root /dev/shm}
SUDO_HOSTS=${FLEET_SUDO_HOSTS:-}
SUDO_USER_NAME=${FLEET_SUDO_USER:-mlaops}
HIDDEN_HOSTS=${FLEET_HIDDEN_HOSTS:-}
BASTION=${FLEET_BASTION:-h01}
REKEYED_HOSTS=${FLEET_REKEYED_HOSTS:-}
SSHD=${SSHD:-$(command -v sshd || echo /usr/sbin/sshd)}
SUDOERS=/etc/sudoers.d/mla-doctor-fleet
case "$MODE" in
  loopback) PORT=${FLEET_PORT:-2222} ;;
  netns)    PORT=${FLEET_PORT:-22} ;;
  *) echo "FLEET_MODE must be loopback or netns" >&2; exit 2 ;;
esac
[ "$(id -u)" = 0 ] || { echo "up.sh needs root (mount/pid namespaces); running as uid $(id -u)" >&2; exit 2; }
case "$(getent shadow root | cut -d: -f2)" in
  '!'*) echo "root's password field is locked ('!...'): with UsePAM no, sshd refuses even key logins." \
             "Unlock without a password: usermod -p '*' root" >&2; exit 2 ;;
esac
[ -x "$SSHD" ] || { echo "no sshd at '$SSHD': apt-get install -y openssh-server" >&2; exit 2; }
for tool in ssh-keygen unshare setsid ip; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y openssh-client util-linux iproute2" >&2; exit 2; }
done
case "$N" in ''|*[!0-9]*) echo "N must be a number, got '$N'" >&2; exit 2 ;; esac
[ "$N" -ge 1 ] && [ "$N" -le 240 ] || { echo "N must be 1..240" >&2; exit 2; }

# in_list WORD LIST: is WORD one of the space-separated LIST?
in_list() { case " $2 " in *" $1 "*) return 0 ;; esac; return 1; }
valid_name() { case "$1" in h[0-9][0-9]|h[0-9][0-9][0-9]) [ "$((10#${1#h}))" -ge 1 ] && [ "$((10#${1#h}))" -le "$N" ] ;; *) false ;; esac; }
for h in $SUDO_HOSTS $HIDDEN_HOSTS $REKEYED_HOSTS; do
  valid_name "$h" || { echo "unknown host '$h' in FLEET_*_HOSTS (fleet is h01..$(printf 'h%02d' "$N"))" >&2; exit 2; }
done
if [ -n "$HIDDEN_HOSTS" ]; then
  [ "$MODE" = netns ] || { echo "FLEET_HIDDEN_HOSTS needs FLEET_MODE=netns (loopback hosts share one network stack)" >&2; exit 2; }
  valid_name "$BASTION" || { echo "FLEET_BASTION '$BASTION' is not a host of this fleet" >&2; exit 2; }
  if in_list "$BASTION" "$HIDDEN_HOSTS"; then echo "the bastion $BASTION cannot itself be hidden" >&2; exit 2; fi
fi
if [ -n "$SUDO_HOSTS" ]; then
  command -v sudo >/dev/null || { echo "FLEET_SUDO_HOSTS needs sudo: apt-get install -y sudo" >&2; exit 2; }
fi

# A fleet whose processes were killed (e.g. the CI runner ended them) leaves network
# namespaces, veths, the bridge and route behind: clean those; refuse if a fleet is alive.
if [ -e "$FLEET_DIR/fleet.env" ]; then
  for pf in "$FLEET_DIR"/hosts/*/sshd.pid; do
    p=$(cat "$pf" 2>/dev/null) || continue
    if [ -n "$p" ] && awk '/^State:/{exit ($2=="Z")}' "/proc/$p/status" 2>/dev/null; then
      echo "fleet already up in $FLEET_DIR (run down.sh first)" >&2; exit 1
    fi
  done
  echo "cleaning stale fleet state in $FLEET_DIR" >&2
  FLEET_DIR=$FLEET_DIR "$HERE/down.sh" >&2 || true
  rm -rf "$FLEET_DIR"
fi
stale_ns=$(ip netns list 2>/dev/null | awk '/^mla-[hs][0-9]+/{print $1}')
if [ -n "$stale_ns" ] || ip link show mla-br0 >/dev/null 2>&1; then
  for ns in $stale_ns; do
    if [ -n "$(ip netns pids "$ns" 2>/dev/null)" ]; then
      echo "netns $ns still has processes: another fleet is running" >&2; exit 1
    fi
  done
  echo "removing stale fleet network state" >&2
  for ns in $stale_ns; do ip netns del "$ns"; done
  ip -o link show | awk -F': ' '/ mla-v[0-9]+@/{sub(/@.*/, "", $2); print $2}' | xargs -r -n1 ip link del 2>/dev/null || true
  ip link del mla-br0 2>/dev/null || true
  ip route del unreachable 198.18.0.0/15 metric 4000 2>/dev/null || true
fi

t0=$(date +%s.%N)
mkdir -p "$FLEET_DIR/hosts" "$FLEET_DIR/ssh_config.d"
chmod 700 "$FLEET_DIR"
FLEET_DIR=$(cd "$FLEET_DIR" && pwd)   # absolute: it goes into configs
# From here on, a failure tears down what was started (keeping FLEET_DIR for its logs).
trap 'rc=$?; if [ "$rc" != 0 ]; then echo "up.sh failed (exit $rc); tearing the partial fleet down" >&2;
      FLEET_KEEP=1 FLEET_DIR=$FLEET_DIR "$HERE/down.sh" >&2 || true; fi' EXIT

for d in $BIND_DIRS; do
  case "$d" in /*) ;; *) echo "FLEET_BIND_DIRS entries must be absolute: $d" >&2; exit 2 ;; esac
  case "$FLEET_DIR/" in "${d%/}/"*) echo "FLEET_BIND_DIRS entry $d holds FLEET_DIR ($FLEET_DIR)" >&2; exit 2 ;; esac
done

cat > "$FLEET_DIR/fleet.env" <<EOF
FLEET_DIR=$FLEET_DIR
FLEET_MODE=$MODE
FLEET_N=$N
FLEET_PORT=$PORT
FLEET_BIND_DIRS="$BIND_DIRS"
FLEET_SUDO_HOSTS="$SUDO_HOSTS"
FLEET_SUDO_USER=$SUDO_USER_NAME
FLEET_HIDDEN_HOSTS="$HIDDEN_HOSTS"
FLEET_BASTION=$BASTION
FLEET_REKEYED_HOSTS="$REKEYED_HOSTS"
SSHD=$SSHD
EOF

# sshd's privilege-separation dir; the Debian package creates it only via systemd/tmpfiles.
mkdir -p /run/sshd && chmod 755 /run/sshd

# Mount points must exist in the main namespace; remember which ones we create.
: > "$FLEET_DIR/created_dirs"
for d in $BIND_DIRS; do
  if [ ! -d "$d" ]; then
    # record every level we create, deepest last (down.sh removes them in reverse order)
    missing=() p=$d
    while [ ! -d "$p" ]; do missing=("$p" "${missing[@]}"); p=$(dirname "$p"); done
    mkdir -p "$d"
    printf '%s\n' "${missing[@]}" >> "$FLEET_DIR/created_dirs"
  fi
done

# The non-root user of the sudo hosts, machine-wide (/etc/passwd is shared by all hosts).
if [ -n "$SUDO_HOSTS" ]; then
  if ! getent passwd "$SUDO_USER_NAME" >/dev/null; then
    useradd -m -s /bin/bash "$SUDO_USER_NAME"
    echo "$SUDO_USER_NAME" > "$FLEET_DIR/created_user"
    usermod -p '*' "$SUDO_USER_NAME"     # '!' (useradd's default) = locked: refused with UsePAM no
  fi
  case "$(getent shadow "$SUDO_USER_NAME" | cut -d: -f2)" in
    '!'*) echo "user $SUDO_USER_NAME is locked ('!...'): with UsePAM no, sshd refuses it." \
               "Unlock without a password: usermod -p '*' $SUDO_USER_NAME" >&2; exit 2 ;;
  esac
  if [ ! -e "$SUDOERS" ]; then
    printf '# written by mla-doctor tests/fleet/up.sh (%s); removed by down.sh\n%s ALL=(ALL) NOPASSWD: ALL\n' \
      "$FLEET_DIR" "$SUDO_USER_NAME" > "$SUDOERS.tmp"
    chmod 440 "$SUDOERS.tmp"
    if command -v visudo >/dev/null; then visudo -cqf "$SUDOERS.tmp" || { rm -f "$SUDOERS.tmp"; exit 2; }; fi
    mv "$SUDOERS.tmp" "$SUDOERS"
    echo "$SUDOERS" > "$FLEET_DIR/created_sudoers"
  fi
fi

# One client key for the whole fleet.
ssh-keygen -q -t ed25519 -N '' -C mla-fleet-client -f "$FLEET_DIR/id_ed25519"
cp "$FLEET_DIR/id_ed25519.pub" "$FLEET_DIR/authorized_keys"
chmod 644 "$FLEET_DIR/authorized_keys"

EXTRA=$(fleet_sshd_extra "$SSHD")

if [ "$MODE" = netns ]; then
  # note: `ip netns add` self-bind-mounts /run/netns and leaves it behind; down.sh undoes it
  BR=mla-br0
  ip link add "$BR" type bridge
  ip addr add 198.18.0.1/24 dev "$BR"
  ip link set "$BR" up
  # Guard: if the bridge vanishes, traffic to the fleet range must fail locally, never go out.
  ip route add unreachable 198.18.0.0/15 metric 4000
fi

: > "$FLEET_DIR/hosts.txt"
: > "$FLEET_DIR/known_hosts"
: > "$FLEET_DIR/ssh_config.d/hosts.conf"

# setup_host NAME I: write the host's keys, configs, start script and host.env
setup_host() {
  local name=$1 i=$2 hd="$FLEET_DIR/hosts/$1" addr port kh user=root proxy=- sudo=false netns own=0 veth=
  mkdir -p "$hd/fs"
  for d in $BIND_DIRS; do mkdir -p "$hd/fs$d"; done
  if [ -d "$hd/fs/root" ]; then cp -a /etc/skel/. "$hd/fs/root/" 2>/dev/null || true; chmod 700 "$hd/fs/root"; fi
  printf '127.0.0.1\tlocalhost\n127.0.1.1\t%s\n::1\tlocalhost ip6-localhost ip6-loopback\n' "$name" > "$hd/etc_hosts"
  ssh-keygen -q -t ed25519 -N '' -C "$name" -f "$hd/ssh_host_ed25519_key"
  port=$PORT
  if in_list "$name" "$HIDDEN_HOSTS"; then
    addr=127.0.0.1; port=$((2200 + i)); proxy=$BASTION; netns=mla-$BASTION
  elif [ "$MODE" = loopback ]; then
    addr=${FLEET_LOOPBACK_PREFIX:-127.0.10}.$i; netns=
  else
    addr=198.18.0.$((10 + i)); netns=mla-$name; own=1; veth=mla-v$i
  fi
  kh="[$addr]:$port"; [ "$port" = 22 ] && kh=$addr
  if in_list "$name" "$REKEYED_HOSTS"; then   # a WRONG key: an unrelated, freshly generated one
    ssh-keygen -q -t ed25519 -N '' -C "not-$name" -f "$hd/wrong_host_key"
    echo "$kh $(cut -d' ' -f1,2 "$hd/wrong_host_key.pub")" >> "$FLEET_DIR/known_hosts"
    rm -f "$hd/wrong_host_key"
  else
    echo "$kh $(cut -d' ' -f1,2 "$hd/ssh_host_ed25519_key.pub")" >> "$FLEET_DIR/known_hosts"
  fi
  local login="PermitRootLogin prohibit-password
AuthorizedKeysFile $FLEET_DIR/authorized_keys"
  if in_list "$name" "$SUDO_HOSTS"; then
    user=$SUDO_USER_NAME; sudo=true
    # sshd opens AuthorizedKeysFile as the target user, who cannot traverse a 0700 FLEET_DIR
    # (nor pytest's 0700 basetemp): let root-run cat hand it the same fleet-wide file.
    login="PermitRootLogin no
AllowUsers $SUDO_USER_NAME
AuthorizedKeysFile none
AuthorizedKeysCommand /bin/cat $FLEET_DIR/authorized_keys
AuthorizedKeysCommandUser root"
  fi
  # local forwarding (direct-tcpip) as sshd allows by default: mla-doctor's HTTP tunnel and ProxyJump use it;
  # hosts in FLEET_NOFWD_HOSTS refuse it, like a locked-down production sshd
  local fwd="AllowTcpForwarding local"
  case " ${FLEET_NOFWD_HOSTS:-} " in *" $name "*) fwd="AllowTcpForwarding no" ;; esac
  echo "$name $addr $port $user $proxy $sudo" >> "$FLEET_DIR/hosts.txt"
  {
    echo "Host $name"
    echo "  HostName $addr"
    echo "  Port $port"
    [ "$user" = root ] || echo "  User $user"
    [ "$proxy" = - ] || echo "  ProxyJump $proxy"
  } >> "$FLEET_DIR/ssh_config.d/hosts.conf"
  cat > "$hd/host.env" <<EOF
NAME=$name
ADDR=$addr
PORT=$port
NETNS=$netns
OWN_NETNS=$own
VETH=$veth
EOF
  fleet_sshd_config "$hd" "$name" "$addr" "$port" "$login" "$fwd" "$EXTRA"
  # Runs inside the new namespaces: private bind mounts, hostname, then sshd as PID 1.
  {
    echo '#!/bin/sh'
    echo 'set -e'
    [ "$own" = 1 ] && echo 'ip link set lo up'
    for d in $BIND_DIRS; do echo "mount --bind '$hd/fs$d' '$d'"; done
    echo "mount --bind '$hd/etc_hosts' /etc/hosts"
    echo "hostname '$name'"
    echo "exec '$SSHD' -D -e -f '$hd/sshd_config'"
  } > "$hd/start.sh"
  : > "$hd/sshd.log"
  if [ "$own" = 1 ]; then
    ip netns add "$netns"
    ip -n "$netns" link set lo up     # before any hidden host binds its 127.0.0.1
    ip link add "$veth" type veth peer name eth0 netns "$netns"
    ip link set "$veth" master "$BR" up
    ip -n "$netns" addr add "$addr/24" dev eth0
    ip -n "$netns" link set eth0 up
  fi
}

# Normal hosts first (the bastion's network namespace must exist), then the hidden ones.
order=()
hidden=()
for i in $(seq 1 "$N"); do
  if in_list "$(printf 'h%02d' "$i")" "$HIDDEN_HOSTS"; then hidden+=("$i"); else order+=("$i"); fi
done
order+=("${hidden[@]}")
for i in $(seq 1 "$N"); do setup_host "$(printf 'h%02d' "$i")" "$i"; done
for i in "${order[@]}"; do fleet_launch "$FLEET_DIR/hosts/$(printf 'h%02d' "$i")"; done

# Include first: OpenSSH takes the first value it obtains, so per-host blocks must come
# before the `Host *` defaults.
cat > "$FLEET_DIR/ssh_config" <<EOF
# generated by mla-doctor tests/fleet/up.sh
Include $FLEET_DIR/ssh_config.d/*.conf

Host *
  User root
  IdentityFile $FLEET_DIR/id_ed25519
  IdentitiesOnly yes
  UserKnownHostsFile $FLEET_DIR/known_hosts
  StrictHostKeyChecking yes
  BatchMode yes
  LogLevel ERROR
EOF

# hosts.json for Python tests, in host order
awk 'BEGIN{printf "["}
     {printf "%s\n {\"name\": \"%s\", \"host\": \"%s\", \"port\": %s, \"user\": \"%s\", \"proxy_jump\": %s, \"sudo\": %s}",
             (NR>1?",":""), $1, $2, $3, $4, ($5=="-" ? "null" : "\"" $5 "\""), $6}
     END{print "\n]"}' "$FLEET_DIR/hosts.txt" > "$FLEET_DIR/hosts.json"

# Wait until every sshd answers with its banner (bounded: 20 s), then record sshd PIDs.
deadline=$(( $(date +%s) + 20 ))
for i in "${order[@]}"; do
  fleet_wait_ready "$FLEET_DIR/hosts/$(printf 'h%02d' "$i")" "$deadline"
done

t1=$(date +%s.%N)
awk -v a="$t0" -v b="$t1" -v n="$N" -v m="$MODE" -v d="$FLEET_DIR" 'BEGIN{printf "fleet up: %s hosts, mode %s, in %.2fs (%s)\n", n, m, b-a, d}'

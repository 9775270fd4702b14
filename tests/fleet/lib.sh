# lib.sh: shell functions shared by up.sh, down.sh and rekey.sh (sourced, not run).
#
# Every host directory $FLEET_DIR/hosts/<name>/ holds host.env, written by up.sh:
#   NAME      h01...
#   ADDR PORT where sshd listens (in the host's network namespace)
#   NETNS     network namespace the host's sshd runs in ('' in loopback mode;
#             the bastion's namespace for a hidden host)
#   OWN_NETNS 1 if NETNS belongs to this host (down.sh deletes it and the veth)
#   VETH      the host-side veth name, or ''

# alive PID COMM: process exists, is not a zombie (the reaper may take ~1 s), has that name
fleet_alive() {
  awk -v c="$2" '/^Name:/{n=$2} /^State:/{s=$2} END{exit !(n==c && s!="Z")}' "/proc/$1/status" 2>/dev/null
}

# fleet_launch HOSTDIR: start the host's sshd as PID 1 of new mount+PID+UTS namespaces,
# inside $NETNS when set. Records the unshare PID in unshare.pid.
fleet_launch() {
  local hd=$1 NAME ADDR PORT NETNS OWN_NETNS VETH
  # shellcheck disable=SC1091
  . "$hd/host.env"
  local launcher=()
  [ -n "$NETNS" ] && launcher=(ip netns exec "$NETNS")
  # --kill-child: if unshare dies, sshd (PID 1 of the host) gets SIGTERM and the kernel
  # then kills every process left in that PID namespace. Mounts vanish with the namespace.
  setsid "${launcher[@]}" unshare --mount --uts --pid --fork --mount-proc --kill-child=TERM \
      sh "$hd/start.sh" >> "$hd/sshd.log" 2>&1 < /dev/null &
  echo $! > "$hd/unshare.pid"
  rm -f "$hd/sshd.pid"
}

# fleet_wait_ready HOSTDIR DEADLINE(epoch s): wait for the SSH-2.0 banner (from inside
# $NETNS for a hidden host, which the controller cannot reach), then record sshd's PID.
fleet_wait_ready() {
  local hd=$1 deadline=$2 NAME ADDR PORT NETNS OWN_NETNS VETH
  # shellcheck disable=SC1091
  . "$hd/host.env"
  local probe="exec 3<>/dev/tcp/$ADDR/$PORT && head -c 7 <&3 | grep -q SSH-2.0"
  local via=()
  [ "$OWN_NETNS" = 1 ] || [ -z "$NETNS" ] || via=(ip netns exec "$NETNS")
  local upid
  upid=$(cat "$hd/unshare.pid")
  until "${via[@]}" bash -c "$probe" 2>/dev/null; do
    if ! fleet_alive "$upid" unshare; then
      echo "host $NAME ($ADDR:$PORT${NETNS:+ in netns $NETNS}): sshd exited; log:" >&2
      cat "$hd/sshd.log" >&2
      return 1
    fi
    if [ "$(date +%s)" -ge "$deadline" ]; then
      echo "host $NAME ($ADDR:$PORT${NETNS:+ in netns $NETNS}) did not come up; log:" >&2
      cat "$hd/sshd.log" >&2
      return 1
    fi
    sleep 0.05
  done
  awk '{print $1}' "/proc/$upid/task/$upid/children" 2>/dev/null > "$hd/sshd.pid"
}

# fleet_signal HOSTDIR: SIGTERM the host's sshd (only if it is still the child of our
# unshare); prints the unshare PID when it is still alive, for fleet_reap.
fleet_signal() {
  local hd=$1 upid spid
  [ -f "$hd/unshare.pid" ] || return 0
  upid=$(cat "$hd/unshare.pid")
  spid=$(cat "$hd/sshd.pid" 2>/dev/null || true)
  if [ -z "$spid" ]; then   # not recorded yet (up.sh failed half-way): find it now
    spid=$(awk '{print $1}' "/proc/$upid/task/$upid/children" 2>/dev/null || true)
  fi
  if [ -n "$spid" ] && [ "$(awk '/^PPid:/{print $2}' "/proc/$spid/status" 2>/dev/null)" = "$upid" ]; then
    kill -TERM "$spid" 2>/dev/null
  fi
  if fleet_alive "$upid" unshare; then echo "$upid"; fi
}

# fleet_reap PID...: wait for those unshare processes to exit; SIGKILL after 5 s
# (`unshare --fork` ignores SIGTERM; --kill-child then takes the host's PID namespace down).
fleet_reap() {
  local deadline=$(( $(date +%s) + 5 )) p
  for p in "$@"; do
    while fleet_alive "$p" unshare; do
      if [ "$(date +%s)" -ge "$deadline" ]; then kill -KILL "$p" 2>/dev/null; sleep 0.1; fi
      sleep 0.02
    done
  done
}

# fleet_sshd_extra SSHD: the sshd options only this sshd's version needs: OpenSSH >= 9.8 penalises
# sources (127.0.0.1 included) that fail auth or drop early, which a test fleet does on purpose.
fleet_sshd_extra() {
  local version
  version=$("$1" -V 2>&1 | head -1 || true)   # e.g. "OpenSSH_9.2p1 Debian-2+deb12u10, ..." (sshd -V may exit 1)
  if printf '%s' "$version" | grep -Eq 'OpenSSH_(9\.(8|9)|[1-9][0-9])'; then echo "PerSourcePenalties no"; fi
}

# fleet_sshd_config HOSTDIR NAME ADDR PORT LOGIN FWD EXTRA: write HOSTDIR/sshd_config (host key
# HOSTDIR/ssh_host_ed25519_key; LOGIN: who may log in and how; FWD: the AllowTcpForwarding line;
# EXTRA: options only some OpenSSH versions know, may be empty). Shared by up.sh and service-host.sh.
fleet_sshd_config() {
  cat > "$1/sshd_config" <<EOF
Port $4
ListenAddress $3
AddressFamily inet
HostKey $1/ssh_host_ed25519_key
PidFile none
$5
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
UsePAM no
StrictModes no
UseDNS no
$6
MaxStartups 200:30:400
MaxSessions 100
LoginGraceTime 30
LogLevel VERBOSE
PrintMotd no
PrintLastLog no
Subsystem sftp internal-sftp
AcceptEnv LANG LC_*
SetEnv MLA_FLEET_HOST=$2
$7
EOF
}

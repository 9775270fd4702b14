"""How commands reach a host: one SSH connection per host (paramiko), or this machine (--local).

Every command is a shell string assembled with shlex.quote from argv-like pieces; nothing a
user typed is pasted into a shell unquoted. Host keys are verified: a changed key is always
refused (unless the policy is explicitly `off`), an unknown key is refused under `strict` and
recorded under `accept-new`. known_hosts is read here, not by paramiko (which crashes on marker lines):
a key listed after `@revoked` is refused for every host, under every policy but `off`; a host that an
`@cert-authority` line covers and whose own key is not listed is refused ("host certificates are not
supported") instead of being trusted on first use; lines that cannot be parsed are skipped.
"""
from __future__ import annotations

import base64
import binascii
import functools
import logging
import os
import re
import select
import shlex
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mla_doctor.errors import AuthError, HostKeyError, RemoteError, UnreachableError, UsageError
from mla_doctor.ssh.local import (  # noqa: F401 - re-exported: the connection's types live in ssh.local
    HOST_KEY_POLICIES,
    CommandResult,
    ConnectOptions,
    LocalTransport,
    Stream,
    Transport,
    TransportStats,
)
from mla_doctor.ssh.sshconfig import (HostParams, SSHConfigFile, check_port, check_user, default_config_path,
                                      parse_jump, proxy_command_line, split_target)

if TYPE_CHECKING:
    import paramiko


# paramiko logs a refused tunnel channel ("Secsh channel N open FAILED") at ERROR; while a restarted
# server loads, every readiness poll is one. Its failures reach us as exceptions: keep stderr clean.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


def _paramiko():
    """paramiko, imported on first SSH use: `--local` never loads it (it pulls invoke, asyncio, unittest.mock)."""
    import paramiko

    return paramiko


@functools.lru_cache(maxsize=None)
def _policies():
    """The host-key policy classes (they subclass paramiko's, so they are made on first SSH use)."""
    paramiko = _paramiko()

    class AcceptNewPolicy(paramiko.MissingHostKeyPolicy):
        """Like OpenSSH's accept-new: record an unknown key by appending one line; never rewrite the file."""

        def __init__(self, path: str | None):
            self.path = path

        def missing_host_key(self, client, hostname, key):
            client.get_host_keys().add(hostname, key.get_name(), key)
            if self.path:
                os.makedirs(os.path.dirname(os.path.abspath(self.path)) or ".", exist_ok=True)
                with open(self.path, "a", encoding="ascii") as f:
                    f.write(f"{hostname} {key.get_name()} {key.get_base64()}\n")

    class AcceptAnyPolicy(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            return None

    class CheckedPolicy(paramiko.MissingHostKeyPolicy):
        """Before the policy sees an unknown key: refuse a revoked key or a host only a CA vouches for."""

        def __init__(self, inner, known: KnownHosts, label: str):
            self.inner, self.known, self.label = inner, known, label

        def missing_host_key(self, client, hostname, key):
            self.known.refuse(hostname, key, self.label)
            return self.inner.missing_host_key(client, hostname, key)

    return AcceptNewPolicy, AcceptAnyPolicy, CheckedPolicy


@dataclass
class KnownHosts:
    """known_hosts as OpenSSH reads it: plain keys (loaded into paramiko), `@revoked` keys and
    `@cert-authority` host patterns, each with the file and line it came from."""

    entries: list = field(default_factory=list)  # paramiko HostKeyEntry: trusted plain keys
    revoked: list[tuple[str, int, bytes]] = field(default_factory=list)  # (path, line, key blob)
    authorities: list[tuple[str, int, list[str]]] = field(default_factory=list)  # (path, line, host patterns)
    skipped: list[tuple[str, int, str]] = field(default_factory=list)  # (path, line, why)

    def fill(self, keys: paramiko.HostKeys, only: str | None = None) -> paramiko.HostKeys:
        """Add the trusted keys (never a revoked one) to paramiko's table; the first line for a name and type
        wins. A revoked key is thus unknown to paramiko, which asks the policy, which refuses it.
        `only`: the one name paramiko will look up ([host]:port off 22) — lines for other hosts are left
        out, so a fleet's connections don't each copy a known_hosts of thousands of lines."""
        blobs = {b for _, _, b in self.revoked}
        for e in self.entries:
            if only is not None and not any(_name_is(h, only) for h in e.hostnames):
                continue
            if e.key.asbytes() in blobs:
                continue
            for name in e.hostnames:
                have = keys.lookup(name)
                if have is None or e.key.get_name() not in have:
                    keys.add(name, e.key.get_name(), e.key)
        return keys

    def revoked_at(self, key) -> str | None:
        blob = key.asbytes()
        return next((f"{p}:{n}" for p, n, b in self.revoked if b == blob), None)

    def authority_for(self, name: str) -> str | None:
        return next((f"{p}:{n}" for p, n, pats in self.authorities if host_matches(pats, name)), None)

    def refuse(self, name: str, key, label: str) -> None:
        """Raise HostKeyError when `key` offered by `name` ([host]:port off 22) must not be accepted."""
        where = self.revoked_at(key)
        if where:
            raise HostKeyError(f"REVOKED HOST KEY: {name} offered {key.get_name()} {_fingerprint(key)}, which "
                               f"{where} marks @revoked; refusing to connect. The host's key must be replaced "
                               f"(and known_hosts updated) before it can be audited", host=label)
        where = self.authority_for(name)
        if where:
            raise HostKeyError(f"{where} trusts a certificate authority (@cert-authority) for {name}, and its own "
                               f"key ({key.get_name()} {_fingerprint(key)}) is not in known_hosts: host "
                               f"certificates are not supported; add the host's key itself to known_hosts "
                               f"(ssh-keyscan), then connect again", host=label)


def _name_is(entry_name: str, name: str) -> bool:
    """One known_hosts host field against the name paramiko looks up, as `HostKeys.lookup` compares them
    (exact, or a hashed `|1|salt|hash` field; paramiko has no wildcards in plain key lines)."""
    if entry_name.startswith("|1|"):
        try:
            return _paramiko().HostKeys.hash_host(name, entry_name) == entry_name
        except (AssertionError, binascii.Error, ValueError, IndexError):
            return False
    return entry_name == name


def host_matches(patterns: list[str], name: str) -> bool:
    """OpenSSH known_hosts patterns: `*` and `?` wildcards, `!` negation (wins), hashed `|1|salt|hash`."""
    hit = False
    for pat in patterns:
        neg = pat.startswith("!")
        pat = pat[1:] if neg else pat
        if pat.startswith("|1|"):
            try:
                ok = _paramiko().HostKeys.hash_host(name, pat) == pat
            except (AssertionError, binascii.Error, ValueError, IndexError):
                ok = False
        else:  # only * and ? are special (no [classes]: `[host]:port` is literal)
            rx = "".join(".*" if c == "*" else "." if c == "?" else re.escape(c) for c in pat.lower())
            ok = re.fullmatch(rx, name.lower()) is not None
        if ok and neg:
            return False
        hit = hit or ok
    return hit


def read_known_hosts(path: str, into: KnownHosts) -> KnownHosts:
    """Add one known_hosts file to `into`; never crashes on a line (markers, bad base64, unknown types)."""
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    for n, raw in enumerate(lines, 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        marker = fields.pop(0) if fields[0].startswith("@") else None
        if len(fields) < 3:
            into.skipped.append((path, n, "not enough fields"))
            continue
        if marker == "@cert-authority":
            into.authorities.append((path, n, fields[0].split(",")))
        elif marker == "@revoked":
            try:
                into.revoked.append((path, n, base64.b64decode(fields[2], validate=True)))
            except (binascii.Error, ValueError):
                into.skipped.append((path, n, "bad key data in @revoked line"))
        elif marker:
            into.skipped.append((path, n, f"unknown marker {marker}"))
        else:
            try:
                entry = _paramiko().hostkeys.HostKeyEntry.from_line(" ".join(fields[:3]), n)
            except Exception as e:  # InvalidHostKey, SSHException, binascii.Error: skip the line, as ssh does
                into.skipped.append((path, n, f"unreadable key: {e}"))
                continue
            if entry is None:
                into.skipped.append((path, n, f"unsupported key type {fields[1]}"))
            else:
                into.entries.append(entry)
    return into


def load_known_hosts(paths: list[str], system: str | None = "/etc/ssh/ssh_known_hosts") -> KnownHosts:
    """The user's files (unreadable: a usage error), then the system file (errors ignored)."""
    kh = KnownHosts()
    for path in paths:
        if os.path.exists(path):
            try:
                read_known_hosts(path, kh)
            except OSError as e:
                raise UsageError(f"{path}: cannot read known_hosts: {e.strerror or e}") from e
    if system and os.path.exists(system):
        try:
            read_known_hosts(system, kh)
        except OSError:
            pass
    return kh


def _file_id(path: str | None):
    try:
        st = os.stat(path) if path else None
    except OSError:
        return None
    return st and (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


_READ_LOCK = threading.Lock()
_MISSING = object()


def _read_once(cache: dict, key: tuple, read):
    """read(), kept in `cache` for this process under `key`, which names the files read by their identity
    (`_file_id`: an edited or replaced file is another key, so it is read afresh); at most 16 kept. A fleet's
    threads share one read instead of one per host; what is kept is never mutated after it is read."""
    with _READ_LOCK:
        got = cache.get(key, _MISSING)
    if got is _MISSING:
        got = read()
        with _READ_LOCK:
            if len(cache) > 16:
                cache.clear()
            cache[key] = got
    return got


_KNOWN_CACHE: dict = {}
_KEYS: dict = {}


def known_hosts_for(paths: list[str], system: str | None = "/etc/ssh/ssh_known_hosts") -> KnownHosts:
    """`load_known_hosts`, read once per process while the files stay as they are (`_read_once`; it was per
    host, so O(hosts x lines)): an accept-new append, an edit or a replaced file is read afresh."""
    key = (tuple(paths), system, tuple(_file_id(p) for p in paths), _file_id(system))
    return _read_once(_KNOWN_CACHE, key, lambda: load_known_hosts(paths, system))


def identity_key(path: str):
    """The private key in `path` as paramiko's SSHClient would load it for `key_filename` (each key class in
    its order; a `-cert.pub` beside it attached), read once per process while the key and certificate files
    stay as they are (`_read_once`): a fleet audit connects to every host with the same identity (paramiko
    parsed the file about three times per host). None when it does not load without a passphrase: paramiko
    then tries the file itself, as before."""
    cert = path + "-cert.pub"
    return _read_once(_KEYS, (path, _file_id(path), _file_id(cert)), lambda: _load_identity(path, cert))


def _load_identity(path: str, cert: str):
    paramiko = _paramiko()
    for cls in (paramiko.RSAKey, paramiko.ECDSAKey, paramiko.Ed25519Key):
        try:
            key = cls.from_private_key_file(path)
            if os.path.isfile(cert):
                key.load_certificate(cert)
            return key
        except (paramiko.SSHException, OSError, ValueError):
            continue
    return None


def _fingerprint(key) -> str:
    import base64
    import hashlib

    return "SHA256:" + base64.b64encode(hashlib.sha256(key.asbytes()).digest()).decode().rstrip("=")


class SSHTransport(Transport):
    """One paramiko connection per host (plus one per bastion hop), reused for every command."""

    def __init__(self, target: str, options: ConnectOptions, config: SSHConfigFile | None = None):
        super().__init__()
        self.options = options
        self.config = config or SSHConfigFile(options.ssh_config or default_config_path())
        user, host, port = split_target(target)
        self.params = self.config.lookup(host)
        # checked again here, whoever built the target (inventory, --host, a caller of the library): the user
        # and port reach ssh_config's %r/%p and the jump hops
        self.user = check_user(user or options.user or self.params.user or os.environ.get("USER") or "root")
        self.port = check_port(port or options.port or self.params.port)
        self.name = target
        self._clients: list[paramiko.SSHClient] = []
        try:
            self.client = self._connect_chain()
        except BaseException:
            self.close()  # a bastion hop may already be connected
            raise

    # -- connecting -------------------------------------------------------------------------

    def _policy(self, params: HostParams) -> str:
        if self.options.host_key_policy:
            return self.options.host_key_policy
        shk = (params.strict_host_key_checking or "").lower()
        return {"yes": "strict", "accept-new": "accept-new"}.get(shk, "accept-new")

    def _known_hosts(self, params: HostParams) -> list[str]:
        if self.options.known_hosts:
            return [os.path.expanduser(self.options.known_hosts)]
        return list(params.known_hosts_files) or [os.path.expanduser("~/.ssh/known_hosts")]

    def _connect_chain(self) -> paramiko.SSHClient:
        paramiko = _paramiko()
        jumps = parse_jump(self.params.proxy_jump) if self.params.proxy_jump else []
        hops: list[tuple[HostParams, str, int]] = []
        for juser, jhost, jport in jumps:
            jp = self.config.lookup(jhost)
            hops.append((jp, check_user(juser or jp.user or self.options.user or "root", "ProxyJump user"),
                         check_port(jport or jp.port, "ProxyJump port")))
        hops.append((self.params, self.user, self.port))
        for i, (params, user, port) in enumerate(hops):
            label = params.alias if i < len(hops) - 1 else self.name
            if i == 0 and params.proxy_command:
                sock = paramiko.ProxyCommand(proxy_command_line(params.proxy_command, params.hostname, port))
            elif i == 0:
                sock = self._tcp(params.hostname, port, label)
            else:  # through the previous hop: a direct-tcpip channel on its connection
                try:
                    sock = self._clients[-1].get_transport().open_channel(
                        "direct-tcpip", (params.hostname, port), ("127.0.0.1", 0),
                        timeout=self.options.connect_timeout)
                except Exception as e:
                    raise UnreachableError(f"bastion {hops[i - 1][0].alias} could not open a tunnel to "
                                           f"{params.hostname}:{port}: {e}", host=self.name) from e
            self._clients.append(self._handshake(params, user, port, sock, label))
            self.stats.hops.append(f"{user}@{params.hostname}:{port}")
        return self._clients[-1]

    def _tcp(self, hostname: str, port: int, label: str):
        t0 = time.monotonic()
        try:
            s = socket.create_connection((hostname, port), timeout=self.options.connect_timeout)
        except socket.gaierror as e:
            raise UnreachableError(f"cannot resolve {hostname}: {e.strerror}", host=label) from e
        except (socket.timeout, TimeoutError) as e:
            raise UnreachableError(f"connect to {hostname}:{port} timed out after "
                                   f"{self.options.connect_timeout:g}s", host=label) from e
        except OSError as e:
            raise UnreachableError(f"cannot connect to {hostname}:{port}: {e.strerror or e}", host=label) from e
        finally:
            self.stats.connect_s += time.monotonic() - t0
        self.stats.connections += 1
        return s

    def _handshake(self, params: HostParams, user: str, port: int, sock, label: str) -> paramiko.SSHClient:
        paramiko = _paramiko()
        AcceptNewPolicy, AcceptAnyPolicy, CheckedPolicy = _policies()
        client = paramiko.SSHClient()
        policy = self._policy(params)
        known = self._known_hosts(params)
        kh = known_hosts_for(known) if policy != "off" else KnownHosts()
        # The name keys are looked up under: HostKeyAlias, else host (and [host]:port off 22).
        key_name = params.host_key_alias or params.hostname
        kh.fill(client.get_host_keys(), only=_kh_name(key_name, port))
        inner = (paramiko.RejectPolicy() if policy == "strict"
                 else AcceptNewPolicy(known[0]) if policy == "accept-new" else AcceptAnyPolicy())
        client.set_missing_host_key_policy(inner if policy == "off" else CheckedPolicy(inner, kh, label))
        # paramiko saves *all* keys on AutoAdd; we append one line ourselves instead.
        client._host_keys_filename = None
        idents = list(self.options.identity) + list(params.identity_files)
        idents = [p for p in idents if os.path.exists(p)]
        only = params.identities_only or bool(self.options.identity)
        # the first identity tried as a key loaded once per process; the rest by file, in order, as before
        first = identity_key(idents[0]) if idents and not idents[0].endswith("-cert.pub") else None
        t0 = time.monotonic()
        try:
            client.connect(
                key_name, port=port, username=user, sock=sock, pkey=first,
                key_filename=(idents[1:] if first is not None else idents) or None,
                look_for_keys=not only, allow_agent=not only, timeout=self.options.connect_timeout,
                banner_timeout=self.options.connect_timeout, auth_timeout=self.options.connect_timeout,
                compress=False,
            )
        except HostKeyError:  # refused by _CheckedPolicy: revoked, or only a CA vouches for the host
            client.close()
            raise
        except paramiko.BadHostKeyException as e:
            client.close()
            if kh.revoked_at(e.key):
                kh.refuse(_kh_name(key_name, port), e.key, label)
            raise HostKeyError(
                f"HOST KEY CHANGED for {key_name} (port {port}): known_hosts has {_fingerprint(e.expected_key)}, "
                f"host offered {e.key.get_name()} {_fingerprint(e.key)}; refusing to connect. If the change is "
                f"expected, remove the old key: ssh-keygen -R {shlex.quote(_kh_name(key_name, port))}",
                host=label) from e
        except paramiko.AuthenticationException as e:
            client.close()
            tried = ", ".join(idents) if idents else "agent and default keys"
            raise AuthError(f"authentication refused for user {user!r} ({tried}): {e}", host=label) from e
        except paramiko.SSHException as e:
            silent = self._no_banner(client, params.hostname, port, label)
            client.close()
            if silent:
                raise silent from e
            msg = str(e)
            if "not found in known_hosts" in msg:
                raise HostKeyError(f"unknown host key for {_kh_name(key_name, port)} and --host-key-policy "
                                   f"strict: add it to {known[0]} first (ssh-keyscan), or use accept-new",
                                   host=label) from e
            raise UnreachableError(f"SSH handshake failed: {msg}", host=label) from e
        except (socket.timeout, TimeoutError, EOFError, OSError) as e:
            silent = self._no_banner(client, params.hostname, port, label)
            client.close()
            raise (silent or UnreachableError(f"SSH handshake failed: {e or type(e).__name__}", host=label)) from e
        finally:
            self.stats.connect_s += time.monotonic() - t0
        tr = client.get_transport()
        if tr is not None:
            tr.set_keepalive(15)
        return client

    def _no_banner(self, client, hostname: str, port: int, label: str) -> UnreachableError | None:
        """The failure said as what it was when the host never sent its SSH banner (paramiko then reports
        whatever its next step hit, e.g. "No existing session"): a port that accepts and never speaks."""
        tr = client.get_transport()
        if tr is None or getattr(tr, "remote_version", None):
            return None
        return UnreachableError(f"no SSH banner from {hostname}:{port} within {self.options.connect_timeout:g}s: "
                                "the port accepts connections but nothing speaks SSH there (sshd hung or "
                                "overloaded, or another service)", host=label)

    # -- running ----------------------------------------------------------------------------

    def _exec(self, command):
        """A new session channel on the one connection, running `command`."""
        paramiko = _paramiko()
        tr = self.client.get_transport()
        if tr is None or not tr.is_active():
            raise UnreachableError("SSH connection lost", host=self.name)
        try:
            chan = tr.open_session(timeout=self.options.connect_timeout)
            chan.exec_command(command)
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise UnreachableError(f"cannot open a session: {e}", host=self.name) from e
        return chan

    def run(self, command, stdin=None, timeout=None):
        paramiko = _paramiko()
        timeout = timeout or self.options.command_timeout
        t0 = time.monotonic()
        chan = self._exec(command)
        self.stats.executions += 1
        writer = None
        if stdin:
            def _write():
                try:
                    chan.sendall(stdin)
                    chan.shutdown_write()
                except (OSError, EOFError, paramiko.SSHException):
                    pass

            if len(stdin) <= chan.out_window_size:
                _write()  # within the window the server granted: sending cannot wait for output to be read
            else:  # in a thread, so a large payload cannot deadlock against unread output
                writer = threading.Thread(target=_write, daemon=True)
                writer.start()
            self.stats.bytes_sent += len(stdin)
        else:
            chan.shutdown_write()
        try:
            rc, out, err = read_to_end(chan, t0 + timeout, timeout, self.name)
        finally:
            chan.close()
            if writer:
                writer.join(timeout=1)
        self.stats.bytes_received += len(out) + len(err)
        return CommandResult(rc, bytes(out), bytes(err), time.monotonic() - t0)

    def open_stream(self, command):
        return self._opened(_SSHStream(self._exec(command), self.name))

    def close(self):
        self.close_streams()
        for c in reversed(self._clients):
            try:
                c.close()
            except Exception:
                pass
        self._clients = []


NO_EXIT_STATUS = -1  # paramiko's exit_status when the channel closed without one (killed by a signal: exit-signal)


def read_to_end(chan, deadline: float, timeout: float, name: str) -> tuple[int, bytearray, bytearray]:
    """stdout, stderr and the exit status of one `exec` channel, read until the channel's EOF *and* its exit
    status (or its close). Never until the exit status alone: sshd sends the exit status when it reaps the
    command, which may be before it has drained the command's pipe, so data can follow the status. EOF covers
    both streams (stderr is the same channel's extended data) and paramiko handles a channel's messages in
    order, so once EOF is in, everything sent before it is in the buffers.

    A channel that closes with no EOF was cut (the connection died, or was closed from here: a timeout or a
    cancel): that is an UnreachableError saying how much had arrived, never a short answer returned as whole."""
    out, err = bytearray(), bytearray()

    def drain() -> bool:
        got = False
        while chan.recv_ready():
            out.extend(chan.recv(1 << 16))
            got = True
        while chan.recv_stderr_ready():
            err.extend(chan.recv_stderr(1 << 16))
            got = True
        return got

    while True:
        got = drain()
        if chan.eof_received and chan.exit_status_ready():
            break
        if chan.closed:
            drain()
            if not chan.eof_received:
                tr = getattr(chan, "transport", None)
                why = "the SSH connection was lost" if tr is None or not tr.is_active() else "the channel closed"
                raise UnreachableError(f"{why} before the command's output ended ({len(out)} bytes of stdout, "
                                       f"{len(err)} of stderr received, no exit status)", host=name)
            break
        now = time.monotonic()
        if now > deadline:
            raise RemoteError(f"command timed out after {timeout:g}s ({len(out)} bytes of stdout received, "
                              f"{'end of output in' if chan.eof_received else 'output not ended'}, "
                              "no exit status)", host=name)
        if not got:
            # Sleep until something happens, not on a short tick: the channel's pipe is set by data, EOF and
            # close, so a long wait costs nothing in latency, while a 20 ms tick woke each of a fleet's
            # threads ~50 times a second for every second its agent ran (GIL hand-offs, CPU per host).
            wait = max(0.0, min(0.5, deadline - now))
            if chan.eof_received:  # nothing more to read: only the exit status (or the close) is still to come
                chan.status_event.wait(wait)
            else:
                select.select([chan], [], [], wait)
    drain()
    return chan.recv_exit_status(), out, err


class _SSHStream(Stream):
    """An `exec` channel kept open: stdout read with a timeout, stderr drained by a thread."""

    TIMEOUTS = (socket.timeout, TimeoutError)

    def __init__(self, chan, name: str):
        super().__init__(name)
        self.chan = chan
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        try:
            for chunk in iter(lambda: self.chan.recv_stderr(4096), b""):
                self._keep_err(chunk)
        except (OSError, EOFError):
            pass

    def write(self, data: bytes) -> None:
        try:
            self.chan.sendall(data)
        except (OSError, EOFError) as e:
            raise RemoteError(f"the agent's channel failed: {e}", host=self.name) from e
        except Exception as e:  # paramiko.SSHException
            raise RemoteError(f"the agent's channel failed: {e}", host=self.name) from e

    def _recv(self, n: int, timeout: float) -> bytes:
        self.chan.settimeout(timeout)
        return self.chan.recv(n)

    def close(self, kill: bool = False) -> None:
        if self.closed:
            return
        super().close()
        try:
            self.chan.shutdown_write()  # end of requests: the agent exits
            self.chan.close()
        except Exception:  # noqa: BLE001 - a dead connection: nothing left to close
            pass


def _kh_name(host: str, port: int) -> str:
    return host if port == 22 else f"[{host}]:{port}"


_split_target = split_target  # the old name (tests, callers)


def open_transport(target: str | None, options: ConnectOptions, config: SSHConfigFile | None = None) -> Transport:
    if options.local:
        return LocalTransport(options.command_timeout)
    if not target:
        raise UsageError("no host: give --host HOST (or --local to audit this machine)")
    return SSHTransport(target, options, config)

"""The agent's contract: its version, the ops it answers (and the modules that answer them), the marks it
writes, how it travels.

The controller (mla_doctor/remote/bundle.py) sends, on the stdin of `python -B -c BOOTSTRAP`, one
payload: PAYLOAD_MAGIC, the length of what follows (4 bytes, big-endian), the agent package's
sources as zlib-compressed JSON {"facts/ops.py": source, ...}; then the JSON plan. BOOTSTRAP
refuses Python < 3.8 (exit OLD_PYTHON_RC) and hands the sources to _boot.py, which imports them
from memory: nothing is written on the host to run the agent. The agent starts itself the same
way elsewhere (inside a container) with the very payload it was started with (reexec.py).
"""
from __future__ import annotations

AGENT_VERSION = 1
# The one table of the ops: op -> (module, function) that answers it, relative to this package. main.py
# dispatches through it (each module imported only when its op runs); OPS, its names, is what the
# controller's typed builders (mla_doctor/remote/protocol.py) are checked against.
DISPATCH = {
    "static": ("facts.ops", "op_static"),
    "index": ("facts.ops", "op_index"),
    "patch": ("lifecycle.patch", "op_patch"),
    "revert": ("lifecycle.revert", "op_revert"),
    "renew": ("lease", "op_renew"),
    "records": ("change.records", "op_records"),
    "server_restart": ("runtimes.process", "op_server_restart"),
    "server_restore": ("lifecycle.server", "op_server_restore"),
    "tick": ("lifecycle.server", "op_tick"),
    "http": ("loopback", "op_http"),
    "port_held": ("facts.processes", "op_port_held"),
    "command_restart": ("runtimes.command", "op_command_restart"),
    "systemd_restart": ("runtimes.systemd", "op_systemd_restart"),
    "docker_find": ("runtimes.docker", "op_docker_find"),
    "docker_restart": ("runtimes.docker", "op_docker_restart"),
    "attach_check": ("attach.ops", "op_attach_check"),
    "attach": ("attach.ops", "op_attach"),
    "detach": ("attach.ops", "op_detach"),
}
OPS = tuple(DISPATCH)

PACKAGE = "mla_doctor_agent"  # the package's name on the host, in memory (module files: mla_doctor_agent/...)
PAYLOAD_MAGIC = b"MLAD"
PAYLOAD_HEADER = len(PAYLOAD_MAGIC) + 4  # magic, then the compressed sources' length (4 bytes, big-endian)
OLD_PYTHON_RC = 97
# Both bootstraps start the same way: refuse an old interpreter (exit OLD_PYTHON_RC) before anything else.
_PY_CHECK = (
    "import sys\n"
    "if sys.version_info < (3, 8):\n"
    "    sys.stderr.write('mla-doctor: the agent needs Python 3.8+, %%s is %%d.%%d\\n' %% "
    "((sys.executable,) + tuple(sys.version_info[:2])))\n"
    "    sys.exit(%d)\n"
    "import json, zlib\n"
) % OLD_PYTHON_RC
_NOT_FRAMED = "    sys.stderr.write('mla-doctor: the agent payload on stdin is not framed as expected\\n')\n"
BOOTSTRAP = _PY_CHECK + (
    "d = sys.stdin.buffer.read()\n"
    "n = %d + int.from_bytes(d[%d:%d], 'big')\n"
    "if d[:%d] != %r or len(d) < n:\n"
    + _NOT_FRAMED +
    "    sys.exit(2)\n"
    "m = json.loads(zlib.decompress(d[%d:n]).decode('utf-8'))\n"
    "g = {'__name__': '%s._boot'}\n"
    "exec(compile(m['_boot.py'], '%s/_boot.py', 'exec', dont_inherit=True), g)\n"
    "sys.exit(g['start'](m, d[:n], d[n:]))\n"
) % (PAYLOAD_HEADER, len(PAYLOAD_MAGIC), PAYLOAD_HEADER, len(PAYLOAD_MAGIC), PAYLOAD_MAGIC, PAYLOAD_HEADER, PACKAGE,
     PACKAGE)

# The same agent serving every op of a live run on one connection (`serve`): the payload as above, then
# frames both ways, each a 4-byte big-endian length and that many bytes of JSON. The agent answers a hello
# frame first (before any request: the controller knows it started), then one answer frame per request
# frame, in order, until stdin ends. Its real stdin/stdout carry only frames (fd 0 and 1 are /dev/null to
# everything else it runs).
FRAME_HEADER = 4
SERVE_BOOTSTRAP = _PY_CHECK + (
    "h = sys.stdin.buffer.read(%d)\n"
    "b = sys.stdin.buffer.read(int.from_bytes(h[%d:%d], 'big')) if h[:%d] == %r and len(h) == %d else b''\n"
    "if not b:\n"
    + _NOT_FRAMED +
    "    sys.exit(2)\n"
    "m = json.loads(zlib.decompress(b).decode('utf-8'))\n"
    "g = {'__name__': '%s._boot'}\n"
    "exec(compile(m['_boot.py'], '%s/_boot.py', 'exec', dont_inherit=True), g)\n"
    "sys.exit(g['serve'](m, h + b))\n"
) % (PAYLOAD_HEADER, len(PAYLOAD_MAGIC), PAYLOAD_HEADER, len(PAYLOAD_MAGIC), PAYLOAD_MAGIC, PAYLOAD_HEADER, PACKAGE,
     PACKAGE)

class Refusal(Exception):
    """A precondition failed: nothing has been changed."""

"""The in-memory importer the bootstrap starts: the agent package imported from the payload's sources.

BOOTSTRAP (protocol.py) runs this file's source with __name__ "<package>._boot" and calls start().
Each module is compiled on its first import (a read-only op never compiles the modules that change
files), under a file name such as mla_doctor_agent/facts/ops.py whose lines linecache knows, so a
traceback names the module and shows its line. Nothing is written on the host.

A controller on this same machine (--local) may put the modules already compiled between the payload and
the plan (CODE_MAGIC, this interpreter's bytecode magic, a 4-byte length, marshal of {path: code}): used only
when the magic is this interpreter's, else every module is compiled from its source as above.
"""
import importlib
import linecache
import marshal
import os
import sys
from importlib.machinery import ModuleSpec


class SourceImporter:
    """Finds and loads `package` and its submodules from {relative path: source}: a meta path finder and
    loader by protocol (find_spec, create_module, exec_module). Not derived from importlib.abc's classes:
    importing importlib.abc pulls importlib.resources, pathlib, tempfile, shutil, typing (~10 ms of every
    agent's start) for two base classes that add nothing here."""

    def __init__(self, package, sources, codes=None):
        self.package = package
        self.sources = sources
        self.codes = codes or {}

    def _locate(self, fullname):
        """(relative path, is a package) of a module of ours, or (None, False)."""
        if fullname == self.package:
            rel = ""
        elif fullname.startswith(self.package + "."):
            rel = fullname[len(self.package) + 1:].replace(".", "/") + "/"
        else:
            return None, False
        if rel + "__init__.py" in self.sources:
            return rel + "__init__.py", True
        if rel and rel[:-1] + ".py" in self.sources:
            return rel[:-1] + ".py", False
        return None, False

    def find_spec(self, fullname, path=None, target=None):
        rel, is_pkg = self._locate(fullname)
        if rel is None:
            return None
        return ModuleSpec(fullname, self, origin=self.package + "/" + rel, is_package=is_pkg)

    def create_module(self, spec):
        return None  # the default module object

    def exec_module(self, module):
        rel, _is_pkg = self._locate(module.__name__)
        filename = self.package + "/" + rel
        source = self.sources[rel]
        remember(filename, source)
        module.__file__ = filename
        code = self.codes.get(rel)
        if code is None:
            code = compile(source, filename, "exec", dont_inherit=True)
        exec(code, module.__dict__)

    def get_source(self, fullname):
        rel, _is_pkg = self._locate(fullname)
        if rel is None:
            raise ImportError("not an agent module: %s" % fullname, name=fullname)
        return self.sources[rel]


def remember(filename, source):
    """Lines for tracebacks: no file to read them from (mtime None: linecache.checkcache keeps them)."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


CODE_MAGIC = b"MLAC"


def split_codes(rest):
    """({path: code object}, the plan's bytes) from what follows the payload: the compiled modules when they
    come first and were compiled by an interpreter of this bytecode magic, else none."""
    if rest[:4] != CODE_MAGIC or len(rest) < 12:
        return {}, rest
    n = 12 + int.from_bytes(rest[8:12], "big")
    if rest[4:8] != _magic():
        return {}, rest[n:]
    try:
        codes = marshal.loads(rest[12:n])
    except (EOFError, ValueError, TypeError):
        codes = None
    return (codes if isinstance(codes, dict) else {}), rest[n:]


def _magic():
    """This interpreter's bytecode magic, without importing importlib.util (on 3.8 that imports importlib.abc)."""
    magic = getattr(getattr(importlib, "_bootstrap_external", None), "MAGIC_NUMBER", None)
    if magic is None:
        from importlib.util import MAGIC_NUMBER as magic
    return magic


def _install(sources, payload, codes=None):
    """Install the importer and keep the payload for re-runs elsewhere; the package's name."""
    package = __name__.rpartition(".")[0]
    remember(package + "/_boot.py", sources["_boot.py"])
    sys.meta_path.insert(0, SourceImporter(package, sources, codes))
    importlib.import_module(package + ".privilege").clean_for_root()  # as root: cwd /, a clean environment
    importlib.import_module(package + ".reexec").PAYLOAD = payload
    return package


def start(sources, payload, plan_bytes):
    """Answer the one plan, then exit without the interpreter's teardown (freeing every module and object
    costs tens of ms and changes nothing once the answer is flushed; the agent registers no exit hooks and
    its files are closed by their with-blocks). Only on this normal path: an exception exits as before."""
    codes, plan_bytes = split_codes(plan_bytes)
    status = importlib.import_module(_install(sources, payload, codes) + ".main").main(plan_bytes)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status or 0)


def serve(sources, payload):
    """Answer framed plans on stdin until it ends (protocol.SERVE_BOOTSTRAP); the exit status."""
    return importlib.import_module(_install(sources, payload) + ".main").serve()

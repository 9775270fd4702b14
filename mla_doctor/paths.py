"""Where mla-doctor's own data lives, and the one default for the run root on a host.

The runbooks (`playbooks/`) and Jinja2 templates (`templates/`) are edited at the top of the source
tree and ship inside the wheel as `mla_doctor/playbooks` and `mla_doctor/templates` (package data,
see pyproject.toml): an installed copy finds them beside this module, a checkout at its top."""
from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# The host directory where runs keep manifests, backups, leases and records (`--run-root`).
DEFAULT_RUN_ROOT = "/var/tmp/mla-doctor"


def _data_dir(name: str, env: str) -> Path:
    if os.environ.get(env):
        return Path(os.environ[env])
    installed = PACKAGE_DIR / name
    return installed if installed.is_dir() else PACKAGE_DIR.parent / name


TEMPLATES_DIR = _data_dir("templates", "MLA_DOCTOR_TEMPLATES")
PLAYBOOKS_DIR = _data_dir("playbooks", "MLA_DOCTOR_PLAYBOOKS")

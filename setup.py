"""Only the package list lives here (everything else is in pyproject.toml): every `mla_doctor*` package found
on disk, plus the two data packages mapped from the top of the tree (`playbooks/`, `templates/`), which a
find directive in pyproject.toml cannot add."""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["mla_doctor", "mla_doctor.*"])
      + ["mla_doctor.playbooks", "mla_doctor.templates"])

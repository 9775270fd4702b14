# make test  — set up everything from nothing (venv, packages, system packages when root) and run every tier.
# make demo  — build a local sandbox host with a real vLLM and run the installed wheel's mla-doctor against it.
PYTHON ?= python3
VENV   ?= .venv
PY      = $(VENV)/bin/python
PYTEST  = $(VENV)/bin/pytest
ARGS   ?=
# the wheel as a user gets it: built from a clean copy of the tree, installed into its own venv (both ignored)
DIST       ?= build/dist
WHEEL_VENV ?= build/venv-wheel

.PHONY: test setup system-packages demo-packages demo-wheel-venv unit unit-local unit-data faults soak corpus integration install-tier lint clean demo \
	wheel wheel-venv guard docs

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,bench]'
	touch $@

# Installs the missing packages named in $$missing when root (apt-get, one line per package fetched and set up:
# progress, never a silent minute); without root, a warning naming them.
INSTALL_MISSING = if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ]; then \
	    echo "installing system packages:$$missing (apt-get)"; \
	    apt-get update -qq || exit 1; st=$$(mktemp); \
	    { DEBIAN_FRONTEND=noninteractive apt-get install -y -q -o Dpkg::Use-Pty=0 $$missing 2>&1; echo $$? >$$st; } \
	      | grep --line-buffered -E '^(Get:|Setting up )' | sed -u 's/^/  /'; \
	    rc=$$(cat $$st); rm -f $$st; [ "$$rc" = 0 ] || { echo "apt-get install failed (exit $$rc)" >&2; exit 1; }; \
	  else \
	    echo "WARNING: missing system packages:$$missing (need root to install)" >&2; \
	  fi; \
	fi

# What `make demo` needs and nothing more: sshd (the sandbox host) and gdb (`run` attaches to the server).
demo-packages:
	@missing=""; \
	[ -x /usr/sbin/sshd ] || missing="$$missing openssh-server"; \
	[ -x /usr/bin/gdb ] || missing="$$missing gdb"; \
	$(INSTALL_MISSING)
	@# a gdb whose injected call leaves the process alive (Debian 12's cannot on a CPU with AMX): installed when root
	@$(PYTHON) tools/ensure_gdb.py || [ "$$(id -u)" != 0 ]

# The tiers' own, beside the demo's: iproute2 for the test fleet (nftables: the fault tier's packet loss), sudo
# for the non-root host, chromium to render the HTML report (headless, offline), systemd, docker.io (dockerd),
# containerd (ctr) and podman for the service host of the systemd/docker/containerd/podman runtimes
# (tests/fleet/service-host.sh). Installed only when missing
# and root, by the targets that need them: `test`, `unit-local` (chromium, sshd); never by `setup`, `unit` or
# `demo`.
system-packages: demo-packages
	@missing=""; \
	[ -x /lib/systemd/systemd ] || missing="$$missing systemd"; \
	command -v dockerd >/dev/null 2>&1 || missing="$$missing docker.io"; \
	command -v ctr >/dev/null 2>&1 || missing="$$missing containerd"; \
	command -v podman >/dev/null 2>&1 || missing="$$missing podman"; \
	command -v ip >/dev/null 2>&1 || missing="$$missing iproute2"; \
	command -v nft >/dev/null 2>&1 || missing="$$missing nftables"; \
	command -v sudo >/dev/null 2>&1 || missing="$$missing sudo"; \
	command -v chromium >/dev/null 2>&1 || missing="$$missing chromium"; \
	$(INSTALL_MISSING)

# the agent (agent/) runs on the host's Python, 3.8 and up; the controller (the rest) on 3.9 and up (RHEL 9's)
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check mla_doctor tests
	$(VENV)/bin/vermin --no-tips --violations -t=3.8- mla_doctor/agent
	$(VENV)/bin/vermin --no-tips --violations -t=3.9- mla_doctor

# right after lint, under 3 minutes: no import cycle (imports inside functions counted), the installed wheel's
# CLI under the oldest supported controller Python (pyenv's 3.9) and the agent under 3.8, the speed ratios (never
# absolute times). Fails, never skips, when pyenv's 3.9 or 3.8 is missing.
guard: setup unit-data
	$(PYTEST) -q tests/guard

# the reference site (docs/, mkdocs.yml) into build/site, about a second: --strict, so a warning fails it, and
# mkdocs.yml makes a link to a page or an anchor that does not exist a warning. Not --quiet: it hides the
# warnings from the strict count as well (the build would pass).
docs: setup
	$(VENV)/bin/mkdocs build --strict

# What the unit tier reads besides the tree: vLLM 0.33.0's real sources (a few of its tests fail, never skip,
# without them). Cached outside the clone; a second run downloads nothing.
unit-data: setup
	$(PY) tests/support/corpus.py vllm==0.33.0

# the fast loop: the unit tests that run in this process only (no system package, nothing started);
# unit-local: the rest of tests/unit, which start the agent, the CLI, a pty, chromium, sshd (tests/unit/conftest.py)
unit: setup unit-data
	$(PYTEST) -q -m 'not local' tests/unit

unit-local: setup system-packages unit-data
	$(PYTEST) -q -m local tests/unit

# the load and fault tier (netem, loss, resets, silent sshd, killed agents, busy cores): the netns fleet, root;
# one fleet per machine, so under the fleet lock. The soak: one loopback sshd, minutes of audits, no growth.
faults: setup
	flock /tmp/mla-fleet.lock $(PYTEST) -q tests/faults

soak: setup unit-data
	$(PYTEST) -q tests/soak

# builds the wheel, installs it into a fresh venv and drives the installed CLI (needs only python3 + pip)
install-tier: setup
	$(PYTEST) -q tests/install

# Tiers fastest first, so a failure shows early; every tier runs, the exit status is the worst. The release
# wheels the corpus tier reads (42, several GB when nothing is cached) download in the background from the start
# (network-bound, 3 at a time) while the CPU-bound tiers before it run: the corpus tier comes after attack so the
# downloads are done by then (a release still in flight is waited for through its lock, never raced).
TIERS ?= unit real_logs install attack corpus integration faults soak

test: setup system-packages lint guard docs unit-data
	@mkdir -p build; $(PY) tests/support/corpus.py --jobs 3 >build/corpus-prefetch.log 2>&1 & pre=$$!; \
	failed=""; for t in $(TIERS); do \
	  [ -d tests/$$t ] || { echo "tier tests/$$t: missing" >&2; failed="$$failed $$t"; continue; }; \
	  if [ $$t = corpus ]; then wait $$pre || echo "corpus prefetch failed (the tier fetches what is missing):" \
	    "build/corpus-prefetch.log" >&2; pre=""; fi; \
	  echo "=== tier $$t"; $(PYTEST) -q tests/$$t || failed="$$failed $$t"; \
	done; \
	[ -z "$$pre" ] || wait $$pre; \
	rest=$$(ls -d tests/*/ | xargs -n1 basename | grep -vxE '__pycache__|support|fixtures|fleet|guard|$(shell echo $(TIERS) | tr ' ' '|')'); \
	[ -z "$$rest" ] || { echo "test dirs not in TIERS: $$rest" >&2; failed="$$failed $$rest"; }; \
	[ -z "$$failed" ] || { echo "FAILED tiers:$$failed" >&2; exit 1; }

# $(call BUILD_WHEEL,PYTHON): the wheel into $(DIST), built by PYTHON's pip from a clean copy of the tree
BUILD_WHEEL = rm -rf $(DIST) && mkdir -p $(DIST) && d=$$(mktemp -d) && \
	cp -r mla_doctor playbooks templates pyproject.toml setup.py README.md $$d/ && \
	find $$d -name __pycache__ -prune -exec rm -rf {} + && \
	$(1) -m pip wheel -q --no-deps -w $(DIST) $$d && rm -rf $$d

wheel: setup
	$(call BUILD_WHEEL,$(PY))
	@ls $(DIST)/mla_doctor-*.whl

wheel-venv: wheel
	[ -x $(WHEEL_VENV)/bin/python ] || $(PYTHON) -m venv $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(DIST)/mla_doctor-*.whl
	$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
	  $(DIST)/mla_doctor-*.whl

clean:
	rm -rf $(VENV) .pytest_cache $(DIST) $(WHEEL_VENV) build *.egg-info

# One line per stage from the first second; each long stage says what it is doing (sandbox.py: the vLLM venv's
# pip step and size every 5 s, the server's newest log line every 10 s).
# The demo needs no dev venv (no test extras): the wheel is built by its own venv's pip, and demo/sandbox.py
# (stdlib only) runs under that venv's python.
demo:
	@echo "[demo] 1/3 system packages the demo needs (openssh-server, gdb): installed only when missing"
	@$(MAKE) -s --no-print-directory demo-packages
	@echo "[demo] 2/3 mla-doctor as a user gets it: a wheel of this tree installed into its own venv $(WHEEL_VENV)" \
	  "(pip; about 20-60 s the first time)"
	@$(MAKE) -s --no-print-directory demo-wheel-venv
	@echo "[demo] 3/3 the sandbox: vLLM CPU venv, tiny model, sshd, vLLM server, then mla-doctor run"
	@MLA_DOCTOR_BIN=$(abspath $(WHEEL_VENV))/bin/mla-doctor $(WHEEL_VENV)/bin/python demo/sandbox.py $(ARGS)

demo-wheel-venv:
	@[ -x $(WHEEL_VENV)/bin/python ] || $(PYTHON) -m venv $(WHEEL_VENV)
	@$(call BUILD_WHEEL,$(WHEEL_VENV)/bin/python)
	@$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check $(DIST)/mla_doctor-*.whl
	@$(WHEEL_VENV)/bin/python -m pip install -q --disable-pip-version-check --force-reinstall --no-deps \
	  $(DIST)/mla_doctor-*.whl

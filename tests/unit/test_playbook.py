"""Runbooks: bundled ones load, templates are strict, errors name file:line, plans render per host."""
from __future__ import annotations

import pytest

from mla_doctor.fleet import playbook as pb_mod
from mla_doctor.errors import ConfigFileError, UsageError
from mla_doctor.fleet.inventory import Host


def host(name="gpu-1", **vars):
    return Host(name=name, vars=vars, groups=["prod"])


def write(tmp_path, text):
    p = tmp_path / "book.yaml"
    p.write_text(text)
    return str(p)


def test_bundled_runbooks_and_catalog_separates_target_files():
    cat = {e["name"]: e for e in pb_mod.catalog()}
    assert cat["static"]["kind"] == "runbook" and not cat["static"]["restarts"] and not cat["static"]["changes"]
    assert cat["mla-path"]["restarts"] and cat["revert"]["changes"] and not cat["revert"]["restarts"]
    assert cat["instrument-mla"]["kind"] == "targets"
    assert sorted(pb_mod.bundled_names()) == ["mla-attach", "mla-path", "revert", "static"]
    # attach injects a probe in memory: no file changed, no restart (issue 32: labelled by what its steps do)
    assert not cat["mla-attach"]["restarts"] and not cat["mla-attach"]["changes"] and cat["mla-attach"]["attaches"]
    mp = pb_mod.load("mla-path")
    assert mp.serial == 1 and mp.max_fail_percent == 0 and [s.kind for s in mp.steps] == ["live", "expect"]


def test_a_live_step_attaches_by_default_as_run_does_and_restarts_only_when_it_says_so(tmp_path):
    """The runbook's live step and `mla-doctor run` default alike: attach (no restart, no --yes, not
    rolling); `method: patch` (or a template that may render to it) restarts."""
    from mla_doctor.host.live_options import RunOptions
    from mla_doctor.host.steps import Live

    for text, restarts in (("live: {}", False), ("live: {method: attach}", False), ("live: {method: patch}", True),
                           ("live: {method: plugin}", True), ("live: {method: '{{ m }}'}", True)):
        book = pb_mod.load(write(tmp_path, f"steps:\n  - {text}\n"))
        assert book.restarts is restarts and book.changes is restarts, text  # attach edits no file
    assert Live.make({}).options.method == "attach" == RunOptions().method
    assert pb_mod.load("mla-path").steps[0].options["method"] == "patch"  # the bundled one says so


def test_a_target_file_is_not_a_runbook():
    with pytest.raises(ConfigFileError, match="patch-target file"):
        pb_mod.load("instrument-mla")
    with pytest.raises(UsageError, match="no playbook 'nope'.*static"):
        pb_mod.load("nope")


def test_templates_render_per_host_with_native_types(tmp_path):
    p = write(tmp_path, """
name: t
vars: {tokens: 4, root: /var/tmp/x}
steps:
  - name: audit with the host's model
    audit: {model: "/models/{{ host }}/{{ model_name }}"}
  - live: {max_tokens: "{{ tokens }}", run_root: "{{ root }}", prompts: "short,long", method: patch}
  - command: ["echo", "{{ host }}", "a b"]
""")
    book = pb_mod.load(p)
    assert book.restarts and book.changes
    plan = pb_mod.plan(book, host(model_name="glm5"), {"tokens": 7})
    a, live, cmd = plan.steps
    assert a.options == {"model": "/models/gpu-1/glm5"}
    assert live.options["max_tokens"] == 7 and live.options["prompts"] == ["short", "long"]
    assert cmd.options["run"] == "echo gpu-1 'a b'"


def test_strict_undefined_names_the_step_line_and_host(tmp_path):
    p = write(tmp_path, "steps:\n  - audit: {}\n  - name: uses a var\n    audit: {model: '{{ nope }}'}\n")
    book = pb_mod.load(p)
    with pytest.raises(ConfigFileError) as e:
        pb_mod.plan(book, host())
    assert str(e.value).startswith(f"{p}:3:") and "'nope' is undefined" in str(e.value) and "gpu-1" in str(e.value)


def test_expect_step_merges_over_inventory_expectations(tmp_path):
    p = write(tmp_path, "steps:\n  - expect: {vllm: '>=0.30'}\n")
    plan = pb_mod.plan(pb_mod.load(p), host(expect={"vllm": ">=0.10", "integrity": "clean"}))
    assert plan.steps[0].options == {"vllm": ">=0.30", "integrity": "clean"}


@pytest.mark.parametrize("text,line,needle", [
    ("steps: []\n", 1, "'steps' is empty"),
    ("name: x\n", 1, "missing required key 'steps'"),
    ("stepz: []\n", 1, "unknown key 'stepz'"),
    ("steps:\n  - audit: {}\n    live: {}\n", 2, "exactly one of"),
    ("steps:\n  - nmae: x\n    audit: {}\n", 2, "unknown key 'nmae'"),
    ("steps:\n  - audit: {modle: x}\n", 2, "audit has no option 'modle'"),
    ("steps:\n  - live: {max_tokens: many}\n", 2, "live.max_tokens must be int"),
    ("steps:\n  - live: {method: magic}\n", 2, "live.method is one of"),
    ("steps:\n  - audit: {}\n  - expect: {prefill: dense}\n", 3, "expect prefill is one of"),
    ("steps:\n  - audit: {model: '{{ unclosed'}\n", 2, "template error"),
    ("serial: 0\nsteps:\n  - audit: {}\n", 1, "serial must be an integer >= 1"),
])
def test_validation_errors_name_file_and_line(tmp_path, text, line, needle):
    p = write(tmp_path, text)
    with pytest.raises(ConfigFileError) as e:
        pb_mod.load(p)
    assert str(e.value).startswith(f"{p}:{line}:"), str(e.value)
    assert needle in str(e.value)


def test_rendered_values_are_checked_too(tmp_path):
    p = write(tmp_path, "steps:\n  - live: {max_tokens: '{{ n }}'}\n")
    with pytest.raises(ConfigFileError, match=r":2: .*live.max_tokens must be int, not str"):
        pb_mod.plan(pb_mod.load(p), host(), {"n": "lots"})

"""The unit tier in two parts: the pure in-process tests (the fast loop, `make unit`: `pytest -m 'not local'`)
and the `local` ones, which start processes on this machine: the agent under its bootstrap, the CLI in a
subprocess, a pty, chromium, a throwaway sshd, ssh-keygen (`make unit-local`; `make test` runs both).

LOCAL below says which tests are `local`, by file and name (data here rather than a mark in each file, so the
files stay as they are). A guard keeps it right: in a run that leaves the local tests out, a test not listed
that starts a process fails, naming itself and this table; a listed name that is no test fails collection.
`python tests/support/local_tests.py` brings the table up to date (after a merge, say): it runs that loop with
the guard recording instead of failing, then adds what started a process and drops the names of no test.
"""
from __future__ import annotations

import json
import os
import subprocess

import pytest

ALL = "*"  # every test of the file
# file (test_<name>.py) -> the names (test_<name>) of its tests that start a process, however short, or ALL
LOCAL: dict[str, object] = {
    "agent_bundle": {"a_payload_that_is_not_framed_is_refused_clearly",
        "a_traceback_names_the_agent_module_file_and_line", "framing_survives_any_byte_in_payload_and_plan",
        "running_the_agent_writes_nothing", "static_through_the_bootstrap_loads_no_module_that_changes_files",
        "the_docker_reexec_sends_the_payload_the_agent_was_started_with", "the_payload_is_built_once_per_process",
        "unknown_op_answers_fatal_json_and_loads_only_the_entry"},
    "agent_compiled": {"the_compiled_modules_give_the_same_answer_and_are_cached"},
    "agent_dump": {"an_edited_source_is_what_runs_and_is_named", "the_dumped_script_answers_as_the_normal_path",
        "the_dumped_sources_are_the_payload_bundle_sends", "the_plan_is_what_static_sends",
        "the_script_is_stdlib_only_and_python38"},
    "agent_pure": {"agent_command_quotes_the_python_path", "agent_runs_under_the_bootstrap_and_always_answers_json",
        "no_python_on_the_host_is_a_clear_error", "old_python_is_refused_by_the_bootstrap"},
    "agent_session": {"a_dead_channel_raises_once_then_every_call_runs_one_shot", "a_late_answer_ends_the_session",
        "a_transport_without_streaming_exec_runs_one_shot", "an_agent_error_is_an_answer_not_a_dead_session",
        "an_interpreter_that_cannot_serve_gives_the_one_shot_error",
        "every_op_on_one_agent_process_with_the_one_shot_answers", "protocol_call_with_a_session_uses_it",
        "the_serving_agent_exits_when_the_transport_closes"},
    "agent_startup": {"a_static_audit_starts_without_the_heavy_stdlib_modules"},
    "attach_host": {"the_default_needs_no_consent_a_restart_method_does"},
    "attach_probe": ALL,
    "bench_scripts": {"help_runs"},
    "cli_and_results": {"help_lists_connection_options", "missing_ssh_config_names_the_file",
        "no_host_is_a_usage_error_with_parseable_json", "unknown_option_is_exit_2_and_json"},
    "cli_conventions": ALL,
    "cli_errors": ALL,
    "cli_lazy": {"each_command_is_loaded_when_it_runs", "help_lists_every_command_as_when_all_are_loaded",
        "static_imports_only_its_own_modules", "static_local_leaves_the_ssh_side_unimported"},
    "controller_grammar": {"hostile_inventory_and_host_with_a_live_ssh_config_run_nothing",
        "run_api_key_env_is_a_name_checked_up_front", "the_secret_never_leaves_the_cli_unless_the_operator_names_it",
        "the_transport_refuses_a_hostile_scope_id_before_match_exec_runs"},
    "controller_hostile": {"address_with_a_semicolon_runs_nothing_through_a_proxycommand",
        "changed_host_key_is_refused_when_ssh_config_says_strict_no", "cli_error_message_with_host_text_is_inert",
        "config_file_values_by_kind_name_the_file_and_line", "deep_config_file_is_a_usage_error_naming_the_file",
        "deep_saved_report_is_a_usage_error_naming_the_file", "dry_run_plan_shows_inventory_values_escaped"},
    "controller_safety": {"alias_bomb_via_the_real_cli_inventory_and_playbook",
        "cr_in_env_via_the_real_cli_is_a_usage_error_before_any_connection",
        "inventory_runtime_with_control_characters_is_refused_before_any_connection",
        "known_hosts_read_once_per_process_and_filled_for_one_name", "marker_lines_parse_without_crashing",
        "real_sshd_control_a_listed_key_gets_past_the_host_key_check",
        "real_sshd_only_a_ca_vouches_for_is_refused_not_trusted_on_first_use",
        "real_sshd_with_a_revoked_key_is_refused", "refuse_revoked_and_ca_only_hosts",
        "template_escape_under_dry_run_via_the_real_cli"},
    "controller_saved_reports": {"a_hostile_saved_report_is_a_usage_error_naming_file_host_and_field"},
    "explain_input": {"a_path_and_log_disagree_is_a_usage_error", "anything_but_a_regular_file_is_refused_at_once",
        "stdin_is_read_as_the_file_is"},
    "first_screen": {"colour_on_a_terminal_only_never_piped_nor_with_no_color", "connection_local_runs_locally",
        "the_dry_run_plan_is_redacted"},
    "first_screen_terminal": ALL,
    "fleet_html_browser": ALL,
    "fleet_interrupt_restore": ALL,
    "help_examples": ALL,
    "host_target": {"execute_runs_a_plan_over_one_connection_and_stops_at_the_first_failure"},
    "install_writes": {"a_users_install_is_patched_and_restored_as_that_user",
        "patch_refuses_a_directory_symlink_planted_in_the_tree",
        "revert_never_follows_a_package_directory_swapped_for_a_symlink"},
    "interrupts": {"a_fleet_audit_on_sigterm_writes_the_finished_hosts_and_the_retry_file",
        "static_in_the_banner_phase_ends_at_once", "static_while_the_agent_runs_ends_at_once",
        "the_guard_does_not_cut_the_outcome_of_a_restore",
        "the_guard_exits_when_something_blocks_past_the_interrupt"},
    "inventory_conventions": {"connection_local_in_the_plan_and_never_silently_ssh",
        "extra_vars_override_inventory_connection_vars",
        "templates_in_expect_values_are_not_parsed_before_rendering"},
    "patch_engine": {"watchdog_never_reverts_under_a_patch_still_being_written"},
    "privilege": {"a_config_the_server_user_cannot_read_is_never_read_by_root", "a_fifo_named_pth_hangs_nothing",
        "a_users_interpreter_is_asked_as_that_user_and_its_pth_never_runs_as_root",
        "an_editable_install_its_venv_imports_through_a_pth_is_its_install",
        "one_look_alike_is_a_usage_error_listing_it_never_vllm_not_found",
        "pid_travels_from_the_command_line_to_the_agent",
        "run_as_drops_uid_gid_and_groups_and_bounds_time_and_output",
        "the_interpreter_check_never_runs_tools_from_the_callers_path",
        "the_port_is_read_as_vllm_reads_it_and_a_mapping_alone_proves_nothing",
        "the_root_agent_keeps_a_clean_environment_and_cwd_root",
        "the_root_agent_never_starts_on_an_interpreter_another_user_controls",
        "the_server_is_the_process_serving_its_port_and_look_alikes_are_reported",
        "the_servers_stdout_is_read_through_its_descriptor_never_by_its_name",
        "two_servers_are_a_usage_error_until_pid_names_one"},
    "reports": {"cli_audit_dry_run_and_usage_errors", "cli_report_merge_and_render"},
    "resolve_cache": {"a_tree_the_scan_does_not_prove_is_resolved_again",
        "second_audit_takes_the_stored_answer_which_is_the_computed_one"},
    "runtimes_pure": {"docker_exec_wrapper_quotes_every_word", "docker_since_is_rfc3339_with_fractions"},
    "scale_out_examples": {"each_engine_plans_every_host_exactly_once"},
    "scheduler": {"host_job_runs_steps_in_order_on_one_transport_and_stops_at_a_failure"},
    "server_install": {"a_plain_interpreter_is_its_own_prefix", "a_server_from_a_venv_names_its_install",
        "virtual_env_names_the_install_when_argv0_does_not"},
    "speed_equivalence": {"static_local_json_is_what_it_was_before_the_levers"},
    "static_reads": {"a_huge_sparse_source_file_is_refused_without_reading_it"},
    "status_line": {"silent_when_stderr_is_piped", "silent_with_json_on_a_terminal",
        "the_status_line_comes_within_a_second_and_is_erased"},
    "step_kinds": {"a_toy_step_kind_runs_from_the_fleet_command_through_execute"},
    "transport_sshd": ALL,
    "words_and_labels": {"did_you_mean_for_commands_and_options", "static_local_v_is_accepted_as_its_help_shows_it",
                         "vllm_not_found_names_what_was_tried_and_both_ways_to_point_at_it"},
}


RECORD = os.environ.get("MLA_DOCTOR_LOCAL_RECORD")  # tests/support/local_tests.py: record, never fail
_stale: dict[str, list[str]] = {}


def _local(item: pytest.Item) -> bool:
    names = LOCAL.get(item.path.stem[len("test_"):], ())
    return names == ALL or getattr(item, "originalname", item.name)[len("test_"):] in names


def pytest_collection_modifyitems(config, items):
    checked = set()
    for item in items:
        stem = item.path.stem[len("test_"):]
        if stem in LOCAL and stem not in checked and LOCAL[stem] != ALL:
            checked.add(stem)
            stale = sorted(n for n in LOCAL[stem] if not hasattr(item.module, "test_" + n))
            if stale and RECORD:
                _stale[stem] = stale
            elif stale:
                raise pytest.UsageError(f"tests/unit/conftest.py: LOCAL[{stem!r}] names no test: {stale}")
        if _local(item):
            item.add_marker(pytest.mark.local)


# ---------------------------------------------------------------- the guard, in a run without the local tests

_running: list[str] = []  # the pure test running now (its setup, call and teardown)
_spawned: dict[str, str] = {}  # nodeid -> what it started


def _message(nodeid: str, what: str) -> str:
    return (f"{nodeid} starts a process ({what}) in a run without the local tests: add it to LOCAL in "
            "tests/unit/conftest.py")


def _guarded(what: str, real):
    def spawn(*args, **kw):
        if _running:
            _spawned.setdefault(_running[0], what)
            if not RECORD:
                raise AssertionError(_message(_running[0], what))
        return real(*args, **kw)

    return spawn


def _pure_run(config) -> bool:
    return "not local" in " ".join((config.getoption("markexpr") or "").split())


def pytest_configure(config):
    if not _pure_run(config):
        return
    subprocess.Popen._execute_child = _guarded("a subprocess", subprocess.Popen._execute_child)
    for name in ("fork", "forkpty", "posix_spawn", "posix_spawnp"):
        if hasattr(os, name):
            setattr(os, name, _guarded(f"os.{name}", getattr(os, name)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    pure = _pure_run(item.config) and not _local(item)
    if pure:
        _running.append(item.nodeid)
    try:
        yield
    finally:
        if pure:
            _running.remove(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    report = (yield).get_result()
    what = _spawned.get(item.nodeid)
    if what and not RECORD and report.when == "call" and report.passed:  # failed even where the test caught the error
        report.outcome = "failed"
        report.longrepr = _message(item.nodeid, what)


def pytest_sessionfinish(session):
    if RECORD:
        spawned: dict[str, set[str]] = {}
        for nodeid in _spawned:
            path, _, name = nodeid.partition("::")
            spawned.setdefault(os.path.basename(path)[len("test_"):-len(".py")], set()).add(
                name.split("[")[0][len("test_"):])
        with open(RECORD, "w", encoding="utf-8") as f:
            json.dump({"spawned": {k: sorted(v) for k, v in spawned.items()}, "stale": _stale}, f)

"""A run's lifecycle, above change/ (the files) and runtimes/ (the server), which never import each other:
the patch op with its watchdog, the watchdog that reverts files then server, the revert op, tick and the
server's restore."""

"""What changes files on the host: instrumentation, backups, lock, lease, watchdog, revert."""

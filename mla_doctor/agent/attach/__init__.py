"""Attach: diagnose a running server without restarting it (issue 22).

The probe is injected into each model process through gdb with ``Py_AddPendingCall``; it wraps the
run's targets at the class level, writes the file probe's records under the run's lease, and restores
every attribute it wrapped when the lease lapses, on detach, or on any error of its own. Python 3.14's
``sys.remote_exec`` is not used: no 3.14 interpreter was available to test it.
"""

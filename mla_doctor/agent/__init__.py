"""mla-doctor's host agent: stdlib-only, Python 3.8+, shipped over the SSH connection.

It is sent on stdin as one payload (protocol.py, built by mla_doctor/remote/bundle.py) and run once
per phase with a JSON plan; it answers one JSON document on stdout (main.py). It never imports vLLM
or torch (seconds of start-up, and they can crash), never writes on the host during an audit, and
never lets a secret leave the host: argv and environment values that look like secrets are
redacted here, before anything is printed.

Keep it self-contained: it imports nothing from the rest of mla_doctor or third parties, and only
relative imports within itself (on the host it is the in-memory package mla_doctor_agent).
"""

"""Talking to the host agent: the bundled payload, running it over a transport, the typed wire protocol, HTTP."""

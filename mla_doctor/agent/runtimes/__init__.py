"""How a server runs on the host, one module per runtime behind one interface (base.py), found by registry.py."""

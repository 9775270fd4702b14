"""Fleets: inventories, runbooks (playbooks), expectations, the scheduler and one host's job."""

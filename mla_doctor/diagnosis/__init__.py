"""Pure analysis, no I/O: release knowledge, static facts and rules, log reading, live evidence and verdict."""

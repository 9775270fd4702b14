"""The live run's options live in host/live_options.py (importable without the live run's modules: the step
types and the click options are derived from them)."""
from mla_doctor.host.live_options import DEFAULT_DEBUG_ENV, DEFAULT_PROMPTS, RUNTIMES, RunOptions

__all__ = ["DEFAULT_DEBUG_ENV", "DEFAULT_PROMPTS", "RUNTIMES", "RunOptions"]

"""mla-doctor: which MLA attention path a vLLM server really ran, and why."""

__version__ = "0.1.0"

"""nanochat: a terminal chat app with its own vLLM-style inference engine."""

__version__ = "0.1.0"

"""sandboxd: a kernel-enforced sandbox for AI agent tool calls."""

__version__ = "0.1.0"

"""Command-line entry points. Imports stay lazy: `sandboxd run` must start fast."""

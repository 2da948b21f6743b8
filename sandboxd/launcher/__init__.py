"""The launcher: the single ordered setup sequence a sandboxed child runs before exec."""

"""The kernel edge: one module per enforcement mechanism.

Every OS error is translated here, once, into ``sandboxd.errors``. Nothing in
this package imports from the layers above it.
"""

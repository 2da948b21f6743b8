"""The git guard: keeps a sandbox from planting git configuration or hooks that would run as the
user at their next git command on the host (``guard``), over one shared inotify instance per
process (``watch``).

Its own package because it is neither the supervisor's (it forks nothing and waits on nothing) nor
the daemon's alone: the daemon (``service.git_guard_hook``) and one-shot ``sandboxd run``
(``cli.run``) both run it. Layering: above ``kernel`` and ``policy`` only.
"""

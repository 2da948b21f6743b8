"""A daemon's sessions: ``registry`` (``SessionRegistry``, what the servicer talks to) puts together
``table`` (the map of sessions, the one global lock), ``state`` (one session under its own lock),
``access`` (who may act on it, with which rights its sandbox is built), ``lifecycle`` (create,
build, change, close, restore) and ``tied`` (sessions that end with their client's process).

Empty on purpose: each importer names the module it needs, so importing one part never pulls in
the registry (and with it the fork server's client)."""

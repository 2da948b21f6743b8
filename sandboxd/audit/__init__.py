"""The audit log and what outlives the daemon: the event store (SQLite)."""

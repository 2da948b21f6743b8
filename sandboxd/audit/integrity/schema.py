"""The chain's columns and tables (the event store's migration 6).

Events written before it keep NULL hashes: the chain starts at the first new event, and the one
``audit_genesis`` row says where (``first_event_id``) and how many unchained events precede it.
Every signed checkpoint signs that id, so moving the start is caught once one checkpoint exists.
"""

MIGRATION = """
    ALTER TABLE events ADD COLUMN prev_hash BLOB;
    ALTER TABLE events ADD COLUMN hash BLOB;
    ALTER TABLE events ADD COLUMN session_prev_hash BLOB;
    CREATE TABLE audit_genesis (first_event_id INTEGER NOT NULL, legacy_events INTEGER NOT NULL, time REAL NOT NULL);
    INSERT INTO audit_genesis (first_event_id, legacy_events, time) SELECT
        MAX(COALESCE((SELECT MAX(id) FROM events), 0),
            COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'events'), 0)) + 1,
        (SELECT COUNT(*) FROM events), CAST(strftime('%s', 'now') AS REAL);
    CREATE TABLE audit_checkpoints (
        id INTEGER PRIMARY KEY, kind TEXT NOT NULL, genesis_id INTEGER NOT NULL, last_event_id INTEGER NOT NULL,
        head_hash BLOB NOT NULL, count INTEGER NOT NULL, pruned_through INTEGER NOT NULL DEFAULT 0,
        pruned_hash BLOB NOT NULL, pruned_count INTEGER NOT NULL DEFAULT 0, prev_digest BLOB NOT NULL,
        signature BLOB NOT NULL, key_id TEXT NOT NULL, time REAL NOT NULL)
"""

# 8 (the store's migration 8): the checkpoint interval (audit.checkpoint_events) each checkpoint was
# written under, signed into it, and the genesis row's copy for a log with no checkpoint yet: the
# verifier refuses an unsigned tail longer than the interval allows (deleted checkpoints).
INTERVAL_MIGRATION = """
    ALTER TABLE audit_checkpoints ADD COLUMN interval INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE audit_genesis ADD COLUMN checkpoint_events INTEGER NOT NULL DEFAULT 0
"""

CHECKPOINT_COLUMNS = ("id, kind, genesis_id, last_event_id, head_hash, count, pruned_through, pruned_hash, "
                      "pruned_count, prev_digest, signature, key_id, time, interval")

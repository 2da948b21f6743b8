"""The audit log's integrity: a hash chain over every event (the node's stream and each session's),
signed checkpoints of its head, the offline and online verifiers, and retention that keeps the
chain verifiable across what it prunes (docs/operations.md, "The audit chain")."""

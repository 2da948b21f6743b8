"""The supervisor: forks sandboxes (through the spawner), enforces timeouts, collects exit and usage."""

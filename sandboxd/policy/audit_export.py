"""The ``[audit.export]`` settings: where the audit log is sent as OCSF JSON lines, if anywhere
(sandboxd/audit/export does it; docs/operations.md documents each key and the OCSF mapping).

* ``sink`` "none" (the default: nothing leaves the node unless an operator says where), "stdout"
  (the daemon's standard output, for a container's log collector), "file" (JSON lines in ``path``,
  rotated at ``max_bytes`` keeping ``keep`` old files) or "otlp" (OTLP logs over HTTP to
  ``endpoint``, with the OpenTelemetry SDK).
* ``batch`` events are read from the log, sent and acknowledged at a time; the cursor (the id of
  the last event acknowledged) is stored after each, so a restart repeats at most one batch.
"""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy

SINKS = ("none", "stdout", "file", "otlp")
MIN_FILE_BYTES = 64 << 10          # one batch of ordinary events fits, so a rotation is not per line
MAX_KEEP = 1000
MAX_BATCH = 1000                   # the event store's page (audit.store.MAX_PAGE)


class AuditExport(Record):
    """The ``[audit.export]`` keys, checked together (sandboxd.config documents each)."""

    sink: str = "none"
    path: str = ""                 # the file sink's file: absolute (config.settings fills the default)
    max_bytes: int = 64 << 20
    keep: int = 5
    endpoint: str = ""             # the OTLP sink's logs URL: http(s)://HOST:PORT/v1/logs
    batch: int = 500

    def __post_init__(self) -> None:
        if self.sink not in SINKS:
            raise InvalidPolicy(f"audit.export.sink must be one of {', '.join(SINKS)}, not {self.sink!r}")
        if self.sink == "file" and not self.path.startswith("/"):
            raise InvalidPolicy(f"audit.export.path must be an absolute path for the file sink, not {self.path!r}")
        if self.max_bytes < MIN_FILE_BYTES:
            raise InvalidPolicy(f"audit.export.max_bytes must be at least {MIN_FILE_BYTES} bytes (64K), "
                                f"not {self.max_bytes}")
        if not 1 <= self.keep <= MAX_KEEP:
            raise InvalidPolicy(f"audit.export.keep must be from 1 to {MAX_KEEP} rotated files, not {self.keep}")
        if not 1 <= self.batch <= MAX_BATCH:
            raise InvalidPolicy(f"audit.export.batch must be from 1 to {MAX_BATCH} events, not {self.batch}")
        if self.sink == "otlp" and not self.endpoint.startswith(("http://", "https://")):
            raise InvalidPolicy("audit.export.endpoint must be the collector's OTLP/HTTP logs URL for the otlp sink "
                                f"(like http://127.0.0.1:4318/v1/logs), not {self.endpoint!r}")

    @property
    def enabled(self) -> bool:
        return self.sink != "none"

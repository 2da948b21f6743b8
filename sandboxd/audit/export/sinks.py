"""Where exported records go. A sink's ``send`` returns once the batch is delivered (written and
synced to a file, written to stdout, acknowledged by the collector) and raises otherwise; the
exporter stores its cursor only after ``send`` returns. A sink holds no events between batches.

- ``StdoutSink``: the daemon's standard output, one JSON line per record (a container's log
  collector reads it).
- ``FileSink``: JSON lines appended to a file (0600, root's), rotated before a line would take it
  past ``max_bytes``: ``path`` -> ``path.1`` -> ... -> ``path.KEEP``, the oldest removed.
- ``OtlpSink``: OTLP logs over HTTP (protobuf) with the OpenTelemetry SDK's exporter: each record
  a log record whose body is the OCSF JSON text, with its class, activity, event id and session
  as attributes. The SDK is the ``otlp`` extra (``pip install 'sandboxd[otlp]'``), imported only
  by this sink.
"""

from __future__ import annotations

import errno
import os
import stat
from typing import Any, Protocol, Sequence

from sandboxd.errors import InvalidPolicy

OTLP_TIMEOUT_SECONDS = 10.0        # one request's deadline: a collector that hangs costs this, then a retry


class Sink(Protocol):
    name: str

    def send(self, records: Sequence[tuple[dict[str, Any], bytes]]) -> None:
        """Deliver ``records`` (each the OCSF record and its JSON line), or raise."""

    def close(self) -> None:
        """Release what the sink holds."""


class StdoutSink:
    name = "stdout"

    def __init__(self, fd: int = 1) -> None:
        self._fd = fd

    def send(self, records: Sequence[tuple[dict[str, Any], bytes]]) -> None:
        _write_all(self._fd, b"".join(line for _record, line in records))

    def close(self) -> None:
        pass


class FileSink:
    name = "file"

    def __init__(self, path: str, max_bytes: int, keep: int) -> None:
        self.path, self.max_bytes, self.keep = path, max_bytes, keep
        self._fd = -1
        self._size = 0

    def _open(self) -> None:
        """The file, opened (its directory made) at the first batch and again when someone else
        (logrotate) moved it away: a failure here is the batch's, retried, never the daemon's start."""
        if self._fd >= 0:
            try:
                moved = os.stat(self.path, follow_symlinks=False).st_ino != os.fstat(self._fd).st_ino
            except FileNotFoundError:
                moved = True
            if not moved:
                return
            os.close(self._fd)
            self._fd = -1
        os.makedirs(os.path.dirname(self.path), mode=0o700, exist_ok=True)
        # O_NONBLOCK: a FIFO put at the path must not hang the export thread; what was opened is
        # then checked: the node's audit trail goes only into a regular file of the daemon's that
        # nobody else may read or write (one another user made first would be theirs to read).
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o600)
        st = os.fstat(fd)
        problem = ("is not a regular file" if not stat.S_ISREG(st.st_mode)
                   else f"belongs to uid {st.st_uid}, not to the daemon's" if st.st_uid != os.geteuid()
                   else f"has mode {stat.S_IMODE(st.st_mode):o}: others may read or write it" if st.st_mode & 0o077
                   else "")
        if problem:
            os.close(fd)
            raise OSError(errno.EPERM, f"audit.export.path {self.path} {problem}: remove it (the sink makes its own, "
                          "0600), or choose a path in a directory only root may write")
        self._fd, self._size = fd, st.st_size

    def send(self, records: Sequence[tuple[dict[str, Any], bytes]]) -> None:
        self._open()
        pending: list[bytes] = []
        pending_size = 0
        for _record, line in records:
            if self._size + pending_size + len(line) > self.max_bytes and self._size + pending_size > 0:
                self._flush(pending)
                pending, pending_size = [], 0
                self._rotate()
            pending.append(line)
            pending_size += len(line)
        self._flush(pending)

    def _flush(self, lines: list[bytes]) -> None:
        if lines:
            data = b"".join(lines)
            _write_all(self._fd, data)
            self._size += len(data)
        os.fsync(self._fd)                             # delivered: the cursor may move past these

    def _rotate(self) -> None:
        """path -> path.1 -> ... -> path.KEEP (the oldest dropped), then a new path."""
        for index in range(self.keep - 1, 0, -1):
            try:
                os.replace(f"{self.path}.{index}", f"{self.path}.{index + 1}")
            except FileNotFoundError:
                pass
        os.replace(self.path, f"{self.path}.1")
        self._open()                                   # sees the file moved: a new one

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class OtlpSink:
    name = "otlp"

    def __init__(self, endpoint: str, timeout: float = OTLP_TIMEOUT_SECONDS) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.util.instrumentation import InstrumentationScope
        except ImportError:
            raise InvalidPolicy("audit.export.sink = \"otlp\" needs the OpenTelemetry SDK: install sandboxd's "
                                "otlp extra (pip install 'sandboxd[otlp]')") from None
        from sandboxd import __version__
        self.endpoint = endpoint
        self._exporter = OTLPLogExporter(endpoint=endpoint, timeout=timeout)
        self._resource = Resource.create({"service.name": "sandboxd", "service.version": __version__,
                                          "host.name": os.uname().nodename})
        self._scope = InstrumentationScope("sandboxd.audit.export", __version__)
        self._severities = _severity_numbers()

    def send(self, records: Sequence[tuple[dict[str, Any], bytes]]) -> None:
        from opentelemetry._logs import LogRecord, SeverityNumber
        from opentelemetry.sdk._logs import ReadableLogRecord
        from opentelemetry.sdk._logs.export import LogRecordExportResult

        batch = []
        for record, line in records:
            severity = self._severities.get(record["severity_id"], SeverityNumber.INFO)
            batch.append(ReadableLogRecord(
                log_record=LogRecord(
                    timestamp=record["time"] * 1_000_000, observed_timestamp=record["time"] * 1_000_000,
                    severity_number=severity, severity_text=record["severity"], body=line.decode().rstrip("\n"),
                    attributes={"ocsf.class_uid": record["class_uid"], "ocsf.activity_id": record["activity_id"],
                                "ocsf.type_uid": record["type_uid"], "sandboxd.event_id": int(record["metadata"]["uid"]),
                                "sandboxd.session_id": record["unmapped"]["session_id"]},
                    event_name=f"ocsf.{record['class_uid']}"),
                resource=self._resource, instrumentation_scope=self._scope))
        if self._exporter.export(batch) != LogRecordExportResult.SUCCESS:
            raise OSError(f"the OTLP collector at {self.endpoint} did not accept the batch")

    def close(self) -> None:
        self._exporter.shutdown()          # type: ignore[no-untyped-call]  # the SDK leaves it untyped


def _severity_numbers() -> dict[int, Any]:
    """OCSF severity_id -> OpenTelemetry's severity number."""
    from opentelemetry._logs import SeverityNumber

    return {1: SeverityNumber.INFO, 2: SeverityNumber.WARN, 3: SeverityNumber.WARN2, 4: SeverityNumber.ERROR,
            5: SeverityNumber.FATAL}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]

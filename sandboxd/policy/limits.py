"""Resource limits of one launch (pure data and parsing)."""

from __future__ import annotations

from sandboxd._record import Record
from sandboxd.errors import InvalidPolicy

_FACTORS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}

DEFAULT_TMP_SIZE = 512 << 20
# The longest time limit (a year; also the fork server's, which checks again at its edge).
MAX_TIMEOUT_SECONDS = 365 * 24 * 3600.0


def parse_size(text: str | int, what: str = "size") -> int:
    """Parse ``1048576``, ``512K``, ``64M``, ``2G`` (binary multiples) into bytes."""
    if isinstance(text, int):
        value = text
    else:
        # "<digits> [K|M|G|T][B|iB]", case-insensitive; parsed by hand to keep `re` off the launch path.
        body = str(text).strip().lower()
        digits = body[: len(body) - len(body.lstrip("0123456789"))]
        unit = body[len(digits):].strip()
        unit = unit[:-2] if unit.endswith("ib") and len(unit) == 3 else unit[:-1] if unit.endswith("b") else unit
        if not digits or unit not in _FACTORS:
            raise InvalidPolicy(f"bad {what} {text!r}: give plain bytes or a number with K, M or G (e.g. 512M)")
        value = int(digits) * _FACTORS[unit]
    if value <= 0:
        raise InvalidPolicy(f"bad {what} {text!r}: must be greater than zero")
    return value


class Limits(Record):
    """What one launch may consume. ``None`` means no limit of that kind."""

    timeout_seconds: float | None = None
    memory_bytes: int | None = None
    pids: int | None = None
    cpu_seconds: int | None = None
    open_files: int | None = None
    tmp_size_bytes: int = DEFAULT_TMP_SIZE

    def __post_init__(self) -> None:
        for name in ("timeout_seconds", "memory_bytes", "pids", "cpu_seconds", "open_files", "tmp_size_bytes"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise InvalidPolicy(f"limit {name} must be greater than zero, got {value!r}")
        if self.timeout_seconds is not None and not self.timeout_seconds <= MAX_TIMEOUT_SECONDS:   # also NaN
            raise InvalidPolicy(f"limit timeout_seconds must be at most {MAX_TIMEOUT_SECONDS:.0f} seconds (a year), "
                                f"got {self.timeout_seconds!r}: give a shorter limit, or none")
        if self.memory_bytes is not None and self.memory_bytes < (4 << 20):
            raise InvalidPolicy("memory limit below 4M cannot even start a shell: give at least 4M")
        if self.open_files is not None and self.open_files < 16:
            raise InvalidPolicy("open-files limit below 16 breaks most programs: give at least 16")

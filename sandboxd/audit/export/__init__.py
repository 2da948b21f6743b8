"""The audit log sent off the node: each event as an OCSF record (``ocsf``), to stdout, a rotated
file or an OTLP logs endpoint (``sinks``), at least once, from a cursor kept beside the store
(``cursor``), by a thread of the daemon that reads the store on a connection of its own (``exporter``)."""

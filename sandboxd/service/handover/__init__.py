"""Restarts that lose no work, the daemon's side: adopting what a surviving supervisor kept
(``adopt``), and the results of calls no client stream waits for (``results``)."""

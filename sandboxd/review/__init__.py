"""Review mode's change set: what a session wrote, read from its overlay's upper layer, and the
person's decisions on it.

* ``upper``: the upper layer read into typed entries (whiteouts, opaque directories, copy-up
  origins), O(entries), bounded, never through a symlink. Reads overlay's ``trusted.*``
  attributes, so as root for a root daemon's session (``user.*`` rootless).
* ``changes``: those entries compared with the host: added, modified, deleted, replaced, type
  and metadata changes, with sizes and SHA-256; paged; each with its flags (``rules``) and its
  conflict (``conflicts``). Reads host files: run as the session's owner.
* ``rules``: the git guard's planted-code paths as review rules (a change there is flagged).
* ``conflicts``: is a host path changed since the session started, or since its last apply?
* ``diff``: one change shown: a unified diff for text, a summary line otherwise.
* ``apply``: apply and discard, per path or all, as the session's owner, every path walked
  beneath a descriptor (kernel.beneath).

The mount that produces the upper layer is kernel.overlay's.
"""

"""The call plan: the setup steps of a session call, named and ordered once.

Both call paths take these steps in this order: the Python one (sequence.run_call and
sequence._run_command) traces them by these names, the native one (sandboxd_call.c) by the
``SBX_STEP_*`` macros native_call.py generates from this module into its header (and into the
digest ``sandboxd-call -V`` prints, so a helper built from another plan is stale). With
``DebugHooks.trace_path`` set, each path appends the name of every step it takes to a file;
``expected`` says what that file must hold, and ``misplaced`` finds a step that is not in the
plan or out of its order (tests/test_call_paths.py, tests/test_call_plan.py).

Plain strings on a plain class, not an Enum: sequence.py imports this on the launch path.
"""

from __future__ import annotations


class Step:
    """Each setup step's traced name; ``SBX_STEP_<attribute>`` in the generated C header."""

    # The call's supervisor (its init, inside the session's PID namespace).
    DIE_WITH_PARENT = "die with parent"
    JOIN_CGROUPS = "join cgroups"
    JOIN_NAMESPACES = "join namespaces"
    CHDIR = "chdir"
    CHILD_SUBREAPER = "child subreaper"
    SET_TITLE = "set title"
    OOM_SCORE = "oom score"
    DROP_PRIVILEGES = "drop privileges"
    NOT_DUMPABLE = "not dumpable"
    OPEN_TERMINAL = "open terminal"
    FORK = "fork"
    # The command, between the fork and its exec.
    DEFAULT_SIGNALS = "default signals"
    NEW_SESSION = "new session"
    CONTROLLING_TERMINAL = "controlling terminal"
    DECLARE_PTRACER = "declare ptracer"
    RLIMITS = "rlimits"
    VERIFY_DROPPED = "verify dropped"
    LANDLOCK = "landlock"
    LANDLOCK_ABI = "landlock abi %d"          # a printf/%-format: the ABI the rules were made for
    CLOSE_ON_EXEC = "close-on-exec"
    CLOSE_ON_EXEC_WALK = "close-on-exec by /proc/self/fd"
    SECCOMP = "seccomp"
    SEND_LISTENER = "send listener"
    EXEC = "exec"


def step_names() -> dict[str, str]:
    """Every step by its attribute name, in declaration order."""
    return {name: value for name, value in vars(Step).items() if name.isupper()}


# When an optional step is taken (a keyword of ``expected``); None: always.
TERMINAL, WALKED, LISTENER = "terminal", "walked", "listener"

# The plan: every step of a call in the order both paths take it, with the condition of the
# optional ones. A step may appear more than once (the death signal is set again after the
# credential change, which clears it, and again in the command against its own parent).
CALL_PLAN: tuple[tuple[str, str | None], ...] = (
    (Step.DIE_WITH_PARENT, None),
    (Step.JOIN_CGROUPS, None),              # before anything forks: limits cover the whole tree
    (Step.JOIN_NAMESPACES, None),
    (Step.CHDIR, None),
    (Step.CHILD_SUBREAPER, None),
    (Step.SET_TITLE, None),
    (Step.OOM_SCORE, None),                 # the call before the session's init when memory runs out
    (Step.DROP_PRIVILEGES, None),
    (Step.DIE_WITH_PARENT, None),           # the credential change cleared it
    (Step.NOT_DUMPABLE, None),
    (Step.OPEN_TERMINAL, TERMINAL),         # as the caller, inside the session: its devpts
    (Step.FORK, None),
    (Step.DEFAULT_SIGNALS, None),
    (Step.DIE_WITH_PARENT, None),
    (Step.NEW_SESSION, None),               # no controlling terminal: no TIOCSTI into the caller
    (Step.CONTROLLING_TERMINAL, TERMINAL),
    (Step.DECLARE_PTRACER, None),           # the session's init brokers its connects (Yama's ptrace_scope 1)
    (Step.RLIMITS, None),
    (Step.VERIFY_DROPPED, None),
    (Step.LANDLOCK, None),
    (Step.LANDLOCK_ABI, None),
    (Step.CLOSE_ON_EXEC, None),
    (Step.CLOSE_ON_EXEC_WALK, WALKED),      # a kernel without CLOSE_RANGE_CLOEXEC (before 5.11)
    (Step.SECCOMP, None),                   # last: nothing after it but exec
    (Step.SEND_LISTENER, LISTENER),
    (Step.EXEC, None),
)


def expected(*, landlock_abi: int, terminal: bool = False, walked: bool = False, listener: bool = False) -> list[str]:
    """The trace a call must leave: the plan's steps, the optional ones when their condition holds."""
    taken = {TERMINAL: terminal, WALKED: walked, LISTENER: listener}
    return [name % landlock_abi if name == Step.LANDLOCK_ABI else name
            for name, condition in CALL_PLAN if condition is None or taken[condition]]


def _matches(planned: str, traced: str) -> bool:
    if planned != Step.LANDLOCK_ABI:
        return planned == traced
    prefix = planned.partition("%")[0]
    return traced.startswith(prefix) and traced[len(prefix):].isdigit()


def misplaced(trace: list[str]) -> str | None:
    """What is wrong with a trace, whatever the call's options: a step the plan does not name,
    one out of the plan's order, or a required one missing. None when it follows the plan."""
    position = 0
    for index, traced in enumerate(trace):
        if not any(_matches(name, traced) for name, _ in CALL_PLAN):
            return f"step {index + 1} {traced!r} is not in the call plan"
        while position < len(CALL_PLAN) and not _matches(CALL_PLAN[position][0], traced):
            if CALL_PLAN[position][1] is None:
                return (f"step {index + 1} {traced!r} comes where the plan has {CALL_PLAN[position][0]!r} "
                        f"(plan step {position + 1})")
            position += 1                           # an optional step not taken
        if position == len(CALL_PLAN):
            return f"step {index + 1} {traced!r} is out of the plan's order"
        position += 1
    missing = [name for name, condition in CALL_PLAN[position:] if condition is None]
    return f"the trace ends before {missing[0]!r}" if missing else None

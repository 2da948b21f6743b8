/*
 * sandboxd-call: one command in a session's sandbox, as a small native program.
 *
 * This is sequence.run_call and sequence._run_command (the Python call path)
 * in C, step for step, so that a call in a warm session costs a vfork, two
 * small execs and a fork of a tiny process instead of two forks of a Python
 * interpreter (the difference is most of a call's CPU time; see
 * docs/benchmark.md). The fork server spawns it (posix_spawn) inside the session's PID
 * namespace, as root, with an EMPTY environment (the command's environment
 * comes in a memfd, so no LD_PRELOAD or similar can reach a root process, and
 * no secret in it shows in this process's world-readable command line), and
 * these descriptors:
 *
 *   0 1 2  the command's stdin, stdout, stderr; with -t, 0 is instead the terminal channel: a Unix
 *          socket the terminal's master is sent back on (SCM_RIGHTS), and the command's stdio is
 *          the terminal's peer
 *   3      report pipe: "pid" once forked; a setup error (step, errno, path); EOF at exec
 *   4      status pipe: the command's wait status and resource usage, at its end
 *   5      pidfd of the session's init (its namespaces are joined through it)
 *   6      the session init's intake socket (seccomp listeners go there), if any
 *   7      a pipe holding the compiled seccomp program (BPF)
 *   8      a memfd holding the command's environment, NUL-terminated KEY=VALUE entries
 *
 * Usage (built by sandboxd.launcher.native_call.command_line):
 *   sandboxd-call -u UID -g GID -c CWD -n NSFLAGS [-C CPU] [-F NOFILE] [-L] [-G CGROUPDIR]...
 *                 [-W WRITABLE]... [-t ROWS:COLUMNS] [-T TRACE_FILE] [-A LANDLOCK_ABI] [-X] -- ARGV...
 *   sandboxd-call -V      prints the digest of the constants it was built with
 * -T, -A and -X are for tests only (plan.DebugHooks): append each setup step's name to a
 * file, use a lower Landlock ABI's rights, take the /proc/self/fd walk instead of close_range.
 * -t runs the command on a terminal of that size from the session's devpts (sequence.open_terminal).
 *
 * Every constant shared with the Python path (descriptor layout, exit code, securebits,
 * Landlock rights and the ABI that introduced each, signals, path lists) comes from
 * sandboxd_call.h, which native_call.py generates from the Python modules at build time,
 * and so do the names of the setup steps it traces (SBX_STEP_*, from launcher/call_plan.py:
 * the call plan both paths follow, in its order).
 *
 * Records on the report and status pipes use the Python side's format
 * (launcher/report.py): key<US>value pairs joined by <RS>, one line.
 * Any failure before exec is reported with its step and errno, then exit 125:
 * the command never runs with less isolation than asked.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <grp.h>
#include <limits.h>
#include <unistd.h>

#include "sandboxd_call.h"

#ifndef SBX_CONSTANTS_DIGEST
#error "sandboxd_call.h is generated: build with python -m sandboxd.launcher.native_call build"
#endif

enum { REPORT_FD = SBX_REPORT_FD, STATUS_FD = SBX_STATUS_FD, SESSION_PIDFD = SBX_SESSION_PIDFD,
       INTAKE_FD = SBX_INTAKE_FD, BPF_FD = SBX_BPF_FD, ENV_FD = SBX_ENV_FD };
enum { SETUP_FAILED_EXIT = SBX_SETUP_FAILED_EXIT, MAX_BPF = 1 << 16, MAX_ENV = 1 << 24 };
/* As many paths as the policy can name (a writable root each, and the workspace; the groups of
 * one cgroup set): one more is refused, never dropped, since a dropped path would lose its rule. */
enum { MAX_WRITABLE = SBX_MAX_WRITABLE_PATHS, MAX_CGROUPS = SBX_MAX_CGROUP_DIRS };

/* Syscalls glibc may not wrap; numbers 434 and up are the same on every architecture
 * (kernel ABI, like the flags below: not sandboxd's own constants). */
#define NR_close_range 436
#define NR_landlock_create_ruleset 444
#define NR_landlock_add_rule 445
#define NR_landlock_restrict_self 446
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#define LL_CREATE_VERSION 1U
#define LL_RULE_PATH_BENEATH 1

struct ll_ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct ll_path_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

struct cap_header { uint32_t version; int pid; };
struct cap_data { uint32_t effective, permitted, inheritable; };

struct options {
    uid_t uid; gid_t gid; const char *cwd; int nsflags;
    long cpu_seconds; long open_files; int listener;
    const char *cgroups[MAX_CGROUPS]; int n_cgroups;
    const char *writable[MAX_WRITABLE]; int n_writable;
    long landlock_abi; int no_close_range;        /* tests only: -A, -X */
    int terminal; unsigned short rows, columns;   /* -t */
    char **env; char **argv;
};

static int trace_fd = -1;                          /* -T: tests only */

/* ---- reporting ------------------------------------------------------------------------------ */

static void write_all(int fd, const char *data, size_t size) {
    while (size > 0) {
        ssize_t n = write(fd, data, size);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) return;
        data += n; size -= (size_t)n;
    }
}

/* Separators inside a value would split the record: they become spaces (as report.encode does). */
static void append_clean(char *out, size_t room, const char *value) {
    size_t used = strlen(out);
    for (; *value && used + 1 < room; value++) out[used++] = (*value == 0x1e || *value == 0x1f || *value == '\n') ? ' ' : *value;
    out[used] = '\0';
}

static _Noreturn void fail(const char *step, int code, const char *path) {
    char line[SBX_PATH_MAX + 512];                  /* a whole path, and the step's name around it */
    snprintf(line, sizeof line, "native\x1f" "1\x1e" "errno\x1f%d\x1e" "step\x1f", code);
    append_clean(line, sizeof line, step);
    if (path) {
        strncat(line, "\x1epath\x1f", sizeof line - strlen(line) - 1);
        append_clean(line, sizeof line, path);
    }
    strncat(line, "\n", sizeof line - strlen(line) - 1);
    write_all(REPORT_FD, line, strlen(line));
    _exit(SETUP_FAILED_EXIT);
}

static void check(long result, const char *step, const char *path) {
    if (result < 0) fail(step, errno, path);
}

/* Whether what snprintf wrote (``written``) fitted ``room``: a path that does not is refused, never used cut short. */
static int fits(size_t room, int written) {
    return written >= 0 && (size_t)written < room;
}

/* A setup step's name on the trace file (-T), as sequence.py's trace: one test compares them. */
static void trace(const char *step) {
    if (trace_fd < 0) return;
    char line[128];
    int length = snprintf(line, sizeof line, "%s\n", step);
    if (write(trace_fd, line, (size_t)length) != length) fail("trace", errno, NULL);
}

/* A decimal number in [min, max] that is all of ``text`` up to ``stop``: 0, or EINVAL (not digits
 * up to there: a sign, a space, nothing) or ERANGE. strtoul alone takes "-1" as ULONG_MAX, "12x"
 * as 12, "" as 0 and an overflow as ULONG_MAX; every number this program reads goes through here. */
static int decimal(const char *text, char stop, unsigned long min, unsigned long max, unsigned long *value) {
    char *end;
    if (*text < '0' || *text > '9') return EINVAL;
    errno = 0;
    *value = strtoul(text, &end, 10);
    if (*end != stop) return EINVAL;
    return errno || *value < min || *value > max ? ERANGE : 0;
}

/* Every descriptor from first up, closed (cloexec 0) or marked close-on-exec (cloexec 1):
 * close_range(2) when the kernel has it (5.9; CLOSE_RANGE_CLOEXEC 5.11), else a walk over
 * /proc/self/fd (as process.cloexec_from); a descriptor the walk cannot handle fails the call
 * rather than leak into the command. Returns whether the walk was taken. */
static int close_from(int first, int cloexec, int use_close_range) {
    if (use_close_range && syscall(NR_close_range, first, ~0U, cloexec ? CLOSE_RANGE_CLOEXEC : 0) == 0) return 0;
    static int found[65536];
    int n = 0;
    DIR *dir = opendir("/proc/self/fd");
    if (!dir) fail("close-on-exec", errno, "/proc/self/fd");
    int own = dirfd(dir);
    struct dirent *entry;
    errno = 0;
    while ((entry = readdir(dir))) {
        unsigned long fd;
        if (decimal(entry->d_name, '\0', (unsigned long)first, INT_MAX, &fd) || (int)fd == own) continue;
        if (n == (int)(sizeof found / sizeof *found)) fail("close-on-exec", EMFILE, "/proc/self/fd");
        found[n++] = (int)fd;
    }
    if (errno) fail("close-on-exec", errno, "/proc/self/fd");
    check(closedir(dir), "close-on-exec", "/proc/self/fd");
    for (int i = 0; i < n; i++) {
        if (!cloexec) { check(close(found[i]), "close descriptors", NULL); continue; }
        int flags = fcntl(found[i], F_GETFD);
        check(flags, "close-on-exec", NULL);
        check(fcntl(found[i], F_SETFD, flags | FD_CLOEXEC), "close-on-exec", NULL);
    }
    return 1;
}

/* ---- the call's supervisor ------------------------------------------------------------------ */

static void die_with_parent(pid_t expected_parent) {
    check(prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl(PR_SET_PDEATHSIG)", NULL);
    if (getppid() != expected_parent) _exit(137);
}

/* cgroups.join in C. This process is single-threaded, so moving its one thread (a v1 group's
 * "tasks") moves all of it, and the kernel does that without its global threadgroup rwsem, whose
 * write side (a "cgroup.procs" write) waits for an RCU grace period after a quiet moment: 10 to
 * 25 ms, more than the rest of a call. A v2 group has no "tasks": "cgroup.procs" there. */
static void join_cgroups(const struct options *o) {
    for (int i = 0; i < o->n_cgroups; i++) {
        char path[SBX_PATH_MAX];
        if (!fits(sizeof path, snprintf(path, sizeof path, "%s/tasks", o->cgroups[i])))
            fail("cgroup join", ENAMETOOLONG, o->cgroups[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 && errno == ENOENT) {
            if (!fits(sizeof path, snprintf(path, sizeof path, "%s/cgroup.procs", o->cgroups[i])))
                fail("cgroup join", ENAMETOOLONG, o->cgroups[i]);
            fd = open(path, O_WRONLY | O_CLOEXEC);
        }
        if (fd < 0 || write(fd, "0", 1) != 1) fail("cgroup join", errno, path);
        check(close(fd), "cgroup join", path);
    }
}

static void drop_privileges(const struct options *o) {
    int last_cap = SBX_FALLBACK_LAST_CAP;
    char text[16] = "";
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f) {
        unsigned long value;
        if (fgets(text, sizeof text, f) && decimal(text, '\n', 0, 63, &value) == 0) last_cap = (int)value;
        fclose(f);
    }
    for (int cap = 0; cap <= last_cap; cap++)
        check(prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability bounding set", NULL);
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities", NULL);
    check(prctl(PR_SET_SECUREBITS, SBX_SECUREBITS, 0, 0, 0), "set securebits", NULL);
    check(setgroups(0, NULL), "drop privileges", NULL);
    check(setresgid(o->gid, o->gid, o->gid), "drop privileges", NULL);
    check(setresuid(o->uid, o->uid, o->uid), "drop privileges", NULL);
    /* For uid 0 the kernel keeps the capability sets across setresuid: clear them. */
    struct cap_header header = {SBX_CAPABILITY_VERSION_3, 0};
    struct cap_data data[2] = {{0, 0, 0}, {0, 0, 0}};
    check(syscall(SYS_capset, &header, data), "capset", NULL);
    check(prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "set no_new_privs", NULL);
}

static int has_children(void) {
    siginfo_t info;
    return !(waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD);
}

/* Every descendant of ours, from the parent links in /proc/<pid>/stat (no CONFIG_PROC_CHILDREN
 * needed), into victims; returns how many. */
static int find_descendants(pid_t *victims, int room) {
    static pid_t pids[65536], parents[65536];
    int n = 0, found = 0;
    DIR *proc = opendir("/proc");
    if (!proc) fail("kill the call's tree", errno, "/proc");   /* as process.descendants: never skip it */
    struct dirent *entry;
    while ((entry = readdir(proc)) && n < 65536) {
        char path[64], buffer[512];
        unsigned long pid, parent;
        if (decimal(entry->d_name, '\0', 1, INT_MAX, &pid)) continue;    /* not a process */
        snprintf(path, sizeof path, "/proc/%lu/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;                      /* the process has ended meanwhile */
        ssize_t size = read(fd, buffer, sizeof buffer - 1);
        close(fd);                                 /* read-only /proc file: nothing to lose */
        if (size <= 0) continue;
        buffer[size] = '\0';
        /* "PID (COMM) STATE PPID ...": the command name may hold anything, so from its last ')' */
        char *close_paren = strrchr(buffer, ')');
        if (!close_paren || strlen(close_paren) < 4 || decimal(close_paren + 4, ' ', 0, INT_MAX, &parent)) continue;
        pids[n] = (pid_t)pid; parents[n] = (pid_t)parent; n++;
    }
    check(closedir(proc), "kill the call's tree", "/proc");
    if (room <= 0) return 0;
    victims[found++] = getpid();                   /* the search starts at us; dropped below */
    for (int head = 0; head < found; head++)
        for (int i = 0; i < n && found < room; i++)
            if (parents[i] == victims[head]) victims[found++] = pids[i];
    memmove(victims, victims + 1, (size_t)(found - 1) * sizeof *victims);
    return found - 1;
}

static void kill_descendants(int reap) {
    static pid_t victims[65536];
    if (!has_children()) return;                   /* every descendant descends from a child */
    for (int round = 0; round < 1000; round++) {
        int n = find_descendants(victims, 65536);
        if (n == 0) return;
        for (int i = 0; i < n; i++) kill(victims[i], SIGKILL);   /* ESRCH: it ended meanwhile */
        if (!reap) return;
        while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {}
    }
}

/* ---- the command ---------------------------------------------------------------------------- */

/* As process.prefer_for_oom_kill: the call (this supervisor, and the command that inherits it) goes
 * before the session's init when the group runs out of memory. */
static void prefer_for_oom_kill(void) {
    char value[16];
    int length = snprintf(value, sizeof value, "%d", SBX_COMMAND_OOM_SCORE_ADJ);
    int fd = open(SBX_OOM_SCORE_ADJ_PATH, O_WRONLY | O_CLOEXEC);
    check(fd, "oom_score_adj", SBX_OOM_SCORE_ADJ_PATH);
    if (write(fd, value, (size_t)length) != length) fail("oom_score_adj", errno, SBX_OOM_SCORE_ADJ_PATH);
    check(close(fd), "oom_score_adj", SBX_OOM_SCORE_ADJ_PATH);
}

static void apply_rlimits(const struct options *o) {
    struct rlimit none = {0, 0};
    check(setrlimit(RLIMIT_CORE, &none), "setrlimit", NULL);
    if (o->cpu_seconds >= 0) {
        struct rlimit cpu = {(rlim_t)o->cpu_seconds, (rlim_t)o->cpu_seconds + 1};
        check(setrlimit(RLIMIT_CPU, &cpu), "setrlimit", NULL);
    }
    if (o->open_files >= 0) {
        struct rlimit current;
        check(getrlimit(RLIMIT_NOFILE, &current), "setrlimit", NULL);
        rlim_t value = (rlim_t)o->open_files;
        if (current.rlim_max != RLIM_INFINITY && current.rlim_max < value) value = current.rlim_max;
        struct rlimit files = {value, value};
        check(setrlimit(RLIMIT_NOFILE, &files), "setrlimit", NULL);
    }
}

static void verify_dropped(void) {
    if (prctl(PR_GET_NO_NEW_PRIVS, 0, 0, 0, 0) != 1) fail("verify privileges", EPERM, NULL);
    if (prctl(PR_CAPBSET_READ, SBX_CAP_SYS_ADMIN, 0, 0, 0) != 0) fail("verify privileges", EPERM, NULL);
}

static void add_rules(int ruleset, const char *const *paths, int count, uint64_t access) {
    for (int i = 0; i < count; i++) {
        int fd = open(paths[i], O_PATH | O_CLOEXEC);
        if (fd < 0) {
            if (errno == ENOENT) continue;
            fail("landlock rule", errno, paths[i]);
        }
        struct stat st;
        check(fstat(fd, &st), "landlock rule", paths[i]);
        /* On a file only file rights may be granted (EINVAL otherwise). */
        struct ll_path_beneath rule = {S_ISDIR(st.st_mode) ? access : access & SBX_LL_WANTED_FILE_WRITES, fd};
        check(syscall(NR_landlock_add_rule, ruleset, LL_RULE_PATH_BENEATH, &rule, 0), "landlock rule", paths[i]);
        check(close(fd), "landlock rule", paths[i]);
    }
}

/* The rights (or scopes) of a {bit, first ABI} table that ABI knows, as landlock.known_rights. */
static uint64_t known_at(const uint64_t (*table)[2], size_t size, long abi) {
    uint64_t known = 0;
    for (size_t i = 0; i < size; i++) if (abi >= (long)table[i][1]) known |= table[i][0];
    return known;
}

/* As landlock.restrict_writes: ENOSYS or EOPNOTSUPP from the version query means no Landlock
 * (the read-only mounts stay the wall); any other failure, and every failure after it, is fatal.
 * Returns the ABI used. */
static long restrict_writes(const struct options *o) {
    static const uint64_t right_abi[][2] = SBX_LL_RIGHT_ABI, scope_abi[][2] = SBX_LL_SCOPE_ABI;
    static const char *const extra_writable[] = SBX_LL_EXTRA_WRITABLE, *const file_writes_only[] = SBX_LL_FILE_WRITES_ONLY;
    long abi = syscall(NR_landlock_create_ruleset, NULL, 0, LL_CREATE_VERSION);
    if (abi < 0) {
        if (errno == ENOSYS || errno == EOPNOTSUPP) return 0;
        fail("landlock version", errno, NULL);
    }
    if (o->landlock_abi > 0 && o->landlock_abi < abi) abi = o->landlock_abi;
    if (abi == 0) return 0;
    uint64_t handled = SBX_LL_WANTED_WRITES & known_at(right_abi, sizeof right_abi / sizeof *right_abi, abi);
    uint64_t scoped = SBX_LL_WANTED_SCOPES & known_at(scope_abi, sizeof scope_abi / sizeof *scope_abi, abi);
    struct ll_ruleset_attr attr = {handled, 0, scoped};
    size_t size = abi >= SBX_LL_SCOPE_ATTR_ABI ? sizeof attr : abi >= SBX_LL_NET_ABI ? 16 : 8;
    int ruleset = (int)syscall(NR_landlock_create_ruleset, &attr, size, 0);
    check(ruleset, "landlock ruleset", NULL);
    add_rules(ruleset, o->writable, o->n_writable, handled);
    add_rules(ruleset, extra_writable, sizeof extra_writable / sizeof *extra_writable, handled);
    add_rules(ruleset, file_writes_only, sizeof file_writes_only / sizeof *file_writes_only,
              SBX_LL_WANTED_FILE_WRITES & handled);
    check(syscall(NR_landlock_restrict_self, ruleset, 0), "landlock restrict", NULL);
    check(close(ruleset), "landlock restrict", NULL);
    return abi;
}

/* One descriptor on a Unix socket (SCM_RIGHTS), as init_loop.send_fd. */
static int send_fd(int sock, int fd) {
    char byte = 'L', control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&message);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
    return sendmsg(sock, &message, MSG_NOSIGNAL) < 0 ? -1 : 0;
}

static void load_seccomp(const struct options *o, struct sock_filter *program, size_t length) {
    struct sock_fprog prog = {(unsigned short)length, program};
    long listener = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                            o->listener ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0, &prog);
    check(listener, "seccomp load", NULL);
    if (!o->listener) return;
    /* The session's init answers this filter's connect() notifications (connect_broker.py). */
    int fd = (int)listener;
    trace(SBX_STEP_SEND_LISTENER);
    check(send_fd(INTAKE_FD, fd), "seccomp listener", NULL);
    check(close(fd), "seccomp listener", NULL);
    check(close(INTAKE_FD), "seccomp listener", NULL);
}

/* execve the program, searching the environment's PATH like execvp(3): remember a real
 * refusal (EACCES...), keep looking past ENOENT/ENOTDIR. */
static _Noreturn void exec_command(char **argv, char **env) {
    const char *program = argv[0], *search = NULL;
    int first_error = 0;
    if (strchr(program, '/')) {
        execve(program, argv, env);
        fail("exec", errno, program);
    }
    for (char **entry = env; *entry; entry++)
        if (strncmp(*entry, "PATH=", 5) == 0 && (*entry)[5]) search = *entry + 5;
    if (!search) search = "/usr/local/bin:/usr/bin:/bin";
    while (1) {
        const char *end = strchrnul(search, ':');
        char candidate[SBX_PATH_MAX];
        int dir_length = (int)(end - search);
        int code = ENAMETOOLONG;                    /* what execve says of a longer path: never cut short */
        if (fits(sizeof candidate, snprintf(candidate, sizeof candidate, "%.*s/%s", dir_length ? dir_length : 1,
                                            dir_length ? search : ".", program))) {
            execve(candidate, argv, env);
            code = errno;
        }
        if (first_error == 0 || ((first_error == ENOENT || first_error == ENOTDIR) && code != ENOENT && code != ENOTDIR))
            first_error = code;
        if (!*end) break;
        search = end + 1;
    }
    fail("exec", first_error, program);
}

/* As sequence.open_terminal: a terminal from the devpts this process sees (the session's own),
 * unlocked and sized, its master sent on the terminal channel (fd 0) and closed here; its peer
 * reached by TIOCGPTPEER (never by its /dev/pts name) is returned, for the command. */
static int open_terminal(const struct options *o) {
    int master = open(SBX_PTMX_PATH, O_RDWR | O_NOCTTY | O_CLOEXEC);
    check(master, "open terminal", SBX_PTMX_PATH);
    int unlock = 0;
    struct winsize size = {o->rows, o->columns, 0, 0};
    check(ioctl(master, TIOCSPTLCK, &unlock), "open terminal", NULL);
    check(ioctl(master, TIOCSWINSZ, &size), "open terminal", NULL);
    int peer = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
    check(peer, "open terminal", NULL);
    check(send_fd(0, master), "send terminal", NULL);
    check(close(master), "open terminal", NULL);
    return peer;
}

static _Noreturn void run_command(const struct options *o, pid_t supervisor,
                                  struct sock_filter *program, size_t length, int terminal_peer) {
    sigset_t none;
    sigemptyset(&none);
    trace(SBX_STEP_DEFAULT_SIGNALS);
    check(sigprocmask(SIG_SETMASK, &none, NULL), "default signals", NULL);
    trace(SBX_STEP_DIE_WITH_PARENT);
    die_with_parent(supervisor);
    trace(SBX_STEP_NEW_SESSION);
    check(setsid(), "setsid", NULL);               /* no controlling terminal: no TIOCSTI into the caller */
    if (terminal_peer >= 0) {                      /* the session's own pty, not the caller's */
        trace(SBX_STEP_CONTROLLING_TERMINAL);
        check(ioctl(terminal_peer, TIOCSCTTY, 0), "controlling terminal", NULL);
        for (int fd = 0; fd < 3; fd++) check(dup2(terminal_peer, fd), "controlling terminal", NULL);
        if (terminal_peer > 2) check(close(terminal_peer), "controlling terminal", NULL);
    }
    /* The session's init (PID 1 here) brokers this command's connects: it reads their address and
     * duplicates their socket, ptrace-attach checks that Yama's ptrace_scope 1 passes only for an
     * ancestor (init is none of this call's) or a declared ptracer. Not inherited by what the
     * command forks (docs/policies.md). EINVAL: a kernel without Yama, nothing to declare. */
    trace(SBX_STEP_DECLARE_PTRACER);
    if (prctl(PR_SET_PTRACER, 1, 0, 0, 0) < 0 && errno != EINVAL) fail("prctl(PR_SET_PTRACER)", errno, NULL);
    trace(SBX_STEP_RLIMITS);
    apply_rlimits(o);
    trace(SBX_STEP_VERIFY_DROPPED);
    verify_dropped();                              /* no caps, no_new_privs */
    trace(SBX_STEP_LANDLOCK);
    long abi = restrict_writes(o);                 /* second wall for writes, by path */
    if (trace_fd >= 0) {                           /* no formatting unless traced */
        char step[48];
        snprintf(step, sizeof step, SBX_STEP_LANDLOCK_ABI, (int)abi);
        trace(step);
    }
    trace(SBX_STEP_CLOSE_ON_EXEC);
    if (close_from(3, 1, !o->no_close_range))      /* only 0, 1, 2 survive exec */
        trace(SBX_STEP_CLOSE_ON_EXEC_WALK);
    trace(SBX_STEP_SECCOMP);
    load_seccomp(o, program, length);              /* last: nothing after this but exec */
    trace(SBX_STEP_EXEC);
    exec_command(o->argv, o->env);
}

/* ---- main ----------------------------------------------------------------------------------- */

/* Opened before the session's namespaces are joined: the path is the host's. Moved above the
 * fixed descriptor layout, close-on-exec: the command never holds it. */
static void open_trace(const char *path) {
    int fd = open(path, O_WRONLY | O_APPEND | O_CLOEXEC);
    if (fd < 0) fail("trace", errno, path);
    trace_fd = fcntl(fd, F_DUPFD_CLOEXEC, SBX_TRACE_FD_MIN);
    if (trace_fd < 0) fail("trace", errno, path);
    check(close(fd), "trace", path);
}

/* A decimal number in [min, max] given on the command line, all of ``text`` up to ``stop``, or
 * the call is refused. */
static unsigned long number(const char *text, char stop, unsigned long min, unsigned long max) {
    unsigned long value;
    int code = decimal(text, stop, min, max, &value);
    if (code) fail("call helper arguments", code, text);
    return value;
}

/* One more path into a list of ``room``; past it the call is refused (E2BIG), never shortened. */
static void add_path(const char **paths, int *count, int room, const char *path) {
    if (*count >= room) fail("call helper arguments", E2BIG, path);
    paths[(*count)++] = path;
}

static void parse(int argc, char **argv, struct options *o) {
    int option;
    memset(o, 0, sizeof *o);
    o->cpu_seconds = o->open_files = -1;
    o->uid = (uid_t)-1;
    while ((option = getopt(argc, argv, "+u:g:c:n:C:F:LG:W:t:T:A:X")) != -1) {
        switch (option) {
        /* (uid_t)-1 and (gid_t)-1 mean "unchanged" to setres[ug]id: never a caller's id. */
        case 'u': o->uid = (uid_t)number(optarg, '\0', 0, (uid_t)-2); break;
        case 'g': o->gid = (gid_t)number(optarg, '\0', 0, (gid_t)-2); break;
        case 'c': o->cwd = optarg; break;
        case 'n': o->nsflags = (int)number(optarg, '\0', 0, INT_MAX); break;
        case 'C': o->cpu_seconds = (long)number(optarg, '\0', 1, SBX_MAX_CPU_SECONDS); break;
        case 'F': o->open_files = (long)number(optarg, '\0', 1, SBX_MAX_OPEN_FILES); break;
        case 'L': o->listener = 1; break;
        case 'G': add_path(o->cgroups, &o->n_cgroups, MAX_CGROUPS, optarg); break;
        case 'W': add_path(o->writable, &o->n_writable, MAX_WRITABLE, optarg); break;
        case 't': {
            const char *colon = strchr(optarg, ':');
            o->rows = (unsigned short)number(optarg, ':', SBX_TERMINAL_MIN_SIZE, SBX_TERMINAL_MAX_SIZE);
            o->columns = (unsigned short)number(colon + 1, '\0', SBX_TERMINAL_MIN_SIZE, SBX_TERMINAL_MAX_SIZE);
            o->terminal = 1;
            break;
        }
        case 'T': open_trace(optarg); break;
        case 'A': o->landlock_abi = (long)number(optarg, '\0', 1, SBX_LL_HIGHEST_ABI); break;
        case 'X': o->no_close_range = 1; break;
        default: fail("call helper arguments", EINVAL, NULL);
        }
    }
    if (!o->cwd || o->uid == (uid_t)-1 || optind >= argc || strcmp(argv[optind - 1], "--") != 0)
        fail("call helper arguments", EINVAL, NULL);
    o->argv = argv + optind;
}

static char *copy(const char *text) {
    char *duplicate = strdup(text);
    if (!duplicate) fail("call helper arguments", ENOMEM, NULL);
    return duplicate;
}

/* Show "sandboxd-call" in ps, like the Python supervisor does: the arguments (paths, the
 * command) are copied out first, then their memory is overwritten. */
static void set_title(int argc, char **argv, struct options *o) {
    o->cwd = copy(o->cwd);
    for (int i = 0; i < o->n_cgroups; i++) o->cgroups[i] = copy(o->cgroups[i]);
    for (int i = 0; i < o->n_writable; i++) o->writable[i] = copy(o->writable[i]);
    int count = 0;
    while (o->argv[count]) count++;
    char **command = calloc((size_t)count + 1, sizeof *command);
    if (!command) fail("call helper arguments", ENOMEM, NULL);
    for (int i = 0; i < count; i++) command[i] = copy(o->argv[i]);
    o->argv = command;
    char *start = argv[0], *end = argv[argc - 1] + strlen(argv[argc - 1]) + 1;
    memset(start, 0, (size_t)(end - start));
    strncpy(start, "sandboxd-call", (size_t)(end - start) - 1);
}

/* The command's environment from ENV_FD: NUL-terminated KEY=VALUE entries. */
static char **read_environment(void) {
    struct stat st;
    check(fstat(ENV_FD, &st), "environment", NULL);
    if (st.st_size < 0 || st.st_size > MAX_ENV) fail("environment", E2BIG, NULL);
    char *data = malloc((size_t)st.st_size + 1);
    size_t got = 0, count = 0;
    if (!data) fail("environment", ENOMEM, NULL);
    while (got < (size_t)st.st_size) {
        ssize_t n = pread(ENV_FD, data + got, (size_t)st.st_size - got, (off_t)got);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) fail("environment", n < 0 ? errno : EIO, NULL);
        got += (size_t)n;
    }
    data[got] = '\0';
    check(close(ENV_FD), "environment", NULL);
    for (size_t i = 0; i < got; i++) count += data[i] == '\0';
    char **env = calloc(count + 1, sizeof *env);
    if (!env) fail("environment", ENOMEM, NULL);
    for (size_t i = 0, start = 0, k = 0; i < got; i++)
        if (data[i] == '\0') { env[k++] = data + start; start = i + 1; }
    return env;
}

int main(int argc, char **argv) {
    struct options o;
    static struct sock_filter program[MAX_BPF / sizeof(struct sock_filter)];
    if (argc == 2 && strcmp(argv[1], "-V") == 0) {
        puts(SBX_CONSTANTS_DIGEST);
        return 0;
    }
    parse(argc, argv, &o);
    set_title(argc, argv, &o);
    o.env = read_environment();

    /* The fork server is outside our PID namespace, so it appears as parent 0. */
    trace(SBX_STEP_DIE_WITH_PARENT);
    die_with_parent(0);
    trace(SBX_STEP_JOIN_CGROUPS);
    join_cgroups(&o);                              /* before anything forks: limits cover the whole tree */
    size_t got = 0;
    for (ssize_t n; (n = read(BPF_FD, (char *)program + got, sizeof program - got)) != 0; got += n > 0 ? (size_t)n : 0)
        if (n < 0 && errno != EINTR) fail("seccomp program", errno, NULL);
    if (got == 0 || got % sizeof(struct sock_filter)) fail("seccomp program", EINVAL, NULL);
    check(close(BPF_FD), "seccomp program", NULL);
    /* The session's root comes with its mount namespace; the pidfd is the session's init. */
    trace(SBX_STEP_JOIN_NAMESPACES);
    check(setns(SESSION_PIDFD, o.nsflags), "setns", NULL);
    check(close(SESSION_PIDFD), "setns", NULL);
    trace(SBX_STEP_CHDIR);
    check(chdir(o.cwd), "chdir", o.cwd);
    trace(SBX_STEP_CHILD_SUBREAPER);
    check(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)", NULL);
    trace(SBX_STEP_SET_TITLE);
    check(prctl(PR_SET_NAME, "sandboxd-call", 0, 0, 0), "prctl(PR_SET_NAME)", NULL);
    trace(SBX_STEP_OOM_SCORE);
    prefer_for_oom_kill();                         /* while its /proc entry is still writable to it */
    trace(SBX_STEP_DROP_PRIVILEGES);
    drop_privileges(&o);                           /* the supervisor keeps no privilege either */
    trace(SBX_STEP_DIE_WITH_PARENT);
    die_with_parent(0);                            /* credential changes clear the death signal */
    trace(SBX_STEP_NOT_DUMPABLE);
    check(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)", NULL);
    int terminal_peer = -1;
    if (o.terminal) {
        trace(SBX_STEP_OPEN_TERMINAL);
        terminal_peer = open_terminal(&o);
    }

    /* Blocked before the fork (the command unblocks them): no signal is lost or acted on early. */
    static const int forwarded[] = SBX_FORWARDED_SIGNALS;
    int kill_tree = SBX_KILL_TREE_SIGNAL;          /* sequence.KILL_TREE_SIGNAL, as Python counts it */
    if (kill_tree < SIGRTMIN || kill_tree > SIGRTMAX) fail("signals", EINVAL, NULL);
    sigset_t handled;
    sigemptyset(&handled);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaddset(&handled, forwarded[i]);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, kill_tree);
    check(sigprocmask(SIG_BLOCK, &handled, NULL), "signals", NULL);

    pid_t supervisor = getpid();
    trace(SBX_STEP_FORK);
    pid_t command = fork();
    if (command < 0) fail("fork", errno, NULL);
    if (command == 0) run_command(&o, supervisor, program, got / sizeof(struct sock_filter), terminal_peer);

    char line[64];
    snprintf(line, sizeof line, "pid\x1f%d\n", (int)command);   /* its pid as seen inside the session */
    write_all(REPORT_FD, line, strlen(line));
    /* Only the status pipe stays: the command's exec closes the report, and its end closes stdio.
     * (A failure here kills the call: the command dies with its supervisor.) */
    for (int fd = 0; fd < STATUS_FD; fd++) check(close(fd), "close descriptors", NULL);
    close_from(STATUS_FD + 1, 0, !o.no_close_range);

    for (;;) {
        siginfo_t info;
        int signum = sigwaitinfo(&handled, &info);
        if (signum < 0) continue;
        if (signum == kill_tree) {
            kill_descendants(0);
        } else if (signum != SIGCHLD) {
            kill(command, signum);                 /* ESRCH: it has ended, SIGCHLD follows */
        } else {
            int status;
            struct rusage usage;
            pid_t pid;
            while ((pid = wait4(-1, &status, WNOHANG, &usage)) > 0) {
                if (pid != command) continue;
                kill_descendants(1);               /* nothing the command started outlives the call */
                char record[256];
                snprintf(record, sizeof record, "status\x1f%d\x1eutime\x1f%.6f\x1estime\x1f%.6f\x1emaxrss_kib\x1f%ld\n",
                         status, usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6,
                         usage.ru_stime.tv_sec + usage.ru_stime.tv_usec / 1e6, usage.ru_maxrss);
                write_all(STATUS_FD, record, strlen(record));
                _exit(0);
            }
        }
    }
}

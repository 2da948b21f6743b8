/*
 * sandboxd-call: one command in a session's sandbox, as a small native program.
 *
 * This is sequence.run_call and sequence._run_command (the Python call path)
 * in C, step for step, so that a call in a warm session costs a vfork, two
 * small execs and a fork of a tiny process instead of two forks of a Python
 * interpreter (the difference is most of a call's CPU time; see the README's
 * benchmark). The fork server spawns it (posix_spawn) inside the session's PID
 * namespace, as root, with an EMPTY environment (the command's environment
 * comes in a memfd, so no LD_PRELOAD or similar can reach a root process, and
 * no secret in it shows in this process's world-readable command line), and
 * these descriptors:
 *
 *   0 1 2  the command's stdin, stdout, stderr
 *   3      report pipe: "pid" once forked; a setup error (step, errno, path); EOF at exec
 *   4      status pipe: the command's wait status and resource usage, at its end
 *   5      pidfd of the session's init (its namespaces are joined through it)
 *   6      the session init's intake socket (seccomp listeners go there), if any
 *   7      a pipe holding the compiled seccomp program (BPF)
 *   8      a memfd holding the command's environment, NUL-terminated KEY=VALUE entries
 *
 * Usage (built by sandboxd.launcher.native_call.command_line):
 *   sandboxd-call -u UID -g GID -c CWD -n NSFLAGS [-C CPU] [-F NOFILE] [-L] [-G CGROUPDIR]...
 *                 [-W WRITABLE]... [-R FILE_WRITES_ONLY]... -- ARGV...
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
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <grp.h>
#include <unistd.h>

enum { REPORT_FD = 3, STATUS_FD = 4, SESSION_PIDFD = 5, INTAKE_FD = 6, BPF_FD = 7, ENV_FD = 8 };
enum { SETUP_FAILED_EXIT = 125, MAX_PATHS = 256, MAX_BPF = 1 << 16, MAX_ENV = 1 << 24 };

/* Syscalls glibc may not wrap; numbers 434 and up are the same on every architecture. */
#define NR_close_range 436
#define NR_landlock_create_ruleset 444
#define NR_landlock_add_rule 445
#define NR_landlock_restrict_self 446
#define CLOSE_RANGE_CLOEXEC (1U << 2)

/* Landlock, as kernel/landlock.py: write-type accesses only, plus the signal scope. */
#define LL_WRITE_FILE (1ULL << 1)
#define LL_REMOVE_DIR (1ULL << 4)
#define LL_REMOVE_FILE (1ULL << 5)
#define LL_MAKE_CHAR (1ULL << 6)
#define LL_MAKE_DIR (1ULL << 7)
#define LL_MAKE_REG (1ULL << 8)
#define LL_MAKE_SOCK (1ULL << 9)
#define LL_MAKE_FIFO (1ULL << 10)
#define LL_MAKE_BLOCK (1ULL << 11)
#define LL_MAKE_SYM (1ULL << 12)
#define LL_REFER (1ULL << 13)
#define LL_TRUNCATE (1ULL << 14)
#define LL_SCOPE_SIGNAL (1ULL << 1)
#define LL_CREATE_VERSION 1U
#define LL_RULE_PATH_BENEATH 1

struct ll_ruleset_attr { uint64_t handled_access_fs, handled_access_net, scoped; };
struct ll_path_beneath { uint64_t allowed_access; int32_t parent_fd; } __attribute__((packed));

/* Capabilities, as kernel/caps.py. */
#define CAP_VERSION_3 0x20080522
#define CAP_SYS_ADMIN_BIT 21
#define SECUREBITS ((1 << 0) | (1 << 1) | (1 << 5) | (1 << 6) | (1 << 7))
struct cap_header { uint32_t version; int pid; };
struct cap_data { uint32_t effective, permitted, inheritable; };

struct options {
    uid_t uid; gid_t gid; const char *cwd; int nsflags;
    long cpu_seconds; long open_files; int listener;
    const char *cgroups[MAX_PATHS]; int n_cgroups;
    const char *writable[MAX_PATHS]; int n_writable;
    const char *file_writes_only[MAX_PATHS]; int n_file_writes_only;
    char **env; char **argv;
};

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
    char line[4608];
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

/* ---- the call's supervisor ------------------------------------------------------------------ */

static void die_with_parent(pid_t expected_parent) {
    check(prctl(PR_SET_PDEATHSIG, SIGKILL), "prctl(PR_SET_PDEATHSIG)", NULL);
    if (getppid() != expected_parent) _exit(137);
}

static void join_cgroups(const struct options *o) {
    for (int i = 0; i < o->n_cgroups; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/cgroup.procs", o->cgroups[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) fail("cgroup join", errno, path);
        close(fd);
    }
}

static void drop_privileges(const struct options *o) {
    int last_cap = 40;
    FILE *f = fopen("/proc/sys/kernel/cap_last_cap", "re");
    if (f) { if (fscanf(f, "%d", &last_cap) != 1) last_cap = 40; fclose(f); }
    for (int cap = 0; cap <= last_cap; cap++)
        check(prctl(PR_CAPBSET_DROP, cap, 0, 0, 0), "drop capability bounding set", NULL);
    check(prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0), "clear ambient capabilities", NULL);
    check(prctl(PR_SET_SECUREBITS, SECUREBITS, 0, 0, 0), "set securebits", NULL);
    check(setgroups(0, NULL), "drop privileges", NULL);
    check(setresgid(o->gid, o->gid, o->gid), "drop privileges", NULL);
    check(setresuid(o->uid, o->uid, o->uid), "drop privileges", NULL);
    /* For uid 0 the kernel keeps the capability sets across setresuid: clear them. */
    struct cap_header header = {CAP_VERSION_3, 0};
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
    if (!proc) return 0;
    struct dirent *entry;
    while ((entry = readdir(proc)) && n < 65536) {
        char *end, path[64], buffer[512];
        long pid = strtol(entry->d_name, &end, 10);
        if (*end || pid <= 0) continue;
        snprintf(path, sizeof path, "/proc/%ld/stat", pid);
        int fd = open(path, O_RDONLY | O_CLOEXEC);
        if (fd < 0) continue;
        ssize_t size = read(fd, buffer, sizeof buffer - 1);
        close(fd);
        if (size <= 0) continue;
        buffer[size] = '\0';
        char *close_paren = strrchr(buffer, ')');
        int parent;
        if (!close_paren || sscanf(close_paren + 1, " %*c %d", &parent) != 1) continue;
        pids[n] = (pid_t)pid; parents[n] = parent; n++;
    }
    closedir(proc);
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
        for (int i = 0; i < n; i++) kill(victims[i], SIGKILL);
        if (!reap) return;
        while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {}
    }
}

/* ---- the command ---------------------------------------------------------------------------- */

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
    if (prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN_BIT, 0, 0, 0) != 0) fail("verify privileges", EPERM, NULL);
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
        struct ll_path_beneath rule = {S_ISDIR(st.st_mode) ? access : access & (LL_WRITE_FILE | LL_TRUNCATE), fd};
        check(syscall(NR_landlock_add_rule, ruleset, LL_RULE_PATH_BENEATH, &rule, 0), "landlock rule", paths[i]);
        close(fd);
    }
}

static void restrict_writes(const struct options *o) {
    long abi = syscall(NR_landlock_create_ruleset, NULL, 0, LL_CREATE_VERSION);
    if (abi <= 0) return;                          /* no Landlock: the read-only mounts stay the wall */
    uint64_t handled = LL_WRITE_FILE | LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_CHAR | LL_MAKE_DIR | LL_MAKE_REG
                       | LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_BLOCK | LL_MAKE_SYM;
    if (abi >= 2) handled |= LL_REFER;
    if (abi >= 3) handled |= LL_TRUNCATE;
    struct ll_ruleset_attr attr = {handled, 0, abi >= 6 ? LL_SCOPE_SIGNAL : 0};
    size_t size = abi >= 6 ? sizeof attr : abi >= 4 ? 16 : 8;
    int ruleset = (int)syscall(NR_landlock_create_ruleset, &attr, size, 0);
    check(ruleset, "landlock ruleset", NULL);
    add_rules(ruleset, o->writable, o->n_writable, handled);
    add_rules(ruleset, o->file_writes_only, o->n_file_writes_only, LL_WRITE_FILE | (abi >= 3 ? LL_TRUNCATE : 0));
    check(syscall(NR_landlock_restrict_self, ruleset, 0), "landlock restrict", NULL);
    close(ruleset);
}

static void load_seccomp(const struct options *o, struct sock_filter *program, size_t length) {
    struct sock_fprog prog = {(unsigned short)length, program};
    long listener = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER,
                            o->listener ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0, &prog);
    check(listener, "seccomp load", NULL);
    if (!o->listener) return;
    /* The session's init answers this filter's connect() notifications (connect_broker.py). */
    char byte = 'L', control[CMSG_SPACE(sizeof(int))];
    struct iovec iov = {&byte, 1};
    struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                             .msg_controllen = sizeof control};
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&message);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int));
    int fd = (int)listener;
    memcpy(CMSG_DATA(cmsg), &fd, sizeof fd);
    check(sendmsg(INTAKE_FD, &message, MSG_NOSIGNAL), "seccomp listener", NULL);
    close(fd);
    close(INTAKE_FD);
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
        char candidate[4096];
        int dir_length = (int)(end - search);
        snprintf(candidate, sizeof candidate, "%.*s/%s", dir_length ? dir_length : 1, dir_length ? search : ".", program);
        execve(candidate, argv, env);
        int code = errno;
        if (first_error == 0 || ((first_error == ENOENT || first_error == ENOTDIR) && code != ENOENT && code != ENOTDIR))
            first_error = code;
        if (!*end) break;
        search = end + 1;
    }
    fail("exec", first_error, program);
}

static _Noreturn void run_command(const struct options *o, pid_t supervisor,
                                  struct sock_filter *program, size_t length) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, NULL);
    die_with_parent(supervisor);
    check(setsid(), "setsid", NULL);               /* no controlling terminal: no TIOCSTI into the caller */
    apply_rlimits(o);
    verify_dropped();                              /* no caps, no_new_privs */
    restrict_writes(o);                            /* second wall for writes, by path */
    syscall(NR_close_range, 3, ~0U, CLOSE_RANGE_CLOEXEC);  /* only 0, 1, 2 survive exec */
    load_seccomp(o, program, length);              /* last: nothing after this but exec */
    exec_command(o->argv, o->env);
}

/* ---- main ----------------------------------------------------------------------------------- */

static void parse(int argc, char **argv, struct options *o) {
    int option;
    memset(o, 0, sizeof *o);
    o->cpu_seconds = o->open_files = -1;
    o->uid = (uid_t)-1;
    while ((option = getopt(argc, argv, "+u:g:c:n:C:F:LG:W:R:")) != -1) {
        switch (option) {
        case 'u': o->uid = (uid_t)strtoul(optarg, NULL, 10); break;
        case 'g': o->gid = (gid_t)strtoul(optarg, NULL, 10); break;
        case 'c': o->cwd = optarg; break;
        case 'n': o->nsflags = (int)strtol(optarg, NULL, 0); break;
        case 'C': o->cpu_seconds = strtol(optarg, NULL, 10); break;
        case 'F': o->open_files = strtol(optarg, NULL, 10); break;
        case 'L': o->listener = 1; break;
        case 'G': if (o->n_cgroups < MAX_PATHS) o->cgroups[o->n_cgroups++] = optarg; break;
        case 'W': if (o->n_writable < MAX_PATHS) o->writable[o->n_writable++] = optarg; break;
        case 'R': if (o->n_file_writes_only < MAX_PATHS) o->file_writes_only[o->n_file_writes_only++] = optarg; break;
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
    for (int i = 0; i < o->n_file_writes_only; i++) o->file_writes_only[i] = copy(o->file_writes_only[i]);
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
    close(ENV_FD);
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
    parse(argc, argv, &o);
    set_title(argc, argv, &o);
    o.env = read_environment();

    /* The fork server is outside our PID namespace, so it appears as parent 0. */
    die_with_parent(0);
    join_cgroups(&o);                              /* before anything forks: limits cover the whole tree */
    size_t got = 0;
    for (ssize_t n; (n = read(BPF_FD, (char *)program + got, sizeof program - got)) != 0; got += n > 0 ? (size_t)n : 0)
        if (n < 0 && errno != EINTR) fail("seccomp program", errno, NULL);
    if (got == 0 || got % sizeof(struct sock_filter)) fail("seccomp program", EINVAL, NULL);
    close(BPF_FD);
    /* The session's root comes with its mount namespace; the pidfd is the session's init. */
    check(setns(SESSION_PIDFD, o.nsflags), "setns", NULL);
    close(SESSION_PIDFD);
    check(chdir(o.cwd), "chdir", o.cwd);
    check(prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(PR_SET_CHILD_SUBREAPER)", NULL);
    prctl(PR_SET_NAME, "sandboxd-call", 0, 0, 0);
    drop_privileges(&o);                           /* the supervisor keeps no privilege either */
    die_with_parent(0);                            /* credential changes clear the death signal */
    check(prctl(PR_SET_DUMPABLE, 0, 0, 0, 0), "prctl(PR_SET_DUMPABLE)", NULL);

    /* Blocked before the fork (the command unblocks them): no signal is lost or acted on early. */
    static const int forwarded[] = {SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGWINCH, SIGCONT};
    int kill_tree = SIGRTMIN + 2;
    sigset_t handled;
    sigemptyset(&handled);
    for (size_t i = 0; i < sizeof forwarded / sizeof *forwarded; i++) sigaddset(&handled, forwarded[i]);
    sigaddset(&handled, SIGCHLD);
    sigaddset(&handled, kill_tree);
    sigprocmask(SIG_BLOCK, &handled, NULL);

    pid_t supervisor = getpid();
    pid_t command = fork();
    if (command < 0) fail("fork", errno, NULL);
    if (command == 0) run_command(&o, supervisor, program, got / sizeof(struct sock_filter));

    char line[64];
    snprintf(line, sizeof line, "pid\x1f%d\n", (int)command);   /* its pid as seen inside the session */
    write_all(REPORT_FD, line, strlen(line));
    /* Only the status pipe stays: the command's exec closes the report, and its end closes stdio. */
    for (int fd = 0; fd < STATUS_FD; fd++) close(fd);
    syscall(NR_close_range, STATUS_FD + 1, ~0U, 0);

    for (;;) {
        siginfo_t info;
        int signum = sigwaitinfo(&handled, &info);
        if (signum < 0) continue;
        if (signum == kill_tree) {
            kill_descendants(0);
        } else if (signum != SIGCHLD) {
            kill(command, signum);
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

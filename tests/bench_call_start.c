/* The pieces of a session call's start, each on its own (tests/bench_call_start.py builds and runs
 * this against a live session): per iteration, wall time and the CPU of this process and its
 * children, in 4 rounds of the 4 modes interleaved. Not a test: it prints numbers.
 * Usage: bench_call_start N HELPER PIDFD NSFLAGS CGROUP_DIR...
 *   spawn-helper: posix_spawn(HELPER -V) + wait   (the exec of the static helper)
 *   fork:         fork + _exit + wait              (a fork of a small C process: what a resident
 *                                                  per-session helper would pay instead)
 *   fork+setns:   the child setns(PIDFD, NSFLAGS)  (joining the session's namespaces)
 *   fork+cgroup:  the child writes 0 to each CGROUP_DIR/cgroup.procs (the migration) */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sched.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

extern char **environ;
static int pidfd, nsflags, ncg;
static char **cgs;
static const char *helper;

static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9; }
static double cpu(int who) { struct rusage r; getrusage(who, &r); return r.ru_utime.tv_sec + r.ru_utime.tv_usec / 1e6 + r.ru_stime.tv_sec + r.ru_stime.tv_usec / 1e6; }

static void one(int mode) {
    if (mode == 0) {
        posix_spawn_file_actions_t fa;
        posix_spawn_file_actions_init(&fa);
        posix_spawn_file_actions_addopen(&fa, 1, "/dev/null", O_WRONLY, 0);
        char *argv[] = {(char *)helper, "-V", NULL};
        pid_t pid;
        if (posix_spawn(&pid, helper, &fa, NULL, argv, environ)) { perror("spawn"); exit(1); }
        posix_spawn_file_actions_destroy(&fa);
        waitpid(pid, NULL, 0);
        return;
    }
    pid_t pid = fork();
    if (pid == 0) {
        if (mode == 2 && setns(pidfd, nsflags)) _exit(2);
        if (mode == 3) for (int i = 0; i < ncg; i++) {
            char path[4096];
            snprintf(path, sizeof path, "%s/cgroup.procs", cgs[i]);
            int fd = open(path, O_WRONLY);
            if (fd < 0 || write(fd, "0", 1) != 1) _exit(3);
            close(fd);
        }
        _exit(0);
    }
    int status;
    waitpid(pid, &status, 0);
    if (status) { fprintf(stderr, "mode %d: status %d\n", mode, status); exit(1); }
}

int main(int argc, char **argv) {
    if (argc < 5) return 2;
    int n = atoi(argv[1]);
    helper = argv[2]; pidfd = atoi(argv[3]); nsflags = (int)strtol(argv[4], NULL, 0);
    cgs = argv + 5; ncg = argc - 5;
    static const char *names[] = {"spawn-helper (exec of static sandboxd-call -V)", "fork+_exit (small C process)",
                                  "fork+setns(session namespaces)", "fork+cgroup join (write cgroup.procs)"};
    double wall[4] = {0}, c[4] = {0};
    for (int round = 0; round < 4; round++)
        for (int mode = 0; mode < 4; mode++) {
            double w0 = now(), c0 = cpu(RUSAGE_SELF) + cpu(RUSAGE_CHILDREN);
            for (int i = 0; i < n / 4; i++) one(mode);
            wall[mode] += now() - w0; c[mode] += cpu(RUSAGE_SELF) + cpu(RUSAGE_CHILDREN) - c0;
        }
    for (int mode = 0; mode < 4; mode++)
        printf("%-48s wall %.3f ms  CPU %.3f ms\n", names[mode], wall[mode] / n * 1e3, c[mode] / n * 1e3);
    return 0;
}

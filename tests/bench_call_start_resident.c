/* A measurement prototype of "a per-session resident helper" (issue 18 item 2, option 2): NOT
 * used by sandboxd. tests/bench_call_start.py builds it (with the generated sandboxd_call.h) and
 * runs its calls as mechanism R.
 *
 * It is sandboxd-call itself (its main renamed and included), plus a loop. Started as root
 * outside the session's PID namespace with these descriptors:
 *   3  a SOCK_SEQPACKET socket: one request per message, answered with the call's pidfd
 *   4  the pidfd of the session's init
 * and arguments NSFLAGS CGROUP_DIR... It joins the session's cgroup (host paths: before the
 * cgroup namespace hides them) and namespaces once, with its children in the session's PID
 * namespace. Then, per request (the helper's argv, NUL-separated; 8 descriptors: stdin, stdout,
 * stderr, report, status, intake, seccomp program, environment), it forks; the child lays the
 * descriptors out as the helper expects (fd 5: the session's pidfd) and runs the helper's main,
 * which is then a fork, not an exec, and joins no cgroup (the request asks for the uts namespace
 * only, which it is in already). The parent sends the child's pidfd back and reaps its children.
 */
#define main sandboxd_call_main
#include SANDBOXD_CALL_SOURCE
#undef main

enum { CONTROL_FD = 3, SERVER_PIDFD = 4, REQUEST_FDS = 8, MAX_REQUEST = 1 << 16 };

static void child(char *request, size_t size, const int *fds) {
    static const int targets[REQUEST_FDS] = {0, 1, 2, REPORT_FD, STATUS_FD, INTAKE_FD, BPF_FD, ENV_FD};
    int high[REQUEST_FDS + 1];
    for (int i = 0; i < REQUEST_FDS; i++) high[i] = fcntl(fds[i], F_DUPFD, 64);
    high[REQUEST_FDS] = fcntl(SERVER_PIDFD, F_DUPFD, 64);
    for (int i = 0; i < REQUEST_FDS; i++) if (high[i] < 0 || dup2(high[i], targets[i]) < 0) _exit(126);
    if (high[REQUEST_FDS] < 0 || dup2(high[REQUEST_FDS], SESSION_PIDFD) < 0) _exit(126);
    syscall(NR_close_range, ENV_FD + 1, ~0U, 0);
    char *argv[4096];
    int argc = 0;
    for (size_t at = 0; at < size && argc < 4095; at += strlen(request + at) + 1) argv[argc++] = request + at;
    argv[argc] = NULL;
    sandboxd_call_main(argc, argv);
    _exit(126);
}

int main(int argc, char **argv) {
    if (argc < 2) return 2;
    int nsflags = (int)strtol(argv[1], NULL, 0);
    for (int i = 2; i < argc; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/cgroup.procs", argv[i]);
        int fd = open(path, O_WRONLY | O_CLOEXEC);
        if (fd < 0 || write(fd, "0", 1) != 1) { perror(path); return 1; }
        close(fd);
    }
    if (setns(SERVER_PIDFD, nsflags | CLONE_NEWPID) < 0) { perror("setns"); return 1; }
    static char request[MAX_REQUEST];
    for (;;) {
        char control[CMSG_SPACE(REQUEST_FDS * sizeof(int))];
        struct iovec iov = {request, sizeof request - 1};
        struct msghdr message = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control,
                                 .msg_controllen = sizeof control};
        ssize_t size = recvmsg(CONTROL_FD, &message, MSG_CMSG_CLOEXEC);
        while (waitpid(-1, NULL, WNOHANG) > 0) {}
        if (size <= 0) return 0;
        request[size] = '\0';
        struct cmsghdr *cmsg = CMSG_FIRSTHDR(&message);
        if (!cmsg || cmsg->cmsg_type != SCM_RIGHTS || cmsg->cmsg_len != CMSG_LEN(REQUEST_FDS * sizeof(int))) return 3;
        int fds[REQUEST_FDS];
        memcpy(fds, CMSG_DATA(cmsg), sizeof fds);
        pid_t pid = fork();
        if (pid == 0) child(request, (size_t)size, fds);
        for (int i = 0; i < REQUEST_FDS; i++) close(fds[i]);
        int pidfd = pid > 0 ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;   /* not reaped yet: the pid is ours */
        if (pidfd < 0) return 4;
        send_fd(CONTROL_FD, pidfd);
        close(pidfd);
    }
}

/* Socket round trips for bench/bench_overhead.py and tests/test_bpf_overhead.py: N round trips of
 * 64 bytes over a socketpair (sendto + recvfrom, then sendmsg + recvmsg when "msg" is given) in one
 * thread, never blocking.
 * usage: socket_trips N [msg] [wait]
 *   wait: print "ready <pid> <fd0> <fd1>" (the socketpair: sends go out on fd0, receives come in on
 *         fd1) and read one line from stdin before the loop (the caller enrols this process first)
 * prints "<wall ns per round trip> <thread CPU ns per round trip>": the CPU time is the thread's own
 * (probe programs run in its context and count), so it is not inflated when the CPU is taken away. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static double ns(clockid_t clk) {
    struct timespec t;
    clock_gettime(clk, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    int msg = 0, wait = 0;
    for (int i = 2; i < argc; i++) {
        msg |= !strcmp(argv[i], "msg");
        wait |= !strcmp(argv[i], "wait");
    }
    int sv[2];
    char buf[64] = {0};
    if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 1;
    if (wait) {
        char line[16];
        printf("ready %d %d %d\n", getpid(), sv[0], sv[1]);
        fflush(stdout);
        if (!fgets(line, sizeof line, stdin))
            return 1;
    }
    struct iovec iov = {.iov_base = buf, .iov_len = sizeof buf};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    double w0 = ns(CLOCK_MONOTONIC), c0 = ns(CLOCK_THREAD_CPUTIME_ID);
    for (long i = 0; i < n; i++) {
        if (msg) {
            if (sendmsg(sv[0], &mh, 0) != sizeof buf || recvmsg(sv[1], &mh, 0) != sizeof buf)
                return 1;
            continue;
        }
        if (sendto(sv[0], buf, sizeof buf, 0, NULL, 0) != sizeof buf)
            return 1;
        if (recvfrom(sv[1], buf, sizeof buf, 0, NULL, NULL) != sizeof buf)
            return 1;
    }
    double w1 = ns(CLOCK_MONOTONIC), c1 = ns(CLOCK_THREAD_CPUTIME_ID);
    printf("%.1f %.1f\n", (w1 - w0) / n, (c1 - c0) / n);
    return 0;
}

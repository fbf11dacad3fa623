/* Host syscall cost for bench/bench_tracer.py: N round trips of 64 bytes over a socketpair (sendto +
 * recvfrom, the syscalls ingero's socket tracepoints see) in a process ingero does not trace.
 * usage: syscall_loop N   -> prints "<ns per round trip>"
 *        syscall_loop N rw  -> the same with write + read on a pipe (what --socket-rw's tracepoints see) */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

int main(int argc, char **argv) {
    long n = argc > 1 ? atol(argv[1]) : 100000;
    int sv[2];
    char buf[64] = {0};
    int rw = argc > 2 && !strcmp(argv[2], "rw");
    if (rw ? pipe(sv) : socketpair(AF_UNIX, SOCK_STREAM, 0, sv))
        return 1;
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (long i = 0; i < n; i++) {
        if (rw) {
            if (write(sv[1], buf, sizeof buf) != sizeof buf || read(sv[0], buf, sizeof buf) != sizeof buf)
                return 1;
            continue;
        }
        if (sendto(sv[0], buf, sizeof buf, 0, NULL, 0) != sizeof buf)
            return 1;
        if (recvfrom(sv[1], buf, sizeof buf, 0, NULL, NULL) != sizeof buf)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n);
    return 0;
}

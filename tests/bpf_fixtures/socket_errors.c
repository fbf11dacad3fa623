/* Failing socket calls of a traced process, each with a known errno (tests/test_bpf_socket_errno.py).
 *   socket_errors DIR    one cudaMalloc of DIR's libcudart (the process becomes a traced target), prints
 *                        "fds <a> <b> <closed> <pipe>" and waits for a line on stdin (the agent probes a new
 *                        target's socket calls from its next sync), then, in this order:
 *     recv(b, MSG_DONTWAIT) on an empty socket            -> EAGAIN
 *     send(closed, 10 bytes)                              -> EBADF
 *     send(a, 10 bytes), recv(b)                          -> 10 each (errno still EBADF in the TLS)
 *     a second thread: recvmsg(pipe) on a pipe             -> ENOTSOCK (its own errno, its own TLS)
 *     close(b); sendto(a, MSG_NOSIGNAL)                    -> EPIPE
 *   and prints "tid <the second thread's id>" and each call's errno as "<name> <errno>". */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

static int pipe_r;
static int thread_errno;
static pid_t thread_tid;

static void *notsock(void *arg) {
    (void)arg;
    char buf[8];
    struct iovec iov = {buf, sizeof buf};
    struct msghdr m = {0};
    m.msg_iov = &iov;
    m.msg_iovlen = 1;
    thread_tid = gettid();
    thread_errno = recvmsg(pipe_r, &m, MSG_DONTWAIT) == -1 ? errno : 0;
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 2)
        return 64;
    char path[4096];
    snprintf(path, sizeof path, "%s/libcudart.so.12", argv[1]);
    void *cudart = dlopen(path, RTLD_NOW);
    int (*malloc_)(void **, size_t) = cudart ? (int (*)(void **, size_t))dlsym(cudart, "cudaMalloc") : NULL;
    void *p;
    int sv[2], pv[2];
    if (!malloc_ || malloc_(&p, 4096) || socketpair(AF_UNIX, SOCK_STREAM, 0, sv) || pipe(pv))
        return 1;
    int closed = dup(0);
    close(closed);
    pipe_r = pv[0];
    printf("fds %d %d %d %d\n", sv[0], sv[1], closed, pipe_r);
    fflush(stdout);
    char line[16], buf[64] = "0123456789";
    if (!fgets(line, sizeof line, stdin))
        return 1;
    printf("recv %d\n", recv(sv[1], buf, sizeof buf, MSG_DONTWAIT) == -1 ? errno : 0);
    printf("send %d\n", send(closed, buf, 10, 0) == -1 ? errno : 0);
    if (send(sv[0], buf, 10, 0) != 10 || recv(sv[1], buf, sizeof buf, 0) != 10)
        return 1;
    pthread_t t;
    if (pthread_create(&t, NULL, notsock, NULL) || pthread_join(t, NULL))
        return 1;
    printf("tid %d\nrecvmsg %d\n", (int)thread_tid, thread_errno);
    close(sv[1]);
    printf("sendto %d\n", sendto(sv[0], buf, 10, MSG_NOSIGNAL, NULL, 0) == -1 ? errno : 0);
    return 0;
}

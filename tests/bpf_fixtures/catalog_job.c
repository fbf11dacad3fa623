/* The workloads of the detection catalog's real recordings (tests/test_bpf_catalog.py): GPU programs
 * against the modelled device of device_cudart.c (dlopen'ed from LIBDIR), each really doing what its
 * family of trouble is made of — forked loaders, disk reads, its own CPU work, a tool call over
 * loopback TCP, checkpoint writes with fsync, a KV cache and a caching allocator over a first-fit
 * device heap, pageable copies, ranks that wait for each other in all-reduces (libnccl from LIBDIR).
 *
 * usage: catalog_job MODE LIBDIR SECONDS [ARGS...]    (runs about SECONDS, prints "done <steps>")
 *   healthy                     steps, 3 ms usleep after each, two 250 ms pauses (asleep on a timer)
 *   fork WORKERS WORK_US        forked DataLoader workers spin WORK_US per batch, hand it over a pipe
 *   inline DECODE_US FILE       reads 256 KiB of FILE (page cache) and decodes it on-CPU: 2 ms, and
 *                               DECODE_US for every 5th batch (large images)
 *   disk CHUNKS FILE            reads CHUNKS x 1 MiB of FILE with O_DIRECT (the disk) before each step
 *   serve PAUSE_MS              decode steps; twice, PAUSE_MS of its own CPU work (detokenise, sample)
 *   toolcall PORT TOOL_PORT EVERY_MS
 *                               an agent server: per user request on PORT, EVERY_MS of decode steps, a
 *                               tool call to TOOL_PORT (send, wait for the reply), a step, the answer
 *   server PORT                 an inference server: waits for a request, prefill + decode, replies
 *                               (both: one decode step, "warm", then a line on stdin before the rest)
 *   checkpoint FILE MB EVERY_MS every EVERY_MS: weights device->host, written to FILE (O_DIRECT), fsync
 *   contend                     steps of 1 ms of host code + kernels (a CPU hog is put beside it)
 *   cpubound HOST_US            steps, each followed by HOST_US of its own host code (CPU-bound at every step)
 *   overlap CHUNKS LATE EVERY FILE
 *                               40 ms of kernels queued, 2 ms of host code, then CHUNKS x 1 MiB of FILE
 *                               read with O_DIRECT while the GPU runs (LATE chunks every EVERY-th step;
 *                               EVERY 0: never), then the sync
 *   kv                          serving with a KV cache of 32 MiB blocks; preempts (frees, recomputes)
 *   leak LEAK_MB                one activation malloc/free per step; every 8th step LEAK_MB never freed
 *   oom LEAK_MB AFTER_S         after AFTER_S, a pinned staging buffer of LEAK_MB per step, never freed
 *   frag                        a caching allocator: a large request fails, the cache is released, retry
 *   pageable                    an 8 MiB batch from pageable memory, 2 MiB of labels pinned, per step
 *   steps                       plain steps (cold start and drift come from the library's environment)
 *   rank RANK NRANKS STEPS EXTRA_US EVERY GO_FILE
 *                               one rank: steps, an all-reduce after each; EXTRA_US of host code
 *                               before every EVERY-th (0: none); waits for GO_FILE first
 *   hog ON_MS OFF_MS            a CPU hog (no GPU): ON_MS spinning, OFF_MS asleep (OFF_MS 0: always on)
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct { unsigned x, y, z; } dim3;
typedef struct { char internal[128]; } ncclUniqueId;

static int (*launch)(const void *, dim3, dim3, void **, size_t, void *);
static int (*sync_stream)(void *);
static int (*copy)(void *, const void *, size_t, int);
static int (*dmalloc)(void **, size_t);
static int (*dfree)(void *);
static int (*hmalloc)(void **, size_t);
static const dim3 G = {1, 1, 1};
static const void *KERNELS[6] = {(void *)0x5a000, (void *)0x5a1c0, (void *)0x5a380,
                                 (void *)0x5a540, (void *)0x5a700, (void *)0x5a8c0};
enum { H2D = 1, D2H = 2 };
#define MiB (1ul << 20)

static void *sym(void *h, const char *name) {
    void *f = dlsym(h, name);
    if (!f) {
        fprintf(stderr, "catalog_job: no %s\n", name);
        exit(2);
    }
    return f;
}

static void *open_lib(const char *dir, const char *soname) {
    char path[4096];
    snprintf(path, sizeof(path), "%s/%s", dir, soname);
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        fprintf(stderr, "catalog_job: %s\n", dlerror());
        exit(2);
    }
    return h;
}

static void load(const char *dir) {
    void *h = open_lib(dir, "libcudart.so.12");
    launch = sym(h, "cudaLaunchKernel");
    sync_stream = sym(h, "cudaStreamSynchronize");
    copy = sym(h, "cudaMemcpy");
    dmalloc = sym(h, "cudaMalloc");
    dfree = sym(h, "cudaFree");
    hmalloc = sym(h, "cudaMallocHost");
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

static uint64_t cpu_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void spin_us(long us) { /* us of this thread's own CPU time */
    uint64_t end = cpu_ns() + (uint64_t)us * 1000;
    while (cpu_ns() < end) {
    }
}

static void sleep_ms(double ms) {
    struct timespec ts = {(time_t)(ms / 1000), (long)((ms - 1000 * (long)(ms / 1000)) * 1e6)};
    while (nanosleep(&ts, &ts))
        ;
}

static char *batch; /* pinned */

static void kernels(int n, long us) {
    for (int k = 0; k < n; k++)
        launch(KERNELS[k % 4], G, G, NULL, (size_t)us, NULL);
}

/* a training step: the batch in (4 MiB, pinned), 4 kernels of 1.2 ms, a blocking sync */
static void step(void) {
    copy((void *)0x7f0000000000ull, batch, 4 * MiB, H2D);
    kernels(4, 1200);
    sync_stream(NULL);
}

/* a decode step: 2 kernels of 1.5 ms, a blocking sync */
static void decode(void) {
    kernels(2, 1500);
    sync_stream(NULL);
}

static int connect_to(int port) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a)) {
        perror("catalog_job: connect");
        exit(3);
    }
    return fd;
}

static int healthy(double secs) {
    int n = 0;
    double t0 = now_s(), pauses[2] = {0.35, 0.7};
    int next = 0;
    while (now_s() - t0 < secs) {
        step();
        sleep_ms(3);
        if (next < 2 && now_s() - t0 >= pauses[next] * secs) { /* evaluation: asleep on a timer */
            sleep_ms(250);
            next++;
        }
        n++;
    }
    return n;
}

static int forked(double secs, int workers, long work_us) {
    int fds[16][2];
    pid_t kids[16];
    if (workers < 1 || workers > 16)
        exit(2);
    step(); /* the first GPU call makes this process traced: its forks are followed from here */
    for (int w = 0; w < workers; w++) {
        if (pipe(fds[w]))
            exit(2);
        kids[w] = fork();
        if (kids[w] == 0) {
            struct sched_param normal = {0}; /* workers at ordinary priority, whatever the trainer's */
            sched_setscheduler(0, SCHED_OTHER, &normal);
            close(fds[w][0]);
            char one = 'b';
            for (;;) { /* decode + augment one batch, hand it over */
                spin_us(work_us);
                if (write(fds[w][1], &one, 1) != 1)
                    _exit(0);
            }
        }
        close(fds[w][1]);
    }
    int n = 0;
    double t0 = now_s();
    for (; now_s() - t0 < secs; n++) {
        char b;
        if (read(fds[n % workers][0], &b, 1) != 1) /* blocks until that worker's batch is ready */
            exit(3);
        step();
    }
    for (int w = 0; w < workers; w++) {
        kill(kids[w], SIGKILL);
        waitpid(kids[w], NULL, 0);
    }
    return n;
}

static int inline_loader(double secs, long decode_us, const char *file) {
    static char buf[256 << 10];
    int fd = open(file, O_RDONLY);
    if (fd < 0)
        exit(3);
    off_t size = lseek(fd, 0, SEEK_END), off = 0;
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        if (off + (off_t)sizeof buf > size)
            off = 0;
        if (pread(fd, buf, sizeof buf, off) != (ssize_t)sizeof buf)
            exit(3);
        off += sizeof buf;
        spin_us(n % 5 == 4 ? decode_us : 2000); /* decode + augment in the training thread (num_workers=0) */
        step();
    }
    close(fd);
    return n;
}

/* the dataset is larger than the page cache: CHUNKS x 1 MiB records from the disk itself (O_DIRECT), wrapping */
#define CHUNK (1 << 20)
static struct {
    int fd;
    off_t size, off;
    void *buf;
} dataset;

static void open_dataset(const char *file) {
    dataset.fd = open(file, O_RDONLY | O_DIRECT);
    if (dataset.fd < 0 || posix_memalign(&dataset.buf, 4096, CHUNK))
        exit(3);
    dataset.size = lseek(dataset.fd, 0, SEEK_END);
}

static void read_chunks(int chunks) {
    for (int c = 0; c < chunks; c++) {
        if (dataset.off + (CHUNK) > dataset.size)
            dataset.off = 0;
        if (pread(dataset.fd, dataset.buf, CHUNK, dataset.off) != CHUNK)
            exit(3);
        dataset.off += CHUNK;
    }
}

static int disk_loader(double secs, int chunks, const char *file) {
    open_dataset(file);
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        read_chunks(chunks);
        step();
    }
    return n;
}

/* the next batch read while the GPU runs the step queued before it: hidden unless the read outlasts it */
static int overlap(double secs, int chunks, int late, int every, const char *file) {
    open_dataset(file);
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        kernels(8, 5000);
        spin_us(2000); /* the step's own Python */
        read_chunks(every && n % every == every - 1 ? late : chunks);
        sync_stream(NULL);
    }
    return n;
}

static int cpubound(double secs, long host_us) {
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        step();
        spin_us(host_us); /* sampling, detokenising, building the next batch: every step */
    }
    return n;
}

static int serve(double secs, double pause_ms) {
    int n = 0, next = 0;
    double t0 = now_s(), at[2] = {0.25, 0.6};
    for (; now_s() - t0 < secs; n++) {
        decode();
        if (next < 2 && now_s() - t0 >= at[next] * secs) {
            spin_us((long)(pause_ms * 1000)); /* detokenising / sampling a long output on the CPU */
            next++;
        }
    }
    return n;
}

/* after its first GPU call the process is traced; the test says "go" once its socket calls are probed too */
static void warm_then_wait(void) {
    char line[16];
    decode();
    printf("warm\n");
    fflush(stdout);
    if (!fgets(line, sizeof line, stdin))
        exit(3);
}

/* a listening socket on loopback PORT */
static int listen_on(int port) {
    int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 4))
        exit(3);
    return ls;
}

/* an agent server: each user request (received on its connection) is decoded for EVERY_MS, then a tool
 * call goes out on the tool's connection and the thread waits for its reply, a last decode step, and
 * the answer goes back on the user's connection */
static int toolcall(double secs, int port, int tool_port, double every_ms) {
    int ls = listen_on(port), one = 1;
    warm_then_wait();
    int user = accept(ls, NULL, NULL), tool = connect_to(tool_port), n = 0;
    setsockopt(user, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char req[256], reply[256];
    double t0 = now_s();
    while (now_s() - t0 < secs) {
        if (recv(user, req, sizeof req, 0) <= 0) /* the next user request */
            break;
        for (double at = now_s(); (now_s() - at) * 1000 < every_ms; n++)
            decode();
        const char call[] = "{\"tool\": \"search\", \"q\": \"gpu idle\"}\n"; /* the agent calls a tool */
        if (send(tool, call, sizeof call - 1, 0) != (ssize_t)(sizeof call - 1) || recv(tool, reply, sizeof reply, 0) <= 0)
            exit(3);
        decode();
        n++;
        if (send(user, "answer\n", 7, 0) != 7)
            break;
    }
    close(tool);
    close(user);
    close(ls);
    return n;
}

static int server(double secs, int port) {
    int ls = listen_on(port), one = 1;
    warm_then_wait();
    int fd = accept(ls, NULL, NULL), n = 0;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char req[256];
    double t0 = now_s();
    while (now_s() - t0 < secs) {
        ssize_t got = recv(fd, req, sizeof req, 0); /* asleep until the next request: low load */
        if (got <= 0)
            break;
        int tokens = 8 + (int)(req[0] % 16);
        kernels(1, 3000); /* prefill */
        for (int k = 0; k < tokens; k++, n++)
            decode();
        if (send(fd, "ok\n", 3, 0) != 3)
            break;
    }
    close(fd);
    close(ls);
    return n;
}

static int checkpoint(double secs, const char *file, long mb, double every_ms) {
    char *host;
    if (hmalloc((void **)&host, (size_t)mb * MiB))
        exit(3);
    int n = 0;
    double t0 = now_s(), last = t0;
    for (; now_s() - t0 < secs; n++) {
        step();
        if ((now_s() - last) * 1000 >= every_ms) { /* torch.save(model.state_dict(), file) */
            copy(host, (void *)0x7f0000000000ull, (size_t)mb * MiB, D2H);
            int fd = open(file, O_WRONLY | O_CREAT | O_TRUNC | O_DIRECT, 0600); /* straight to the disk */
            for (long off = 0; off < mb; off += 4)
                if (write(fd, host + off * MiB, 4 * MiB) != (ssize_t)(4 * MiB))
                    exit(3);
            fsync(fd);
            close(fd);
            last = now_s();
        }
    }
    return n;
}

static int contend(double secs) {
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        spin_us(1000); /* the step's host code: the optimizer, the Python around the kernels */
        kernels(2, 1500);
        sync_stream(NULL);
    }
    return n;
}

/* vLLM-shaped: sequences grow into reserved KV blocks (32 MiB each); every 24 decode steps the cache is
 * full: the scheduler preempts sequences (their blocks freed at once, each cudaFree synchronising),
 * re-admits others (fresh blocks from the driver) and recomputes them (a long prefill) */
static int kv(double secs) {
    enum { BLOCKS = 96, EVICT = 24, EVERY = 24 };
    void *blocks[BLOCKS];
    for (int k = 0; k < BLOCKS; k++)
        if (dmalloc(&blocks[k], 32 * MiB))
            exit(4);
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        decode();
        if (n % EVERY == EVERY - 1) {
            kernels(1, 1500); /* the step in flight when the scheduler preempts */
            for (int k = BLOCKS - EVICT; k < BLOCKS; k++) /* preempted sequences' blocks handed back */
                dfree(blocks[k]);
            for (int k = BLOCKS - EVICT; k < BLOCKS; k++) /* the re-admitted sequences' blocks */
                if (dmalloc(&blocks[k], 32 * MiB))
                    exit(4);
            kernels(1, 30000); /* recompute: the re-admitted sequences' prefill again */
            sync_stream(NULL);
        }
    }
    return n;
}

static int leak(double secs, long leak_mb) {
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        void *act, *lost;
        if (dmalloc(&act, 96 * MiB))
            exit(4);
        if (n % 8 == 0 && dmalloc(&lost, (size_t)leak_mb * MiB)) /* kept by a growing list: never freed */
            exit(4);
        step();
        dfree(act);
    }
    return n;
}

static int oom(double secs, long leak_mb, double after_s) {
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        step();
        void *staging;
        if (now_s() - t0 >= after_s && hmalloc(&staging, (size_t)leak_mb * MiB)) /* a pinned pool that only grows */
            exit(4);
    }
    return n;
}

/* PyTorch's caching allocator over the first-fit device: 64 MiB segments cached; a 768 MiB request
 * fails while the cache holds the memory, so the cache is released (a burst of cudaFree, each
 * synchronising) and the request retried; the cache then fills again */
static int frag(double secs) {
    enum { SEGS = 28, FREE_SEGS = 16 };
    void *seg[SEGS], *big;
    int held = 0, n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        for (int k = 0; k < 2 && held < SEGS; k++) /* the cache grows with the step's new tensors */
            if (dmalloc(&seg[held++], 64 * MiB))
                exit(4);
        step();
        if (held == SEGS) {
            kernels(2, 1200); /* the step that needs the large activation is in flight */
            if (dmalloc(&big, 768 * MiB) == 2) { /* out of memory: release the cache, retry */
                for (int k = 0; k < FREE_SEGS; k++)
                    dfree(seg[--held]);
                if (dmalloc(&big, 768 * MiB))
                    exit(4);
            }
            sync_stream(NULL);
            dfree(big);
        }
    }
    return n;
}

static int pageable(double secs) {
    char *images = malloc(8 * MiB), *labels;
    if (!images || hmalloc((void **)&labels, 2 * MiB))
        exit(3);
    memset(images, 1, 8 * MiB);
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++) {
        copy((void *)0x7f0000000000ull, images, 8 * MiB, H2D); /* DataLoader(pin_memory=False) */
        copy((void *)0x7f0000800000ull, labels, 2 * MiB, H2D);
        kernels(4, 1000);
        sync_stream(NULL);
    }
    return n;
}

static int steps(double secs) {
    int n = 0;
    for (double t0 = now_s(); now_s() - t0 < secs; n++)
        step();
    return n;
}

static int rank(const char *dir, int rk, int nranks, int nsteps, long extra_us, int every, const char *go) {
    while (access(go, F_OK))
        sleep_ms(2);
    void *nc = open_lib(dir, "libnccl.so.2");
    int (*getid)(ncclUniqueId *) = (int (*)(ncclUniqueId *))sym(nc, "ncclGetUniqueId");
    int (*init)(void **, int, ncclUniqueId, int) = (int (*)(void **, int, ncclUniqueId, int))sym(nc, "ncclCommInitRank");
    int (*allreduce)(const void *, void *, size_t, int, int, void *, void *) =
        (int (*)(const void *, void *, size_t, int, int, void *, void *))sym(nc, "ncclAllReduce");
    ncclUniqueId id;
    void *comm = NULL;
    if (getid(&id) || init(&comm, nranks, id, rk))
        exit(4);
    for (int s = 0; s < nsteps; s++) {
        step();
        if (extra_us && every && s % every == every - 1)
            spin_us(extra_us); /* this rank's extra host work: the others wait for it in the all-reduce */
        if (allreduce(NULL, NULL, 1 << 20, 7 /* float32 */, 0 /* sum */, comm, NULL))
            exit(5);
    }
    return nsteps;
}

static int hog(double on_ms, double off_ms) {
    for (;;) {
        spin_us((long)(on_ms * 1000));
        if (off_ms > 0)
            sleep_ms(off_ms);
    }
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: catalog_job MODE LIBDIR SECONDS [ARGS...]\n");
        return 2;
    }
    const char *mode = argv[1];
    double secs = atof(argv[3]);
    if (!strcmp(mode, "hog"))
        return hog(atof(argv[3]), argc > 4 ? atof(argv[4]) : 0);
    load(argv[2]);
    if (hmalloc((void **)&batch, 4 * MiB))
        return 2;
    int n = -1;
#define ARGS(k) if (argc != 4 + (k)) return 2
    if (!strcmp(mode, "healthy")) { ARGS(0); n = healthy(secs); }
    else if (!strcmp(mode, "fork")) { ARGS(2); n = forked(secs, atoi(argv[4]), atol(argv[5])); }
    else if (!strcmp(mode, "inline")) { ARGS(2); n = inline_loader(secs, atol(argv[4]), argv[5]); }
    else if (!strcmp(mode, "disk")) { ARGS(2); n = disk_loader(secs, atoi(argv[4]), argv[5]); }
    else if (!strcmp(mode, "serve")) { ARGS(1); n = serve(secs, atof(argv[4])); }
    else if (!strcmp(mode, "toolcall")) { ARGS(3); n = toolcall(secs, atoi(argv[4]), atoi(argv[5]), atof(argv[6])); }
    else if (!strcmp(mode, "server")) { ARGS(1); n = server(secs, atoi(argv[4])); }
    else if (!strcmp(mode, "checkpoint")) { ARGS(3); n = checkpoint(secs, argv[4], atol(argv[5]), atof(argv[6])); }
    else if (!strcmp(mode, "contend")) { ARGS(0); n = contend(secs); }
    else if (!strcmp(mode, "cpubound")) { ARGS(1); n = cpubound(secs, atol(argv[4])); }
    else if (!strcmp(mode, "overlap")) { ARGS(4); n = overlap(secs, atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), argv[7]); }
    else if (!strcmp(mode, "kv")) { ARGS(0); n = kv(secs); }
    else if (!strcmp(mode, "leak")) { ARGS(1); n = leak(secs, atol(argv[4])); }
    else if (!strcmp(mode, "oom")) { ARGS(2); n = oom(secs, atol(argv[4]), atof(argv[5])); }
    else if (!strcmp(mode, "frag")) { ARGS(0); n = frag(secs); }
    else if (!strcmp(mode, "pageable")) { ARGS(0); n = pageable(secs); }
    else if (!strcmp(mode, "steps")) { ARGS(0); n = steps(secs); }
    else if (!strcmp(mode, "rank")) {
        ARGS(6);
        n = rank(argv[2], atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), atol(argv[7]), atoi(argv[8]), argv[9]);
    }
    if (n < 0)
        return 2;
    printf("done %d\n", n);
    return 0;
}

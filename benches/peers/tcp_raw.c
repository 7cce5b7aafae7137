/*
 * tcp_raw: the kernel's own floor for a one-way transfer over loopback TCP, for reading
 * FerroCCL's and MPI's tcp numbers against (no library, no protocol: one connected socket).
 *
 *   gcc -O2 -o tcp_raw benches/peers/tcp_raw.c
 *   ./tcp_raw SIZE PIECE ITERS [BUSY]
 *
 * Two processes, pinned to CPUs 0 and 1, TCP_NODELAY. Each iteration the sender writes SIZE
 * bytes in `send` calls of PIECE bytes (blocking) and waits for a 1-byte reply; the receiver
 * reads until it has SIZE bytes, then replies. BUSY=1: the receiver's socket is non-blocking
 * and it spins on `recv` (as a driving FerroCCL rank does); 0: it sleeps in `recv`. Prints
 * the median time per iteration (us) after dropping the first tenth.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static double now_us(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    sched_setaffinity(0, sizeof s, &s);
}

static int cmp(const void *x, const void *y) {
    double a = *(const double *)x, b = *(const double *)y;
    return a < b ? -1 : a > b;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: tcp_raw SIZE PIECE ITERS [BUSY]\n");
        return 2;
    }
    size_t size = strtoull(argv[1], 0, 10), piece = strtoull(argv[2], 0, 10);
    int iters = atoi(argv[3]), busy = argc > 4 ? atoi(argv[4]) : 0, one = 1;
    if (size == 0 || piece == 0 || iters < 10) {
        fprintf(stderr, "SIZE and PIECE must be > 0, ITERS >= 10\n");
        return 2;
    }
    int ls = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    if (ls < 0 || bind(ls, (void *)&a, sizeof a) || getsockname(ls, (void *)&a, &alen) || listen(ls, 1))
        die("listen");
    char *buf = aligned_alloc(4096, (size + 4095) / 4096 * 4096);
    double *t = malloc(sizeof(double) * iters);
    if (!buf || !t)
        die("alloc");
    memset(buf, 1, size);
    pid_t child = fork();
    if (child == 0) {
        pin(1);
        int s = socket(AF_INET, SOCK_STREAM, 0);
        if (s < 0 || connect(s, (void *)&a, sizeof a))
            die("connect");
        setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (busy)
            fcntl(s, F_SETFL, O_NONBLOCK);
        for (int i = 0; i < iters; i++) {
            for (size_t got = 0; got < size;) {
                ssize_t n = recv(s, buf + got, size - got, 0);
                if (n < 0 && (errno == EAGAIN || errno == EINTR))
                    continue;
                if (n <= 0)
                    die("recv");
                got += n;
            }
            char c = 0;
            while (send(s, &c, 1, 0) != 1)
                if (errno != EAGAIN && errno != EINTR)
                    die("reply");
        }
        exit(0);
    }
    pin(0);
    int s = accept(ls, 0, 0);
    if (s < 0)
        die("accept");
    setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    for (int i = 0; i < iters; i++) {
        double t0 = now_us();
        for (size_t off = 0; off < size;) {
            size_t k = size - off < piece ? size - off : piece;
            ssize_t n = send(s, buf + off, k, 0);
            if (n <= 0 && errno != EINTR)
                die("send");
            off += n > 0 ? (size_t)n : 0;
        }
        char c;
        if (recv(s, &c, 1, MSG_WAITALL) != 1)
            die("wait for the reply");
        t[i] = now_us() - t0;
    }
    int skip = iters / 10;
    qsort(t + skip, iters - skip, sizeof *t, cmp);
    printf("size %zu piece %zu busy %d: median %.1f us\n", size, piece, busy, t[skip + (iters - skip) / 2]);
    waitpid(child, 0, 0);
    return 0;
}

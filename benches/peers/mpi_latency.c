/*
 * mpi_latency: the MPI side of benches/latency.sh, the peer of `ferroccl-perf latency`.
 *
 * Small-message allreduce latency (f32, sum, in place), two ways in one run, alternating:
 *
 *   blocking    MPI_Allreduce(MPI_IN_PLACE, buf, ...)
 *   persistent  MPI_Allreduce_init(MPI_IN_PLACE, buf, ...) once per size, then
 *               MPI_Start + MPI_Wait per call (MPI-4). Open MPI 4.1 is MPI-3.1 and has it
 *               as MPIX_Allreduce_init in <mpi-ext.h> (the "pcollreq" extension, run by
 *               its libnbc component); MPICH >= 4 as MPI_Allreduce_init.
 *
 * Same method as ferroccl-perf latency: for each size, BATCHES batches per mode, the modes
 * alternating batch by batch (blocking first in even batches, persistent first in odd
 * ones); a batch is a barrier, then ITERS timed calls; its time per call is the slowest
 * rank's (max over the ranks). Before the batches: WARMUP calls of each mode, and one
 * checked call of each (every rank's input is rank + 1; the sum must be n(n+1)/2).
 *
 *   mpicc -O2 -o target/peers/mpi_latency benches/peers/mpi_latency.c
 *   mpirun -np 2 target/peers/mpi_latency [--sizes 8,4K] [-n ITERS] [-w WARMUP]
 *                                         [--batches B] [--raw]
 *
 * Output (rank 0): one line per size and mode: size, mode, median / min / max over the
 * batches of the time per call in microseconds; with --raw, also one line per batch,
 * "#batch SIZE MODE US", which benches/latency.sh collects.
 */
#include <mpi.h>
#if defined(OMPI_MAJOR_VERSION)
#include <mpi-ext.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if MPI_VERSION >= 4
#define PERSISTENT_ALLREDUCE MPI_Allreduce_init
#define PERSISTENT_NAME "MPI_Allreduce_init"
#elif defined(OMPI_HAVE_MPI_EXT_PCOLLREQ)
#define PERSISTENT_ALLREDUCE MPIX_Allreduce_init
#define PERSISTENT_NAME "MPIX_Allreduce_init (Open MPI pcollreq extension)"
#else
#error "no persistent allreduce: needs MPI-4 (MPI_Allreduce_init) or Open MPI's pcollreq extension (MPIX_Allreduce_init)"
#endif

#define MAX_SIZES 16
enum { BLOCKING, PERSISTENT, NMODES };
static const char *mode_names[NMODES] = {"blocking", "persistent"};

static int rank, nranks;

static void die(const char *msg, const char *arg) {
    if (rank == 0) fprintf(stderr, "mpi_latency: error: %s%s\n", msg, arg ? arg : "");
    MPI_Finalize();
    exit(2);
}

static size_t parse_size(const char *s, const char **end_out) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return 0;
    switch (*end) {
    case 'K': case 'k': v <<= 10; end++; break;
    case 'M': case 'm': v <<= 20; end++; break;
    default: break;
    }
    *end_out = end;
    return (size_t)v;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One call of `mode`. */
static void call(int mode, float *buf, int count, MPI_Request *req) {
    if (mode == BLOCKING) {
        MPI_Allreduce(MPI_IN_PLACE, buf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    } else {
        MPI_Start(req);
        MPI_Wait(req, MPI_STATUS_IGNORE);
    }
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    size_t sizes[MAX_SIZES] = {8, 4096};
    int nsizes = 2, iters = 200, warmup = 50, batches = 10, raw = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            if (rank == 0)
                printf("usage: mpirun -np N mpi_latency [--sizes 8,4K] [-n ITERS] [-w WARMUP] [--batches B] [--raw]\n"
                       "allreduce f32 sum in place: MPI_Allreduce vs %s + MPI_Start/MPI_Wait, alternating\n",
                       PERSISTENT_NAME);
            MPI_Finalize();
            return 0;
        } else if (!strcmp(a, "--raw")) {
            raw = 1;
        } else if (!v) {
            die("option needs a value: ", a);
        } else if (!strcmp(a, "--sizes")) {
            nsizes = 0;
            const char *p = v;
            while (*p) {
                const char *end;
                size_t s = parse_size(p, &end);
                if (s < 4 || nsizes == MAX_SIZES || (*end && *end != ',')) die("--sizes: bad list (sizes >= 4 bytes, K or M suffix, comma separated): ", v);
                sizes[nsizes++] = s;
                p = *end ? end + 1 : end;
            }
            i++;
        } else if (!strcmp(a, "-n")) {
            iters = atoi(v), i++;
            if (iters < 1) die("-n must be 1 or more: ", v);
        } else if (!strcmp(a, "-w")) {
            warmup = atoi(v), i++;
        } else if (!strcmp(a, "--batches")) {
            batches = atoi(v), i++;
            if (batches < 1) die("--batches must be 1 or more: ", v);
        } else {
            die("unknown option ", a);
        }
    }

    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int vlen;
    MPI_Get_library_version(version, &vlen);
    char *nl = strchr(version, '\n');
    if (nl) *nl = 0;
    char *comma = strchr(version, ',');
    if (comma) *comma = 0;
    if (rank == 0) {
        printf("# mpi_latency: allreduce f32 sum in place, %d ranks, %s\n", nranks, version);
        printf("#  blocking: MPI_Allreduce; persistent: %s once per size, then MPI_Start + MPI_Wait\n", PERSISTENT_NAME);
        printf("#  %d batches of %d calls per mode (alternating), %d warm-up calls; time per call: the slowest rank's\n", batches, iters,
               warmup);
        printf("#%11s %12s %10s %10s %10s\n", "size(B)", "mode", "median_us", "min_us", "max_us");
    }

    int wrong_total = 0;
    double *t[NMODES];
    for (int m = 0; m < NMODES; m++) t[m] = malloc(sizeof(double) * (size_t)batches);
    for (int si = 0; si < nsizes; si++) {
        int count = (int)(sizes[si] / sizeof(float));
        float *buf = malloc(sizeof(float) * (size_t)count);
        float *pbuf = malloc(sizeof(float) * (size_t)count);
        for (int k = 0; k < count; k++) buf[k] = pbuf[k] = 0.0f;
        MPI_Request req;
        PERSISTENT_ALLREDUCE(MPI_IN_PLACE, pbuf, count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD, MPI_INFO_NULL, &req);

        /* One checked call of each mode, then the warm-up. */
        float want = (float)nranks * (float)(nranks + 1) / 2.0f;
        for (int m = 0; m < NMODES; m++) {
            float *b = m == BLOCKING ? buf : pbuf;
            for (int k = 0; k < count; k++) b[k] = (float)(rank + 1);
            call(m, b, count, &req);
            for (int k = 0; k < count; k++) wrong_total += b[k] != want;
            for (int k = 0; k < count; k++) b[k] = 0.0f;
            for (int w = 0; w < warmup; w++) call(m, b, count, &req);
        }

        for (int bt = 0; bt < batches; bt++) {
            for (int j = 0; j < NMODES; j++) {
                int m = (bt % 2 == 0) ? j : NMODES - 1 - j;
                float *b = m == BLOCKING ? buf : pbuf;
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int it = 0; it < iters; it++) call(m, b, count, &req);
                double us = (MPI_Wtime() - t0) * 1e6 / iters, slowest;
                MPI_Allreduce(&us, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                t[m][bt] = slowest;
                if (raw && rank == 0) printf("#batch %zu %s %.3f\n", sizes[si], mode_names[m], slowest);
            }
        }
        if (rank == 0) {
            for (int m = 0; m < NMODES; m++) {
                qsort(t[m], (size_t)batches, sizeof(double), cmp_double);
                double med = batches % 2 ? t[m][batches / 2] : (t[m][batches / 2 - 1] + t[m][batches / 2]) / 2;
                printf(" %11zu %12s %10.2f %10.2f %10.2f\n", sizes[si], mode_names[m], med, t[m][0], t[m][batches - 1]);
            }
            fflush(stdout);
        }
        MPI_Request_free(&req);
        free(buf);
        free(pbuf);
    }
    int wrong_all = 0;
    MPI_Allreduce(&wrong_total, &wrong_all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) printf("# wrong elements: %d %s\n", wrong_all, wrong_all ? "FAILED" : "OK");
    for (int m = 0; m < NMODES; m++) free(t[m]);
    MPI_Finalize();
    return wrong_all ? 1 : 0;
}

/*
 * mpi_latency: the MPI side of benches/latency.sh, the peer of `ferroccl-perf latency`.
 *
 * Small-message collective latency, two ways in one run, alternating:
 *
 *   blocking    MPI_Allreduce(MPI_IN_PLACE, buf, ...)            (--coll allreduce, default)
 *               MPI_Allgather(send, count, ..., recv, count, ...) (--coll allgather)
 *               MPI_Bcast(buf, ..., root 0)                      (--coll broadcast)
 *               MPI_Reduce_scatter_block(send, recv, count, ...) (--coll reduce_scatter)
 *   persistent  the same call's persistent form (MPI_Allreduce_init, MPI_Allgather_init,
 *               MPI_Bcast_init, MPI_Reduce_scatter_block_init) once per size, then
 *               MPI_Start + MPI_Wait per call (MPI-4). Open MPI 4.1 is MPI-3.1 and has them
 *               as MPIX_*_init in <mpi-ext.h> (the "pcollreq" extension, run by its libnbc
 *               component); MPICH >= 4 as MPI_*_init. An MPI with neither: the persistent
 *               mode is skipped, saying so, and only the blocking one runs.
 *
 * Sizes are per-rank buffer sizes, as in ferroccl-perf latency: for allgather and
 * reduce_scatter, the per-rank block (the gathered output / the input are N times larger).
 * Allreduce and reduce_scatter sum; allreduce and broadcast work in place.
 *
 * --dtype f32 (MPI_FLOAT, MPI_SUM) or bf16. MPI has no bf16 datatype and no bf16 reduction,
 * so bf16 is what an MPI user must do: the elements travel as MPI_UINT16_T and the sum is a
 * user-defined commutative MPI_Op (MPI_Op_create) that widens each pair to float, adds,
 * and rounds back to nearest even (as FerroCCL's kernels do, which accumulate in f32).
 *
 * Same method as ferroccl-perf latency: for each size, BATCHES batches per mode, the modes
 * alternating batch by batch (blocking first in even batches, persistent first in odd
 * ones); a batch is a barrier, then ITERS timed calls; its time per call is the slowest
 * rank's (max over the ranks). Before the batches: one checked call of each mode, then
 * WARMUP calls of each, and after them one more checked call of each (every rank's input
 * is rank + 1; allreduce and reduce_scatter must give n(n+1)/2, allgather block r must be
 * r + 1, broadcast 1; all exact in bf16 up to 22 ranks).
 *
 *   mpicc -O2 -o target/peers/mpi_latency benches/peers/mpi_latency.c
 *       (Open MPI and MPICH side by side on Debian/Ubuntu: mpicc.openmpi, mpicc.mpich)
 *   mpirun -np 2 target/peers/mpi_latency [--sizes 8,4K] [--dtype f32|bf16]
 *       [--coll allreduce|allgather|broadcast|reduce_scatter] [-n ITERS] [-w WARMUP]
 *       [--batches B] [--raw]
 *
 * Output (rank 0): one line per size and mode: size, mode, median / min / max over the
 * batches of the time per call in microseconds; with --raw, also one line per batch,
 * "#batch SIZE MODE US", which benches/latency.sh collects.
 */
#include <mpi.h>
#if defined(OMPI_MAJOR_VERSION)
#include <mpi-ext.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if MPI_VERSION >= 4
#define HAVE_PERSISTENT 1
#define P_ALLREDUCE MPI_Allreduce_init
#define P_ALLGATHER MPI_Allgather_init
#define P_BCAST MPI_Bcast_init
#define P_REDUCE_SCATTER MPI_Reduce_scatter_block_init
#define P_PREFIX "MPI_"
#define P_SUFFIX ""
#elif defined(OMPI_HAVE_MPI_EXT_PCOLLREQ)
#define HAVE_PERSISTENT 1
#define P_ALLREDUCE MPIX_Allreduce_init
#define P_ALLGATHER MPIX_Allgather_init
#define P_BCAST MPIX_Bcast_init
#define P_REDUCE_SCATTER MPIX_Reduce_scatter_block_init
#define P_PREFIX "MPIX_"
#define P_SUFFIX " (Open MPI pcollreq extension)"
#else
#define HAVE_PERSISTENT 0
#endif

#define MAX_SIZES 16
enum { BLOCKING, PERSISTENT, NMODES };
static const char *mode_names[NMODES] = {"blocking", "persistent"};
enum { ALLREDUCE, ALLGATHER, BROADCAST, REDUCE_SCATTER, NCOLLS };
static const char *coll_names[NCOLLS] = {"allreduce", "allgather", "broadcast", "reduce_scatter"};
static const char *blocking_names[NCOLLS] = {"MPI_Allreduce", "MPI_Allgather", "MPI_Bcast", "MPI_Reduce_scatter_block"};
static const char *persistent_names[NCOLLS] = {"Allreduce_init", "Allgather_init", "Bcast_init", "Reduce_scatter_block_init"};

static int rank, nranks;
static int coll = ALLREDUCE, bf16 = 0;
static MPI_Datatype dtype;
static MPI_Op sum_op;
static size_t esize;

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

/* bf16 <-> float: bf16 is the upper half of an IEEE binary32. */
static float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t float_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays a (quiet) NaN */
    u += 0x7fffu + ((u >> 16) & 1); /* round to nearest, ties to even */
    return (uint16_t)(u >> 16);
}

/* The user-defined bf16 sum (MPI_Op_create, commutative): inout[i] = in[i] + inout[i]. */
static void bf16_sum(void *in, void *inout, int *len, MPI_Datatype *type) {
    (void)type;
    const uint16_t *a = in;
    uint16_t *b = inout;
    for (int i = 0; i < *len; i++) b[i] = float_to_bf16(bf16_to_float(a[i]) + bf16_to_float(b[i]));
}

/* Element k of buf, as a double / set to v (exact for the small integers used here). */
static double get(const void *buf, size_t k) {
    return bf16 ? (double)bf16_to_float(((const uint16_t *)buf)[k]) : (double)((const float *)buf)[k];
}

static void fill(void *buf, size_t len, double v) {
    for (size_t k = 0; k < len; k++) {
        if (bf16)
            ((uint16_t *)buf)[k] = float_to_bf16((float)v);
        else
            ((float *)buf)[k] = (float)v;
    }
}

/* One blocking call (in place for allreduce and broadcast: `out` only). */
static void blocking(void *in, void *out, int count) {
    switch (coll) {
    case ALLREDUCE: MPI_Allreduce(MPI_IN_PLACE, out, count, dtype, sum_op, MPI_COMM_WORLD); break;
    case ALLGATHER: MPI_Allgather(in, count, dtype, out, count, dtype, MPI_COMM_WORLD); break;
    case BROADCAST: MPI_Bcast(out, count, dtype, 0, MPI_COMM_WORLD); break;
    default: MPI_Reduce_scatter_block(in, out, count, dtype, sum_op, MPI_COMM_WORLD); break;
    }
}

#if HAVE_PERSISTENT
/* The persistent request of the same call. */
static void persistent_init(void *in, void *out, int count, MPI_Request *req) {
    switch (coll) {
    case ALLREDUCE: P_ALLREDUCE(MPI_IN_PLACE, out, count, dtype, sum_op, MPI_COMM_WORLD, MPI_INFO_NULL, req); break;
    case ALLGATHER: P_ALLGATHER(in, count, dtype, out, count, dtype, MPI_COMM_WORLD, MPI_INFO_NULL, req); break;
    case BROADCAST: P_BCAST(out, count, dtype, 0, MPI_COMM_WORLD, MPI_INFO_NULL, req); break;
    default: P_REDUCE_SCATTER(in, out, count, dtype, sum_op, MPI_COMM_WORLD, MPI_INFO_NULL, req); break;
    }
}
#endif

/* One call of `mode`. */
static void call(int mode, void *in, void *out, int count, MPI_Request *req) {
    if (mode == BLOCKING) {
        blocking(in, out, count);
    } else {
        MPI_Start(req);
        MPI_Wait(req, MPI_STATUS_IGNORE);
    }
}

/* Elements of the input and output of a `count`-element call (0 input: in place). */
static void lens(int count, size_t *in_len, size_t *out_len) {
    size_t c = (size_t)count, n = (size_t)nranks;
    switch (coll) {
    case ALLGATHER: *in_len = c; *out_len = n * c; break;
    case REDUCE_SCATTER: *in_len = n * c; *out_len = c; break;
    default: *in_len = 0; *out_len = c; break;
    }
}

/* The exact result of element k of a checked call (inputs rank + 1). */
static double want(size_t k, int count) {
    switch (coll) {
    case ALLGATHER: return (double)(k / (size_t)count + 1);
    case BROADCAST: return 1.0;
    default: return (double)nranks * (nranks + 1) / 2.0;
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
                printf("usage: mpirun -np N mpi_latency [--sizes 8,4K] [--dtype f32|bf16]\n"
                       "           [--coll allreduce|allgather|broadcast|reduce_scatter] [-n ITERS] [-w WARMUP] [--batches B] [--raw]\n"
                       "a collective's blocking call vs its persistent form + MPI_Start/MPI_Wait, alternating "
#if HAVE_PERSISTENT
                       "(persistent: " P_PREFIX "*_init" P_SUFFIX ")\n"
#else
                       "(this MPI has no persistent collectives: blocking only)\n"
#endif
                );
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
        } else if (!strcmp(a, "--dtype")) {
            if (!strcmp(v, "f32")) bf16 = 0;
            else if (!strcmp(v, "bf16")) bf16 = 1;
            else die("--dtype must be f32 or bf16: ", v);
            i++;
        } else if (!strcmp(a, "--coll")) {
            coll = -1;
            for (int c = 0; c < NCOLLS; c++)
                if (!strcmp(v, coll_names[c])) coll = c;
            if (coll < 0) die("--coll must be one of allreduce, allgather, broadcast, reduce_scatter: ", v);
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
    if (bf16) {
        dtype = MPI_UINT16_T;
        esize = 2;
        MPI_Op_create(bf16_sum, 1, &sum_op);
    } else {
        dtype = MPI_FLOAT;
        esize = 4;
        sum_op = MPI_SUM;
    }
    const char *tname = bf16 ? "bf16" : "f32";

    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int vlen;
    MPI_Get_library_version(version, &vlen);
    char *nl = strchr(version, '\n');
    if (nl) *nl = 0;
    char *comma = strchr(version, ',');
    if (comma) *comma = 0;
    char *vword = strstr(version, "Version:"); /* MPICH's "MPICH Version:\t4.0.2" -> "MPICH 4.0.2" */
    if (vword) {
        char *q = vword + strlen("Version:");
        while (*q == ' ' || *q == '\t') q++;
        memmove(vword, q, strlen(q) + 1);
    }
    int nmodes = HAVE_PERSISTENT ? NMODES : 1;
    if (rank == 0) {
        switch (coll) {
        case ALLREDUCE: printf("# mpi_latency: allreduce %s sum in place", tname); break;
        case ALLGATHER: printf("# mpi_latency: allgather %s, size = the per-rank block", tname); break;
        case BROADCAST: printf("# mpi_latency: broadcast %s from rank 0 in place", tname); break;
        default: printf("# mpi_latency: reduce_scatter %s sum, size = the per-rank block", tname); break;
        }
        printf(", %d ranks, %s\n", nranks, version);
        if (bf16) printf("#  bf16: MPI_UINT16_T elements%s\n", coll == ALLREDUCE || coll == REDUCE_SCATTER ? " and a user-defined MPI_Op (widen to float, add, round to nearest even)" : "");
#if HAVE_PERSISTENT
        printf("#  blocking: %s; persistent: %s%s%s once per size, then MPI_Start + MPI_Wait\n", blocking_names[coll], P_PREFIX,
               persistent_names[coll], P_SUFFIX);
#else
        printf("#  blocking: %s; persistent: skipped (this MPI has neither MPI-4's MPI_%s nor Open MPI's MPIX_%s)\n",
               blocking_names[coll], persistent_names[coll], persistent_names[coll]);
#endif
        printf("#  %d batches of %d calls per mode (alternating), %d warm-up calls; time per call: the slowest rank's\n", batches, iters,
               warmup);
        printf("#%11s %12s %10s %10s %10s\n", "size(B)", "mode", "median_us", "min_us", "max_us");
    }

    int wrong_total = 0;
    double *t[NMODES];
    for (int m = 0; m < NMODES; m++) t[m] = malloc(sizeof(double) * (size_t)batches);
    for (int si = 0; si < nsizes; si++) {
        int count = (int)(sizes[si] / esize);
        if (count < 1) count = 1;
        size_t in_len, out_len;
        lens(count, &in_len, &out_len);
        /* Blocking and persistent buffers (in: unused by the in-place calls). */
        void *in[NMODES], *out[NMODES];
        for (int m = 0; m < NMODES; m++) {
            in[m] = calloc(in_len ? in_len : 1, esize);
            out[m] = calloc(out_len, esize);
        }
        MPI_Request req = MPI_REQUEST_NULL;
#if HAVE_PERSISTENT
        persistent_init(in[PERSISTENT], out[PERSISTENT], count, &req);
#endif

        /* One checked call of each mode, then the warm-up. */
        int wrong[NMODES] = {0}, wrong_sum[NMODES] = {0};
        for (int m = 0; m < nmodes; m++) {
            if (in_len)
                fill(in[m], in_len, rank + 1);
            else
                fill(out[m], out_len, rank + 1);
            call(m, in[m], out[m], count, &req);
            for (size_t k = 0; k < out_len; k++) wrong[m] += get(out[m], k) != want(k, count);
            fill(in[m], in_len, 0);
            fill(out[m], out_len, 0);
            for (int w = 0; w < warmup; w++) call(m, in[m], out[m], count, &req);
        }

        for (int bt = 0; bt < batches; bt++) {
            for (int j = 0; j < nmodes; j++) {
                int m = (bt % 2 == 0) ? j : nmodes - 1 - j;
                MPI_Barrier(MPI_COMM_WORLD);
                double t0 = MPI_Wtime();
                for (int it = 0; it < iters; it++) call(m, in[m], out[m], count, &req);
                double us = (MPI_Wtime() - t0) * 1e6 / iters, slowest;
                MPI_Allreduce(&us, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
                t[m][bt] = slowest;
                if (raw && rank == 0) printf("#batch %zu %s %.3f\n", sizes[si], mode_names[m], slowest);
            }
        }
        /* And one checked call of each mode after them: a mode that moved the data only in
         * its first call (a persistent request reused wrongly) fails here. */
        for (int m = 0; m < nmodes; m++) {
            if (in_len)
                fill(in[m], in_len, rank + 1);
            else
                fill(out[m], out_len, rank + 1);
            if (in_len) fill(out[m], out_len, 0);
            call(m, in[m], out[m], count, &req);
            for (size_t k = 0; k < out_len; k++) wrong[m] += get(out[m], k) != want(k, count);
        }
        /* A mode that gave wrong elements at this size: said per mode (benches/latency.sh
         * leaves its batches out). */
        MPI_Allreduce(wrong, wrong_sum, NMODES, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
        for (int m = 0; m < nmodes; m++) {
            wrong_total += wrong_sum[m];
            if (rank == 0 && wrong_sum[m]) printf("#wrong %zu %s %d\n", sizes[si], mode_names[m], wrong_sum[m]);
        }
        if (rank == 0) {
            for (int m = 0; m < nmodes; m++) {
                qsort(t[m], (size_t)batches, sizeof(double), cmp_double);
                double med = batches % 2 ? t[m][batches / 2] : (t[m][batches / 2 - 1] + t[m][batches / 2]) / 2;
                printf(" %11zu %12s %10.2f %10.2f %10.2f\n", sizes[si], mode_names[m], med, t[m][0], t[m][batches - 1]);
            }
            fflush(stdout);
        }
        if (req != MPI_REQUEST_NULL) MPI_Request_free(&req);
        for (int m = 0; m < NMODES; m++) {
            free(in[m]);
            free(out[m]);
        }
    }
    int wrong_all = wrong_total; /* summed over the ranks above */
    if (rank == 0) printf("# wrong elements: %d %s\n", wrong_all, wrong_all ? "FAILED" : "OK");
    for (int m = 0; m < NMODES; m++) free(t[m]);
    if (bf16) MPI_Op_free(&sum_op);
    MPI_Finalize();
    return wrong_all ? 1 : 0;
}

/*
 * mpi_moe: one mixture-of-experts step (dispatch + identity experts + combine) with MPI,
 * the baseline that FerroCCL's MoE module is compared against (benches/moe.sh).
 *
 *   mpicc -O2 -o target/peers/mpi_moe benches/peers/mpi_moe.c
 *   mpirun -np 4 target/peers/mpi_moe [--check] T [H [E [K [STEPS [WARMUP]]]]]
 *
 * T tokens per rank, H hidden (default 4096), E experts (default 8; a multiple of the
 * rank count, at most 64), K top-k (default 2; 1 <= K <= min(E, 8)), STEPS timed steps
 * (default 100), WARMUP untimed steps first (default 10). Elements are bf16 (2 bytes);
 * MPI only moves bytes, sums are computed in float (bf16 -> float: bits << 16; float ->
 * bf16: round to nearest even on the top 16 bits).
 *
 * Routing (identical in every implementation; step s counts from 0 over warm-up and timed
 * steps, t is the token's index on its rank r):
 *
 *   splitmix64(v): z = v + 0x9E3779B97F4A7C15;
 *                  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9;
 *                  z = (z ^ (z >> 27)) * 0x94D049BB133111EB;
 *                  return z ^ (z >> 31)          (all mod 2^64; the conformance tests' Rng)
 *   x   = splitmix64((r << 40) ^ (s << 20) ^ t)
 *   e_0 = x % E
 *   for j = 1 .. K-1:  h = x;  repeat { h = splitmix64(h); c = (e_{j-1} + 1 + h % (E-1)) % E }
 *                      until c is none of e_0 .. e_{j-1};  e_j = c
 *        (h carries over from one j to the next; for K = 2, e_1 != e_0 at the first try)
 *   weights: K = 1: w_0 = 1; else w_j = 0.75 * 0.25^j for j < K-1 and w_{K-1} = 0.25^{K-1}
 *        (K = 2: 0.75 and 0.25; they sum to 1 exactly, every one a power of two times 3 or 1)
 *   expert e lives on rank e / (E / nranks).
 *
 * One step (timed from just after an MPI_Barrier to the end of the combine; the routing above
 * is the router's output, computed before the barrier; the slowest rank's time is the step's):
 *   1. dispatch: each token goes ONCE to each distinct rank that owns one of its experts;
 *      rows are packed by destination rank, in token order within one destination.
 *      MPI_Alltoall of the row counts; MPI_Alltoallv of the rows (H bf16 each) and
 *      MPI_Alltoallv of one metadata record per row (token index, mask of the token's
 *      experts, the weights of the mask's experts in ascending expert order). The receiver
 *      copies each row into the group of each of its local experts the mask names (in
 *      arrival order).
 *   2. experts: y = x (identity, no compute: the benchmark measures communication).
 *   3. combine: for each row it received, a rank sums w_e * y_e over its local experts e of
 *      that token (ascending e) in float, converts to bf16, and MPI_Alltoallv's the rows
 *      back (the dispatch's counts reversed, so they land where the token's rows were packed);
 *      the token's origin sums the rows from its destination ranks (ascending rank) in float
 *      and converts to bf16.
 *
 * Output (rank 0, one line): mpi_moe ranks=N tokens=T hidden=H experts=E topk=K steps=S
 * median_us=.. p10_us=.. p90_us=..   (percentiles of the per-step times, linear
 * interpolation between the sorted samples at q * (S - 1)).
 *
 * --check: token values are bf16 with the two lowest mantissa bits zero (so 0.75 x and
 * 0.25 x are bf16 values too, exact), new every step; after every step (untimed) each rank
 * compares its combined tokens bit for bit with a local model of the same arithmetic, and
 * for K <= 2 with the original tokens (identity experts, weights summing to 1: exact).
 * Exits with 1 on any difference; prints "mpi_moe check ok ..." on success.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAXK 8

typedef uint16_t bf16;

static uint64_t splitmix64(uint64_t v) {
    uint64_t z = v + 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static float bf2f(bf16 b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static bf16 f2bf(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFFu + ((u >> 16) & 1u); /* round to nearest even (no NaNs here) */
    return (bf16)(u >> 16);
}

/* The routing of token t of rank r at step s: experts e[0..K) and weights w[0..K). */
static void route(int r, int s, int t, int E, int K, int *e, float *w) {
    uint64_t x = splitmix64(((uint64_t)r << 40) ^ ((uint64_t)s << 20) ^ (uint64_t)t);
    e[0] = (int)(x % (uint64_t)E);
    uint64_t h = x;
    for (int j = 1; j < K; j++) {
        for (;;) {
            h = splitmix64(h);
            int c = (int)((e[j - 1] + 1 + h % (uint64_t)(E - 1)) % (uint64_t)E);
            int dup = 0;
            for (int i = 0; i < j; i++) dup |= e[i] == c;
            if (!dup) {
                e[j] = c;
                break;
            }
        }
    }
    if (K == 1) {
        w[0] = 1.0f;
    } else {
        float p = 1.0f;
        for (int j = 0; j < K - 1; j++, p *= 0.25f) w[j] = 0.75f * p;
        w[K - 1] = p;
    }
}

/* Token value for --check: bf16 bits from (r, s, t, i), exponent 120..135, low 2 mantissa bits 0. */
static bf16 token_value(int r, int s, int t, int i) {
    uint64_t h = splitmix64(((uint64_t)r << 48) ^ ((uint64_t)s << 32) ^ ((uint64_t)t << 16) ^ (uint64_t)i);
    uint16_t sign = (uint16_t)((h & 1) << 15);
    uint16_t exp = (uint16_t)(120 + ((h >> 1) & 15));
    uint16_t man = (uint16_t)(((h >> 5) & 0x1F) << 2);
    return (bf16)(sign | (exp << 7) | man);
}

struct meta {
    uint32_t token;
    uint32_t pad;
    uint64_t mask;   /* bit e: expert e is one of the token's */
    float w[MAXK];   /* the weights of the mask's experts, ascending expert order */
};

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double pct(const double *sorted, int n, double q) {
    double at = q * (n - 1);
    int i = (int)at;
    if (i + 1 >= n) return sorted[n - 1];
    return sorted[i] + (at - i) * (sorted[i + 1] - sorted[i]);
}

static void usage(void) {
    fprintf(stderr, "usage: mpi_moe [--check] T [H [E [K [STEPS [WARMUP]]]]]\n");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);

    int check = 0;
    long v[6] = {-1, 4096, 8, 2, 100, 10}; /* T H E K STEPS WARMUP */
    int nv = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--check") == 0) {
            check = 1;
        } else if (nv < 6) {
            char *end;
            v[nv++] = strtol(argv[i], &end, 10);
            if (*end || v[nv - 1] < 0) {
                if (rank == 0) usage();
                MPI_Abort(MPI_COMM_WORLD, 2);
            }
        } else {
            if (rank == 0) usage();
            MPI_Abort(MPI_COMM_WORLD, 2);
        }
    }
    int T = (int)v[0], H = (int)v[1], E = (int)v[2], K = (int)v[3], steps = (int)v[4], warm = (int)v[5];
    if (T < 0 || nv < 1 || H < 1 || E < 1 || E > 64 || K < 1 || K > MAXK || K > E || E % n != 0 || steps < 1) {
        if (rank == 0) {
            usage();
            fprintf(stderr, "mpi_moe: need T >= 0, H >= 1, 1 <= E <= 64 with E %% ranks == 0, 1 <= K <= min(E, %d), STEPS >= 1\n", MAXK);
        }
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const int per = E / n; /* experts per rank */
    const size_t row = (size_t)H * sizeof(bf16);
    const int dmax = K < n ? K : n; /* destination ranks per token, at most */

    MPI_Datatype ROW, META;
    MPI_Type_contiguous((int)row, MPI_BYTE, &ROW);
    MPI_Type_commit(&ROW);
    MPI_Type_contiguous((int)sizeof(struct meta), MPI_BYTE, &META);
    MPI_Type_commit(&META);

    bf16 *tokens = calloc((size_t)T * H + 1, sizeof(bf16)); /* this rank's input */
    bf16 *out = calloc((size_t)T * H + 1, sizeof(bf16));    /* the combined result */
    bf16 *sbuf = malloc((size_t)T * dmax * row + 1);         /* dispatch send = combine recv */
    struct meta *smeta = malloc((size_t)T * dmax * sizeof(struct meta) + 1);
    size_t rmax = (size_t)n * T * dmax; /* rows a rank may receive */
    bf16 *rbuf = malloc(rmax * row + 1);                    /* dispatch recv */
    struct meta *rmeta = malloc(rmax * sizeof(struct meta) + 1);
    bf16 *cbuf = malloc(rmax * row + 1);                    /* combine send */
    bf16 *groups = malloc((size_t)per * rmax * row + 1);    /* per local expert, rmax rows each */
    int *gfill = calloc((size_t)per, sizeof(int));
    int *gpos = malloc(rmax * MAXK * sizeof(int) + 1); /* row i, k-th local expert of it: its row in that group */
    int *ex = malloc((size_t)T * K * sizeof(int) + 1);
    float *wt = malloc((size_t)T * K * sizeof(float) + 1);
    int *pos = malloc((size_t)T * n * sizeof(int) + 1); /* token t's row for rank d in sbuf, or -1 */
    float *acc = malloc(row * 2 + 4);
    double *times = malloc((size_t)steps * sizeof(double));
    int *scnt = calloc(n, sizeof(int)), *rcnt = calloc(n, sizeof(int));
    int *sdis = calloc(n, sizeof(int)), *rdis = calloc(n, sizeof(int));
    if (!tokens || !out || !sbuf || !smeta || !rbuf || !rmeta || !cbuf || !groups || !gfill || !gpos || !ex || !wt || !pos || !acc ||
        !times || !scnt || !rcnt || !sdis || !rdis) {
        fprintf(stderr, "mpi_moe: rank %d: out of memory\n", rank);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    for (size_t i = 0; i < (size_t)T * H; i++) tokens[i] = token_value(rank, 0, (int)(i / H), (int)(i % H));

    long bad = 0, exact_rows = 0;
    for (int s = 0; s < warm + steps; s++) {
        /* The router's output (untimed). */
        for (int t = 0; t < T; t++) route(rank, s, t, E, K, &ex[t * K], &wt[t * K]);
        if (check) {
            for (size_t i = 0; i < (size_t)T * H; i++) tokens[i] = token_value(rank, s, (int)(i / H), (int)(i % H));
        }
        memset(out, 0xFF, (size_t)T * row);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = MPI_Wtime();

        /* 1. Dispatch: counts per destination rank, then pack rows and metadata. */
        for (int d = 0; d < n; d++) scnt[d] = 0;
        for (int t = 0; t < T; t++) {
            uint64_t dests = 0;
            for (int j = 0; j < K; j++) dests |= 1ull << (ex[t * K + j] / per);
            for (int d = 0; d < n; d++) {
                pos[t * n + d] = -1;
                if (dests >> d & 1) scnt[d]++;
            }
        }
        for (int d = 0, o = 0; d < n; d++) {
            sdis[d] = o;
            o += scnt[d];
        }
        {
            int *fill = rcnt; /* scratch until the counts exchange */
            for (int d = 0; d < n; d++) fill[d] = sdis[d];
            for (int t = 0; t < T; t++) {
                uint64_t mask = 0;
                for (int j = 0; j < K; j++) mask |= 1ull << ex[t * K + j];
                struct meta m = {(uint32_t)t, 0, mask, {0}};
                int k = 0;
                for (int e = 0; e < E; e++) {
                    if (!(mask >> e & 1)) continue;
                    for (int j = 0; j < K; j++)
                        if (ex[t * K + j] == e) m.w[k] = wt[t * K + j];
                    k++;
                }
                for (int d = 0; d < n; d++) {
                    if (!((mask >> (d * per)) & ((per == 64) ? ~0ull : ((1ull << per) - 1)))) continue;
                    int at = fill[d]++;
                    pos[t * n + d] = at;
                    memcpy((char *)sbuf + (size_t)at * row, tokens + (size_t)t * H, row);
                    smeta[at] = m;
                }
            }
        }
        MPI_Alltoall(scnt, 1, MPI_INT, rcnt, 1, MPI_INT, MPI_COMM_WORLD);
        int nrecv = 0;
        for (int d = 0; d < n; d++) {
            rdis[d] = nrecv;
            nrecv += rcnt[d];
        }
        MPI_Alltoallv(sbuf, scnt, sdis, ROW, rbuf, rcnt, rdis, ROW, MPI_COMM_WORLD);
        MPI_Alltoallv(smeta, scnt, sdis, META, rmeta, rcnt, rdis, META, MPI_COMM_WORLD);
        /* Into per-local-expert groups. */
        for (int g = 0; g < per; g++) gfill[g] = 0;
        for (int i = 0; i < nrecv; i++) {
            int k = 0;
            for (int g = 0; g < per; g++) {
                if (!(rmeta[i].mask >> (rank * per + g) & 1)) continue;
                int at = gfill[g]++;
                gpos[i * MAXK + k++] = at;
                memcpy((char *)groups + ((size_t)g * rmax + at) * row, (char *)rbuf + (size_t)i * row, row);
            }
        }

        /* 2. Experts: identity (y = x, in place in the groups). */

        /* 3. Combine: pre-sum this rank's experts of each row, send back, sum at the origin. */
        for (int i = 0; i < nrecv; i++) {
            const struct meta *m = &rmeta[i];
            for (int h = 0; h < H; h++) acc[h] = 0.0f;
            int k = 0, wi = 0;
            for (int e = 0; e < E; e++) {
                if (!(m->mask >> e & 1)) continue;
                float w = m->w[wi++];
                if (e / per != rank) continue;
                const bf16 *y = (const bf16 *)((char *)groups + ((size_t)(e - rank * per) * rmax + gpos[i * MAXK + k++]) * row);
                for (int h = 0; h < H; h++) acc[h] += w * bf2f(y[h]);
            }
            bf16 *c = (bf16 *)((char *)cbuf + (size_t)i * row);
            for (int h = 0; h < H; h++) c[h] = f2bf(acc[h]);
        }
        /* Back: the dispatch's counts reversed, into the dispatch's send layout. */
        MPI_Alltoallv(cbuf, rcnt, rdis, ROW, sbuf, scnt, sdis, ROW, MPI_COMM_WORLD);
        for (int t = 0; t < T; t++) {
            for (int h = 0; h < H; h++) acc[h] = 0.0f;
            for (int d = 0; d < n; d++) {
                int at = pos[t * n + d];
                if (at < 0) continue;
                const bf16 *y = (const bf16 *)((char *)sbuf + (size_t)at * row);
                for (int h = 0; h < H; h++) acc[h] += bf2f(y[h]);
            }
            bf16 *o = out + (size_t)t * H;
            for (int h = 0; h < H; h++) o[h] = f2bf(acc[h]);
        }

        double dt = MPI_Wtime() - t0, slowest;
        MPI_Allreduce(&dt, &slowest, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
        if (s >= warm) times[s - warm] = slowest * 1e6;

        if (check) {
            /* The model: per destination rank (ascending) the bf16 of the float sum of its
             * experts' w * x (ascending expert), summed in float, rounded to bf16. */
            for (int t = 0; t < T; t++) {
                const int *e = &ex[t * K];
                const float *w = &wt[t * K];
                int row_exact = 1;
                for (int h = 0; h < H; h++) {
                    float x = bf2f(tokens[(size_t)t * H + h]), total = 0.0f;
                    for (int d = 0; d < n; d++) {
                        float part = 0.0f;
                        int any = 0;
                        for (int ee = d * per; ee < (d + 1) * per; ee++)
                            for (int j = 0; j < K; j++)
                                if (e[j] == ee) {
                                    part += w[j] * x;
                                    any = 1;
                                }
                        if (any) total += bf2f(f2bf(part));
                    }
                    bf16 want = f2bf(total), got = out[(size_t)t * H + h];
                    if (got != want || (K <= 2 && got != tokens[(size_t)t * H + h])) {
                        if (bad < 5)
                            fprintf(stderr, "mpi_moe: rank %d step %d token %d [%d]: got %#06x, want %#06x (input %#06x)\n", rank, s, t,
                                    h, got, want, tokens[(size_t)t * H + h]);
                        bad++;
                    }
                    row_exact &= got == tokens[(size_t)t * H + h];
                }
                exact_rows += row_exact;
            }
        }
    }

    long all_bad = 0, all_exact = 0;
    MPI_Reduce(&bad, &all_bad, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    MPI_Reduce(&exact_rows, &all_exact, 1, MPI_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    int rc = 0;
    if (rank == 0) {
        qsort(times, steps, sizeof(double), cmp_double);
        printf("mpi_moe ranks=%d tokens=%d hidden=%d experts=%d topk=%d steps=%d median_us=%.1f p10_us=%.1f p90_us=%.1f\n", n, T, H, E,
               K, steps, pct(times, steps, 0.5), pct(times, steps, 0.1), pct(times, steps, 0.9));
        if (check) {
            long rows = (long)n * T * (warm + steps);
            if (all_bad) {
                fprintf(stderr, "mpi_moe check FAILED: %ld wrong elements\n", all_bad);
                rc = 1;
            } else {
                printf("mpi_moe check ok: %ld token rows over %d steps, %ld bit-equal to the input\n", rows, warm + steps, all_exact);
            }
        }
        fflush(stdout);
    }
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Type_free(&ROW);
    MPI_Type_free(&META);
    MPI_Finalize();
    return rc;
}

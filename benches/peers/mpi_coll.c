/*
 * mpi_coll: the peer of ferroccl-perf, with MPI's collectives.
 *
 * Same collectives, sizes, warm-up and timed iterations, same timing (mean over the timed
 * calls, measured between barriers on every rank, the slowest rank's reported), same
 * nccl-tests columns and busbw factors, same JSON layout (so `ferroccl-perf --baseline`
 * can overlay it). Built and run by compare.sh:
 *
 *   mpicc -O2 -o target/peers/mpi_coll benches/peers/mpi_coll.c
 *   mpirun -np 4 target/peers/mpi_coll allreduce -b 8 -e 256M -f 4 -n 20 -w 5 -d f32 -o sum
 *
 * Options: COLLECTIVE (allreduce allgather reduce_scatter broadcast reduce alltoall
 * sendrecv all), -b MIN, -e MAX, -f FACTOR, -n ITERS, -w WARMUP, -d DTYPE, -o OP (sum prod
 * min max; MPI has no avg), -c 0|1, -r ROOT, --inplace, --no-inplace, --json FILE.
 *
 * Sizes are defined as in ferroccl-perf (tools/ferroccl-perf/src/colls.rs): the larger
 * per-rank buffer; allgather: the gathered output; reduce_scatter: the input; alltoall: the
 * send buffer. A size is rounded down to whole elements (whole blocks of n), never below
 * one element (block).
 *
 * f16 and bf16: MPI (Open MPI 4.1) has no 16-bit float type, so for these the MPI side
 * moves and reduces MPI_FLOAT (f32) buffers of the same size in BYTES (half the elements).
 * The bytes on the wire match FerroCCL's; the reduction work is f32 arithmetic on half as
 * many elements. The type column says "f32~bf16" so that no one mistakes it for native bf16.
 *
 * In-place forms: MPI_IN_PLACE for allreduce, allgather, reduce_scatter (MPI_Reduce_scatter_
 * block: the result lands in the first block, where FerroCCL leaves it in block `rank`),
 * reduce; broadcast is in place only; alltoall and sendrecv are run out of place only (as
 * in ferroccl-perf).
 *
 * -c 1 checks one more call per size: inputs are small integers (a function of rank and
 * index), exact in every type and every reduction order.
 */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum coll { ALLREDUCE, ALLGATHER, REDUCE_SCATTER, BROADCAST, REDUCE, ALLTOALL, SENDRECV, NCOLL };
static const char *coll_names[NCOLL] = {"allreduce", "allgather", "reduce_scatter", "broadcast", "reduce", "alltoall", "sendrecv"};

struct dtype {
    const char *name;  /* the name given with -d */
    const char *shown; /* the type column */
    MPI_Datatype mpi;
    int size; /* bytes of the MPI element */
    int is_signed;
};

static const struct dtype dtypes[] = {
    {"f32", "f32", MPI_FLOAT, 4, 1},         {"f64", "f64", MPI_DOUBLE, 8, 1},         {"f16", "f32~f16", MPI_FLOAT, 4, 1},
    {"bf16", "f32~bf16", MPI_FLOAT, 4, 1},   {"i8", "i8", MPI_INT8_T, 1, 1},           {"u8", "u8", MPI_UINT8_T, 1, 0},
    {"i32", "i32", MPI_INT32_T, 4, 1},       {"u32", "u32", MPI_UINT32_T, 4, 0},       {"i64", "i64", MPI_INT64_T, 8, 1},
    {"u64", "u64", MPI_UINT64_T, 8, 0},
};

struct opts {
    int colls[NCOLL];
    int ncolls;
    size_t minb, maxb, factor;
    int iters, warmup, check, root, oop, ip;
    const struct dtype *dt;
    const char *opname;
    MPI_Op op;
    int opcode; /* 0 sum 1 prod 2 min 3 max */
    const char *json;
};

static int rank, nranks;

static void die(const char *msg, const char *arg) {
    if (rank == 0) fprintf(stderr, "mpi_coll: error: %s%s\n", msg, arg ? arg : "");
    MPI_Finalize();
    exit(2);
}

static size_t parse_size(const char *s) {
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s) return 0;
    switch (*end) {
    case 'K': case 'k': v <<= 10; end++; break;
    case 'M': case 'm': v <<= 20; end++; break;
    case 'G': case 'g': v <<= 30; end++; break;
    default: break;
    }
    if (*end == 'B' || *end == 'b') end++;
    if (*end) return 0;
    return (size_t)v;
}

/* Rank r's input value at pattern position m (0..250), as ferroccl-perf's data.rs defines it. */
static int small_val(int r, size_t m, int opcode, int is_signed) {
    int h = (int)((m * 7 + (size_t)r * 13 + m * (size_t)r * 3) % 5);
    if (opcode == 1) {
        if (r == 0 && h == 1) return 2;
        if (is_signed && h == 0) return -1;
        return 1;
    }
    return is_signed ? h - 2 : h;
}
#define PERIOD 251

static void set_val(void *buf, const struct dtype *dt, size_t i, double v) {
    switch (dt->size) {
    case 1: if (dt->is_signed) ((int8_t *)buf)[i] = (int8_t)v; else ((uint8_t *)buf)[i] = (uint8_t)v; break;
    case 4:
        if (dt->mpi == MPI_FLOAT) ((float *)buf)[i] = (float)v;
        else if (dt->is_signed) ((int32_t *)buf)[i] = (int32_t)v;
        else ((uint32_t *)buf)[i] = (uint32_t)v;
        break;
    default:
        if (dt->mpi == MPI_DOUBLE) ((double *)buf)[i] = v;
        else if (dt->is_signed) ((int64_t *)buf)[i] = (int64_t)v;
        else ((uint64_t *)buf)[i] = (uint64_t)v;
    }
}

static double get_val(const void *buf, const struct dtype *dt, size_t i) {
    switch (dt->size) {
    case 1: return dt->is_signed ? ((const int8_t *)buf)[i] : ((const uint8_t *)buf)[i];
    case 4:
        if (dt->mpi == MPI_FLOAT) return ((const float *)buf)[i];
        return dt->is_signed ? (double)((const int32_t *)buf)[i] : (double)((const uint32_t *)buf)[i];
    default:
        if (dt->mpi == MPI_DOUBLE) return ((const double *)buf)[i];
        return dt->is_signed ? (double)((const int64_t *)buf)[i] : (double)((const uint64_t *)buf)[i];
    }
}

static double input_of(const struct opts *o, int r, size_t idx) {
    return small_val(r, idx % PERIOD, o->opcode, o->dt->is_signed);
}

static double reduced(const struct opts *o, size_t idx) {
    double acc = input_of(o, 0, idx);
    for (int q = 1; q < nranks; q++) {
        double v = input_of(o, q, idx);
        switch (o->opcode) {
        case 0: acc += v; break;
        case 1: acc *= v; break;
        case 2: acc = v < acc ? v : acc; break;
        default: acc = v > acc ? v : acc;
        }
    }
    return acc;
}

static void fill_input(const struct opts *o, void *buf, size_t len) {
    for (size_t i = 0; i < len; i++) set_val(buf, o->dt, i, input_of(o, rank, i));
}

static void fill_sentinel(const struct opts *o, void *buf, size_t len) {
    for (size_t i = 0; i < len; i++) set_val(buf, o->dt, i, 99);
}

struct layout { size_t count, bytes, block, send, recv; };

static struct layout layout_of(int c, size_t requested, const struct opts *o) {
    struct layout l;
    size_t t = (size_t)o->dt->size, n = (size_t)nranks;
    if (c == ALLGATHER || c == REDUCE_SCATTER || c == ALLTOALL) {
        size_t block = requested / (t * n);
        if (block == 0) block = 1;
        size_t total = block * n;
        l.count = total; l.bytes = total * t; l.block = block;
        l.send = c == ALLGATHER ? block : total;
        l.recv = c == REDUCE_SCATTER ? block : total;
    } else {
        size_t count = requested / t;
        if (count == 0) count = 1;
        l.count = count; l.bytes = count * t; l.block = count; l.send = count; l.recv = count;
    }
    return l;
}

static double bus_factor(int c) {
    double n = nranks;
    switch (c) {
    case ALLREDUCE: return 2.0 * (n - 1) / n;
    case ALLGATHER: case REDUCE_SCATTER: case ALLTOALL: return (n - 1) / n;
    default: return 1.0;
    }
}

static int has_oop(int c) { return c != BROADCAST; }
static int has_ip(int c) { return c != ALLTOALL && c != SENDRECV; }
static int reduces(int c) { return c == ALLREDUCE || c == REDUCE_SCATTER || c == REDUCE; }
static int rooted(int c) { return c == BROADCAST || c == REDUCE; }

static void call(int c, int inplace, const struct opts *o, const struct layout *l, void *send, void *recv) {
    MPI_Datatype t = o->dt->mpi;
    int cnt = (int)l->count, blk = (int)l->block;
    if (!inplace) {
        switch (c) {
        case ALLREDUCE: MPI_Allreduce(send, recv, cnt, t, o->op, MPI_COMM_WORLD); break;
        case ALLGATHER: MPI_Allgather(send, blk, t, recv, blk, t, MPI_COMM_WORLD); break;
        case REDUCE_SCATTER: MPI_Reduce_scatter_block(send, recv, blk, t, o->op, MPI_COMM_WORLD); break;
        case REDUCE: MPI_Reduce(send, recv, cnt, t, o->op, o->root, MPI_COMM_WORLD); break;
        case ALLTOALL: MPI_Alltoall(send, blk, t, recv, blk, t, MPI_COMM_WORLD); break;
        case SENDRECV:
            MPI_Sendrecv(send, cnt, t, (rank + 1) % nranks, 0, recv, cnt, t, (rank + nranks - 1) % nranks, 0, MPI_COMM_WORLD,
                         MPI_STATUS_IGNORE);
            break;
        default: break;
        }
    } else {
        /* The in-place buffer is `recv` (sized for the larger of send and recv). */
        switch (c) {
        case ALLREDUCE: MPI_Allreduce(MPI_IN_PLACE, recv, cnt, t, o->op, MPI_COMM_WORLD); break;
        case ALLGATHER: MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, recv, blk, t, MPI_COMM_WORLD); break;
        case REDUCE_SCATTER: MPI_Reduce_scatter_block(MPI_IN_PLACE, recv, blk, t, o->op, MPI_COMM_WORLD); break;
        case BROADCAST: MPI_Bcast(recv, cnt, t, o->root, MPI_COMM_WORLD); break;
        case REDUCE:
            if (rank == o->root) MPI_Reduce(MPI_IN_PLACE, recv, cnt, t, o->op, o->root, MPI_COMM_WORLD);
            else MPI_Reduce(recv, NULL, cnt, t, o->op, o->root, MPI_COMM_WORLD);
            break;
        default: break;
        }
    }
}

static void fill(int c, int inplace, const struct opts *o, const struct layout *l, void *send, void *recv) {
    if (!inplace) {
        fill_input(o, send, l->send);
        fill_sentinel(o, recv, l->recv);
    } else if (c == ALLGATHER) {
        fill_sentinel(o, recv, l->count);
        char *mine = (char *)recv + (size_t)rank * l->block * (size_t)o->dt->size;
        for (size_t k = 0; k < l->block; k++) set_val(mine, o->dt, k, input_of(o, rank, k));
    } else {
        fill_input(o, recv, c == REDUCE_SCATTER ? l->send : l->count);
    }
}

static long long check(int c, int inplace, const struct opts *o, const struct layout *l, const void *recv) {
    long long wrong = 0;
    size_t n = (size_t)nranks, r = (size_t)rank, b = l->block;
    switch (c) {
    case ALLREDUCE:
        for (size_t i = 0; i < l->count; i++) wrong += get_val(recv, o->dt, i) != reduced(o, i);
        break;
    case REDUCE:
        if (rank == o->root)
            for (size_t i = 0; i < l->count; i++) wrong += get_val(recv, o->dt, i) != reduced(o, i);
        break;
    case ALLGATHER:
        for (size_t q = 0; q < n; q++)
            for (size_t k = 0; k < b; k++) wrong += get_val(recv, o->dt, q * b + k) != input_of(o, (int)q, k);
        break;
    case REDUCE_SCATTER:
        /* Out of place and MPI_IN_PLACE both leave this rank's block at the start. */
        for (size_t k = 0; k < b; k++) wrong += get_val(recv, o->dt, k) != reduced(o, r * b + k);
        break;
    case BROADCAST:
        for (size_t i = 0; i < l->count; i++) wrong += get_val(recv, o->dt, i) != input_of(o, o->root, i);
        break;
    case ALLTOALL:
        for (size_t q = 0; q < n; q++)
            for (size_t k = 0; k < b; k++) wrong += get_val(recv, o->dt, q * b + k) != input_of(o, (int)q, r * b + k);
        break;
    case SENDRECV:
        for (size_t i = 0; i < l->count; i++) wrong += get_val(recv, o->dt, i) != input_of(o, (int)((r + n - 1) % n), i);
        break;
    default: break;
    }
    (void)inplace;
    return wrong;
}

struct cell { int ran; double time_us, algbw, busbw; long long wrong; };

static struct cell run_variant(int c, int inplace, const struct opts *o, const struct layout *l, void *send, void *recv) {
    struct cell cell = {0, 0, 0, 0, 0};
    if (inplace ? !has_ip(c) : !has_oop(c)) return cell;
    if (inplace ? !o->ip : !o->oop) return cell;
    cell.ran = 1;
    fill(c, inplace, o, l, send, recv);
    for (int i = 0; i < o->warmup; i++) call(c, inplace, o, l, send, recv);
    MPI_Barrier(MPI_COMM_WORLD);
    double t0 = MPI_Wtime();
    for (int i = 0; i < o->iters; i++) call(c, inplace, o, l, send, recv);
    double us = (MPI_Wtime() - t0) * 1e6 / o->iters;
    MPI_Barrier(MPI_COMM_WORLD);
    long long wrong = 0;
    if (o->check) {
        fill(c, inplace, o, l, send, recv);
        call(c, inplace, o, l, send, recv);
        wrong = check(c, inplace, o, l, recv);
    }
    double maxus;
    long long sumwrong;
    MPI_Reduce(&us, &maxus, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(&wrong, &sumwrong, 1, MPI_LONG_LONG, MPI_SUM, 0, MPI_COMM_WORLD);
    cell.time_us = maxus;
    cell.algbw = maxus > 0 ? (double)l->bytes / (maxus * 1e-6) / 1e9 : 0;
    cell.busbw = cell.algbw * bus_factor(c);
    cell.wrong = sumwrong;
    return cell;
}

static void cell_text(const struct cell *c, int check, char out[4][32]) {
    if (!c->ran) {
        for (int i = 0; i < 4; i++) strcpy(out[i], "N/A");
        return;
    }
    snprintf(out[0], 32, c->time_us < 10000 ? "%.2f" : "%.0f", c->time_us);
    snprintf(out[1], 32, "%.2f", c->algbw);
    snprintf(out[2], 32, "%.2f", c->busbw);
    if (check) snprintf(out[3], 32, "%lld", c->wrong);
    else strcpy(out[3], "N/A");
}

static void cell_json(FILE *f, const struct cell *c, int check) {
    if (!c->ran) {
        fprintf(f, "null");
        return;
    }
    fprintf(f, "{\"time_us\": %.6g, \"algbw\": %.6g, \"busbw\": %.6g, \"wrong\": ", c->time_us, c->algbw, c->busbw);
    if (check) fprintf(f, "%lld}", c->wrong);
    else fprintf(f, "null}");
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &nranks);

    struct opts o;
    memset(&o, 0, sizeof o);
    o.minb = 8; o.maxb = 32 << 20; o.factor = 2; o.iters = 20; o.warmup = 5; o.check = 1; o.oop = 1; o.ip = 1;
    o.dt = &dtypes[0]; o.opname = "sum"; o.op = MPI_SUM; o.opcode = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        int takes = 1;
        if (!strcmp(a, "--inplace")) { o.oop = 0; takes = 0; }
        else if (!strcmp(a, "--no-inplace")) { o.ip = 0; takes = 0; }
        else if (a[0] != '-') {
            takes = 0;
            if (!strcmp(a, "all")) {
                for (int c = 0; c < NCOLL; c++) o.colls[o.ncolls++] = c;
            } else {
                int found = -1;
                for (int c = 0; c < NCOLL; c++) if (!strcmp(a, coll_names[c])) found = c;
                if (found < 0) die("unknown collective ", a);
                if (o.ncolls >= NCOLL) die("too many collectives", NULL);
                o.colls[o.ncolls++] = found;
            }
        } else if (!v) die("option needs a value: ", a);
        else if (!strcmp(a, "-b")) { if (!(o.minb = parse_size(v))) die("-b: bad size ", v); }
        else if (!strcmp(a, "-e")) { if (!(o.maxb = parse_size(v))) die("-e: bad size ", v); }
        else if (!strcmp(a, "-f")) { o.factor = (size_t)atol(v); if (o.factor < 2) die("-f: must be 2 or more: ", v); }
        else if (!strcmp(a, "-n")) { o.iters = atoi(v); if (o.iters < 1) die("-n: must be 1 or more: ", v); }
        else if (!strcmp(a, "-w")) { o.warmup = atoi(v); if (o.warmup < 0) die("-w: must be 0 or more: ", v); }
        else if (!strcmp(a, "-c")) { o.check = atoi(v) != 0; }
        else if (!strcmp(a, "-r")) { o.root = atoi(v); if (o.root < 0 || o.root >= nranks) die("-r: root out of range: ", v); }
        else if (!strcmp(a, "--json")) { o.json = v; }
        else if (!strcmp(a, "-d")) {
            o.dt = NULL;
            for (size_t k = 0; k < sizeof dtypes / sizeof dtypes[0]; k++) if (!strcmp(v, dtypes[k].name)) o.dt = &dtypes[k];
            if (!o.dt) die("-d: unknown dtype ", v);
        } else if (!strcmp(a, "-o")) {
            o.opname = v;
            if (!strcmp(v, "sum")) { o.op = MPI_SUM; o.opcode = 0; }
            else if (!strcmp(v, "prod")) { o.op = MPI_PROD; o.opcode = 1; }
            else if (!strcmp(v, "min")) { o.op = MPI_MIN; o.opcode = 2; }
            else if (!strcmp(v, "max")) { o.op = MPI_MAX; o.opcode = 3; }
            else die("-o: MPI supports sum, prod, min, max; not ", v);
        } else die("unknown option ", a);
        i += takes;
    }
    if (o.ncolls == 0) die("missing the collective", NULL);
    if (o.minb > o.maxb) die("-e is smaller than -b", NULL);

    size_t sizes[128];
    int nsizes = 0;
    for (size_t s = o.minb; s <= o.maxb && nsizes < 127; s *= o.factor) {
        sizes[nsizes++] = s;
        if (s > o.maxb / o.factor) break;
    }
    if (sizes[nsizes - 1] != o.maxb) sizes[nsizes++] = o.maxb;

    char version[MPI_MAX_LIBRARY_VERSION_STRING];
    int vlen;
    MPI_Get_library_version(version, &vlen);
    char *comma = strpbrk(version, ",\n");
    if (comma) *comma = 0;
    char host[MPI_MAX_PROCESSOR_NAME];
    int hlen;
    MPI_Get_processor_name(host, &hlen);

    FILE *jf = NULL;
    if (rank == 0) {
        printf("# mpi_coll (%s): %d ranks, type %s, op %s, root %d, iters %d, warmup %d, check %d\n", version, nranks, o.dt->shown,
               o.opname, o.root, o.iters, o.warmup, o.check);
        printf("#  host %s\n", host);
        if (o.json) {
            jf = fopen(o.json, "w");
            if (!jf) die("--json: cannot write ", o.json);
            fprintf(jf, "{\n  \"tool\": \"mpi_coll\",\n  \"label\": \"%s\",\n  \"ranks\": %d,\n  \"dtype\": \"%s\",\n  \"op\": \"%s\",\n",
                    version, nranks, o.dt->shown, o.opname);
            fprintf(jf, "  \"root\": %d,\n  \"iters\": %d,\n  \"warmup\": %d,\n  \"check\": %s,\n", o.root, o.iters, o.warmup,
                    o.check ? "true" : "false");
            fprintf(jf, "  \"machine\": {\"hostname\": \"%s\"},\n  \"runs\": [\n", host);
        }
    }
    long long total_wrong = 0;
    for (int ci = 0; ci < o.ncolls; ci++) {
        int c = o.colls[ci];
        if (rank == 0) {
            printf("#\n# %s: busbw = algbw * %s\n", coll_names[c], c == ALLREDUCE ? "2(n-1)/n" : bus_factor(c) == 1.0 ? "1" : "(n-1)/n");
            printf("#%12s %13s %7s %7s %7s %9s %7s %7s %7s %9s %7s %7s %7s  %s\n", "size", "count", "type", "redop", "root", "time",
                   "algbw", "busbw", "#wrong", "time", "algbw", "busbw", "#wrong", "algo");
            if (jf) fprintf(jf, "    {\"collective\": \"%s\", \"bus_factor\": %.6g, \"rows\": [\n", coll_names[c], bus_factor(c));
        }
        double bwsum = 0;
        int bwn = 0;
        for (int si = 0; si < nsizes; si++) {
            struct layout l = layout_of(c, sizes[si], &o);
            size_t big = l.send > l.recv ? l.send : l.recv;
            void *send = malloc(l.send * (size_t)o.dt->size);
            void *recv = malloc(big * (size_t)o.dt->size);
            if (!send || !recv) die("out of memory", NULL);
            if (rank == 0) fprintf(stderr, "mpi_coll: %s %zu B (%d/%d)\n", coll_names[c], sizes[si], si + 1, nsizes);
            struct cell oc = run_variant(c, 0, &o, &l, send, recv);
            struct cell ic = run_variant(c, 1, &o, &l, send, recv);
            free(send);
            free(recv);
            if (rank == 0) {
                char a[4][32], b[4][32];
                cell_text(&oc, o.check, a);
                cell_text(&ic, o.check, b);
                printf(" %12zu %13zu %7s %7s %7d %9s %7s %7s %7s %9s %7s %7s %7s  %s\n", l.bytes, l.count, o.dt->shown,
                       reduces(c) ? o.opname : "none", rooted(c) ? o.root : -1, a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3], "mpi");
                fflush(stdout);
                if (oc.ran) { bwsum += oc.busbw; bwn++; total_wrong += oc.wrong; }
                if (ic.ran) { bwsum += ic.busbw; bwn++; total_wrong += ic.wrong; }
                if (jf) {
                    fprintf(jf, "      {\"size\": %zu, \"count\": %zu, \"type\": \"%s\", \"redop\": \"%s\", \"root\": %d, \"algo\": \"mpi\", ",
                            l.bytes, l.count, o.dt->shown, reduces(c) ? o.opname : "none", rooted(c) ? o.root : -1);
                    fprintf(jf, "\"out_of_place\": ");
                    cell_json(jf, &oc, o.check);
                    fprintf(jf, ", \"in_place\": ");
                    cell_json(jf, &ic, o.check);
                    fprintf(jf, "}%s\n", si + 1 < nsizes ? "," : "");
                }
            }
        }
        if (rank == 0) {
            printf("# Avg bus bandwidth    : %.3f GB/s\n", bwn ? bwsum / bwn : 0.0);
            if (jf) fprintf(jf, "    ], \"avg_busbw\": %.6g}%s\n", bwn ? bwsum / bwn : 0.0, ci + 1 < o.ncolls ? "," : "");
        }
    }
    if (rank == 0) {
        printf("# wrong elements: %lld %s\n", total_wrong, total_wrong ? "FAILED" : "OK");
        if (jf) {
            fprintf(jf, "  ]\n}\n");
            fclose(jf);
        }
    }
    MPI_Finalize();
    return total_wrong ? 1 : 0;
}

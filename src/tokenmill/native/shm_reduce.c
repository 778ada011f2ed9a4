/* Sums over the tensor-parallel ranks of one machine through shared memory.
 *
 * On this project's VMs a gloo all-reduce of a few KiB takes 1-2.5 ms (its worker and transport threads hand the
 * work on several times per message), and a step needs two per layer. Ranks on one machine instead share a
 * segment (created by rank 0 in /dev/shm, mapped by every rank): each rank copies its partial sum into its slot,
 * publishes the operation's sequence number, waits until every rank has published it, and adds the slots up in
 * rank order, so every rank gets the same bits. Two sets of slots alternate between consecutive operations: a rank
 * can only write a set again after every rank has arrived at the next operation, i.e. finished reading this one.
 *
 * Waiting spins briefly, then yields the CPU (ranks may outnumber cores), checks the clock against a timeout and
 * every few milliseconds whether each other rank's process is still alive (/proc/PID/stat): a rank that died or
 * stopped makes the operation fail within milliseconds or the timeout, instead of hanging the step.
 *
 * Layout: a 4 KiB header (tm_shm_header), one 64-byte flag per rank, then 2 x world slots of `capacity` floats.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#define TM_SHM_MAX_RANKS 64
#define TM_SHM_FLAG_STRIDE 8 /* int64s per flag: one cache line each */

typedef struct {
    int64_t world;
    int64_t capacity; /* floats per slot */
    int32_t pids[TM_SHM_MAX_RANKS];
} tm_shm_header;

typedef struct {
    char *base;     /* the mapped segment */
    int64_t rank;
    int64_t seq;    /* operations done by this rank (the same on every rank) */
    double timeout_s;
    int64_t failed_rank; /* set when an operation fails: the rank that was gone or late, */
    int64_t failed_code; /* and the code returned */
} tm_shm_group;

#define HEADER_BYTES 4096

static _Atomic int64_t *flag(const tm_shm_group *g, int64_t rank) {
    return (_Atomic int64_t *)(g->base + HEADER_BYTES) + rank * TM_SHM_FLAG_STRIDE;
}

static float *slot(const tm_shm_group *g, int64_t parity, int64_t rank) {
    const tm_shm_header *h = (const tm_shm_header *)g->base;
    char *data = g->base + HEADER_BYTES + h->world * TM_SHM_FLAG_STRIDE * sizeof(int64_t);
    return (float *)data + (parity * h->world + rank) * h->capacity;
}

/* bytes the segment needs */
int64_t tm_shm_bytes(int64_t world, int64_t capacity) {
    return HEADER_BYTES + world * TM_SHM_FLAG_STRIDE * (int64_t)sizeof(int64_t) + 2 * world * capacity * (int64_t)sizeof(float);
}

/* rank 0, on a zeroed segment: record its geometry */
void tm_shm_init(char *base, int64_t world, int64_t capacity) {
    tm_shm_header *h = (tm_shm_header *)base;
    h->world = world;
    h->capacity = capacity;
}

/* every rank: record its process id (read by the others' liveness checks) */
void tm_shm_join(char *base, int64_t rank, int32_t pid) { ((tm_shm_header *)base)->pids[rank] = pid; }

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* 0 when the process exists and is neither a zombie nor dead */
static int process_gone(int32_t pid) {
    if (pid <= 0) return 0; /* not joined yet: nothing to check */
    char path[64], text[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    FILE *f = fopen(path, "r");
    if (!f) return 1;
    size_t n = fread(text, 1, sizeof text - 1, f);
    fclose(f);
    text[n] = 0;
    const char *state = strrchr(text, ')'); /* "pid (comm) S ...": the state follows the command's name */
    return state && (state[2] == 'Z' || state[2] == 'X');
}

/* Until every rank has published `seq`: 0, or -4 when a rank's process is gone, -5 on timeout. */
static int wait_all(tm_shm_group *g, int64_t seq) {
    const tm_shm_header *h = (const tm_shm_header *)g->base;
    const double start = now_s();
    double next_check = start + 0.002;
    for (int64_t r = 0; r < h->world; ++r) {
        for (int64_t spin = 0; atomic_load_explicit(flag(g, r), memory_order_acquire) < seq; ++spin) {
            if (spin < 2000) continue; /* a rank a few microseconds behind */
            sched_yield();
            if ((spin & 63) != 0) continue;
            const double t = now_s();
            if (t > next_check) {
                if (process_gone(h->pids[r])) return g->failed_rank = r, g->failed_code = -4;
                next_check = t + 0.002;
            }
            if (t - start > g->timeout_s) return g->failed_rank = r, g->failed_code = -5;
        }
    }
    return 0;
}

/* One operation on up to capacity floats: publish x [n] in this rank's slot and wait for every rank's; returns
 * the slots' parity (0 or 1), or a negative code from wait_all. */
static int64_t publish_and_wait(tm_shm_group *g, const float *x, int64_t n) {
    const int64_t seq = ++g->seq, parity = seq & 1;
    memcpy(slot(g, parity, g->rank), x, sizeof(float) * n);
    atomic_store_explicit(flag(g, g->rank), seq, memory_order_release);
    const int rc = wait_all(g, seq);
    return rc ? rc : parity;
}

/* x [n] = the sum over ranks of x, in place (a tm_reduce_fn: ctx is the tm_shm_group). 0, or negative: -4 a rank's
 * process is gone, -5 timeout. */
int tm_shm_allreduce(void *ctx, float *x, int64_t n) {
    tm_shm_group *g = ctx;
    const tm_shm_header *h = (const tm_shm_header *)g->base;
    for (int64_t done = 0; done < n; done += h->capacity) {
        const int64_t part = n - done < h->capacity ? n - done : h->capacity;
        const int64_t parity = publish_and_wait(g, x + done, part);
        if (parity < 0) return (int)parity;
        float *y = x + done;
        memcpy(y, slot(g, parity, 0), sizeof(float) * part);
        for (int64_t r = 1; r < h->world; ++r) {
            const float *s = slot(g, parity, r);
#pragma omp simd
            for (int64_t i = 0; i < part; ++i) y[i] += s[i];
        }
    }
    return 0;
}

/* rows x [m, n] of every rank -> out [m, world * n] on rank 0 (each row: the ranks' parts side by side); out is
 * NULL on the other ranks. 0, -1 when m * n exceeds a slot, or a code of tm_shm_allreduce. */
int tm_shm_gather_columns(void *ctx, const float *x, int64_t m, int64_t n, float *out) {
    tm_shm_group *g = ctx;
    const tm_shm_header *h = (const tm_shm_header *)g->base;
    if (m * n > h->capacity) return -1;
    const int64_t parity = publish_and_wait(g, x, m * n);
    if (parity < 0) return (int)parity;
    if (!out) return 0;
    for (int64_t r = 0; r < h->world; ++r) {
        const float *s = slot(g, parity, r); /* [m, n] */
        for (int64_t i = 0; i < m; ++i) memcpy(out + (i * h->world + r) * n, s + i * n, sizeof(float) * n);
    }
    return 0;
}

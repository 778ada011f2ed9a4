/* How the kernels share work among threads: a team (one OpenMP parallel region) in which the calling thread runs
 * the kernel's own code and the other threads only serve its jobs. A job is a range [0, n) cut into `items`
 * contiguous pieces; every thread of the team claims pieces from one shared counter, and the job ends when all
 * are done, whoever did them.
 *
 * Why: a barrier waits for every thread to arrive. On a machine where another process holds a core, one of two
 * threads is off the CPU for a scheduler slice (milliseconds) at a time; with a parallel region per layer and a
 * barrier after each of its steps (about 170 per decode step of a 24-layer model), decode ran 3-4x slower with 2
 * threads than with 1. Here a thread that is not running claims nothing and the others do its share: the caller
 * waits only for pieces already claimed and not finished (at most one per thread), and for the team's end, once
 * per kernel call. The teams are OpenMP's (libgomp, shared with torch, which loads it first), so the threads
 * that run torch's operations between our calls are the same ones: no second set of threads spinning beside
 * them.
 *
 * That still waits for a helper that was descheduled holding a piece: when the caller, its own pieces done,
 * waits longer than STALL_PIECES of them (plus STALL_NS) for the others, a helper was off the CPU, and the
 * calling thread runs every job alone (no waits) for a while, then tries the team again, within the same body as
 * well (a body is a whole decode step: at 8B, 180 ms, of which the rest alone cost 10% of decode on a quiet VM).
 * A virtual machine's host stalls a thread now and then (one stall, then none for a while: a short while alone,
 * SOLO_MIN_NS); another process on a core stalls a team again and again: each stall soon (SOLO_AGAIN_NS) after a
 * while alone doubles the next one, up to SOLO_MAX_NS. On a busy machine that is one thread's speed, less one
 * stall per SOLO_MAX_NS, instead of a stall per job.
 *
 * A piece is claimed by a compare-and-swap of one word that holds the job's number and the next piece: a thread
 * that read a job's description and was descheduled before claiming cannot take a piece of a later job. */
#include "kernels.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#define CALLER_SPINS 256  /* then the caller, waiting for a claimed piece, yields its core each time it looks */
#define STALL_PIECES 3    /* a wait this many of the caller's own pieces long (plus STALL_NS): a stall */
#define STALL_NS 500000   /* (a slice the scheduler gives another process is milliseconds; page faults, microseconds) */
#define SOLO_MIN_NS 20000000    /* the caller's first while alone after a stall */
#define SOLO_MAX_NS 2000000000  /* and its longest, when stalls keep coming */
#define SOLO_AGAIN_NS 200000000 /* a stall this soon after a while alone doubles the next */

typedef struct {
    tm_range_fn fn;
    void *ctx;
    int64_t n, items; /* piece i: [i * n / items, (i + 1) * n / items) */
} job_t;

static struct {
    pthread_mutex_t caller; /* one team at a time (say two Python threads calling products) */
    job_t job;
    uint32_t seq;    /* sequence lock over job: odd while the caller writes it */
    uint64_t claim;  /* job number << 32 | the next unclaimed piece */
    int64_t done;    /* pieces finished of the current job */
    int32_t ended;   /* the team's body has returned: its helpers leave */
    int threads;     /* threads of a team, the caller included */
    uint32_t number; /* the current job's number (0: none yet) */
    int64_t solo_until; /* CLOCK_MONOTONIC ns: jobs run on the caller alone until then */
    int64_t stalls;     /* waits that passed STALL_NS (for the tests and benchmarks) */
    int64_t solo_ns;    /* the last while alone */
} pool = {.caller = PTHREAD_MUTEX_INITIALIZER, .threads = 1};

/* what this thread's jobs do: make a team of their own, go to the team whose body it runs, or run on it alone
 * (SOLO: no team; PAUSED: in a team's body, alone until pool.solo_until, then with the team again) */
enum { NO_TEAM = 0, IN_TEAM = 1, SOLO = 2, PAUSED = 3 };
static _Thread_local int team_state;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int solo_now(void) {
    return pool.threads == 1 || now_ns() < __atomic_load_n(&pool.solo_until, __ATOMIC_RELAXED);
}

static inline void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

void tm_set_threads(int n) { pool.threads = n < 1 ? 1 : n; }

int tm_threads(void) { return pool.threads; }

/* claims and runs pieces of job `number` (described by j) until none is left; returns how many it ran */
static int64_t work(uint32_t number, const job_t *j) {
    for (int64_t ran = 0;; ++ran) {
        uint64_t c = __atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE);
        if ((uint32_t)(c >> 32) != number || (int64_t)(uint32_t)c >= j->items) return ran;
        if (!__atomic_compare_exchange_n(&pool.claim, &c, c + 1, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            --ran;
            continue;
        }
        const int64_t i = (int64_t)(uint32_t)c;
        j->fn(j->ctx, i * j->n / j->items, (i + 1) * j->n / j->items);
        __atomic_add_fetch(&pool.done, 1, __ATOMIC_RELEASE);
    }
}

/* a helper of the team: serves jobs newer than the last it saw until the body ends */
static void serve(void) {
    uint32_t seen = 0; /* a job that began before this thread joined is served too */
    while (!__atomic_load_n(&pool.ended, __ATOMIC_ACQUIRE)) {
        const uint32_t s1 = __atomic_load_n(&pool.seq, __ATOMIC_ACQUIRE);
        const uint32_t number = (uint32_t)(__atomic_load_n(&pool.claim, __ATOMIC_ACQUIRE) >> 32);
        if (number == seen || (s1 & 1)) {
            relax();
            continue;
        }
        const job_t j = pool.job; /* a copy, checked against the sequence lock: */
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&pool.seq, __ATOMIC_RELAXED) != s1) continue; /* rewritten meanwhile: look again */
        seen = number;
        work(number, &j);
    }
}

int64_t tm_pool_stalls(void) { return __atomic_load_n(&pool.stalls, __ATOMIC_RELAXED); }

int tm_pool_solo(void) { return pool.threads > 1 && solo_now(); }

void tm_team_run(void (*body)(void *), void *ctx) {
    if (team_state != NO_TEAM) { /* within a team's body already */
        body(ctx);
        return;
    }
    if (solo_now()) {
        team_state = SOLO;
        body(ctx);
        team_state = NO_TEAM;
        return;
    }
    pthread_mutex_lock(&pool.caller);
    __atomic_store_n(&pool.ended, 0, __ATOMIC_RELEASE);
#pragma omp parallel num_threads(pool.threads)
    {
        if (omp_get_thread_num() == 0) {
            team_state = IN_TEAM;
            body(ctx);
            team_state = NO_TEAM; /* also after a stall made the body's last jobs solo */
            __atomic_store_n(&pool.ended, 1, __ATOMIC_RELEASE);
        } else {
            serve();
        }
    }
    pthread_mutex_unlock(&pool.caller);
}

typedef struct {
    tm_range_fn fn;
    void *ctx;
    int64_t n, items;
} for_args;

static void for_body(void *p) {
    const for_args *a = p;
    tm_pool_for(a->fn, a->ctx, a->n, a->items);
}

void tm_pool_for(tm_range_fn fn, void *ctx, int64_t n, int64_t items) {
    if (n <= 0) return;
    items = items < 1 ? 1 : items > n ? n : items;
    if (team_state == PAUSED && now_ns() >= __atomic_load_n(&pool.solo_until, __ATOMIC_RELAXED))
        team_state = IN_TEAM; /* the while alone is over: the team's helpers are still serving */
    if (pool.threads == 1 || items == 1 || team_state == SOLO || team_state == PAUSED) { /* no one to share with */
        fn(ctx, 0, n);
        return;
    }
    if (team_state == NO_TEAM) { /* a team for this one job */
        for_args a = {fn, ctx, n, items};
        tm_team_run(for_body, &a);
        return;
    }
    __atomic_add_fetch(&pool.seq, 1, __ATOMIC_ACQ_REL); /* odd: the description is being written */
    pool.job = (job_t){fn, ctx, n, items};
    __atomic_store_n(&pool.done, 0, __ATOMIC_RELAXED);
    pool.number = pool.number + 1 ? pool.number + 1 : 1; /* 0 is no job */
    const uint32_t number = pool.number;
    __atomic_store_n(&pool.claim, (uint64_t)number << 32, __ATOMIC_RELEASE);
    __atomic_add_fetch(&pool.seq, 1, __ATOMIC_RELEASE);
    const job_t j = pool.job;
    const int64_t start = now_ns(), ran = work(number, &j);
    int64_t waiting_since = now_ns();
    const int64_t stall_ns = (waiting_since - start) / (ran ? ran : 1) * STALL_PIECES + STALL_NS;
    for (int spins = 0; __atomic_load_n(&pool.done, __ATOMIC_ACQUIRE) < items; ++spins) {
        if (spins < CALLER_SPINS) {
            relax();
            continue;
        }
        sched_yield(); /* a helper holding a piece may be waiting for this core */
        const int64_t now = now_ns();
        if (team_state == IN_TEAM && now - waiting_since > stall_ns) { /* a while alone, from the stall's end */
            __atomic_add_fetch(&pool.stalls, 1, __ATOMIC_RELAXED);
            const int again = pool.solo_until && now - pool.solo_until < SOLO_AGAIN_NS;
            pool.solo_ns = !again ? SOLO_MIN_NS : 2 * pool.solo_ns < SOLO_MAX_NS ? 2 * pool.solo_ns : SOLO_MAX_NS;
            team_state = PAUSED;
        }
    }
    if (team_state == PAUSED) /* (it was IN_TEAM when this job began): the while alone counts from the stall's end */
        __atomic_store_n(&pool.solo_until, now_ns() + pool.solo_ns, __ATOMIC_RELAXED);
}

/* ---- for the tests: jobs whose pieces take caller_us on the caller, helper_us on a helper (one off the CPU) ---- */
typedef struct {
    int64_t caller_us, helper_us;
    int64_t *caller_pieces; /* pieces the caller ran, per job */
    int64_t job;
} probe_ctx;

static void probe_piece(void *p, int64_t begin, int64_t end) {
    probe_ctx *c = p;
    const int helper = team_state == NO_TEAM; /* (the caller is in its team's body, or running solo) */
    const struct timespec t = {0, (helper ? c->helper_us : c->caller_us) * 1000};
    nanosleep(&t, NULL);
    if (!helper) __atomic_add_fetch(&c->caller_pieces[c->job], end - begin, __ATOMIC_RELAXED);
}

typedef struct {
    probe_ctx c;
    int64_t jobs, pieces;
} probe_args;

static void probe_body(void *p) {
    probe_args *a = p;
    for (a->c.job = 0; a->c.job < a->jobs; ++a->c.job) tm_pool_for(probe_piece, &a->c, a->pieces, a->pieces);
}

/* runs `jobs` jobs of `pieces` pieces in one team; caller_pieces[j]: the pieces of job j the caller ran */
void tm_pool_probe(int64_t jobs, int64_t pieces, int64_t caller_us, int64_t helper_us, int64_t *caller_pieces) {
    probe_args a = {{caller_us, helper_us, caller_pieces, 0}, jobs, pieces};
    tm_team_run(probe_body, &a);
}

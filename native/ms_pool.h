// minispec's product thread pool, shared by the shims (ggml_shim.c, iqk_shim.c): one product at a time runs in
// `parts` parts, the caller taking part 0 and persistent workers the rest. A worker waits for work by spinning
// (long enough to span the gaps between the products of one model pass) and then sleeping on a condition
// variable, so a busy neighbour on the same core costs its share of time, never a collapse (and minispec.threads
// then picks one thread). Header-only: each shim is its own shared library with its own pool.
#ifndef MS_POOL_H
#define MS_POOL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#define MS_MAX_THREADS 64
#define MS_SPIN_ROUNDS 200000L  // about 5-20 ms of pause: spans the gaps between the products of one model pass

// runs part `part` of `parts` of the job `job`
typedef void (*ms_part_fn)(const void *job, int64_t part, int64_t parts);

static ms_part_fn g_fn;
static const void *g_arg;
static int64_t g_parts;
static atomic_long g_generation;
static atomic_int g_pending;
static int g_workers;  // started so far
static long g_start[MS_MAX_THREADS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;  // one product at a time (callers may be threads)

static void *ms_worker(void *arg) {
    const int64_t part = (int64_t)(intptr_t)arg;
    long seen = g_start[part];  // the generation before the first job it is to take part in
    for (;;) {
        long now;
        long spins = 0;
        while ((now = atomic_load_explicit(&g_generation, memory_order_acquire)) == seen && spins < MS_SPIN_ROUNDS) {
            CPU_RELAX();
            spins++;
        }
        if (now == seen) {
            pthread_mutex_lock(&g_lock);
            while ((now = atomic_load(&g_generation)) == seen) pthread_cond_wait(&g_wake, &g_lock);
            pthread_mutex_unlock(&g_lock);
        }
        seen = now;
        if (part < g_parts) g_fn(g_arg, part, g_parts);
        if (atomic_fetch_sub_explicit(&g_pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&g_lock);  // the caller may be asleep waiting for the last part
            pthread_cond_signal(&g_done);
            pthread_mutex_unlock(&g_lock);
        }
    }
    return NULL;
}

static int ms_ensure_workers(int want) {
    while (g_workers < want) {
        pthread_t t;
        g_start[g_workers + 1] = atomic_load(&g_generation);
        if (pthread_create(&t, NULL, ms_worker, (void *)(intptr_t)(g_workers + 1)) != 0) return g_workers;
        pthread_detach(t);
        g_workers++;
    }
    return g_workers;
}

// Runs fn(job, part, parts) for every part of `threads` parts (one part, on the caller, when threads <= 1).
static void ms_run(ms_part_fn fn, const void *job, int threads) {
    if (threads > MS_MAX_THREADS) threads = MS_MAX_THREADS;
    if (threads <= 1) {
        fn(job, 0, 1);
        return;
    }
    pthread_mutex_lock(&g_call);
    const int helpers = ms_ensure_workers(threads - 1);
    g_fn = fn, g_arg = job;
    g_parts = helpers < threads - 1 ? helpers + 1 : threads;
    atomic_store(&g_pending, g_workers);
    pthread_mutex_lock(&g_lock);
    atomic_fetch_add_explicit(&g_generation, 1, memory_order_release);
    pthread_cond_broadcast(&g_wake);
    pthread_mutex_unlock(&g_lock);
    fn(job, 0, g_parts);
    // a bounded spin, then sleep: a caller spinning on while a worker waits for a core shared with another process
    // would hold the very core the worker needs
    for (long spins = 0; atomic_load_explicit(&g_pending, memory_order_acquire) > 0 && spins < MS_SPIN_ROUNDS; spins++)
        CPU_RELAX();
    if (atomic_load(&g_pending) > 0) {
        pthread_mutex_lock(&g_lock);
        while (atomic_load(&g_pending) > 0) pthread_cond_wait(&g_done, &g_lock);
        pthread_mutex_unlock(&g_lock);
    }
    pthread_mutex_unlock(&g_call);
}

#endif

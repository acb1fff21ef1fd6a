// minispec's quantized product: a GGUF's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...) times 1..16 activation rows,
// through llama.cpp's maintained ggml CPU kernels (ggml_get_type_traits_cpu: from_float quantizes an activation
// row to the kernel's type, Q8_K for the K-quants; vec_dot multiplies one weight row by one activation row).
//
// Every output is one vec_dot of one weight row with one activation row, so a row's bits never depend on how many
// rows share the pass or on the thread count. Output columns (weight rows) are the outer loop and the activation
// rows the inner one: a weight row is read from memory once per pass and reused from L1 for every activation row.
// Threads split the output columns in fixed, equal ranges; a worker waits for work by spinning briefly and then
// sleeping on a condition variable, so a busy neighbour on the same core costs its share of time, never a collapse.
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "ggml.h"
#include "ggml-cpu.h"

#define MAX_THREADS 64
#define SPIN_ROUNDS 20000  // about tens of microseconds: the gap between two products of one model pass

struct job {
    ggml_vec_dot_t vec_dot;
    const uint8_t *w;
    size_t w_row;
    const uint8_t *xq;
    size_t x_row;
    int64_t n, k, rows, parts;
    float *y;
};

static struct job g_job;
static atomic_long g_generation;
static atomic_int g_pending;
static int g_workers;  // started so far
static long g_start[MAX_THREADS];
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t g_done = PTHREAD_COND_INITIALIZER;
static pthread_mutex_t g_call = PTHREAD_MUTEX_INITIALIZER;  // one product at a time (callers may be threads)

static void run_part(const struct job *j, int64_t part) {
    const int64_t begin = j->n * part / j->parts, end = j->n * (part + 1) / j->parts;
    for (int64_t c = begin; c < end; c++) {
        const uint8_t *wr = j->w + (size_t)c * j->w_row;
        for (int64_t r = 0; r < j->rows; r++) {
            j->vec_dot((int)j->k, j->y + r * j->n + c, 0, wr, 0, j->xq + (size_t)r * j->x_row, 0, 1);
        }
    }
}

static void *worker(void *arg) {
    const int64_t part = (int64_t)(intptr_t)arg;
    long seen = g_start[part];  // the generation before the first job it is to take part in
    for (;;) {
        long now;
        int spins = 0;
        while ((now = atomic_load_explicit(&g_generation, memory_order_acquire)) == seen && spins < SPIN_ROUNDS) {
            CPU_RELAX();
            spins++;
        }
        if (now == seen) {
            pthread_mutex_lock(&g_lock);
            while ((now = atomic_load(&g_generation)) == seen) pthread_cond_wait(&g_wake, &g_lock);
            pthread_mutex_unlock(&g_lock);
        }
        seen = now;
        if (part < g_job.parts) run_part(&g_job, part);
        if (atomic_fetch_sub_explicit(&g_pending, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&g_lock);  // the caller may be asleep waiting for the last part
            pthread_cond_signal(&g_done);
            pthread_mutex_unlock(&g_lock);
        }
    }
    return NULL;
}

static int ensure_workers(int want) {
    while (g_workers < want) {
        pthread_t t;
        g_start[g_workers + 1] = atomic_load(&g_generation);
        if (pthread_create(&t, NULL, worker, (void *)(intptr_t)(g_workers + 1)) != 0) return g_workers;
        pthread_detach(t);
        g_workers++;
    }
    return g_workers;
}

int ms_init(void) {
    ggml_cpu_init();
    return 0;
}

// The activation type a weight type's vec_dot takes (Q8_K for the K-quants), or -1 if it has no vec_dot.
int ms_vec_dot_type(int type) {
    if (type < 0 || type >= GGML_TYPE_COUNT) return -1;
    const struct ggml_type_traits_cpu *t = ggml_get_type_traits_cpu((enum ggml_type)type);
    if (!t->vec_dot || !ggml_get_type_traits_cpu(t->vec_dot_type)->from_float) return -1;
    return (int)t->vec_dot_type;
}

size_t ms_row_size(int type, int64_t k) { return ggml_row_size((enum ggml_type)type, k); }

// y (rows, n) float32 = x (rows, k) float32 times the (n, k) matrix w of `type` (its GGUF blocks, row-major),
// transposed: y[r][c] = dot(w[c], x[r]) with x[r] quantized to the kernel's activation type in `scratch`
// (rows * ms_row_size(ms_vec_dot_type(type), k) bytes). Returns 0, or -1 for a type without a kernel.
int ms_matmul(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y, void *scratch,
              int threads) {
    const int vt = ms_vec_dot_type(type);
    if (vt < 0) return -1;
    const size_t x_row = ggml_row_size((enum ggml_type)vt, k);
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu((enum ggml_type)vt)->from_float;
    for (int64_t r = 0; r < rows; r++) quantize(x + r * k, (uint8_t *)scratch + r * x_row, k);
    struct job j = {ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot, (const uint8_t *)w,
                    ggml_row_size((enum ggml_type)type, k), (const uint8_t *)scratch, x_row, n, k, rows, 1, y};
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads <= 1 || n < 2 * threads) {
        run_part(&j, 0);
        return 0;
    }
    pthread_mutex_lock(&g_call);
    const int helpers = ensure_workers(threads - 1);
    j.parts = helpers < threads - 1 ? helpers + 1 : threads;
    g_job = j;
    atomic_store(&g_pending, g_workers);
    pthread_mutex_lock(&g_lock);
    atomic_fetch_add_explicit(&g_generation, 1, memory_order_release);
    pthread_cond_broadcast(&g_wake);
    pthread_mutex_unlock(&g_lock);
    run_part(&g_job, 0);
    // a bounded spin, then sleep: a caller spinning on while a worker waits for a core shared with another process
    // would hold the very core the worker needs
    for (int spins = 0; atomic_load_explicit(&g_pending, memory_order_acquire) > 0 && spins < SPIN_ROUNDS; spins++)
        CPU_RELAX();
    if (atomic_load(&g_pending) > 0) {
        pthread_mutex_lock(&g_lock);
        while (atomic_load(&g_pending) > 0) pthread_cond_wait(&g_done, &g_lock);
        pthread_mutex_unlock(&g_lock);
    }
    pthread_mutex_unlock(&g_call);
    return 0;
}

// The (n, k) matrix of `type` as float32 (ggml's own dequantization), for tests and fallbacks.
int ms_dequantize(int type, const void *w, int64_t n, int64_t k, float *out) {
    const struct ggml_type_traits *t = ggml_get_type_traits((enum ggml_type)type);
    if (!t->to_float) return -1;
    const size_t row = ggml_row_size((enum ggml_type)type, k);
    for (int64_t r = 0; r < n; r++) t->to_float((const uint8_t *)w + r * row, out + r * k, k);
    return 0;
}

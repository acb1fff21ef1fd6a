// minispec's quantized product: a GGUF's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...) times 1..16 activation rows,
// through llama.cpp's maintained ggml CPU kernels (ggml_get_type_traits_cpu: from_float quantizes an activation
// row to the kernel's type, Q8_K for the K-quants; vec_dot multiplies one weight row by one activation row).
//
// Every output is one vec_dot of one weight row with one activation row (or, for a Q4_K matrix repacked as llama.cpp
// does on AVX2, one one-row gemv over eight weight rows), so a row's bits never depend on how many rows share the
// pass or on the thread count. Output columns (weight rows) are the outer loop and the activation rows the inner
// one: a weight row is read from memory once per pass and reused from cache for every activation row.
// Threads (ms_pool.h) split the output columns in fixed ranges.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ms_pool.h"
#include "ms_layer.h"
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ms_ggml.h"  // after ggml.h, whose API it calls

// llama.cpp's repacked Q4_K product for one activation row (ggml-cpu's repack.h, extern "C" there, linked from the
// static ggml-cpu): eight weight rows interleaved into one block_q4_Kx8, the row quantized to Q8_K. Its four-row
// gemm is not used: on AVX2 it costs as much per row as the one-row product (docs/benchmarks.md) and gives other
// bits, so every row goes through the one-row product, alone.
void ggml_gemv_q4_K_8x8_q8_K(int n, float *s, size_t bs, const void *vx, const void *vy, int nr, int nc);

struct job {
    int repacked;  // w is Q4_K repacked eight rows to a block (ms_repack)
    ggml_vec_dot_t vec_dot;
    const uint8_t *w;
    size_t w_row;
    const uint8_t *xq;
    size_t x_row;
    int64_t n, k, rows, parts;
    float *y;
};

#define TILE_COLS 16  // parts and chunks start on multiples of 16 weight rows (the repacked tiles are 8)
#define CHUNK_COLS 64  // weight rows multiplied by every activation row while they sit in L2

static void run_repacked(const struct job *j, int64_t part) {
    const int64_t tiles = (j->n + TILE_COLS - 1) / TILE_COLS;
    const int64_t begin = tiles * part / j->parts * TILE_COLS, end_t = tiles * (part + 1) / j->parts * TILE_COLS;
    const int64_t end = end_t < j->n ? end_t : j->n;
    for (int64_t c = begin; c < end; c += CHUNK_COLS) {
        const int64_t nc = end - c < CHUNK_COLS ? end - c : CHUNK_COLS;
        for (int64_t r = 0; r < j->rows; r++)
            ggml_gemv_q4_K_8x8_q8_K((int)j->k, j->y + r * j->n + c, (size_t)j->n, j->w + (size_t)c * j->w_row,
                                    j->xq + (size_t)r * j->x_row, 1, (int)nc);
    }
}

static void run_part(const struct job *j, int64_t part) {
    if (j->repacked) {
        run_repacked(j, part);
        return;
    }
    const int64_t begin = j->n * part / j->parts, end = j->n * (part + 1) / j->parts;
    for (int64_t c = begin; c < end; c++) {
        const uint8_t *wr = j->w + (size_t)c * j->w_row;
        for (int64_t r = 0; r < j->rows; r++) {
            j->vec_dot((int)j->k, j->y + r * j->n + c, 0, wr, 0, j->xq + (size_t)r * j->x_row, 0, 1);
        }
    }
}

// ggml's warnings and errors reach stderr; its information lines (one per repacked matrix) do not
static void log_warnings(enum ggml_log_level level, const char *text, void *user) {
    (void)user;
    if (level == GGML_LOG_LEVEL_WARN || level == GGML_LOG_LEVEL_ERROR) fputs(text, stderr);
}

int ms_init(void) {
    ggml_log_set(log_warnings, NULL);
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

static void run_job_part(const void *job, int64_t part, int64_t parts) {
    struct job j = *(const struct job *)job;
    j.parts = parts;
    run_part(&j, part);
}

// Runs a product in `threads` parts over the output columns (one part for a matrix too small to split).
static void run_job(const struct job *j, int threads) {
    ms_run(run_job_part, j, j->n < 2 * TILE_COLS * threads ? 1 : threads);
}

// Quantizes each row of x to the kernel's activation type in scratch and runs the product (vec_dot, or the
// repacked one-row product when `repacked`).
static void product(int type, int repacked, const void *w, int64_t n, int64_t k, const float *x, int64_t rows,
                    float *y, void *scratch, int threads) {
    const enum ggml_type vt = (enum ggml_type)ms_vec_dot_type(type);  // Q8_K for Q4_K, the repacked form's too
    const size_t x_row = ggml_row_size(vt, k);
    const ggml_from_float_t quantize = ggml_get_type_traits_cpu(vt)->from_float;
    for (int64_t r = 0; r < rows; r++) quantize(x + r * k, (uint8_t *)scratch + r * x_row, k);
    struct job j = {repacked, ggml_get_type_traits_cpu((enum ggml_type)type)->vec_dot, (const uint8_t *)w,
                    ggml_row_size((enum ggml_type)type, k), (const uint8_t *)scratch, x_row, n, k, rows, 1, y};
    run_job(&j, threads);
}

// y (rows, n) float32 = x (rows, k) float32 times the (n, k) matrix w of `type` (its GGUF blocks, row-major),
// transposed: y[r][c] = dot(w[c], x[r]) with x[r] quantized to the kernel's activation type in `scratch`
// (rows * ms_row_size(ms_vec_dot_type(type), k) bytes). Returns 0, or -1 for a type without a kernel.
int ms_matmul(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y, void *scratch,
              int threads) {
    if (ms_vec_dot_type(type) < 0) return -1;
    product(type, 0, w, n, k, x, rows, y, scratch, threads);
    return 0;
}

// Whether an (n, k) matrix of `type` has a repacked product here: Q4_K with n a multiple of 8 on a CPU with
// AVX2 (the form llama.cpp itself picks there; its buffer type "CPU_REPACK" does the interleaving).
int ms_repackable(int type, int64_t n, int64_t k) {
#if defined(__x86_64__) && defined(__AVX2__)
    return type == GGML_TYPE_Q4_K && n % 8 == 0 && k % 256 == 0 && ggml_cpu_has_avx2();
#else
    (void)type, (void)n, (void)k;
    return 0;
#endif
}

static ggml_backend_buffer_type_t repack_buffer_type(void) {
    ggml_backend_reg_t reg = ggml_backend_cpu_reg();
    ggml_backend_dev_get_extra_bufts_t get =
        (ggml_backend_dev_get_extra_bufts_t)ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
    if (!get) return NULL;
    for (ggml_backend_buffer_type_t *b = get(ggml_backend_reg_dev_get(reg, 0)); b && *b; b++)
        if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
    return NULL;
}

// Writes the (n, k) matrix w of `type` to dst (as many bytes) in ggml's repacked form, through ggml's own
// repacking. Returns 0, or -1 when this matrix has no repacked form here.
int ms_repack(int type, const void *w, int64_t n, int64_t k, void *dst) {
    if (!ms_repackable(type, n, k)) return -1;
    ggml_backend_buffer_type_t buft = repack_buffer_type();
    if (!buft) return -1;
    struct ggml_init_params params = {ggml_tensor_overhead() * 2, NULL, true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return -1;
    struct ggml_tensor *t = ggml_new_tensor_2d(ctx, (enum ggml_type)type, k, n);
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft);
    int ok = buf != NULL && t->extra != NULL;  // extra: the repacked form ggml chose (none: it would not repack)
    if (ok) {
        ggml_backend_tensor_set(t, w, 0, ggml_nbytes(t));
        memcpy(dst, t->data, ggml_nbytes(t));
    }
    if (buf) ggml_backend_buffer_free(buf);
    ggml_free(ctx);
    return ok ? 0 : -1;
}

// As ms_matmul, for a matrix ms_repack wrote.
int ms_matmul_repacked(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                       void *scratch, int threads) {
    if (!ms_repackable(type, n, k)) return -1;
    product(type, 1, w, n, k, x, rows, y, scratch, threads);
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

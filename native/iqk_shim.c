// minispec's row-tiled quantized product: a GGUF's own blocks (Q4_K, Q6_K, Q5_0, Q8_0, ...) times 1..16 activation
// rows through ik_llama.cpp's CPU matrix product (iqk_mul_mat, its ggml fork's ggml/src/iqk), which unpacks each
// weight block once for a tile of up to 8 activation rows instead of once per row.
//
// Each activation row is quantized alone to the type ik's kernel takes (its ggml type traits' vec_dot_type: Q8_2_X4
// for the K-quants on AVX2). A call multiplies at most EXACT_ROWS rows: below ik's switch (32 rows and more) to
// converting the weights first, so every row goes through the same kernels whatever the row count; its tiles of 1-8
// rows keep one accumulator a row with the same operations in the same order, so a row's bits do not depend on the
// other rows of the pass, nor on the thread count (tests/test_ggml.py checks both, bit for bit, for every type).
// Threads (ms_pool.h) split the weight rows as iqk_mul_mat does for its own ith / nth.
//
// Where the CPU has AVX-512 VNNI, Q4_K and Q6_K matrices take minispec's own 16-row tiles instead (ms_rows.h,
// chosen at load by ms_repack), with the same contract.
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ggml.h"
#include "ms_pool.h"
#include "ms_layer.h"
#include "ms_ggml.h"
#include "ms_rows.h"

// ik_llama.cpp's entry point (ggml/src/iqk/iqk_mul_mat.h, extern "C", linked from the static ggml): C (Ny, Nx) =
// B (Ny rows of typeB) times A (Nx rows of typeA) transposed, the part of the weight rows thread ith of nth takes
bool iqk_mul_mat(long Nx, long Ny, long ne00, int typeA, const void *A, long strideA, int typeB, const void *B,
                 long strideB, float *C, long stride_C, int ith, int nth);

#define EXACT_ROWS 16  // rows one call multiplies (ik converts the weights first from 32 rows on: other bits)

struct job {
    int type, vtype;
    const uint8_t *w;
    size_t w_row;
    const uint8_t *xq;
    size_t x_row;
    int64_t n, k, rows;
    float *y;
};

static void run_part(const void *arg, int64_t part, int64_t parts) {
    const struct job *j = (const struct job *)arg;
    for (int64_t r = 0; r < j->rows; r += EXACT_ROWS) {
        const int64_t m = j->rows - r < EXACT_ROWS ? j->rows - r : EXACT_ROWS;
        iqk_mul_mat((long)j->n, (long)m, (long)j->k, j->type, j->w, (long)j->w_row, j->vtype,
                    j->xq + (size_t)r * j->x_row, (long)j->x_row, j->y + r * j->n, (long)j->n, (int)part, (int)parts);
    }
}

int ms_init(void) {
    // ggml's fp16 tables, which its quantizers read, are filled by the first ggml_init
    struct ggml_init_params params = {0, NULL, true};
    struct ggml_context *ctx = ggml_init(params);
    if (ctx) ggml_free(ctx);
    return 0;
}

// Whether minispec's own 16-row tiles (ms_rows.h) are compiled in: on x86 with AVX-512 VNNI, F16C and BW.
int ms_rows_built(void) {
#ifdef MS_ROWS
    return 1;
#else
    return 0;
#endif
}

size_t ms_row_size(int type, int64_t k) {
#ifdef MS_ROWS
    if (type == MS_Q8_X16) return ms_q8x_row(k);
#endif
    return ggml_row_size((enum ggml_type)type, k);
}

// The activation type ik's product takes for a weight type, or -1 where it has none: the type traits' vec_dot_type,
// confirmed by a trial product of a zero 32 x 256 matrix (iqk_mul_mat refuses a pair it has no kernel for).
static int probe(int type) {
    const ggml_type_traits_t t = ggml_internal_get_type_traits((enum ggml_type)type);
    if (!t.is_quantized || t.vec_dot_type >= GGML_TYPE_COUNT ||
        !ggml_internal_get_type_traits(t.vec_dot_type).from_float)
        return -1;
    const int64_t n = 32, k = 256;
    const size_t w_row = ggml_row_size((enum ggml_type)type, k), x_row = ggml_row_size(t.vec_dot_type, k);
    uint8_t *w = calloc(n, w_row), *x = calloc(1, x_row);
    float *y = calloc(n, sizeof(float));
    const bool ok = w && x && y &&
                    iqk_mul_mat((long)n, 1, (long)k, type, w, (long)w_row, t.vec_dot_type, x, (long)x_row, y, (long)n, 0, 1);
    free(w), free(x), free(y);
    return ok ? (int)t.vec_dot_type : -1;
}

static int g_vec_dot_type[GGML_TYPE_COUNT];  // probe(type) + 2, 0 until probed (a race only probes twice)

int ms_vec_dot_type(int type) {
#ifdef MS_ROWS
    if (type == MS_Q4_K_X16 || type == MS_Q6_K_X16) return MS_Q8_X16;
#endif
    if (type < 0 || type >= GGML_TYPE_COUNT) return -1;
    if (!g_vec_dot_type[type]) g_vec_dot_type[type] = probe(type) + 2;
    return g_vec_dot_type[type] - 2;
}

// y (rows, n) float32 = x (rows, k) float32 times the (n, k) matrix w of `type` (its GGUF blocks, row-major),
// transposed, x's rows quantized to ms_vec_dot_type(type) in `scratch` (rows * ms_row_size(that type, k) bytes).
// Returns 0, or -1 for a type without a product.
int ms_matmul(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y, void *scratch,
              int threads) {
#ifdef MS_ROWS
    if (type == MS_Q4_K_X16 || type == MS_Q6_K_X16) {
        ms_rows_matmul(type, w, n, k, x, rows, y, scratch, threads);
        return 0;
    }
#endif
    const int vt = ms_vec_dot_type(type);
    if (vt < 0) return -1;
    const size_t x_row = ggml_row_size((enum ggml_type)vt, k);
    const ggml_from_float_t quantize = ggml_internal_get_type_traits((enum ggml_type)vt).from_float;
    for (int64_t r = 0; r < rows; r++) quantize(x + r * k, (uint8_t *)scratch + r * x_row, k);
    const struct job j = {type, vt, (const uint8_t *)w, ggml_row_size((enum ggml_type)type, k),
                          (const uint8_t *)scratch, x_row, n, k, rows, y};
    ms_run(run_part, &j, threads);
    return 0;
}

void iqk_repack_tensor(struct ggml_tensor *tensor);  // ggml/src/iqk/iqk_quantize.h, extern "C"

// Writes the (n, k) matrix w of `type` to dst (as many bytes) in the fastest interleaved form here: minispec's own
// 16-row tiles for Q4_K and Q6_K where the CPU has AVX-512 VNNI (ms_rows.h; MINISPEC_FORM=ik at load takes ik's
// instead, for comparison), else ik's row-interleaved form (Q4_K as Q4_K_R4, four rows to a block, ...: what its
// -rtr does at load), through ik's own repacking. Returns the form's type (which ms_matmul then takes), or -1 where
// there is none. Only for a row count that every interleaved form's kernel takes whole (ik's kernels assert it,
// aborting the process, rather than return).
int ms_repack(int type, const void *w, int64_t n, int64_t k, void *dst) {
    if (n % 16 != 0) return -1;
#ifdef MS_ROWS
    const char *form = getenv("MINISPEC_FORM");
    if (!(form && strcmp(form, "ik") == 0) && ms_rows_form(type, n, k) >= 0) return ms_rows_repack(type, w, n, k, dst);
#endif
    struct ggml_init_params params = {ggml_tensor_overhead() * 2, NULL, true};
    struct ggml_context *ctx = ggml_init(params);
    if (!ctx) return -1;
    struct ggml_tensor *t = ggml_new_tensor_2d(ctx, (enum ggml_type)type, k, n);
    t->data = dst;
    memcpy(dst, w, ggml_nbytes(t));
    iqk_repack_tensor(t);
    const int repacked = (int)t->type;
    ggml_free(ctx);
    return repacked != type && ms_vec_dot_type(repacked) >= 0 ? repacked : -1;
}

// The (n, k) matrix of `type` as float32 (ggml's own dequantization in ik's copy), for tests and the switch-off path.
int ms_dequantize(int type, const void *w, int64_t n, int64_t k, float *out) {
    const ggml_type_traits_t t = ggml_internal_get_type_traits((enum ggml_type)type);
    if (!t.to_float) return -1;
    const size_t row = ggml_row_size((enum ggml_type)type, k);
    for (int64_t r = 0; r < n; r++) t.to_float((const uint8_t *)w + r * row, out + r * k, k);
    return 0;
}

// One transformer block of a kept (quantized) model for a pass of any number of rows, in one call: RMSNorm, the
// q/k/v products with their biases, RoPE, the new keys and values written to the paged pool, attention, the output
// product and the residual, RMSNorm, SwiGLU and the residual again (minispec/model.py states the same maths in
// PyTorch; minispec/fused.py calls this). A decode step's Python and PyTorch work between the products (about a
// third of a step of the 1.5B) becomes one call a layer.
//
// Every row is computed alone: the norms, RoPE and SwiGLU work row by row, a row's attention over its own key list
// by one thread from start to end, and the products are row-independent (the shims' contract), so a row's bits
// depend neither on the other rows of the pass nor on the thread count: a verify pass gives every position what a
// decode step gives it. Header-only, included by each shim; the products are called through the function pointers
// the caller passes (either shim's ms_matmul), so one layer may mix the two libraries.
#ifndef MS_LAYER_H
#define MS_LAYER_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ms_pool.h"

typedef int (*ms_matmul_fn)(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                            void *scratch, int threads);

// a matrix and the function that multiplies it: y (rows, n) = x (rows, k) times w transposed
struct ms_product {
    ms_matmul_fn fn;
    const void *w;
    int64_t n, k;
    int64_t x_row;  // scratch bytes a row of x takes once quantized for this product
    int32_t type;
};

// a block's weights, the same for every pass
struct ms_block {
    int64_t dim, n_heads, n_kv_heads, head_dim, ffn;
    float eps;
    int32_t n_qkv;  // 1: q, k and v stacked in qkv[0]; 3: qkv[0..2] are q, k and v
    const float *norm1, *norm2;  // (dim)
    const float *qkv_bias;  // ((H + 2 Hkv) D) or NULL
    struct ms_product qkv[3], o, gate, up, down;
};

// a pass: its rows and where they read and write, the same for every block
struct ms_pass {
    int64_t rows;
    int32_t threads;
    const float *cos, *sin;  // (rows, D): each row's position's RoPE table rows (sin signed: cat(-sin, sin))
    float *pool;  // the first block's (slots, 2 Hkv, D): keys then values; block i's at pool + i * pool_stride
    int64_t pool_stride;
    const int64_t *write_slot;  // (rows): where a row's key and value go; -1 for padding (not written, no output)
    const int64_t *keys;  // the pool slots rows attend, row r's at keys[key_start[r]] .. + key_count[r] - 1
    const int64_t *key_start, *key_count;
    float *x;  // (rows, dim): the residual stream, updated in place
};

// e^x in plain arithmetic the compiler vectorizes (libm's expf is a call a value): x = n ln2 + r with n rounded to
// nearest, e^r by Cephes' degree-6 polynomial (within 2 ulp), times 2^n built in the exponent bits. x is clamped to
// [-87.3, 88.7] (e^x stays a normal float): attention scores and SwiGLU's gates never need more.
static inline float ms_expf(float x) {
    x = x < -87.3f ? -87.3f : (x > 88.7f ? 88.7f : x);
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23)
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;  // ln2 in two parts: r exact to a float
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return (p * r * r + r + 1.0f) * scale;
}

// a dot product in 16 partial sums added in a fixed order
static float ms_dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0;
    for (int j = 0; j < 16; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

// weight * (x * 1/sqrt(mean(x^2) + eps)), one row; the sum of squares as ms_dot sums
static void ms_rms_norm(const float *x, const float *w, int64_t n, float eps, float *out) {
    const float scale = 1.0f / sqrtf(ms_dot(x, x, n) / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = w[i] * (x[i] * scale);
}

// o += w v over n values
static void ms_axpy(float *restrict o, const float *restrict v, float w, int64_t n) {
    for (int64_t i = 0; i < n; i++) o[i] += w * v[i];
}

// rotate-half RoPE of one head in place: x * cos + roll(x, D/2) * sin
static void ms_rope(float *restrict x, const float *restrict cos, const float *restrict sin, int64_t d,
                    float *restrict tmp) {
    const int64_t half = d / 2;  // (the two halves apart: loops without a modulo vectorize)
    for (int64_t i = 0; i < half; i++) tmp[i] = x[i] * cos[i] + x[i + half] * sin[i];
    for (int64_t i = half; i < d; i++) tmp[i] = x[i] * cos[i] + x[i - half] * sin[i];
    memcpy(x, tmp, (size_t)d * sizeof(float));
}

struct ms_attend_job {
    const struct ms_block *b;
    const struct ms_pass *p;
    const float *pool;  // this block's
    const float *qkv;  // (rows, (H + 2 Hkv) D), rotated
    float *out;  // (rows, H D)
    float *scores;  // per part: the longest key list's floats
    int64_t longest;
};

// softmax(q k^T / sqrt(D)) v for the (row, head) pairs of this part, each pair by one part alone
static void ms_attend_part(const void *arg, int64_t part, int64_t parts) {
    const struct ms_attend_job *j = (const struct ms_attend_job *)arg;
    const struct ms_block *b = j->b;
    const struct ms_pass *p = j->p;
    const int64_t H = b->n_heads, Hkv = b->n_kv_heads, D = b->head_dim, width = (H + 2 * Hkv) * D;
    const int64_t pairs = p->rows * H, group = H / Hkv;
    const float scale = 1.0f / sqrtf((float)D);
    float *s = j->scores + part * j->longest;
    for (int64_t pair = pairs * part / parts; pair < pairs * (part + 1) / parts; pair++) {
        const int64_t r = pair / H, h = pair % H, g = h / group;
        float *o = j->out + r * H * D + h * D;
        memset(o, 0, (size_t)D * sizeof(float));
        if (p->write_slot[r] < 0) continue;
        const float *q = j->qkv + r * width + h * D;
        const int64_t *keys = p->keys + p->key_start[r], n = p->key_count[r];
        float top = -INFINITY;
        for (int64_t t = 0; t < n; t++) {
            s[t] = ms_dot(q, j->pool + (keys[t] * 2 * Hkv + g) * D, D) * scale;
            if (s[t] > top) top = s[t];
        }
        for (int64_t t = 0; t < n; t++) s[t] = ms_expf(s[t] - top);
        float sum = 0;
        for (int64_t t = 0; t < n; t++) sum += s[t];
        for (int64_t t = 0; t < n; t++) ms_axpy(o, j->pool + (keys[t] * 2 * Hkv + Hkv + g) * D, s[t] / sum, D);
    }
}

struct ms_swiglu_job {
    float *g;
    const float *u;
    int64_t n;
};

static void ms_swiglu_part(const void *arg, int64_t part, int64_t parts) {
    const struct ms_swiglu_job *j = (const struct ms_swiglu_job *)arg;
    float *restrict g = j->g;
    const float *restrict u = j->u;
    for (int64_t i = j->n * part / parts; i < j->n * (part + 1) / parts; i++) g[i] = g[i] / (1.0f + ms_expf(-g[i])) * u[i];
}

static int ms_product_run(const struct ms_product *m, const float *x, int64_t rows, float *y, void *scratch,
                          int threads) {
    return m->fn(m->type, m->w, m->n, m->k, x, rows, y, scratch, threads);
}

// buffers a pass takes, carved out of one allocation
struct ms_buffers {
    float *h, *qkv, *att, *g, *u, *scores, *tmp;
    void *qs;
};

static int ms_block_run(const struct ms_block *b, const struct ms_pass *p, float *pool, const struct ms_buffers *m,
                        int64_t longest) {
    const int64_t R = p->rows, dim = b->dim, H = b->n_heads, Hkv = b->n_kv_heads, D = b->head_dim;
    const int64_t width = (H + 2 * Hkv) * D;
    const int threads = p->threads > 1 ? p->threads : 1;
    for (int64_t r = 0; r < R; r++) ms_rms_norm(p->x + r * dim, b->norm1, dim, b->eps, m->h + r * dim);
    if (b->n_qkv == 1) {
        if (ms_product_run(&b->qkv[0], m->h, R, m->qkv, m->qs, threads)) return -2;
    } else {  // three products side by side, then their rows interleaved as one stacked product's would be
        const int64_t off[3] = {0, H * D, (H + Hkv) * D};
        for (int i = 0; i < 3; i++) {
            if (ms_product_run(&b->qkv[i], m->h, R, m->att, m->qs, threads)) return -2;
            for (int64_t r = 0; r < R; r++)
                memcpy(m->qkv + r * width + off[i], m->att + r * b->qkv[i].n, (size_t)b->qkv[i].n * sizeof(float));
        }
    }
    for (int64_t r = 0; r < R; r++) {
        float *row = m->qkv + r * width;
        if (b->qkv_bias)
            for (int64_t i = 0; i < width; i++) row[i] += b->qkv_bias[i];
        for (int64_t hd = 0; hd < H + Hkv; hd++) ms_rope(row + hd * D, p->cos + r * D, p->sin + r * D, D, m->tmp);
        if (p->write_slot[r] >= 0)  // keys then values, as the pool keeps them
            memcpy(pool + p->write_slot[r] * 2 * Hkv * D, row + H * D, (size_t)2 * Hkv * D * sizeof(float));
    }
    const struct ms_attend_job aj = {b, p, pool, m->qkv, m->att, m->scores, longest};
    ms_run(ms_attend_part, &aj, (int)(R * H < threads ? R * H : threads));
    if (ms_product_run(&b->o, m->att, R, m->h, m->qs, threads)) return -2;
    for (int64_t i = 0; i < R * dim; i++) p->x[i] += m->h[i];
    for (int64_t r = 0; r < R; r++) ms_rms_norm(p->x + r * dim, b->norm2, dim, b->eps, m->h + r * dim);
    if (ms_product_run(&b->gate, m->h, R, m->g, m->qs, threads)) return -2;
    if (ms_product_run(&b->up, m->h, R, m->u, m->qs, threads)) return -2;
    const struct ms_swiglu_job sj = {m->g, m->u, R * b->ffn};
    ms_run(ms_swiglu_part, &sj, R > 1 ? threads : 1);
    if (ms_product_run(&b->down, m->g, R, m->h, m->qs, threads)) return -2;
    for (int64_t i = 0; i < R * dim; i++) p->x[i] += m->h[i];
    return 0;
}

// The n blocks (all of one shape) over the pass's rows, in order. Returns 0, -1 when memory runs out, -2 when a
// product refuses its type (the residual stream is then half-computed: the caller raises).
int ms_blocks_forward(const struct ms_block *blocks, int64_t n, const struct ms_pass *p) {
    if (n < 1) return 0;
    const struct ms_block *b = &blocks[0];
    const int64_t R = p->rows, H = b->n_heads, Hkv = b->n_kv_heads, D = b->head_dim, width = (H + 2 * Hkv) * D;
    int64_t longest = 1, x_row = 0;
    for (int64_t r = 0; r < R; r++)
        if (p->key_count[r] > longest) longest = p->key_count[r];
    for (int64_t i = 0; i < n; i++) {
        const struct ms_block *l = &blocks[i];
        const struct ms_product *all[] = {&l->qkv[0], &l->qkv[1], &l->qkv[2], &l->o, &l->gate, &l->up, &l->down};
        for (int j = 0; j < 7; j++)
            if ((j == 0 || j > 2 || l->n_qkv == 3) && all[j]->x_row > x_row) x_row = all[j]->x_row;
    }
    const int64_t parts = p->threads > 1 ? p->threads : 1;
    const size_t floats = (size_t)R * (b->dim + width + H * D + 2 * b->ffn) + (size_t)(parts * longest + D);
    float *buf = malloc(floats * sizeof(float));
    void *qs = malloc((size_t)(R * x_row) + 64);
    if (!buf || !qs) {
        free(buf), free(qs);
        return -1;
    }
    struct ms_buffers m = {buf, NULL, NULL, NULL, NULL, NULL, NULL, qs};
    m.qkv = m.h + R * b->dim, m.att = m.qkv + R * width, m.g = m.att + R * H * D, m.u = m.g + R * b->ffn;
    m.scores = m.u + R * b->ffn, m.tmp = m.scores + parts * longest;
    int rc = 0;
    for (int64_t i = 0; i < n && !rc; i++) rc = ms_block_run(&blocks[i], p, p->pool + i * p->pool_stride, &m, longest);
    free(buf), free(qs);
    return rc;
}

#endif

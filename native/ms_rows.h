// minispec's own row-tiled product for Q4_K and Q6_K matrices on CPUs with AVX-512 VNNI: the weights interleaved
// sixteen rows to a tile at load, so that one 512-bit register holds four consecutive values of each of 16 weight
// rows; a dot with an activation row is then one vpmaddubsw against four of that row's int8 values broadcast, and
// the 16 outputs of a tile come out in one register. Each weight block is unpacked once (nibbles and high bits) for
// a group of up to 8 activation rows (4 for Q6_K), while the rows' accumulators stay in registers, so the unpacking
// is shared by the rows of a verify pass. (The instructions are AVX-512 BW's; the build asks for VNNI too, the
// CPUs this was measured on.)
//
// Row independence by construction: every activation row gets the same instructions in the same order whatever
// the group it falls in or the number of rows (its own integer sums, its own float accumulators), and each output
// is computed by one thread, so a row's bits depend neither on the pass nor on the thread count (tests/test_ggml.py).
//
// The maths (ggml's): a Q4_K value is d sc_j q - dmin m_j (q in 0..15, sub-block j of 32 values); a Q6_K value is
// d sc_g (q - 32) (q in 0..63, group g of 16). An activation row is quantized alone, per 256 values, to int8 with
// one float scale dx (round to nearest of x 127 / max|x|), with its int16 sums per 16 and per 32 values. A
// super-block's contribution to an output is then dx (d isc - dmin imin) for Q4_K, isc = sum_j sc_j sum q x and
// imin = sum_j m_j sum x, and dx d (isc - 32 ioff) for Q6_K, isc = sum_g sc_g sum q x and ioff = sum_g sc_g sum x:
// the sums exact in int32, the rest in float.
#ifndef MS_ROWS_H
#define MS_ROWS_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__F16C__)
#define MS_ROWS 1

#include <immintrin.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "ms_pool.h"

// type ids of the interleaved forms and of their activation rows, beyond ggml's (which end below 256)
#define MS_Q4_K_X16 1012
#define MS_Q6_K_X16 1014
#define MS_Q8_X16 1015
#define MS_TILE 16
#define MS_Q4_K_BYTES 144  // a Q4_K block: d, dmin (fp16), 12 bytes of 6-bit scales and mins, 128 of nibbles
#define MS_Q6_K_BYTES 210  // a Q6_K block: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16)
#define MS_ROWS_CHUNK 64  // activation rows whose accumulators one pass over a tile keeps
// Bytes ahead that a pass of several rows prefetches the weights, a line at a time among the products: the
// hardware's prefetcher stops at each 4 KiB page, and a pass computing several rows a block waits at every page
// (a 9-row pass of the 1.5B's products took 1.25x as long without). A decode step streams fast enough without, and
// slower with.
#define MS_PREFETCH 4096
// An activation row of k values (k a multiple of 256, nb = k / 256 blocks): nb float scales, nb x 16 int16 sums of
// 16 values, nb x 8 int16 sums of 32, then the k int8 values.
static inline size_t ms_q8x_row(int64_t k) { return (size_t)(k / 256) * (4 + 32 + 16 + 256); }

static void ms_q8x_quantize(const float *restrict x, int64_t k, uint8_t *restrict out) {
    const int64_t nb = k / 256;
    float *d = (float *)out;
    int16_t *bs16 = (int16_t *)(d + nb), *bs32 = bs16 + 16 * nb;
    int8_t *q = (int8_t *)(bs32 + 8 * nb);
    for (int64_t b = 0; b < nb; b++) {
        const float *xb = x + b * 256;
        int8_t *qb = q + b * 256;
        float amax = 0;
        for (int i = 0; i < 256; i++) amax = fabsf(xb[i]) > amax ? fabsf(xb[i]) : amax;
        const float id = amax > 0 ? 127.0f / amax : 0.0f;
        d[b] = amax / 127.0f;
        for (int i = 0; i < 256; i++) qb[i] = (int8_t)nearbyintf(xb[i] * id);
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++) s += qb[16 * j + i];
            bs16[b * 16 + j] = (int16_t)s;
        }
        for (int j = 0; j < 8; j++) bs32[b * 8 + j] = (int16_t)(bs16[b * 16 + 2 * j] + bs16[b * 16 + 2 * j + 1]);
    }
}

// Q4_K, a tile's super-block (2304 bytes, 16 rows' blocks, in the order the kernel reads them): the 16 rows' d,
// then their dmin (fp16); the 12 scale bytes as 12 planes of 16 (plane b: byte b of each row); then the nibbles as
// 32 registers, register (p, g) holding in dword lane r the file's bytes qs[32 p + 4 g .. + 3] of row r (low
// nibbles: values 64 p + 4 g + t of sub-block 2 p; high nibbles: those of sub-block 2 p + 1). Row r's block b goes
// to the tile's super-block o.
static void ms_place_q4_k(uint8_t *o, const uint8_t *b, int r) {
    for (int p = 0; p < 4; p++)
        for (int g = 0; g < 8; g++) memcpy(o + 256 + (p * 8 + g) * 64 + 4 * r, b + 16 + 32 * p + 4 * g, 4);
    for (int j = 0; j < 12; j++) o[64 + j * 16 + r] = b[4 + j];
    memcpy(o + 2 * r, b, 2);
    memcpy(o + 32 + 2 * r, b + 2, 2);
}

// Q6_K, a tile's super-block (3360 bytes, in the order the kernel reads them): the 16 rows' d (fp16); the 16
// scales as 16 planes of 16; then for each (h, g) three registers: the low nibbles (h, 0, g) and (h, 1, g), holding
// in lane r the bytes ql[64 h + 32 q + 4 g .. + 3] of row r, and the high bit pairs qh[32 h + 4 g .. + 3].
static void ms_place_q6_k(uint8_t *o, const uint8_t *b, int r) {
    for (int h = 0; h < 2; h++)
        for (int g = 0; g < 8; g++) {
            uint8_t *hg = o + 288 + (h * 8 + g) * 192 + 4 * r;
            for (int q = 0; q < 2; q++) memcpy(hg + 64 * q, b + 64 * h + 32 * q + 4 * g, 4);
            memcpy(hg + 128, b + 128 + 32 * h + 4 * g, 4);
        }
    for (int j = 0; j < 16; j++) o[32 + j * 16 + r] = b[192 + j];
    memcpy(o + 2 * r, b + 208, 2);
}

// The (n, k) matrix w of `bytes`-byte blocks into dst, tile after tile, each tile's super-blocks in order, every
// row's block placed by `place`
static void ms_interleave(const uint8_t *w, int64_t n, int64_t k, uint8_t *dst, int64_t bytes,
                          void (*place)(uint8_t *o, const uint8_t *b, int r)) {
    const int64_t nb = k / 256;
    for (int64_t t = 0; t < n / MS_TILE; t++)
        for (int64_t s = 0; s < nb; s++)
            for (int r = 0; r < MS_TILE; r++)
                place(dst + (t * nb + s) * MS_TILE * bytes, w + ((t * MS_TILE + r) * nb + s) * bytes, r);
}

static inline __m512i ms_bcast4(const void *p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// the activation row's parts (see ms_q8x_row)
struct ms_xrow {
    const float *d;
    const int16_t *bs16, *bs32;
    const int8_t *q;
};

static inline struct ms_xrow ms_xrow_at(const uint8_t *row, int64_t nb) {
    struct ms_xrow x;
    x.d = (const float *)row, x.bs16 = (const int16_t *)(x.d + nb), x.bs32 = x.bs16 + 16 * nb;
    x.q = (const int8_t *)(x.bs32 + 8 * nb);
    return x;
}

// two planes of 16 bytes (one a lane) as 16 dword lanes of int16 pairs (b, c): (b, b) given the same plane twice
static inline __m512i ms_pairs_u8(__m128i b, __m128i c) {
    return _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(b, c), _mm_unpacklo_epi8(b, c)));
}

static inline __m512i ms_pairs_i8(__m128i b, __m128i c) {
    return _mm512_cvtepi8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(b, c), _mm_unpacklo_epi8(b, c)));
}

// The products are vpmaddubsw (a weight's unsigned value times an activation's int8, pairs summed in int16) and
// vpmaddwd (int16 pairs times the scales, into int32), all exact integer sums: on the AVX-512 CPUs measured here
// this pair runs about 1.7x as many multiply-adds a cycle as vpdpbusd. Int16 sums stay below 2^15: a Q4_K pair is at
// most 2 x 15 x 127 = 3810 and eight are summed (a sub-block), a Q6_K pair at most 2 x 63 x 127 = 16002 and two are.

// G activation rows against one Q4_K tile super-block (SC: (sc_j, sc_j) a lane; MP: (m_2i, m_2i+1) a lane; d,
// dmin per lane), into acc (G x 16 floats): acc += dx (d isc - dmin imin), isc and imin exact int32
static inline __attribute__((always_inline)) void ms_q4k_rows(const int G, const uint8_t *blk, const __m512i *SC,
                                                               const __m512i *MP, __m512 d, __m512 dmin,
                                                               const struct ms_xrow *x, int64_t sb, float *acc,
                                                               int64_t pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i isc[8];
    for (int r = 0; r < G; r++) isc[r] = _mm512_setzero_si512();
    // the loops over the weights kept (nearly) rolled: unrolled, each row count's code is kilobytes long, and a 9-row
    // pass (two counts) ran 1.05x slower
#pragma GCC unroll 1
    for (int p = 0; p < 4; p++) {
        __m512i lo[8], hi[8];
        for (int r = 0; r < G; r++) lo[r] = hi[r] = _mm512_setzero_si512();
#pragma GCC unroll 2
        for (int g = 0; g < 8; g++) {
            const __m512i z = _mm512_loadu_si512((const void *)(blk + 256 + (p * 8 + g) * 64));
            if (pf) _mm_prefetch((const char *)blk + pf + (p * 8 + g) * 72, _MM_HINT_T0);
            const __m512i wl = _mm512_and_si512(z, m4), wh = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
            for (int r = 0; r < G; r++) {
                const int8_t *q = x[r].q + sb * 256 + 64 * p + 4 * g;
                const __m512i a = _mm512_maddubs_epi16(wl, ms_bcast4(q)), b = _mm512_maddubs_epi16(wh, ms_bcast4(q + 32));
                lo[r] = _mm512_add_epi16(lo[r], a);
                hi[r] = _mm512_add_epi16(hi[r], b);
            }
        }
        for (int r = 0; r < G; r++) {
            isc[r] = _mm512_add_epi32(isc[r], _mm512_madd_epi16(lo[r], SC[2 * p]));
            isc[r] = _mm512_add_epi32(isc[r], _mm512_madd_epi16(hi[r], SC[2 * p + 1]));
        }
    }
    for (int r = 0; r < G; r++) {
        const int16_t *bs = x[r].bs32 + sb * 8;
        __m512i im = _mm512_madd_epi16(MP[0], ms_bcast4(bs));
        for (int i = 1; i < 4; i++) im = _mm512_add_epi32(im, _mm512_madd_epi16(MP[i], ms_bcast4(bs + 2 * i)));
        const __m512 v = _mm512_fmsub_ps(d, _mm512_cvtepi32_ps(isc[r]), _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(im)));
        _mm512_storeu_ps(acc + 16 * r, _mm512_fmadd_ps(v, _mm512_set1_ps(x[r].d[sb]), _mm512_loadu_ps(acc + 16 * r)));
    }
}

// G activation rows against one Q6_K tile super-block (SC: (sc_g, sc_g) a lane; SP: (sc_2i, sc_2i+1) a lane; d per
// lane), into acc: acc += dx d (isc - 32 ioff), isc = sum_g sc_g sum q x and ioff = sum_g sc_g sum x exact int32
static inline __attribute__((always_inline)) void ms_q6k_rows(const int G, const uint8_t *blk, const __m512i *SC,
                                                               const __m512i *SP, __m512 d, const struct ms_xrow *x,
                                                               int64_t sb, float *acc, int64_t pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m30 = _mm512_set1_epi8(0x30);
    __m512i isc[4];
    for (int r = 0; r < G; r++) isc[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int h = 0; h < 2; h++)
#pragma GCC unroll 1
        for (int g0 = 0; g0 < 8; g0 += 2) {  // two registers' values a group's int16 sums take
            __m512i t[4][4];
            for (int r = 0; r < G; r++)
                for (int s = 0; s < 4; s++) t[r][s] = _mm512_setzero_si512();
            for (int g = g0; g < g0 + 2; g++) {  // the weights read in the order they lie: the memory streams
                const uint8_t *hg = blk + 288 + (h * 8 + g) * 192;
                if (pf)
                    for (int i = 0; i < 192; i += 64) _mm_prefetch((const char *)hg + pf + i, _MM_HINT_T0);
                const __m512i l0 = _mm512_loadu_si512((const void *)hg);
                const __m512i l1 = _mm512_loadu_si512((const void *)(hg + 64));
                const __m512i qh = _mm512_loadu_si512((const void *)(hg + 128));
                __m512i w[4];
                w[0] = _mm512_or_si512(_mm512_and_si512(l0, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 4), m30));
                w[1] = _mm512_or_si512(_mm512_and_si512(l1, m4), _mm512_and_si512(_mm512_slli_epi16(qh, 2), m30));
                w[2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l0, 4), m4), _mm512_and_si512(qh, m30));
                w[3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l1, 4), m4),
                                       _mm512_and_si512(_mm512_srli_epi16(qh, 2), m30));
                for (int r = 0; r < G; r++) {
                    const int8_t *q = x[r].q + sb * 256 + 128 * h + 4 * g;
                    for (int s = 0; s < 4; s++) {
                        const __m512i a = _mm512_maddubs_epi16(w[s], ms_bcast4(q + 32 * s));
                        t[r][s] = _mm512_add_epi16(t[r][s], a);
                    }
                }
            }
            for (int r = 0; r < G; r++)
                for (int s = 0; s < 4; s++)
                    isc[r] = _mm512_add_epi32(isc[r], _mm512_madd_epi16(t[r][s], SC[8 * h + 2 * s + g0 / 4]));
        }
    for (int r = 0; r < G; r++) {
        const int16_t *bs = x[r].bs16 + sb * 16;
        __m512i off = _mm512_madd_epi16(SP[0], ms_bcast4(bs));
        for (int i = 1; i < 8; i++) off = _mm512_add_epi32(off, _mm512_madd_epi16(SP[i], ms_bcast4(bs + 2 * i)));
        const __m512 v = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(isc[r], _mm512_slli_epi32(off, 5))));
        _mm512_storeu_ps(acc + 16 * r, _mm512_fmadd_ps(v, _mm512_set1_ps(x[r].d[sb]), _mm512_loadu_ps(acc + 16 * r)));
    }
}

// group sizes: the rows whose accumulators fit the 32 registers beside the weights'
#define MS_Q4K_GROUP 8
#define MS_Q6K_GROUP 4

// The rows in groups of at most `most`, as even as possible (9 rows: 5 + 4), each through the case of its size
// (r0 its first row): every row's instructions are the same in any group.
#define MS_GROUPS(most, cases)                                         \
    for (int64_t gi = 0, groups = (rows + (most) - 1) / (most), r0 = 0; gi < groups; gi++) { \
        const int64_t G = (rows - r0) / (groups - gi);                 \
        switch (G) { cases }                                           \
        r0 += G;                                                       \
    }

static void ms_q4k_tile(const uint8_t *w, int64_t nb, const struct ms_xrow *x, int64_t rows, float *acc, int64_t pf) {
    for (int64_t sb = 0; sb < nb; sb++) {
        const uint8_t *blk = w + sb * MS_TILE * MS_Q4_K_BYTES, *P = blk + 64;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        const __m512 dm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(blk + 32)));
        __m128i sc[8], m[8];
        const __m128i m63 = _mm_set1_epi8(63), m15 = _mm_set1_epi8(15), m3 = _mm_set1_epi8(3);
        for (int j = 0; j < 8; j++) {  // ggml's get_scale_min_k4, 16 rows at once
            if (j < 4) {
                sc[j] = _mm_and_si128(_mm_loadu_si128((const __m128i *)(P + 16 * j)), m63);
                m[j] = _mm_and_si128(_mm_loadu_si128((const __m128i *)(P + 16 * (j + 4))), m63);
            } else {
                const __m128i b8 = _mm_loadu_si128((const __m128i *)(P + 16 * (j + 4)));
                const __m128i lo = _mm_loadu_si128((const __m128i *)(P + 16 * (j - 4)));
                const __m128i mid = _mm_loadu_si128((const __m128i *)(P + 16 * j));
                // (b >> 6) << 4 on bytes: bits 6-7 to 4-5
                sc[j] = _mm_or_si128(_mm_and_si128(b8, m15), _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(lo, 6), m3), 4));
                m[j] = _mm_or_si128(_mm_and_si128(_mm_srli_epi16(b8, 4), m15),
                                    _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(mid, 6), m3), 4));
            }
        }
        __m512i SC[8], MP[4];
        for (int j = 0; j < 8; j++) SC[j] = ms_pairs_u8(sc[j], sc[j]);
        for (int i = 0; i < 4; i++) MP[i] = ms_pairs_u8(m[2 * i], m[2 * i + 1]);
#define MS_CASE(n) \
    case n: ms_q4k_rows(n, blk, SC, MP, d, dm, x + r0, sb, acc + 16 * r0, pf); break;
        MS_GROUPS(MS_Q4K_GROUP, MS_CASE(1) MS_CASE(2) MS_CASE(3) MS_CASE(4) MS_CASE(5) MS_CASE(6) MS_CASE(7) MS_CASE(8))
#undef MS_CASE
    }
}

static void ms_q6k_tile(const uint8_t *w, int64_t nb, const struct ms_xrow *x, int64_t rows, float *acc, int64_t pf) {
    for (int64_t sb = 0; sb < nb; sb++) {
        const uint8_t *blk = w + sb * MS_TILE * MS_Q6_K_BYTES;
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)blk));
        __m128i sc[16];
        for (int j = 0; j < 16; j++) sc[j] = _mm_loadu_si128((const __m128i *)(blk + 32 + 16 * j));
        __m512i SC[16], SP[8];
        for (int j = 0; j < 16; j++) SC[j] = ms_pairs_i8(sc[j], sc[j]);
        for (int i = 0; i < 8; i++) SP[i] = ms_pairs_i8(sc[2 * i], sc[2 * i + 1]);
#define MS_CASE(n) \
    case n: ms_q6k_rows(n, blk, SC, SP, d, x + r0, sb, acc + 16 * r0, pf); break;
        MS_GROUPS(MS_Q6K_GROUP, MS_CASE(1) MS_CASE(2) MS_CASE(3) MS_CASE(4))
#undef MS_CASE
    }
}

struct ms_rows_job {
    int type;
    const uint8_t *w;
    int64_t n, k, rows;
    const uint8_t *xq;
    size_t x_row;
    float *y;
};

// this part's tiles, every row of the job, MS_ROWS_CHUNK rows at a time
static void ms_rows_part(const void *arg, int64_t part, int64_t parts) {
    const struct ms_rows_job *j = (const struct ms_rows_job *)arg;
    const int64_t nb = j->k / 256, tiles = j->n / MS_TILE;
    const size_t tile_bytes = (size_t)nb * MS_TILE * (j->type == MS_Q4_K_X16 ? MS_Q4_K_BYTES : MS_Q6_K_BYTES);
    struct ms_xrow x[MS_ROWS_CHUNK];
    float acc[MS_ROWS_CHUNK * MS_TILE] __attribute__((aligned(64)));
    for (int64_t r0 = 0; r0 < j->rows; r0 += MS_ROWS_CHUNK) {
        const int64_t rows = j->rows - r0 < MS_ROWS_CHUNK ? j->rows - r0 : MS_ROWS_CHUNK;
        for (int64_t r = 0; r < rows; r++) x[r] = ms_xrow_at(j->xq + (size_t)(r0 + r) * j->x_row, nb);
        const int64_t pf = rows > 1 ? MS_PREFETCH : 0;
        for (int64_t t = tiles * part / parts; t < tiles * (part + 1) / parts; t++) {
            memset(acc, 0, (size_t)rows * MS_TILE * sizeof(float));
            const uint8_t *w = j->w + (size_t)t * tile_bytes;
            if (j->type == MS_Q4_K_X16) ms_q4k_tile(w, nb, x, rows, acc, pf);
            else ms_q6k_tile(w, nb, x, rows, acc, pf);
            for (int64_t r = 0; r < rows; r++)
                memcpy(j->y + (r0 + r) * j->n + t * MS_TILE, acc + r * MS_TILE, MS_TILE * sizeof(float));
        }
    }
}

// the interleaved form's type for a ggml type and shape, or -1 where it has none
static int ms_rows_form(int type, int64_t n, int64_t k) {
    if (n % MS_TILE || k % 256) return -1;
    return type == 12 ? MS_Q4_K_X16 : type == 14 ? MS_Q6_K_X16 : -1;  // GGML_TYPE_Q4_K, GGML_TYPE_Q6_K
}

static int ms_rows_repack(int type, const void *w, int64_t n, int64_t k, void *dst) {
    const int form = ms_rows_form(type, n, k);
    if (form == MS_Q4_K_X16) ms_interleave(w, n, k, dst, MS_Q4_K_BYTES, ms_place_q4_k);
    else if (form == MS_Q6_K_X16) ms_interleave(w, n, k, dst, MS_Q6_K_BYTES, ms_place_q6_k);
    return form;
}

static void ms_rows_matmul(int type, const void *w, int64_t n, int64_t k, const float *x, int64_t rows, float *y,
                           void *scratch, int threads) {
    const size_t x_row = ms_q8x_row(k);
    for (int64_t r = 0; r < rows; r++) ms_q8x_quantize(x + r * k, k, (uint8_t *)scratch + r * x_row);
    const struct ms_rows_job j = {type, (const uint8_t *)w, n, k, rows, (const uint8_t *)scratch, x_row, y};
    const int64_t tiles = n / MS_TILE;
    ms_run(ms_rows_part, &j, (int)(tiles < threads ? tiles : threads));
}

#endif
#endif

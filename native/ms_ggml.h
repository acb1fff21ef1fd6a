// What both shims export through ggml's own API, which llama.cpp's ggml and ik_llama.cpp's fork keep alike:
// included by each after its own ggml.h.
#ifndef MS_GGML_H
#define MS_GGML_H

// The (n, k) float matrix x as n rows of `type` blocks in out (n * ms_row_size(type, k) bytes), by ggml's own
// quantizer (ggml_quantize_chunk). Returns 0, or -1 for a type this does not take (only the plain block types
// without an importance matrix: Q8_0, Q4_0, Q5_0, ...).
int ms_quantize(int type, const float *x, int64_t n, int64_t k, void *out) {
    if (type != GGML_TYPE_Q8_0 && type != GGML_TYPE_Q4_0 && type != GGML_TYPE_Q5_0) return -1;
    if (k % ggml_blck_size((enum ggml_type)type)) return -1;
    ggml_quantize_chunk((enum ggml_type)type, x, out, 0, n, k, NULL);
    return 0;
}

#endif

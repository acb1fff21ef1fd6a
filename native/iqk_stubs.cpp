// Stand-ins for the parts of ik_llama.cpp's ggml that minispec's product never reaches, so that its build compiles
// only the files the product needs (tools/build_ggml.py: about a third of ik's ggml, the rest of its compile time
// going to kernels for other weight types and to flash attention). iqk_mul_mat's dispatch asks these for their
// types' kernels: each says it has none, so a type they served is refused (ms_vec_dot_type says so), never
// multiplied wrongly. ggml's graph code (never run here) links against the flash-attention entry points.
#include <array>
#include <cstddef>

#include "iqk_common.h"
#include "iqk_gemm_1bit.h"
#include "iqk_gemm_floats.h"
#include "iqk_gemm_iqk_quants.h"
#include "iqk_gemm_iquants.h"
#include "iqk_gemm_ktquants.h"
#include "iqk_mul_mat.h"

bool iqk_set_kernels_float(int, int, int, std::array<mul_mat_t, IQK_MAX_NY> &) { return false; }
bool iqk_set_kernels_1bit(int, int, int, std::array<mul_mat_t, IQK_MAX_NY> &, mul_mat_t &) { return false; }
bool iqk_set_kernels_iqk_quants(int, int, int, std::array<mul_mat_t, IQK_MAX_NY> &, mul_mat_t &) { return false; }
bool iqk_set_kernels_iquants(int, int, int, std::array<mul_mat_t, IQK_MAX_NY> &, mul_mat_t &) { return false; }
bool iqk_set_kernels_ktquants(int, int, int, std::array<mul_mat_t, IQK_MAX_NY> &, mul_mat_t &) { return false; }
bool iqk_convert_1bit_q80_r8(int, int, const void *, size_t, void *, int) { return false; }
bool iqk_convert_iqk_quants_q80_r8(int, int, const void *, size_t, void *, int) { return false; }
bool iqk_convert_iquants_q80_r8(int, int, const void *, size_t, void *, int) { return false; }
bool iqk_dequantize_ktquants(int, int, const void *, size_t, void *, size_t, int) { return false; }

// the flash-attention kernels, one a head size (ggml/src/iqk/fa/iqk_fa_templates.h's IQK_FA_CASE)
#define MS_NO_FA(name)                                                                                             \
    bool name(int, int, int, int, int, int, int, int, int, const float *, const void *, const void *, const void *, \
              float, float, float *, const float *, float *, float *) {                                           \
        return false;                                                                                              \
    }
MS_NO_FA(iqk_fa_576_512)
MS_NO_FA(iqk_fa_512_512)
MS_NO_FA(iqk_fa_320_256)
MS_NO_FA(iqk_fa_256_256)
MS_NO_FA(iqk_fa_192_192)
MS_NO_FA(iqk_fa_192_128)
MS_NO_FA(iqk_fa_128_128)
MS_NO_FA(iqk_fa_96_96)
MS_NO_FA(iqk_fa_64_64)

extern "C" size_t iqk_fa_work_buffer_size(const struct ggml_tensor *, int) { return 0; }

extern "C" bool iqk_flash_attn_noalibi(int, int, float, int, int, long, long, int, int, long, long, int, int, long,
                                       long, int, int, long, int, int, int, int, int, int, int, int, int, int,
                                       const void *, const void *, const void *, const void *, const void *, float,
                                       float, float *, void *, barrier_t, void *, int, int, int) {
    return false;
}

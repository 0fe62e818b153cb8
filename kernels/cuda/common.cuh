// weft-kernels: helpers shared by every CUDA kernel source.
//
// Prepended to each kernel file before NVRTC compiles it (NVRTC resolves no
// includes here: the sources include nothing, so they compile with the bare
// libnvrtc that the `nvidia-cuda-nvrtc` wheel provides, no toolkit headers).
//
// Shape legend (llm.c's): B batch, T sequence, C channels, OC output
// channels, NH heads, HS head size, V vocabulary (Vp padded), N = B*T rows.

typedef unsigned short bf16_t;  // bf16 as raw bits
typedef unsigned short f16_t;   // IEEE half as raw bits
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define WEFT_INF __int_as_float(0x7f800000)

// bf16 -> f32: exact.
__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

// f32 -> bf16, round to nearest even; a NaN stays a quiet NaN with its
// sign and top payload bits (the `half` crate's conversion, bit for bit).
__device__ __forceinline__ bf16_t f32_to_bf16(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// f32 -> IEEE half, round to nearest even, subnormals kept, overflow to
// infinity (the hardware conversion).
__device__ __forceinline__ f16_t f32_to_f16(float x) {
    f16_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}

// IEEE half -> f32: exact.
__device__ __forceinline__ float f16_to_f32(f16_t h) {
    float x;
    asm("cvt.f32.f16 %0, %1;" : "=f"(x) : "h"(h));
    return x;
}

// f32 rounded to the nearest bf16 and back (the CPU's `Precision::Bf16`
// operand rounding).
__device__ __forceinline__ float round_bf16(float x) {
    return bf16_to_f32(f32_to_bf16(x));
}

// f32 rounded to the nearest IEEE half and back (`Precision::F16`).
__device__ __forceinline__ float round_f16(float x) {
    return f16_to_f32(f32_to_f16(x));
}

// The CPU kernels' `exp_f32` (kernels/src/real.rs), operation for
// operation: with the module compiled `--fmad=false` its results are the
// CPU's bit for bit. Cody-Waite reduction by ln 2, a degree-6 polynomial.
__device__ __forceinline__ float weft_exp(float x) {
    const float LOG2E = 1.44269504088896340736f;
    const float LN2_HI = 0.6933594f;
    const float LN2_LO = -2.1219444e-4f;
    const float MAGIC = 12582912.0f;
    // Rust's f32::clamp: NaN passes through.
    if (x < -87.0f) x = -87.0f;
    if (x > 88.0f) x = 88.0f;
    float z = x * LOG2E + MAGIC;
    float n = z - MAGIC;
    int ni = __float_as_int(z) - __float_as_int(MAGIC);
    float r = x - n * LN2_HI - n * LN2_LO;
    float p = 1.9875691e-4f;
    p = p * r + 1.3981999e-3f;
    p = p * r + 8.333452e-3f;
    p = p * r + 4.1665796e-2f;
    p = p * r + 1.6666665e-1f;
    p = p * r + 5.0000001e-1f;
    float y = p * r * r + r + 1.0f;
    float scale = __int_as_float((ni + 127) << 23);
    return y * scale;
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32),
// in a fixed order (so deterministic); every thread gets the result.
// `shared` holds at least 32 floats; the call synchronises the block.
__device__ __forceinline__ float block_sum(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (lane < nw) ? shared[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* shared) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = (lane < nw) ? shared[lane] : -WEFT_INF;
    return warp_max(v);
}

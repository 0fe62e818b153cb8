// Element-wise kernels: GELU (tanh approximation, in its sigmoid form),
// the residual add, accumulation, and operand rounding to bf16 / fp16.
//
// Compiled with --fmad=false: every operation rounds as the CPU kernels'
// (kernels/src/pointwise.rs), in the same order, so GELU, its backward and
// the adds are the CPU's bit for bit. Grid-stride loops; any grid works.

// out = x / (1 + exp(-2u)), u = s * (x + k*x^3): 0.5*x*(1 + tanh u).
// s = sqrt(2/pi) and k = 0.044715 come from the host rounded as the CPU
// rounds them (f64 -> f32).
extern "C" __global__ void gelu_forward(float* out, const float* inp, u64 n, float s, float k) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float x = inp[i];
        float u = s * (x + k * x * x * x);
        out[i] = x / (1.0f + weft_exp(-2.0f * u));
    }
}

// dinp += gelu'(x) * dout, with sigma = sigmoid(2u):
// gelu'(x) = sigma + 2 x sigma (1 - sigma) s (1 + k3 x^2), k3 = 3k.
extern "C" __global__ void gelu_backward(float* dinp, const float* inp, const float* dout, u64 n,
                                         float s, float k, float k3) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float x = inp[i];
        float u = s * (x + k * x * x * x);
        float sig = 1.0f / (1.0f + weft_exp(-2.0f * u));
        float grad = sig + 2.0f * x * sig * (1.0f - sig) * s * (1.0f + k3 * x * x);
        dinp[i] += grad * dout[i];
    }
}

// out = a + b
extern "C" __global__ void residual_forward(float* out, const float* a, const float* b, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = a[i] + b[i];
    }
}

// dst += src
extern "C" __global__ void accumulate(float* dst, const float* src, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] += src[i];
    }
}

// buf *= a
extern "C" __global__ void scale(float* buf, u64 n, float a) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        buf[i] *= a;
    }
}

// dst = src rounded to bf16 (ties to even).
extern "C" __global__ void to_bf16(bf16_t* dst, const float* src, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = f32_to_bf16(src[i]);
    }
}

// dst = src rounded to IEEE half (ties to even).
extern "C" __global__ void to_f16(f16_t* dst, const float* src, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = f32_to_f16(src[i]);
    }
}

// dst = src widened from bf16 (exact).
extern "C" __global__ void from_bf16(float* dst, const bf16_t* src, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        dst[i] = bf16_to_f32(src[i]);
    }
}

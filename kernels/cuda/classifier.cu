// Fused softmax + cross-entropy over the vocabulary (the language-model
// head's loss), llm.c's fused_classifier split in two as the CPU's
// fused_classifier_forward / fused_classifier_backward
// (kernels/src/softmax.rs): the forward writes each row's loss and saves
// its maximum and sum of exponentials, the backward overwrites the logits
// with their gradient in one pass from those statistics.
//
// Compiled with --fmad=false and using the CPU's exp (weft_exp): given the
// same statistics the backward is the CPU's bit for bit; the forward's
// maximum is exact, its sum is a block reduction (a different order from
// the CPU's 16 lanes), so sums and losses agree to f32 rounding.

#define CLS_THREADS 512

// One block of CLS_THREADS threads per row: logits (N, V), only the first
// v_real entries of a row take part. losses (N), stats (N, 2) = (max, sum).
extern "C" __global__ void fused_classifier_forward(const float* logits, float* losses, float* stats,
                                                    const u32* targets, u32 v, u32 v_real) {
    __shared__ float red[32];
    u64 row = blockIdx.x;
    const float* x = logits + row * v;
    float m = -WEFT_INF;
    for (u32 i = threadIdx.x; i < v_real; i += blockDim.x) {
        float xi = x[i];
        m = xi > m ? xi : m;
    }
    m = block_max(m, red);
    float s = 0.0f;
    for (u32 i = threadIdx.x; i < v_real; i += blockDim.x) s += weft_exp(x[i] - m);
    s = block_sum(s, red);
    if (threadIdx.x == 0) {
        float xt = x[targets[row]];
        losses[row] = logf(s) - (xt - m);
        stats[2 * row] = m;
        stats[2 * row + 1] = s;
    }
}

// logits (N, V) <- (softmax - onehot(target)) * dloss, from stats; the
// padding columns [v_real, v) get 0.
extern "C" __global__ void fused_classifier_backward(float* logits, const float* stats,
                                                     const u32* targets, float dloss, u32 v,
                                                     u32 v_real) {
    u64 row = blockIdx.x;
    float* x = logits + row * v;
    float m = stats[2 * row];
    float inv = 1.0f / stats[2 * row + 1];
    u32 tgt = targets[row];
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) {
        float d = 0.0f;
        if (i < v_real) {
            float p = weft_exp(x[i] - m) * inv;
            d = p * dloss;
            if (i == tgt) d -= dloss;
        }
        x[i] = d;
    }
}

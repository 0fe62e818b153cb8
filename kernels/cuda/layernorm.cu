// Layer normalisation over C channels, forward and backward (llm.c's
// kernels/layernorm.cuh shape: one warp per row, the row's statistics
// reduced with shuffles).
//
// Differs from the CPU kernels (kernels/src/layernorm.rs) only in the
// order of the row sums (32 lanes then a butterfly, against 16 lanes then
// a tree), so results agree to a few f32 roundings. The parameter
// gradients are deterministic: fixed chunks of rows give partial sums
// (layernorm_backward_weight_partial), then one thread per channel adds
// the chunks' partials in chunk order (layernorm_backward_weight_finish).

// out (N, C), mean (N), rstd (N) from inp (N, C), weight (C), bias (C).
// Block: any multiple of 32 threads; one warp per row.
extern "C" __global__ void layernorm_forward(float* out, float* mean, float* rstd, const float* inp,
                                             const float* weight, const float* bias, u32 n, u32 c,
                                             float eps) {
    u32 warps = blockDim.x >> 5;
    u32 row = blockIdx.x * warps + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (row >= n) return;
    const float* x = inp + (u64)row * c;
    float s = 0.0f;
    for (u32 i = lane; i < c; i += 32) s += x[i];
    float m = warp_sum(s) / (float)c;
    float v = 0.0f;
    for (u32 i = lane; i < c; i += 32) {
        float d = x[i] - m;
        v += d * d;
    }
    float var = warp_sum(v) / (float)c;
    float r = 1.0f / sqrtf(var + eps);
    float* o = out + (u64)row * c;
    for (u32 i = lane; i < c; i += 32) {
        o[i] = (x[i] - m) * r * weight[i] + bias[i];
    }
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = r;
    }
}

// dinp (N, C) += the input gradient, one warp per row:
// dinp += (w*g - mean(w*g) - norm * mean(w*g*norm)) * rstd.
extern "C" __global__ void layernorm_backward_input(float* dinp, const float* dout, const float* inp,
                                                    const float* weight, const float* mean,
                                                    const float* rstd, u32 n, u32 c) {
    u32 warps = blockDim.x >> 5;
    u32 row = blockIdx.x * warps + (threadIdx.x >> 5);
    u32 lane = threadIdx.x & 31;
    if (row >= n) return;
    const float* g = dout + (u64)row * c;
    const float* x = inp + (u64)row * c;
    float m = mean[row], r = rstd[row];
    float a = 0.0f, b = 0.0f;
    for (u32 i = lane; i < c; i += 32) {
        float dn = weight[i] * g[i];
        a += dn;
        b += dn * (x[i] - m) * r;
    }
    a = warp_sum(a) / (float)c;
    b = warp_sum(b) / (float)c;
    float* di = dinp + (u64)row * c;
    for (u32 i = lane; i < c; i += 32) {
        float norm = (x[i] - m) * r;
        di[i] += (weight[i] * g[i] - a - norm * b) * r;
    }
}

// Partial parameter gradients: block (chunk = blockIdx.y, channels
// blockIdx.x * blockDim.x + threadIdx.x) sums rows
// [chunk * rows_per_chunk, ...) in row order into
// partial[chunk, 0, ch] (dweight) and partial[chunk, 1, ch] (dbias).
extern "C" __global__ void layernorm_backward_weight_partial(float* partial, const float* dout,
                                                             const float* inp, const float* mean,
                                                             const float* rstd, u32 n, u32 c,
                                                             u32 rows_per_chunk) {
    u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    u32 chunk = blockIdx.y;
    if (ch >= c) return;
    u32 lo = chunk * rows_per_chunk;
    u32 hi = min(n, lo + rows_per_chunk);
    float dw = 0.0f, db = 0.0f;
    for (u32 row = lo; row < hi; row++) {
        float g = dout[(u64)row * c + ch];
        dw += (inp[(u64)row * c + ch] - mean[row]) * rstd[row] * g;
        db += g;
    }
    partial[((u64)chunk * 2) * c + ch] = dw;
    partial[((u64)chunk * 2 + 1) * c + ch] = db;
}

// dweight[ch] += sum over chunks of partial[chunk, 0, ch], in chunk order;
// dbias likewise.
extern "C" __global__ void layernorm_backward_weight_finish(float* dweight, float* dbias,
                                                            const float* partial, u32 chunks, u32 c) {
    u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    float dw = 0.0f, db = 0.0f;
    for (u32 k = 0; k < chunks; k++) {
        dw += partial[((u64)k * 2) * c + ch];
        db += partial[((u64)k * 2 + 1) * c + ch];
    }
    dweight[ch] += dw;
    dbias[ch] += db;
}

// Column sums for a bias gradient: dbias (OC) += sum over N rows of
// dout (N, OC), by the same two deterministic stages.
extern "C" __global__ void column_sum_partial(float* partial, const float* dout, u32 n, u32 oc,
                                              u32 rows_per_chunk) {
    u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    u32 chunk = blockIdx.y;
    if (ch >= oc) return;
    u32 lo = chunk * rows_per_chunk;
    u32 hi = min(n, lo + rows_per_chunk);
    float s = 0.0f;
    for (u32 row = lo; row < hi; row++) s += dout[(u64)row * oc + ch];
    partial[(u64)chunk * oc + ch] = s;
}

extern "C" __global__ void column_sum_finish(float* dbias, const float* partial, u32 chunks, u32 oc) {
    u32 ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= oc) return;
    float s = 0.0f;
    for (u32 k = 0; k < chunks; k++) s += partial[(u64)k * oc + ch];
    dbias[ch] += s;
}

// out (N, OC) += bias (OC) broadcast over rows.
extern "C" __global__ void add_bias(float* out, const float* bias, u64 n, u32 oc) {
    u64 total = n * oc;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        out[i] += bias[i % oc];
    }
}

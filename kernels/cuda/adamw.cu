// The fused AdamW update (torch.optim.AdamW's form) on f32 master weights
// and f32 moments, optionally writing the updated weights rounded to bf16
// (the copy the bf16 products read).
//
// Compiled with --fmad=false and fed the constants the CPU derives
// (kernels/src/adamw.rs), in the same order of operations: the updated
// parameters and moments are the CPU's bit for bit.
//
// p <- p*keep - step_size * m / (sqrt(v)/bc2_sqrt + eps), with
// m <- b1 m + (1-b1) g, v <- b2 v + (1-b2) g^2.
extern "C" __global__ void adamw(float* params, bf16_t* params_bf16, const float* grads, float* m,
                                 float* v, u64 n, float keep, float b1, float b2, float step_size,
                                 float bc2_sqrt, float eps) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float gi = grads[i];
        float mi = b1 * m[i] + (1.0f - b1) * gi;
        float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        float denom = sqrtf(vi) / bc2_sqrt + eps;
        float p = params[i] * keep - step_size * mi / denom;
        params[i] = p;
        if (params_bf16) params_bf16[i] = f32_to_bf16(p);
    }
}

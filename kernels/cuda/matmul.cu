// The batch-invariant matrix product: C (M, N) = [C +] A (M, K) . B (K, N)
// [+ bias (N)], on the CUDA cores, every output element one sum over k in
// increasing order (an f32 fused multiply-add chain from zero), whatever
// M, N, the tile or the grid: a row's bits depend on its own input row and
// the weights alone. So a sequence's result does not depend on the batch it
// is computed in, nor a decoded position on how many came before it — the
// GPU side of Mode::BatchInvariant. (cuBLAS, used in Mode::Throughput,
// promises no such thing: it picks kernels and split-K by shape.)
//
// Operands are read through strides, so every layout of the model's
// linear layers (weights [in, out] or [out, in], transposed operands of
// the backward) is one kernel: A[m, k] = a[m * sam + k * sak],
// B[k, n] = b[k * sbk + n * sbn], C[m, n] = c[m * ldc + n]. `round`
// rounds every operand as it is loaded: 0 none (f32), 1 bf16, 2 fp16 —
// Precision's products, f32 accumulation.
//
// 64 x 64 output tiles, 256 threads each computing a 4 x 4 block, k in
// slices of 16 through shared memory.

#define GT 64
#define GK 16

__device__ __forceinline__ float load_round(const float* p, u64 at, int round) {
    float x = p[at];
    if (round == 1) return round_bf16(x);
    if (round == 2) return round_f16(x);
    return x;
}

extern "C" __global__ void __launch_bounds__(256)
matmul_invariant(float* c, const float* a, const float* b, const float* bias, u32 m, u32 n, u32 k,
                 u64 sam, u64 sak, u64 sbk, u64 sbn, u64 ldc, int accumulate, int round) {
    __shared__ float as[GK][GT + 4];
    __shared__ float bs[GK][GT + 4];
    u32 m0 = blockIdx.y * GT, n0 = blockIdx.x * GT;
    u32 tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    float acc[4][4];
#pragma unroll
    for (int r = 0; r < 4; r++)
#pragma unroll
        for (int s = 0; s < 4; s++) acc[r][s] = 0.0f;
    for (u32 k0 = 0; k0 < k; k0 += GK) {
        for (u32 x = threadIdx.x; x < GK * GT; x += 256) {
            u32 kk = x % GK, mm = x / GK;
            u32 gm = m0 + mm, gk = k0 + kk;
            as[kk][mm] = (gm < m && gk < k) ? load_round(a, (u64)gm * sam + (u64)gk * sak, round) : 0.0f;
            u32 nn = x % GT, kb = x / GT;
            u32 gn = n0 + nn, gkb = k0 + kb;
            bs[kb][nn] = (gn < n && gkb < k) ? load_round(b, (u64)gkb * sbk + (u64)gn * sbn, round) : 0.0f;
        }
        __syncthreads();
        // Past k the operands are zeros: the chain is the same as stopping
        // at k only if no term is added there, so the loop stops at k.
        u32 kend = min((u32)GK, k - k0);
        for (u32 kk = 0; kk < kend; kk++) {
            float av[4], bv[4];
#pragma unroll
            for (int r = 0; r < 4; r++) av[r] = as[kk][ty * 4 + r];
#pragma unroll
            for (int s = 0; s < 4; s++) bv[s] = bs[kk][tx * 4 + s];
#pragma unroll
            for (int r = 0; r < 4; r++)
#pragma unroll
                for (int s = 0; s < 4; s++) acc[r][s] = fmaf(av[r], bv[s], acc[r][s]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int r = 0; r < 4; r++) {
        u32 gm = m0 + ty * 4 + r;
        if (gm >= m) continue;
#pragma unroll
        for (int s = 0; s < 4; s++) {
            u32 gn = n0 + tx * 4 + s;
            if (gn >= n) continue;
            float v = acc[r][s];
            if (bias) v += bias[gn];
            u64 at = (u64)gm * ldc + gn;
            c[at] = accumulate ? c[at] + v : v;
        }
    }
}

// Causal multi-head attention, flash-style (Dao et al., FlashAttention-2's
// loop order), in f32 on the CUDA cores: no (T, T) matrix is ever stored.
// The forward streams key/value tiles through shared memory with an online
// softmax and saves one statistic per row, lse = max + ln(sum of
// exponentials); the backward recomputes each probability from it.
//
// Layout (the CPU kernels', kernels/src/attention.rs): qkv (B, T, 3C) with
// q, k, v of head h at channels h*HS, C + h*HS and 2C + h*HS; out (B, T, C);
// lse (B, NH, T). docs (B, T), optional: row i attends only to keys
// docs[i] ..= i (document masking).
//
// The head size is a compile-time constant (-DHS=n, one module per head
// size) so per-row vectors live in registers. Deterministic: the backward
// runs one pass for dK, dV (a block per key tile, looping over queries)
// and one for dQ (a block per query tile, looping over keys), so every
// sum is in a fixed order and nothing is added with atomics.
//
// Versus the CPU kernel the sums run in another order (tiles of keys, an
// online rescaling), so results agree to f32 rounding, not bit for bit.
// These kernels are the correct baseline; the tensor-core version (mma,
// bf16 operands) that the throughput goal needs is still to come.

#ifndef HS
#define HS 64
#endif
// Rows (threads) per block of the per-row kernels.
#if HS <= 64
#define ROWS 64
#else
#define ROWS (4096 / HS)
#endif
// Rows per shared tile streamed past them.
#define TILE ((1024 / HS) > 64 ? 64 : ((1024 / HS) < 4 ? 4 : (1024 / HS)))
// Key rows per tile of the forward (scores kept in registers).
#define FTILE ((2048 / HS) > 32 ? 32 : ((2048 / HS) < 4 ? 4 : (2048 / HS)))

// grid (ceil(T/ROWS), NH, B), block ROWS: one thread per query row.
extern "C" __global__ void __launch_bounds__(ROWS)
attention_forward(float* out, float* lse, const float* qkv, const u32* docs, u32 t, u32 nh,
                  float scale) {
    __shared__ float ks[FTILE][HS];
    __shared__ float vs[FTILE][HS];
    __shared__ float ss[ROWS][FTILE + 1];
    u32 b = blockIdx.z, h = blockIdx.y;
    u32 i0 = blockIdx.x * ROWS;
    u32 i = i0 + threadIdx.x;
    u32 c = nh * HS;
    u64 c3 = 3ull * c;
    const float* base = qkv + (u64)b * t * c3;
    bool valid = i < t;
    float q[HS], o[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) {
        q[d] = valid ? base[(u64)i * c3 + h * HS + d] : 0.0f;
        o[d] = 0.0f;
    }
    u32 start = (valid && docs) ? docs[(u64)b * t + i] : 0;
    float m = -WEFT_INF, l = 0.0f;
    u32 last = min(t, i0 + ROWS) - 1;
    for (u32 j0 = 0; j0 <= last; j0 += FTILE) {
        for (u32 x = threadIdx.x; x < FTILE * HS; x += blockDim.x) {
            u32 jj = x / HS, d = x % HS, j = j0 + jj;
            ks[jj][d] = j < t ? base[(u64)j * c3 + c + h * HS + d] : 0.0f;
            vs[jj][d] = j < t ? base[(u64)j * c3 + 2 * c + h * HS + d] : 0.0f;
        }
        __syncthreads();
        if (valid && j0 <= i) {
            // Scores of this row against the tile, kept in shared memory
            // (a register array would need every loop over it unrolled).
            float mt = m;
#pragma unroll 1
            for (int jj = 0; jj < FTILE; jj++) {
                u32 j = j0 + jj;
                float dot = 0.0f;
#pragma unroll
                for (int d = 0; d < HS; d++) dot += q[d] * ks[jj][d];
                bool ok = j <= i && j >= start;
                float sc = ok ? dot * scale : -WEFT_INF;
                ss[threadIdx.x][jj] = sc;
                mt = fmaxf(mt, sc);
            }
            if (mt > -WEFT_INF) {
                float corr = expf(m - mt);
                l *= corr;
#pragma unroll
                for (int d = 0; d < HS; d++) o[d] *= corr;
#pragma unroll 1
                for (int jj = 0; jj < FTILE; jj++) {
                    float sc = ss[threadIdx.x][jj];
                    float p = sc == -WEFT_INF ? 0.0f : expf(sc - mt);
                    l += p;
#pragma unroll
                    for (int d = 0; d < HS; d++) o[d] += p * vs[jj][d];
                }
                m = mt;
            }
        }
        __syncthreads();
    }
    if (valid) {
        float inv = 1.0f / l;
        float* dst = out + ((u64)b * t + i) * c + h * HS;
#pragma unroll
        for (int d = 0; d < HS; d++) dst[d] = o[d] * inv;
        lse[((u64)b * nh + h) * t + i] = m + logf(l);
    }
}

// delta (B, NH, T) = rowsum(dout * out) per head: the softmax backward's
// correction term. One thread per (row, head).
extern "C" __global__ void attention_backward_delta(float* delta, const float* dout, const float* out,
                                                    u32 b_, u32 t, u32 nh) {
    u64 total = (u64)b_ * t * nh;
    for (u64 x = blockIdx.x * (u64)blockDim.x + threadIdx.x; x < total; x += (u64)gridDim.x * blockDim.x) {
        u32 h = (u32)(x % nh);
        u64 row = x / nh;  // b * t + i
        u32 i = (u32)(row % t);
        u64 b = row / t;
        const float* g = dout + row * nh * HS + h * HS;
        const float* o = out + row * nh * HS + h * HS;
        float s = 0.0f;
#pragma unroll
        for (int d = 0; d < HS; d++) s += g[d] * o[d];
        delta[(b * nh + h) * t + i] = s;
    }
}

// dK, dV: grid (ceil(T/ROWS), NH, B), block ROWS, one thread per key row
// j; loops over the query rows i >= j in tiles. Accumulates into dqkv.
extern "C" __global__ void __launch_bounds__(ROWS)
attention_backward_dkdv(float* dqkv, const float* dout, const float* qkv, const float* lse,
                        const float* delta, const u32* docs, u32 t, u32 nh, float scale) {
    __shared__ float kr[ROWS][HS + 1];
    __shared__ float vr[ROWS][HS + 1];
    __shared__ float qs[TILE][HS];
    __shared__ float gs[TILE][HS];
    __shared__ float ls[TILE], ds[TILE];
    __shared__ u32 st[TILE];
    u32 b = blockIdx.z, h = blockIdx.y;
    u32 j0 = blockIdx.x * ROWS;
    u32 j = j0 + threadIdx.x;
    u32 c = nh * HS;
    u64 c3 = 3ull * c;
    const float* base = qkv + (u64)b * t * c3;
    const float* gbase = dout + (u64)b * t * c;
    const float* lrow = lse + ((u64)b * nh + h) * t;
    const float* drow = delta + ((u64)b * nh + h) * t;
    bool valid = j < t;
    float dk[HS], dv[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) {
        kr[threadIdx.x][d] = valid ? base[(u64)j * c3 + c + h * HS + d] : 0.0f;
        vr[threadIdx.x][d] = valid ? base[(u64)j * c3 + 2 * c + h * HS + d] : 0.0f;
        dk[d] = 0.0f;
        dv[d] = 0.0f;
    }
    for (u32 i0 = j0 - j0 % TILE; i0 < t; i0 += TILE) {
        __syncthreads();
        for (u32 x = threadIdx.x; x < TILE * HS; x += blockDim.x) {
            u32 ii = x / HS, d = x % HS, i = i0 + ii;
            qs[ii][d] = i < t ? base[(u64)i * c3 + h * HS + d] : 0.0f;
            gs[ii][d] = i < t ? gbase[(u64)i * c + h * HS + d] : 0.0f;
        }
        for (u32 ii = threadIdx.x; ii < TILE; ii += blockDim.x) {
            u32 i = i0 + ii;
            ls[ii] = i < t ? lrow[i] : 0.0f;
            ds[ii] = i < t ? drow[i] : 0.0f;
            st[ii] = (i < t && docs) ? docs[(u64)b * t + i] : 0;
        }
        __syncthreads();
        if (!valid) continue;
#pragma unroll 1
        for (int ii = 0; ii < TILE; ii++) {
            u32 i = i0 + ii;
            if (i >= t || j > i || j < st[ii]) continue;
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int d = 0; d < HS; d++) {
                s += qs[ii][d] * kr[threadIdx.x][d];
                dp += gs[ii][d] * vr[threadIdx.x][d];
            }
            float p = expf(s * scale - ls[ii]);
            float dsc = p * (dp - ds[ii]) * scale;
#pragma unroll
            for (int d = 0; d < HS; d++) {
                dv[d] += p * gs[ii][d];
                dk[d] += dsc * qs[ii][d];
            }
        }
    }
    if (valid) {
        float* dst = dqkv + ((u64)b * t + j) * c3;
#pragma unroll
        for (int d = 0; d < HS; d++) {
            dst[c + h * HS + d] += dk[d];
            dst[2 * c + h * HS + d] += dv[d];
        }
    }
}

// dQ: grid (ceil(T/ROWS), NH, B), block ROWS, one thread per query row i;
// loops over the key rows j <= i in tiles. Accumulates into dqkv.
extern "C" __global__ void __launch_bounds__(ROWS)
attention_backward_dq(float* dqkv, const float* dout, const float* qkv, const float* lse,
                      const float* delta, const u32* docs, u32 t, u32 nh, float scale) {
    __shared__ float qr[ROWS][HS + 1];
    __shared__ float gr[ROWS][HS + 1];
    __shared__ float kt[TILE][HS];
    __shared__ float vt[TILE][HS];
    u32 b = blockIdx.z, h = blockIdx.y;
    u32 i0 = blockIdx.x * ROWS;
    u32 i = i0 + threadIdx.x;
    u32 c = nh * HS;
    u64 c3 = 3ull * c;
    const float* base = qkv + (u64)b * t * c3;
    bool valid = i < t;
    float dq[HS];
#pragma unroll
    for (int d = 0; d < HS; d++) {
        qr[threadIdx.x][d] = valid ? base[(u64)i * c3 + h * HS + d] : 0.0f;
        gr[threadIdx.x][d] = valid ? dout[((u64)b * t + i) * c + h * HS + d] : 0.0f;
        dq[d] = 0.0f;
    }
    float l = valid ? lse[((u64)b * nh + h) * t + i] : 0.0f;
    float dl = valid ? delta[((u64)b * nh + h) * t + i] : 0.0f;
    u32 start = (valid && docs) ? docs[(u64)b * t + i] : 0;
    u32 last = min(t, i0 + ROWS) - 1;
    for (u32 j0 = 0; j0 <= last; j0 += TILE) {
        __syncthreads();
        for (u32 x = threadIdx.x; x < TILE * HS; x += blockDim.x) {
            u32 jj = x / HS, d = x % HS, j = j0 + jj;
            kt[jj][d] = j < t ? base[(u64)j * c3 + c + h * HS + d] : 0.0f;
            vt[jj][d] = j < t ? base[(u64)j * c3 + 2 * c + h * HS + d] : 0.0f;
        }
        __syncthreads();
        if (!valid) continue;
#pragma unroll 1
        for (int jj = 0; jj < TILE; jj++) {
            u32 j = j0 + jj;
            if (j > i || j < start) continue;
            float s = 0.0f, dp = 0.0f;
#pragma unroll
            for (int d = 0; d < HS; d++) {
                s += qr[threadIdx.x][d] * kt[jj][d];
                dp += gr[threadIdx.x][d] * vt[jj][d];
            }
            float p = expf(s * scale - l);
            float dsc = p * (dp - dl) * scale;
#pragma unroll
            for (int d = 0; d < HS; d++) dq[d] += dsc * kt[jj][d];
        }
    }
    if (valid) {
        float* dst = dqkv + ((u64)b * t + i) * c3 + h * HS;
#pragma unroll
        for (int d = 0; d < HS; d++) dst[d] += dq[d];
    }
}

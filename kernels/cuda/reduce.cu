// Reductions for the step's checks and for the reproducible mode:
// finiteness counts, and exact (order-independent) sums built on integer
// fixed-point accumulators, the device side of weft_numerics::ExactSum.
//
// Every finite f32 is an integer multiple of 2^-149, and its square an
// integer multiple of 2^-298. A sum of such values is kept exactly as a
// fixed-point integer split into 32-bit limbs, each held in a 64-bit
// integer (so up to 2^31 additions per limb cannot overflow); integer
// addition is associative, so the per-thread, per-block and global
// accumulations (atomics included) give the same integer whatever the
// order or the grid. Nothing is rounded until the end: on the host
// (exact_sum, exact_sum_squares hand back the limbs, which the host adds
// into an ExactSum) or on the device (exact_sum_columns rounds each
// column once, to nearest even, as ExactSum::to_f32 does).
//
// Register arrays are indexed with compile-time constants only (unrolled
// selects), so they stay in registers.

#define NL 10   // signed limbs of exact_sum: weight of limb k = 2^(32k - 149)
#define NLQ 20  // unsigned limbs of exact_sum_squares: 2^(32k - 298)

// flags[0] += NaNs, flags[1] += +inf, flags[2] += -inf,
// flags[3] += values other than -0.0 (ExactSum's sign-of-zero rule).
__device__ __forceinline__ void classify(float x, u64* f) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7f800000u) == 0x7f800000u) {
        if (u & 0x007fffffu) f[0]++;
        else if (u >> 31) f[2]++;
        else f[1]++;
    }
    if (u != 0x80000000u) f[3]++;
}

// The integer significand and limb position of a finite f32:
// |x| = m * 2^(p - 149), p = 32*li + sh.
__device__ __forceinline__ void split_f32(u32 u, u64* m, u32* p) {
    u32 e = (u >> 23) & 0xffu;
    u32 frac = u & 0x7fffffu;
    *m = (e == 0) ? frac : (frac | 0x800000u);
    *p = (e == 0) ? 0 : e - 1;
}

// Number of values that are NaN or infinite: out[0] += count.
extern "C" __global__ void count_nonfinite(u64* out, const float* x, u64 n) {
    u64 c = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        c += ((__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u) ? 1 : 0;
    }
    for (int o = 16; o > 0; o >>= 1) c += __shfl_xor_sync(0xffffffffu, c, o);
    if ((threadIdx.x & 31) == 0 && c) atomicAdd(out, c);
}

// The exact sum of x (n values): out[0..NL) += the limbs (two's
// complement), out[NL..NL+4) += the flags of `classify`.
extern "C" __global__ void exact_sum(u64* out, const float* x, u64 n) {
    i64 acc[NL];
    u64 f[4] = {0, 0, 0, 0};
#pragma unroll
    for (int k = 0; k < NL; k++) acc[k] = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        float v = x[i];
        classify(v, f);
        u32 u = __float_as_uint(v);
        if ((u & 0x7f800000u) == 0x7f800000u) continue;
        u64 m;
        u32 p;
        split_f32(u, &m, &p);
        u32 li = p >> 5;
        u64 lo = m << (p & 31);
        i64 c0 = (i64)(lo & 0xffffffffull), c1 = (i64)(lo >> 32);
        if (u >> 31) {
            c0 = -c0;
            c1 = -c1;
        }
#pragma unroll
        for (int k = 0; k < NL; k++) {
            acc[k] += (k == (int)li ? c0 : 0) + (k == (int)li + 1 ? c1 : 0);
        }
    }
    __shared__ u64 s[NL + 4];
    if (threadIdx.x < NL + 4) s[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NL; k++) {
        if (acc[k]) atomicAdd(&s[k], (u64)acc[k]);
    }
#pragma unroll
    for (int k = 0; k < 4; k++) {
        if (f[k]) atomicAdd(&s[NL + k], f[k]);
    }
    __syncthreads();
    if (threadIdx.x < NL + 4 && s[threadIdx.x]) atomicAdd(&out[threadIdx.x], s[threadIdx.x]);
}

// The exact sum of the squares of x (each square is exact in f64, as the
// CPU's weft_parallel::add_squares): out[0..NLQ) += the limbs,
// out[NLQ..NLQ+4) += the flags of `classify` applied to the squares
// (NaN, +inf, -inf never, not -0.0).
extern "C" __global__ void exact_sum_squares(u64* out, const float* x, u64 n) {
    u64 acc[NLQ];
    u64 nan = 0, inf = 0, nonzero = 0;
#pragma unroll
    for (int k = 0; k < NLQ; k++) acc[k] = 0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        u32 u = __float_as_uint(x[i]);
        nonzero++;  // a square is never -0.0
        if ((u & 0x7f800000u) == 0x7f800000u) {
            if (u & 0x007fffffu) nan++;
            else inf++;
            continue;
        }
        u64 m;
        u32 p;
        split_f32(u, &m, &p);
        // |x|^2 = m^2 * 2^(2p - 298)
        u64 m2 = m * m;
        u32 q = 2 * p;
        u32 li = q >> 5, sh = q & 31;
        u64 lo = m2 << sh;
        u64 hi = sh ? (m2 >> (64 - sh)) : 0;
        u64 c0 = lo & 0xffffffffull, c1 = lo >> 32, c2 = hi;
#pragma unroll
        for (int k = 0; k < NLQ; k++) {
            acc[k] += (k == (int)li ? c0 : 0) + (k == (int)li + 1 ? c1 : 0) + (k == (int)li + 2 ? c2 : 0);
        }
    }
    __shared__ u64 s[NLQ + 4];
    if (threadIdx.x < NLQ + 4) s[threadIdx.x] = 0;
    __syncthreads();
#pragma unroll
    for (int k = 0; k < NLQ; k++) {
        if (acc[k]) atomicAdd(&s[k], acc[k]);
    }
    if (nan) atomicAdd(&s[NLQ], nan);
    if (inf) atomicAdd(&s[NLQ + 1], inf);
    if (nonzero) atomicAdd(&s[NLQ + 3], nonzero);
    __syncthreads();
    if (threadIdx.x < NLQ + 4 && s[threadIdx.x]) atomicAdd(&out[threadIdx.x], s[threadIdx.x]);
}

// 2^e as a double, e in the normal range.
__device__ __forceinline__ double pow2(int e) {
    return __longlong_as_double(((i64)(e + 1023)) << 52);
}

// out[j] = the sum over r < rows of inp[r * len + j], exact, rounded once
// to the nearest f32 (ties to even): ExactSum::to_f32 of the column, bit
// for bit, NaN and infinities and the sign of zero included. The sum over
// ranks of the reproducible all-reduce. rows <= 1024 (the host checks).
extern "C" __global__ void exact_sum_columns(float* out, const float* inp, u32 rows, u64 len) {
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < len; j += (u64)gridDim.x * blockDim.x) {
        i64 acc[NL];
        u64 f[4] = {0, 0, 0, 0};
#pragma unroll
        for (int k = 0; k < NL; k++) acc[k] = 0;
        for (u32 r = 0; r < rows; r++) {
            float v = inp[(u64)r * len + j];
            classify(v, f);
            u32 u = __float_as_uint(v);
            if ((u & 0x7f800000u) == 0x7f800000u) continue;
            u64 m;
            u32 p;
            split_f32(u, &m, &p);
            u32 li = p >> 5;
            u64 lo = m << (p & 31);
            i64 c0 = (i64)(lo & 0xffffffffull), c1 = (i64)(lo >> 32);
            if (u >> 31) {
                c0 = -c0;
                c1 = -c1;
            }
#pragma unroll
            for (int k = 0; k < NL; k++) {
                acc[k] += (k == (int)li ? c0 : 0) + (k == (int)li + 1 ? c1 : 0);
            }
        }
        if (f[0] || (f[1] && f[2])) {
            out[j] = __uint_as_float(0x7fc00000u);
            continue;
        }
        if (f[1]) {
            out[j] = WEFT_INF;
            continue;
        }
        if (f[2]) {
            out[j] = -WEFT_INF;
            continue;
        }
        // Carries up: limbs 0..NL-2 in [0, 2^32), the top one signed.
#pragma unroll
        for (int k = 0; k < NL - 1; k++) {
            i64 carry = acc[k] >> 32;
            acc[k] -= carry << 32;
            acc[k + 1] += carry;
        }
        bool negative = acc[NL - 1] < 0;
        if (negative) {
#pragma unroll
            for (int k = 0; k < NL; k++) acc[k] = -acc[k];
#pragma unroll
            for (int k = 0; k < NL - 1; k++) {
                i64 carry = acc[k] >> 32;
                acc[k] -= carry << 32;
                acc[k + 1] += carry;
            }
        }
        int h = -1;
#pragma unroll
        for (int k = 0; k < NL; k++) {
            if (acc[k] != 0) h = k;
        }
        if (h < 0) {
            out[j] = (rows > 0 && f[3] == 0) ? __uint_as_float(0x80000000u) : 0.0f;
            continue;
        }
        // The top 64 bits (the top limb and the one below it) with every
        // lower bit folded into the last one (sticky): at least 33
        // significant bits, so one rounding of this window to 24 bits is
        // the correct rounding of the whole sum.
        u64 top = 0, next = 0;
        bool sticky = false;
#pragma unroll
        for (int k = 0; k < NL; k++) {
            if (k == h) top = (u64)acc[k];
            if (k == h - 1) next = (u64)acc[k];
            if (k < h - 1 && acc[k] != 0) sticky = true;
        }
        u64 w;
        int e;
        if (h == 0) {
            w = top;
            e = -149;
        } else {
            w = (top << 32) | next | (sticky ? 1ull : 0ull);
            e = 32 * (h - 1) - 149;
        }
        // w rounded once to 24 bits; scaling by 2^e is then exact (the
        // result is normal unless h == 0 and w < 2^24, where it is exact
        // anyway), and a result of 2^128 or more becomes infinity.
        float r = (float)((double)__ull2float_rn(w) * pow2(e));
        out[j] = negative ? -r : r;
    }
}

// Token + position embedding (GPT-2's encoder), forward and backward.
//
// The backward is deterministic and in the CPU's order: the host groups
// the rows by token id (and by position), each group's rows in increasing
// order, and one thread per (group, channel) adds the rows' gradients in
// that order onto the parameter gradient — the CPU's sequential
// `dwte[tok] += dout[row]` over rows, bit for bit, with no atomics.

// out (N, C) = wte[tokens] (V, C) + wpe[pos] (maxT, C); pos = positions[row]
// when positions is non-null, else row % T.
extern "C" __global__ void encoder_forward(float* out, const u32* tokens, const u32* positions,
                                           const float* wte, const float* wpe, u64 n, u32 t, u32 c) {
    u64 total = n * c;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        u64 row = i / c;
        u32 ch = (u32)(i % c);
        u32 tok = tokens[row];
        u32 pos = positions ? positions[row] : (u32)(row % t);
        out[i] = wte[(u64)tok * c + ch] + wpe[(u64)pos * c + ch];
    }
}

// For each group g (grid.x) and channel (grid.y * blockDim.x + threadIdx.x):
// d[ids[g], ch] += sum over rows[starts[g] .. starts[g+1]] of dout[row, ch],
// added one row at a time in the order given.
extern "C" __global__ void embedding_backward(float* d, const float* dout, const u32* ids,
                                              const u32* starts, const u32* rows, u32 c) {
    u32 g = blockIdx.x;
    u32 ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= c) return;
    u64 at = (u64)ids[g] * c + ch;
    float acc = d[at];
    for (u32 r = starts[g]; r < starts[g + 1]; r++) {
        acc += dout[(u64)rows[r] * c + ch];
    }
    d[at] = acc;
}

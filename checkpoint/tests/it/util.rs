//! Test helpers: deterministic tensors and shardings.

use weft_checkpoint::{Dtype, OwnedShard, Region, ShardData};

/// A global tensor with its bytes.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data: Vec<u8>,
}

/// xorshift bytes: deterministic, seed-dependent.
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

pub fn tensor(name: &str, dtype: Dtype, shape: &[u64], seed: u64) -> Tensor {
    let n = shape.iter().product::<u64>() as usize * dtype.size_bytes();
    Tensor {
        name: name.to_owned(),
        dtype,
        shape: shape.to_vec(),
        data: bytes(seed, n),
    }
}

/// A small model-like set of tensors (scalar, vector, matrices, 3-d, bf16).
pub fn model(seed: u64) -> Vec<Tensor> {
    vec![
        tensor("wte.weight", Dtype::F32, &[13, 8], seed),
        tensor("h.0.attn.c_attn.weight", Dtype::BF16, &[8, 24], seed + 1),
        tensor("h.0.ln_1.bias", Dtype::F32, &[8], seed + 2),
        tensor("optim.step", Dtype::I64, &[], seed + 3),
        tensor("moe.experts", Dtype::F16, &[3, 5, 4], seed + 4),
    ]
}

/// Row-major copy of `region` out of a global tensor.
pub fn slice(t: &Tensor, region: &Region) -> Vec<u8> {
    let es = t.dtype.size_bytes();
    let n = t.shape.len();
    let vol = region.volume().unwrap() as usize;
    let mut out = Vec::with_capacity(vol * es);
    let mut idx = vec![0u64; n];
    for _ in 0..vol {
        let mut flat = 0u64;
        for (d, i) in idx.iter().enumerate() {
            flat = flat * t.shape[d] + region.offsets[d] + i;
        }
        let f = flat as usize * es;
        out.extend_from_slice(&t.data[f..f + es]);
        for d in (0..n).rev() {
            idx[d] += 1;
            if idx[d] < region.shape[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    out
}

/// FSDP-style: every tensor with a dimension is split along dim 0 into
/// `world` parts; scalars go to rank 0 only.
pub fn shard_rows(ts: &[Tensor], world: usize) -> Vec<Vec<OwnedShard>> {
    let mut ranks = vec![Vec::new(); world];
    for t in ts {
        for (r, shards) in ranks.iter_mut().enumerate() {
            let region = if t.shape.is_empty() {
                if r != 0 {
                    continue;
                }
                Region::full(&t.shape)
            } else {
                Region::split(&t.shape, 0, world, r)
            };
            shards.push(OwnedShard {
                name: t.name.clone(),
                dtype: t.dtype,
                global_shape: t.shape.clone(),
                data: slice(t, &region),
                region,
            });
        }
    }
    ranks
}

pub fn borrow(ranks: &[Vec<OwnedShard>]) -> Vec<Vec<ShardData<'_>>> {
    ranks
        .iter()
        .map(|r| r.iter().map(OwnedShard::as_data).collect())
        .collect()
}

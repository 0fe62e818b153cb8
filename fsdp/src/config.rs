//! Strategies, the mixed-precision policy and the other settings of a sharded layout.

use weft_collectives::Algorithm;
use weft_numerics::Dtype;

pub use weft_parallel::Strategy;

use crate::error::{Error, Result};

/// The mixed-precision policy of the sharded state. Master weights and
/// AdamW moments are always f32 on the shard; what the kernels multiply is
/// the model's own setting (`weft_kernels::Precision`: in bf16 the linear
/// layers round their operands, whatever dtype was gathered).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    /// Dtype of the parameters that are all-gathered and computed with
    /// (widened to f32 for the kernels): `F32` or `BF16`. With `BF16` the
    /// shard is rounded to nearest-even from the f32 master as it is
    /// written into each gather (as FSDP2 casts into its all-gather input:
    /// no bf16 copy of the shard is kept), except the ranges each unit
    /// keeps in f32 ([`UnitSpec::keep_f32`](crate::UnitSpec::keep_f32)),
    /// which travel as f32 bits; strategies that replicate the parameters
    /// keep the replica in that form, refreshed after every step.
    pub param: Dtype,
    /// Dtype of the gradients on the wire and of the kept gradient shard:
    /// `F32`, or `BF16` (partial sums travel in bf16, every addition is
    /// computed in f32 and rounded once — the collectives' precision rule).
    pub reduce: Dtype,
}

impl Precision {
    /// Everything in f32.
    pub const F32: Precision = Precision {
        param: Dtype::F32,
        reduce: Dtype::F32,
    };
    /// bf16 parameters and gradients (f32 master and moments).
    pub const BF16: Precision = Precision {
        param: Dtype::BF16,
        reduce: Dtype::BF16,
    };
    /// bf16 parameters, f32 gradient reduction.
    pub const BF16_PARAMS: Precision = Precision {
        param: Dtype::BF16,
        reduce: Dtype::F32,
    };

    pub(crate) fn check(&self) -> Result<()> {
        for (field, d) in [
            ("precision.param", self.param),
            ("precision.reduce", self.reduce),
        ] {
            if !matches!(d, Dtype::F32 | Dtype::BF16) {
                return Err(Error::Config {
                    field,
                    reason: format!("= {d:?}; expected f32 or bf16"),
                });
            }
        }
        Ok(())
    }
}

impl Default for Precision {
    fn default() -> Self {
        Precision::F32
    }
}

/// Settings of an [`Fsdp`](crate::Fsdp).
#[derive(Clone, Debug, PartialEq)]
pub struct FsdpConfig {
    /// What is sharded.
    pub strategy: Strategy,
    /// Parameter and gradient dtypes.
    pub precision: Precision,
    /// Reproducible gradient reduction: every strategy and group size gives
    /// bitwise the same gradients, losses and parameters as one rank with
    /// the same global batch (see the crate docs for the exact conditions).
    pub reproducible: bool,
    /// How many units ahead the forward (and backward) all-gathers run
    /// (0: gather each unit just before use, nothing overlaps).
    pub prefetch: usize,
    /// Free a unit's gathered parameters after its forward (ZeRO-3's
    /// default) instead of keeping them until its backward.
    pub reshard_after_forward: bool,
    /// Ranks per shard group under [`Strategy::Hybrid`] (0: the
    /// communicator topology's ranks per domain, capped at the group size).
    pub hybrid_shard: usize,
    /// Algorithm of the gradient all-reduces (the traffic formula assumes
    /// [`Algorithm::Ring`]).
    pub algorithm: Algorithm,
}

impl Default for FsdpConfig {
    fn default() -> Self {
        FsdpConfig {
            strategy: Strategy::Full,
            precision: Precision::F32,
            reproducible: true,
            prefetch: 1,
            reshard_after_forward: true,
            hybrid_shard: 0,
            algorithm: Algorithm::Ring,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn precision_rejects_f16() {
        let p = Precision {
            param: Dtype::F16,
            reduce: Dtype::F32,
        };
        assert!(matches!(
            p.check(),
            Err(Error::Config {
                field: "precision.param",
                ..
            })
        ));
    }
}

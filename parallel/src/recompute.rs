//! Activation recomputation ([`Recompute`], `train.recompute`): which
//! blocks keep only their output in the forward and run their forward
//! again, from the kept input, just before their backward.
//!
//! It lives here, beside the layout, because both the model
//! (`weft_model::GptBlocks::set_recompute`, which runs it) and the planner
//! (`weft-plan`, which counts its memory and time) read it. In
//! `weft-model` a recomputed block keeps `rows·C` floats (its output, the
//! next block's input) instead of its whole `BlockActs`; one block's
//! activations, shared by the chunk's blocks and micro-batches, hold the
//! recomputation (`GptBlocks::scratch` plans them). The recomputed forward is the forward: the same kernels on
//! the same inputs give the same bits (weft's kernels are deterministic),
//! so losses, gradients and weights are bitwise those of [`Recompute::None`]
//! on every layout. What the forward communicates (tensor parallelism's
//! gathers and sums, expert parallelism's token exchanges) it communicates
//! again; an FSDP unit is not gathered again (its backward's gather serves
//! the recomputation); a mixture of experts does not log its load twice.
//! A split backward (zero-bubble schedules) recomputes in both halves: the
//! weight half needs the activations the input half used, and keeping them
//! from B to W would keep what recomputation frees.
//!
//! ```
//! use weft_parallel::Recompute;
//!
//! let every2: Recompute = "every:2".parse()?;
//! assert!(every2.recomputes(0) && !every2.recomputes(1) && every2.recomputes(2));
//! assert!(Recompute::Full.recomputes(5) && !Recompute::None.recomputes(5));
//! assert_eq!(every2.to_string(), "every:2");
//! # Ok::<(), String>(())
//! ```

use std::fmt;
use std::str::FromStr;

/// `train.recompute`: which blocks recompute their forward in the
/// backward instead of keeping its activations.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Recompute {
    /// Every block keeps its activations (`"none"`, the default).
    #[default]
    None,
    /// Every block keeps only its output and recomputes the rest (`"full"`;
    /// torchtitan's and Megatron's full activation checkpointing): the
    /// least memory, one more forward of the blocks per step.
    Full,
    /// Blocks `0, k, 2k, …` recompute, the others keep their activations
    /// (`"every:K"`; torchtitan's selective checkpointing of every k-th
    /// layer): between the two in memory and time. `Every(1)` is
    /// [`Full`](Self::Full).
    Every(usize),
    /// Every block keeps everything but its MLP's activation output
    /// (GELU's, or SwiGLU's product), and recomputes it from what it keeps
    /// before its backward (`"selective"`; the activation function again,
    /// as llm.c recomputes GELU: a few percent of the step). The attention
    /// core, which Megatron-LM's selective recomputation targets, keeps no
    /// `B·NH·T²` probabilities in weft under any policy: its kernel keeps
    /// each row's log-sum-exp and computes the probabilities again in its
    /// backward (flash attention's way).
    Selective,
}

impl Recompute {
    /// Whether block `layer` (its index in the whole model) recomputes
    /// its whole forward.
    pub fn recomputes(self, layer: usize) -> bool {
        match self {
            Recompute::None | Recompute::Selective => false,
            Recompute::Full => true,
            Recompute::Every(k) => k > 0 && layer.is_multiple_of(k),
        }
    }

    /// Whether the blocks recompute their attention probabilities rather
    /// than keep them ([`Selective`](Self::Selective)).
    pub fn selective(self) -> bool {
        self == Recompute::Selective
    }

    /// Whether any block of `layers` recomputes its whole forward.
    pub fn any(self, layers: std::ops::Range<usize>) -> bool {
        layers.into_iter().any(|l| self.recomputes(l))
    }

    /// How many of the blocks `layers` recompute.
    pub fn count(self, layers: std::ops::Range<usize>) -> usize {
        layers.into_iter().filter(|&l| self.recomputes(l)).count()
    }
}

impl fmt::Display for Recompute {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Recompute::None => f.write_str("none"),
            Recompute::Full => f.write_str("full"),
            Recompute::Selective => f.write_str("selective"),
            Recompute::Every(k) => write!(f, "every:{k}"),
        }
    }
}

impl FromStr for Recompute {
    type Err = String;

    /// Parses `none`, `full`, `selective` or `every:K` (K ≥ 1).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "none" => Ok(Recompute::None),
            "full" => Ok(Recompute::Full),
            "selective" => Ok(Recompute::Selective),
            _ => match s.strip_prefix("every:").map(str::parse::<usize>) {
                Some(Ok(1)) => Ok(Recompute::Full),
                Some(Ok(k)) if k > 1 => Ok(Recompute::Every(k)),
                _ => Err(format!(
                    "unknown recomputation `{s}`: expected `none`, `full`, `selective` or `every:K` \
                     (K ≥ 1: blocks 0, K, 2K, … recompute)"
                )),
            },
        }
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for Recompute {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for Recompute {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <String as serde::Deserialize>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spellings_round_trip_and_bad_ones_are_named() {
        for r in [
            Recompute::None,
            Recompute::Full,
            Recompute::Every(3),
            Recompute::Selective,
        ] {
            assert_eq!(r.to_string().parse::<Recompute>(), Ok(r));
        }
        assert_eq!("every:1".parse::<Recompute>(), Ok(Recompute::Full));
        for bad in ["every:0", "every:", "all", "every:x"] {
            let e = bad.parse::<Recompute>().unwrap_err();
            assert!(e.contains(bad) && e.contains("every:K"), "{e}");
        }
        assert_eq!(Recompute::Every(4).count(0..12), 3);
        assert!(!Recompute::Every(4).any(1..4));
        assert!(!Recompute::Selective.any(0..4) && Recompute::Selective.selective());
    }
}

//! Layouts: how a job is split over the GPUs — `weft train`'s `[parallel]`
//! table itself ([`ParallelLayout`]: `dp`, `fsdp`, `hybrid_shard`, `tp`,
//! `sequence_parallel`, `pp`, `pp_schedule`, `pp_chunks`, `ep`, ...), with
//! `train.micro_batch_size` and activation recomputation
//! (`train.recompute`: `none`, `full`, `every:K`).

use std::fmt;

use serde::{Deserialize, Serialize};
use weft_parallel::{ModelShape, ParallelLayout, Recompute, Strategy};
use weft_pipeline::ScheduleKind;

use crate::error::{Error, Result};
use crate::model::ModelSpec;

/// One way to run the job: a `[parallel]` layout, the micro-batch size,
/// and which blocks recompute their activations.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Layout {
    /// The `[parallel]` table: degrees, FSDP strategy, schedule and chunks,
    /// sequence parallelism, reductions (its keys written beside the
    /// others, as in a job file's `[parallel]`).
    #[serde(flatten)]
    pub parallel: ParallelLayout,
    /// Sequences per micro-batch (`train.micro_batch_size`).
    pub micro_batch_size: usize,
    /// Activation recomputation (`train.recompute`): the blocks whose
    /// forward runs again in their backward, keeping only their input.
    #[serde(default)]
    pub recompute: Recompute,
    /// Tokens per chunk of the head's loss (`train.loss_chunk`; 0: the
    /// whole micro-batch): the head holds one chunk's logits and computes
    /// them again in the backward.
    #[serde(default)]
    pub loss_chunk: usize,
}

impl Default for Layout {
    fn default() -> Self {
        Self {
            parallel: ParallelLayout::default(),
            micro_batch_size: 1,
            recompute: Recompute::None,
            loss_chunk: 0,
        }
    }
}

impl Layout {
    /// A layout of these degrees (every other setting the default).
    #[must_use]
    pub fn degrees(dp: usize, tp: usize, pp: usize) -> Self {
        Layout {
            parallel: ParallelLayout {
                dp,
                tp,
                pp,
                ..ParallelLayout::default()
            },
            ..Layout::default()
        }
    }

    /// GPUs the layout needs: `dp · cp · tp · pp`.
    #[must_use]
    pub fn world(&self) -> usize {
        self.parallel.world_size()
    }

    /// Model chunks per pipeline stage ([`ParallelLayout::chunks`]).
    #[must_use]
    pub fn chunks(&self) -> usize {
        self.parallel.chunks()
    }

    /// The pipeline schedule.
    #[must_use]
    pub fn schedule(&self) -> ScheduleKind {
        self.parallel.pp_schedule
    }

    /// The FSDP strategy, `None` for replicas.
    #[must_use]
    pub fn sharding(&self) -> Option<Strategy> {
        self.parallel.fsdp
    }

    /// Whether the parameters are sharded (gathered for compute).
    #[must_use]
    pub fn shards_params(&self) -> bool {
        self.sharding().is_some_and(Strategy::shards_params)
    }

    /// Whether the gradients are sharded (reduce-scattered per micro-batch).
    #[must_use]
    pub fn shards_grads(&self) -> bool {
        self.sharding().is_some_and(Strategy::shards_grads)
    }

    /// Micro-batches each data-parallel rank runs per step for a global
    /// batch of `batch` sequences.
    #[must_use]
    pub fn micro_batches(&self, batch: usize) -> usize {
        batch / (self.parallel.dp * self.micro_batch_size).max(1)
    }

    /// The size of the group the sharding shards over
    /// ([`ParallelLayout::shard_group`]).
    #[must_use]
    pub fn shard_group(&self) -> usize {
        self.parallel.shard_group()
    }

    /// `[parallel]` and `[train]` settings of `weft train` for this layout,
    /// as `--set` arguments.
    #[must_use]
    pub fn train_sets(&self) -> Vec<String> {
        let p = &self.parallel;
        let mut v = vec![
            format!("parallel.dp={}", p.dp),
            format!("parallel.tp={}", p.tp),
            format!("parallel.pp={}", p.pp),
            format!("parallel.ep={}", p.ep),
            format!("parallel.cp={}", p.cp),
            format!(
                "parallel.fsdp=\"{}\"",
                p.fsdp.map_or("none", Strategy::name)
            ),
            format!("train.micro_batch_size={}", self.micro_batch_size),
        ];
        if p.fsdp == Some(Strategy::Hybrid) {
            v.push(format!("parallel.hybrid_shard={}", p.hybrid_shard));
        }
        if p.pp > 1 {
            v.push(format!("parallel.pp_schedule=\"{}\"", p.pp_schedule));
            if p.pp_schedule == ScheduleKind::Interleaved {
                v.push(format!("parallel.pp_chunks={}", p.pp_chunks));
            }
        }
        if self.recompute != Recompute::None {
            v.push(format!("train.recompute=\"{}\"", self.recompute));
        }
        if self.loss_chunk > 0 {
            v.push(format!("train.loss_chunk={}", self.loss_chunk));
        }
        if p.sequence_parallel {
            v.push("parallel.sequence_parallel=true".into());
        }
        v
    }

    /// Checks that the layout splits `model` and a global batch of `batch`
    /// sequences over `gpus` GPUs: the rules `weft train` applies
    /// ([`ParallelLayout::check`]), an explicit micro-batch size, the
    /// cluster's GPU count, and a vocabulary the tensor-parallel head can
    /// split.
    ///
    /// # Errors
    /// [`Error::InvalidLayout`] naming the setting at fault and why.
    pub fn validate(&self, model: &ModelSpec, batch: usize, gpus: usize) -> Result<()> {
        let p = &self.parallel;
        let bad = |field: &'static str, reason: String| {
            Err(Error::InvalidLayout {
                layout: self.to_string(),
                field,
                reason,
            })
        };
        if self.micro_batch_size == 0 {
            return bad("micro_batch_size", "must be at least 1".into());
        }
        let shape = ModelShape {
            layers: model.layers,
            heads: model.heads,
            kv_heads: model.heads,
            experts: model.experts,
            seq: model.seq,
        };
        match p.check(&shape, batch, self.micro_batch_size) {
            Err(
                weft_parallel::Error::Dims { field, reason }
                | weft_parallel::Error::Batch { field, reason },
            ) => return bad(field, reason),
            Err(e) => return bad("dp", e.to_string()),
            Ok(_) => {}
        }
        if self.world() != gpus {
            return bad(
                "dp",
                format!(
                    "dp·tp·pp = {}·{}·{} = {} ranks, but the cluster has {gpus}",
                    p.dp,
                    p.tp,
                    p.pp,
                    self.world()
                ),
            );
        }
        if model.vocab < p.tp {
            return bad(
                "tp",
                format!("the vocabulary ({}) cannot be split over tp", model.vocab),
            );
        }
        if !(model.kv_heads().is_multiple_of(p.tp) || p.tp.is_multiple_of(model.kv_heads())) {
            return bad(
                "tp",
                format!(
                    "must divide the model's key/value heads ({}) or be a multiple of them \
                     (each rank keeps whole key/value heads, or a copy of one), got {}",
                    model.kv_heads(),
                    p.tp
                ),
            );
        }
        Ok(())
    }
}

impl fmt::Display for Layout {
    /// `dp=4 tp=2 pp=2 cp=2 fsdp=full 1f1b mbs=2 sp`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let p = &self.parallel;
        write!(f, "dp={} tp={} pp={}", p.dp, p.tp, p.pp)?;
        if p.ep > 1 {
            write!(f, " ep={}", p.ep)?;
        }
        if p.cp > 1 {
            write!(f, " cp={}", p.cp)?;
        }
        match p.fsdp {
            None => {}
            Some(Strategy::Hybrid) => write!(f, " fsdp=hybrid/{}", p.hybrid_shard)?,
            Some(s) => write!(f, " fsdp={s}")?,
        }
        if p.pp > 1 {
            write!(f, " {}", p.pp_schedule)?;
            if p.pp_schedule == ScheduleKind::Interleaved {
                write!(f, "/v{}", p.pp_chunks)?;
            }
        }
        write!(f, " mbs={}", self.micro_batch_size)?;
        if p.sequence_parallel {
            f.write_str(" sp")?;
        }
        match self.recompute {
            Recompute::None => {}
            Recompute::Full => f.write_str(" recompute")?,
            r => write!(f, " recompute={r}")?,
        }
        if self.loss_chunk > 0 {
            write!(f, " loss-chunk={}", self.loss_chunk)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn model() -> ModelSpec {
        ModelSpec::gpt(8, 256, 8, 64, 1000)
    }

    #[test]
    fn valid_layouts_pass_and_bad_degrees_name_their_field() {
        let l = Layout {
            micro_batch_size: 2,
            ..Layout::degrees(2, 2, 2)
        };
        l.validate(&model(), 16, 8).unwrap();
        let field = |l: Layout, batch: usize, gpus: usize| match l.validate(&model(), batch, gpus) {
            Err(Error::InvalidLayout { field, .. }) => field,
            other => panic!("{other:?}"),
        };
        let with = |f: fn(&mut ParallelLayout)| {
            let mut x = l;
            f(&mut x.parallel);
            x
        };
        assert_eq!(field(l, 16, 4), "dp");
        assert_eq!(
            field(
                with(|p| {
                    p.tp = 3;
                    p.dp = 1;
                    p.pp = 1;
                }),
                16,
                3
            ),
            "tp"
        );
        assert_eq!(field(l, 6, 8), "micro_batch_size");
        let interleaved = Layout {
            micro_batch_size: 8,
            ..with(|p| p.pp_schedule = ScheduleKind::Interleaved)
        };
        assert_eq!(field(interleaved, 16, 8), "pp_schedule");
        assert_eq!(field(with(|p| p.ep = 2), 16, 8), "ep");
        assert_eq!(
            field(
                with(|p| {
                    p.fsdp = Some(Strategy::Hybrid);
                    p.hybrid_shard = 3;
                }),
                16,
                8
            ),
            "hybrid_shard"
        );
    }

    #[test]
    fn train_sets_name_weft_keys() {
        let mut l = Layout::degrees(2, 1, 2);
        l.parallel.fsdp = Some(Strategy::Full);
        l.parallel.pp_schedule = ScheduleKind::ZbH1;
        let s = l.train_sets().join(" ");
        assert!(s.contains("parallel.fsdp=\"full\""), "{s}");
        assert!(s.contains("parallel.pp_schedule=\"zb-h1\""), "{s}");
        assert_eq!(l.to_string(), "dp=2 tp=1 pp=2 fsdp=full zb-h1 mbs=1");
        // written with the `[parallel]` keys beside the others, and read back
        let json = serde_json::to_value(l).unwrap();
        assert_eq!(json["fsdp"], "full");
        assert_eq!(json["pp_schedule"], "zb-h1");
        assert_eq!(json["micro_batch_size"], 1);
        assert_eq!(serde_json::from_value::<Layout>(json).unwrap(), l);
    }
}

//! What a training loop needs from a model: [`TrainModel`].
//!
//! `weft train` runs one loop for every model and device: the step over a
//! rank's micro-batches, evaluation, reading and writing named parameters
//! (fault drills, bias balancing), the parts of the model a rank writes to
//! a checkpoint and reading them back, and the memory report. The CPU's
//! [`ParallelGpt`](crate::ParallelGpt) (every layout) implements it, and
//! so does the GPU's `CudaGpt` (feature `cuda`); model families to come
//! implement it to be trained by the same loop. What only some models
//! have — a mesh, a pipeline schedule, per-step traffic and timelines —
//! comes through provided methods that default to nothing.

use weft_kernels::OptimStep;
use weft_moe::{BiasBalancer, LoadStats};
use weft_parallel::{AdamWState, ParallelMesh, ParamLayout};
use weft_pipeline::{RankTimeline, Schedule};

use crate::error::{Error, Result};
use crate::gpt::MicroBatch;
use crate::memory::RankMemory;
use crate::parallelize::{StepOutcome, StepTraffic};
use crate::stage::{OwnedPart, ReadTensor};

/// What a model measured in its last step, beyond the step's outcome:
/// empty for models that measure nothing.
#[derive(Debug, Default)]
pub struct StepTelemetry {
    /// What this rank sent, per parallel axis.
    pub traffic: Option<StepTraffic>,
    /// This rank's pipeline timeline (its actions and receive waits).
    pub timeline: Option<RankTimeline>,
    /// Each model chunk's FSDP spans (compute, communication, waits), by
    /// chunk; `None` for a chunk that is not sharded.
    pub fsdp: Vec<Option<weft_fsdp::SpanLog>>,
    /// The context-parallel ring's exchanges and waits (empty without
    /// context parallelism).
    pub cp: Vec<crate::cp::RingSpan>,
}

/// A model one training loop trains: `weft train` runs one loop for every
/// model and device, against this trait. What only some models have — a
/// mesh, a pipeline schedule, per-step traffic and timelines — comes
/// through provided methods that default to nothing.
pub trait TrainModel {
    /// One optimizer step over this rank's share of the global batch:
    /// forward and backward of every micro-batch with the loss scaled by
    /// `loss_scale` (1: unscaled), the reduction, the exact global norm,
    /// clipping at `clip` (0: none), and AdamW with `hp` — skipped, as
    /// the outcome says, when the loss or a gradient is not finite.
    ///
    /// # Errors
    /// The model's: a kernel, a collective, a shape.
    fn train_step(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &OptimStep,
        clip: f64,
        loss_scale: f32,
    ) -> Result<StepOutcome>;

    /// Makes steps take Muon for the hidden matrices
    /// ([`OptimStep::muon`]), with `ns_steps` Newton–Schulz iterations;
    /// returns Muon's work and traffic per step over the model's ranks.
    /// Collective over them. By default Muon is refused.
    ///
    /// # Errors
    /// [`Error::Config`] for a model without Muon; the model's.
    fn use_muon(&mut self, ns_steps: usize) -> Result<weft_parallel::MuonCost> {
        let _ = ns_steps;
        Err(Error::Config {
            field: "optim.name",
            reason: "this model trains with AdamW only".into(),
        })
    }

    /// Mean loss over `batches` (forward passes only).
    ///
    /// # Errors
    /// As [`train_step`](Self::train_step).
    fn eval_loss(&mut self, batches: &[MicroBatch<'_>]) -> Result<f64>;

    /// The whole model's parameters: names, shapes, order.
    fn whole_layout(&self) -> &ParamLayout;

    /// This rank's values of parameter tensor `name`, `None` if it holds
    /// none of it. Collective where the model's parameters are sharded.
    ///
    /// # Errors
    /// The model's.
    fn read_param(&self, name: &str) -> Result<Option<Vec<f32>>>;

    /// Writes this rank's values of parameter `name` (as
    /// [`read_param`](Self::read_param) gave them); `false` if it holds
    /// none of it.
    ///
    /// # Errors
    /// A length that is not the tensor's; the model's.
    fn write_param(&mut self, name: &str, values: &[f32]) -> Result<bool>;

    /// The parts of the model's tensors this rank writes to a checkpoint
    /// (parameters and AdamW moments, every element by exactly one rank),
    /// and the optimizer step.
    ///
    /// # Errors
    /// The model's.
    fn owned_parts(&self) -> Result<(Vec<OwnedPart>, u32)>;

    /// [`owned_parts`](Self::owned_parts) into `out`, reusing what a
    /// previous call left there where the model can (the CPU model
    /// overwrites its parts in place); returns the optimizer step.
    ///
    /// # Errors
    /// The model's.
    fn owned_parts_into(&self, out: &mut Vec<OwnedPart>) -> Result<u32> {
        let (parts, step) = self.owned_parts()?;
        *out = parts;
        Ok(step)
    }

    /// Bytes of [`owned_parts`](Self::owned_parts)' values: the host copy a
    /// checkpoint is saved from. By default counted from a copy; models
    /// count without one.
    ///
    /// # Errors
    /// The model's.
    fn owned_bytes(&self) -> Result<usize> {
        let (parts, _) = self.owned_parts()?;
        Ok(parts
            .iter()
            .flat_map(|p| &p.values)
            .map(|v| 4 * v.len())
            .sum())
    }

    /// Loads this rank's part of a saved model through `read`, and the
    /// optimizer step.
    ///
    /// # Errors
    /// [`Error::Load`] naming the tensor; the model's.
    fn load_with(&mut self, step: u32, read: &mut ReadTensor<'_>) -> Result<()>;

    /// Bytes this rank holds, by category.
    fn memory(&self) -> RankMemory;

    /// Waits until the step's work is done (a device's queue drained), so
    /// that its time is measured. Nothing to wait for by default.
    ///
    /// # Errors
    /// The device's.
    fn finish_step(&mut self) -> Result<()> {
        Ok(())
    }

    /// The device mesh the model is laid out on, if it has one.
    fn mesh(&self) -> Option<&ParallelMesh> {
        None
    }

    /// The pipeline schedule a step runs, if it runs one.
    fn schedule(&self) -> Option<&Schedule> {
        None
    }

    /// What the last step measured (taken: the next call gives the next
    /// step's). Nothing by default.
    fn take_telemetry(&mut self) -> StepTelemetry {
        StepTelemetry::default()
    }

    /// Auxiliary-loss-free balancing (DeepSeek-V3): every mixture-of-experts
    /// layer's selection bias this rank holds moved by `balancer` against
    /// that layer's load over the global batch (`loads`, one per layer).
    ///
    /// # Errors
    /// The balancer's refusal of a load; reading or writing a bias.
    fn balance_experts(&mut self, balancer: &BiasBalancer, loads: &[LoadStats]) -> Result<()> {
        for (l, load) in loads.iter().enumerate() {
            let name = format!("transformer.h.{l}.mlp.router.selection_bias");
            if let Some(mut bias) = self.read_param(&name)? {
                balancer
                    .update(&mut bias, &load.tokens_per_expert)
                    .map_err(|e| Error::Config {
                        field: "model.moe",
                        reason: e.to_string(),
                    })?;
                self.write_param(&name, &bias)?;
            }
        }
        Ok(())
    }
}

/// The whole model as the parts of one rank that holds all of it: every
/// tensor of `layout` with its parameters and AdamW moments cut from the
/// flat buffers (a one-device model's checkpoint: the same files a
/// single-rank CPU run writes).
#[must_use]
pub fn whole_parts(layout: &ParamLayout, params: &[f32], opt: &AdamWState) -> Vec<OwnedPart> {
    layout
        .specs()
        .iter()
        .map(|spec| {
            let r = spec.range();
            OwnedPart {
                name: spec.name.clone(),
                global_shape: spec.shape.clone(),
                whole: 0,
                values: [params, opt.m.as_slice(), opt.v.as_slice()].map(|b| b[r.clone()].to_vec()),
            }
        })
        .collect()
}

/// Reads the whole model through `read` — parameters into `params`,
/// AdamW moments into `opt`, which takes `step`: the reverse of
/// [`whole_parts`].
///
/// # Errors
/// [`Error::Load`] naming the first tensor `read` could not fill.
pub fn read_whole(
    layout: &ParamLayout,
    params: &mut [f32],
    opt: &mut AdamWState,
    step: u32,
    read: &mut ReadTensor<'_>,
) -> Result<()> {
    for spec in layout.specs() {
        let r = spec.range();
        for (which, buf) in [&mut *params, &mut opt.m, &mut opt.v]
            .into_iter()
            .enumerate()
        {
            read(which, &spec.name, &mut buf[r.clone()]).map_err(|source| Error::Load {
                tensor: match which {
                    0 => spec.name.clone(),
                    1 => format!("optimizer.exp_avg.{}", spec.name),
                    _ => format!("optimizer.exp_avg_sq.{}", spec.name),
                },
                source,
            })?;
        }
    }
    opt.step = step;
    Ok(())
}

impl TrainModel for crate::ParallelGpt {
    fn train_step(
        &mut self,
        batches: &[MicroBatch<'_>],
        hp: &OptimStep,
        clip: f64,
        loss_scale: f32,
    ) -> Result<StepOutcome> {
        self.train_step_scaled(batches, hp, clip, loss_scale)
    }

    fn use_muon(&mut self, ns_steps: usize) -> Result<weft_parallel::MuonCost> {
        crate::ParallelGpt::use_muon(self, ns_steps)
    }

    fn eval_loss(&mut self, batches: &[MicroBatch<'_>]) -> Result<f64> {
        crate::ParallelGpt::eval_loss(self, batches)
    }

    fn whole_layout(&self) -> &ParamLayout {
        crate::ParallelGpt::whole_layout(self)
    }

    fn read_param(&self, name: &str) -> Result<Option<Vec<f32>>> {
        crate::ParallelGpt::read_param(self, name)
    }

    fn write_param(&mut self, name: &str, values: &[f32]) -> Result<bool> {
        crate::ParallelGpt::write_param(self, name, values)
    }

    fn owned_parts(&self) -> Result<(Vec<OwnedPart>, u32)> {
        crate::ParallelGpt::owned_parts(self)
    }

    fn owned_bytes(&self) -> Result<usize> {
        crate::ParallelGpt::owned_bytes(self)
    }

    fn owned_parts_into(&self, out: &mut Vec<OwnedPart>) -> Result<u32> {
        crate::ParallelGpt::owned_parts_into(self, out)
    }

    fn load_with(&mut self, step: u32, read: &mut ReadTensor<'_>) -> Result<()> {
        crate::ParallelGpt::load_with(self, step, read)
    }

    fn memory(&self) -> RankMemory {
        crate::ParallelGpt::memory(self)
    }

    fn mesh(&self) -> Option<&ParallelMesh> {
        Some(crate::ParallelGpt::mesh(self))
    }

    fn schedule(&self) -> Option<&Schedule> {
        Some(crate::ParallelGpt::schedule(self))
    }

    fn take_telemetry(&mut self) -> StepTelemetry {
        let traffic = self.last_traffic().cloned();
        let timeline = self.take_timeline();
        let fsdp = self
            .stages_mut()
            .iter_mut()
            .map(|st| {
                st.fsdp_mut().map(|f| {
                    let spans = f.spans().clone();
                    f.spans_mut().clear();
                    spans
                })
            })
            .collect();
        // every chunk's blocks share the rank's one ring log
        let cp = self
            .stages()
            .first()
            .and_then(|st| st.blocks().context_parallel())
            .map(crate::cp::ContextParallel::take_spans)
            .unwrap_or_default();
        StepTelemetry {
            traffic,
            timeline,
            fsdp,
            cp,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Gpt, GptConfig};

    /// The parts of a one-device model are every tensor, and reading them
    /// back through a checkpoint's reader restores every buffer.
    #[test]
    fn whole_parts_read_back_into_the_flat_buffers() {
        let cfg = GptConfig {
            n_layer: 2,
            n_head: 2,
            n_embd: 16,
            vocab_size: 64,
            block_size: 8,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: crate::BlockArch::GPT2,
        };
        let mut gpt = Gpt::new(cfg).unwrap();
        gpt.init_gpt2(3);
        let layout = gpt.layout().clone();
        let mut opt = gpt.adamw_state();
        for (i, (m, v)) in opt.m.iter_mut().zip(&mut opt.v).enumerate() {
            #[allow(clippy::cast_precision_loss)]
            let x = i as f32;
            (*m, *v) = (x, 2.0 * x);
        }
        let parts = whole_parts(&layout, &gpt.params, &opt);
        assert_eq!(parts.len(), layout.specs().len());
        let (mut params, mut back) = (vec![0.0; layout.len()], AdamWState::zeros(layout.len()));
        let mut read =
            |which: usize,
             name: &str,
             out: &mut [f32]|
             -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
                let part = parts.iter().find(|p| p.name == name).ok_or("missing")?;
                out.copy_from_slice(&part.values[which]);
                Ok(())
            };
        read_whole(&layout, &mut params, &mut back, 7, &mut read).unwrap();
        assert_eq!(params, gpt.params);
        assert_eq!((&back.m, &back.v, back.step), (&opt.m, &opt.v, 7));
        let mut missing =
            |_: usize,
             _: &str,
             _: &mut [f32]|
             -> std::result::Result<(), Box<dyn std::error::Error + Send + Sync>> {
                Err("no such tensor".into())
            };
        let e = read_whole(&layout, &mut params, &mut back, 7, &mut missing).unwrap_err();
        assert!(e.to_string().contains("transformer.wte.weight"), "{e}");
    }
}

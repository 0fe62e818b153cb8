//! Published runs the planner is checked against: their model, batch,
//! cluster and layout in, their per-GPU throughput out.
//!
//! [`MEGATRON_2021`] is Table 1 of Narayanan et al., "Efficient
//! Large-Scale Language Model Training on GPU Clusters Using
//! Megatron-LM" (SC '21, arXiv:2104.04473): GPT models of 1.7 to 1008
//! billion parameters on 32 to 3072 A100-80GB GPUs of NVIDIA's Selene
//! (DGX A100 nodes: 8 GPUs on NVLink/NVSwitch, 8 × 200 Gb/s HDR
//! InfiniBand per node), sequence 2048, vocabulary 51,200, mixed precision
//! (fp16), full activation recomputation. The achieved teraFLOP/s per GPU
//! are those of the table (also the Megatron-LM README's
//! `images/cases_april2021.png`); the layout of each row — tensor- and
//! pipeline-parallel sizes, micro-batch size, heads, layers per virtual
//! pipeline stage (the interleaved schedule) and the data-parallel
//! implementation (`--DDP-impl torch`, which overlaps the gradient
//! all-reduce with the backward, or `local`, which does not) — is that of
//! the paper's own script, `examples/academic_paper_scripts/sc21/run_table_1.sh`
//! in NVIDIA/Megatron-LM (commit 6985e58, August 2021; the seq-length,
//! vocabulary and fp16 settings in `CONFIG.sh` beside it). Throughput is
//! counted as the paper counts it: eq. 3,
//! `96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))` FLOPs per iteration
//! ([`ModelSpec::megatron_flops`]).
//!
//! [`models`] are published model configurations of the Llama family
//! (grouped-query attention, SwiGLU, untied embeddings; Mistral's
//! windows) with their published parameter counts, which
//! [`ModelSpec::params`] reproduces exactly, and Llama 3 405B's training
//! compute, 6·N·D.

use serde::Serialize;

use crate::cluster::{Cluster, Precision};
use crate::error::Result;
use weft_parallel::Recompute;
use weft_pipeline::ScheduleKind;

use crate::layout::Layout;
use crate::memory::{Accounting, Recipe};
use crate::model::ModelSpec;
use crate::predict::{Prediction, Request, predict};

/// One published run.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PublishedRun {
    /// The row's name in the table (`1.7B`, ..., `1T`).
    pub name: &'static str,
    /// Attention heads.
    pub heads: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Layers.
    pub layers: usize,
    /// Tensor-parallel size.
    pub tp: usize,
    /// Pipeline-parallel size.
    pub pp: usize,
    /// GPUs.
    pub gpus: usize,
    /// Global batch, sequences.
    pub batch: usize,
    /// Micro-batch size.
    pub micro_batch_size: usize,
    /// Layers per virtual pipeline stage (the interleaved schedule), if
    /// interleaved.
    pub layers_per_virtual_stage: Option<usize>,
    /// Whether the data-parallel all-reduce overlapped the backward
    /// (`--DDP-impl torch`) rather than following it (`local`).
    pub overlap_grad_reduce: bool,
    /// Published achieved teraFLOP/s per GPU.
    pub tflops_per_gpu: f64,
}

/// Sequence length of every row.
pub const MEGATRON_2021_SEQ: usize = 2048;
/// Vocabulary of every row.
pub const MEGATRON_2021_VOCAB: usize = 51_200;

#[allow(clippy::too_many_arguments)]
const fn row(
    name: &'static str,
    heads: usize,
    hidden: usize,
    layers: usize,
    tp: usize,
    pp: usize,
    gpus: usize,
    batch: usize,
    micro_batch_size: usize,
    layers_per_virtual_stage: Option<usize>,
    overlap_grad_reduce: bool,
    tflops_per_gpu: f64,
) -> PublishedRun {
    PublishedRun {
        name,
        heads,
        hidden,
        layers,
        tp,
        pp,
        gpus,
        batch,
        micro_batch_size,
        layers_per_virtual_stage,
        overlap_grad_reduce,
        tflops_per_gpu,
    }
}

/// Narayanan et al. 2021, Table 1 (see the [module docs](self) for the
/// sources of every column).
pub const MEGATRON_2021: [PublishedRun; 10] = [
    row("1.7B", 24, 2304, 24, 1, 1, 32, 512, 16, None, true, 137.0),
    row("3.6B", 32, 3072, 30, 2, 1, 64, 512, 16, None, true, 138.0),
    row("7.5B", 32, 4096, 36, 4, 1, 128, 512, 16, None, true, 142.0),
    row("18B", 48, 6144, 40, 8, 1, 256, 1024, 8, None, true, 135.0),
    row("39B", 64, 8192, 48, 8, 2, 512, 1536, 4, None, false, 138.0),
    row(
        "76B",
        80,
        10240,
        60,
        8,
        4,
        1024,
        1792,
        2,
        Some(5),
        false,
        140.0,
    ),
    row(
        "145B",
        96,
        12288,
        80,
        8,
        8,
        1536,
        2304,
        2,
        Some(5),
        false,
        148.0,
    ),
    row(
        "310B",
        128,
        16384,
        96,
        8,
        16,
        1920,
        2160,
        1,
        Some(3),
        false,
        155.0,
    ),
    row(
        "530B",
        128,
        20480,
        105,
        8,
        35,
        2520,
        2520,
        1,
        Some(1),
        false,
        163.0,
    ),
    row(
        "1T", 160, 25600, 128, 8, 64, 3072, 3072, 1, None, false, 163.0,
    ),
];

impl PublishedRun {
    /// The model.
    #[must_use]
    pub fn model(&self) -> ModelSpec {
        ModelSpec::gpt(
            self.layers,
            self.hidden,
            self.heads,
            MEGATRON_2021_SEQ,
            MEGATRON_2021_VOCAB,
        )
    }

    /// The layout: replicas over `dp = GPUs / (tp · pp)`, 1F1B or
    /// interleaved, full recomputation.
    #[must_use]
    pub fn layout(&self) -> Layout {
        let chunks = self
            .layers_per_virtual_stage
            .map_or(1, |v| self.layers / self.pp / v);
        let mut l = Layout::degrees(self.gpus / (self.tp * self.pp), self.tp, self.pp);
        if chunks > 1 {
            l.parallel.pp_schedule = ScheduleKind::Interleaved;
            l.parallel.pp_chunks = chunks;
        }
        Layout {
            micro_batch_size: self.micro_batch_size,
            recompute: Recompute::Full,
            ..l
        }
    }

    /// The request on `cluster` (its GPU count set to the row's): mixed
    /// precision in fp16, the attention scores materialized (2021: no
    /// fused attention), the gradient all-reduce overlapped as the row's
    /// implementation did.
    #[must_use]
    pub fn request(&self, cluster: &Cluster) -> Request {
        Request {
            model: self.model(),
            batch: self.batch,
            cluster: cluster.clone().with_gpus(self.gpus),
            recipe: Recipe {
                accounting: Accounting::Mixed,
                precision: Precision::F16,
                bf16_grad_wire: true,
                overlap_grad_reduce: self.overlap_grad_reduce,
                flash_attention: false,
                muon: false,
            },
        }
    }
}

/// A published model configuration and its published parameter count.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PublishedModel {
    /// Its name (`Llama 3 8B`, ...).
    pub name: &'static str,
    /// Its dimensions (sequence: the pretraining context).
    pub model: ModelSpec,
    /// The published parameter count.
    pub params: u64,
    /// Where the count comes from.
    pub source: &'static str,
}

/// Llama 3 8B, 70B and 405B (Meta's `config.json` and model cards: 8.03B,
/// 70.6B, 405.9B; weft-model's own layout counts 8,030,261,248 for 8B)
/// and Mistral 7B (Hugging Face's count of `mistralai/Mistral-7B-v0.1`).
#[must_use]
pub fn models() -> Vec<PublishedModel> {
    let llama3 = |l, c, nh, f| ModelSpec::llama(l, c, nh, 8, f, 8192, 128_256);
    vec![
        PublishedModel {
            name: "Llama 3 8B",
            model: llama3(32, 4096, 32, 14336),
            params: 8_030_261_248,
            source: "meta-llama/Meta-Llama-3-8B",
        },
        PublishedModel {
            name: "Llama 3 70B",
            model: llama3(80, 8192, 64, 28672),
            params: 70_553_706_496,
            source: "meta-llama/Meta-Llama-3-70B",
        },
        PublishedModel {
            name: "Llama 3.1 405B",
            model: llama3(126, 16384, 128, 53248),
            params: 405_853_388_800,
            source: "meta-llama/Llama-3.1-405B",
        },
        PublishedModel {
            name: "Mistral 7B",
            model: ModelSpec::llama(32, 4096, 32, 8, 14336, 8192, 32000).with_window(4096, 0),
            params: 7_241_732_096,
            source: "mistralai/Mistral-7B-v0.1",
        },
    ]
}

/// Llama 3 405B's pretraining: 15.6T tokens and 3.8 × 10^25 FLOPs (Dubey
/// et al. 2024, "The Llama 3 Herd of Models", section 3.2.1).
pub const LLAMA3_405B_TOKENS: f64 = 15.6e12;
/// Its published training compute, FLOPs.
pub const LLAMA3_405B_FLOPS: f64 = 3.8e25;

/// The published models as a Markdown table: the published and counted
/// parameters, and the training FLOPs per token (6·N plus attention).
#[must_use]
pub fn models_table(models: &[PublishedModel]) -> String {
    let mut s = String::from(
        "| model | layers | hidden | heads | kv heads | ffn | vocab | published params | counted | FLOPs/token (6N + attention, T = 8192) |\n\
         |---|---|---|---|---|---|---|---|---|---|\n",
    );
    for p in models {
        let m = &p.model;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.3e} |\n",
            p.name,
            m.layers,
            m.hidden,
            m.heads,
            m.kv_heads(),
            m.ffn_hidden,
            m.vocab,
            p.params,
            m.params(),
            m.flops_per_token()
        ));
    }
    s
}

/// A published row beside the planner's prediction.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Comparison {
    /// The published run.
    pub run: PublishedRun,
    /// The planner's prediction for its layout.
    pub prediction: Prediction,
    /// Predicted teraFLOP/s per GPU, counted by the paper's eq. 3.
    pub predicted_tflops: f64,
    /// `(predicted − published) / published`.
    pub error: f64,
}

/// Predicts every row of `runs` on `cluster` (the `a100-80gb` preset for
/// [`MEGATRON_2021`]), with the cluster's efficiency constants for all rows.
///
/// # Errors
/// The planner's errors for a row whose layout it refuses.
pub fn compare(runs: &[PublishedRun], cluster: &Cluster) -> Result<Vec<Comparison>> {
    runs.iter()
        .map(|run| {
            let req = run.request(cluster);
            let p = predict(&req, &run.layout())?;
            let flops = run.model().megatron_flops(run.batch);
            let predicted_tflops = flops / p.step_s / run.gpus as f64 / 1e12;
            Ok(Comparison {
                run: *run,
                prediction: p,
                predicted_tflops,
                error: (predicted_tflops - run.tflops_per_gpu) / run.tflops_per_gpu,
            })
        })
        .collect()
}

/// The comparison as a Markdown table.
#[must_use]
pub fn table(rows: &[Comparison]) -> String {
    let mut s = String::from(
        "| model | heads | hidden | layers | tp | pp | dp | GPUs | batch | mbs | schedule | published TFLOP/s | predicted | error | bubble | memory/GPU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for r in rows {
        let l = r.prediction.layout;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.0} | {:.1} | {:+.1}% | {:.1}% | {} |\n",
            r.run.name,
            r.run.heads,
            r.run.hidden,
            r.run.layers,
            l.parallel.tp,
            l.parallel.pp,
            l.parallel.dp,
            r.run.gpus,
            r.run.batch,
            l.micro_batch_size,
            if l.parallel.pp == 1 {
                "—".to_owned()
            } else if l.chunks() > 1 {
                format!("interleaved/v{}", l.chunks())
            } else {
                "1f1b".to_owned()
            },
            r.run.tflops_per_gpu,
            r.predicted_tflops,
            100.0 * r.error,
            100.0 * r.prediction.time.bubble_fraction,
            crate::memory::bytes(r.prediction.memory.total()),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every published count exactly, from the model's dimensions; and
    /// Llama 3 405B's 3.8 × 10^25 FLOPs are 6·N·D within 1%.
    #[test]
    fn published_models_have_their_parameter_counts() {
        for p in models() {
            p.model.validate().unwrap();
            assert_eq!(p.model.params(), p.params as f64, "{}", p.name);
        }
        let m = &models()[2].model;
        let six_nd = 6.0 * m.params() * LLAMA3_405B_TOKENS;
        assert!(
            (six_nd / LLAMA3_405B_FLOPS - 1.0).abs() < 0.01,
            "{six_nd:e}"
        );
        let t = models_table(&models());
        assert!(
            t.contains(
                "| Llama 3 70B | 80 | 8192 | 64 | 8 | 28672 | 128256 | 70553706496 | 70553706496 |"
            ),
            "{t}"
        );
    }
}

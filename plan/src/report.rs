//! The planner's answer as text: the table of the best layouts, the
//! budget's paragraph and the JSON document `weft plan` prints.

use serde::Serialize;

use crate::budget::BudgetReport;
use crate::explain::Explanation;
use crate::search::reason;
use crate::{Accounting, Cluster, ModelSpec, Prediction, Recipe, Request};

fn secs(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else {
        format!("{:.2} ms", 1e3 * s)
    }
}

/// Bytes in the unit that reads best (B, KB, MB, GB).
fn bytes_text(b: f64) -> String {
    match b {
        b if b >= 1e9 => format!("{:.2} GB", b / 1e9),
        b if b >= 1e6 => format!("{:.1} MB", b / 1e6),
        b if b >= 1e3 => format!("{:.1} KB", b / 1e3),
        b => format!("{b:.0} B"),
    }
}

fn gib(b: u64) -> String {
    crate::memory::bytes(b)
}

/// The table of the best `top` layouts of `preds` (0: all), best first,
/// under a header naming the model, cluster and recipe; then each
/// layout's reason ([`reason`]) against the best.
#[must_use]
pub fn table(req: &Request, preds: &[Prediction], top: usize) -> String {
    let mut s = format!(
        "model: {} layers, hidden {}, {} heads, seq {}, vocab {}{}{}; {:.3}B parameters; global batch {} ({} tokens)\n\
         cluster: {}\n\
         recipe: {} accounting, {} products{}\n\n",
        req.model.layers,
        req.model.hidden,
        req.model.heads,
        req.model.seq,
        req.model.vocab,
        architecture(&req.model),
        if req.model.is_moe() {
            format!(
                ", {} experts top-{}{}{}{}",
                req.model.experts,
                req.model.top_k,
                match req.model.shared_experts {
                    0 => String::new(),
                    n => format!(" + {n} shared"),
                },
                match req.model.expert_hidden {
                    0 => String::new(),
                    w => format!(" of width {w}"),
                },
                match req.model.first_dense {
                    0 => String::new(),
                    n => format!(", first {n} layers dense"),
                }
            )
        } else {
            String::new()
        },
        req.model.params() / 1e9,
        req.batch,
        req.batch * req.model.seq,
        req.cluster,
        match req.recipe.accounting {
            Accounting::Weft => "weft",
            Accounting::Mixed => "mixed-precision",
        },
        req.recipe.precision.name(),
        if req.recipe.accounting == Accounting::Mixed && req.recipe.flash_attention {
            ", flash attention"
        } else {
            ""
        },
    );
    s.push_str(
        "| # | layout | fits | memory/GPU | params | grads | optimizer | activations | buffers | step | compute | tp | dp exposed | bubble | tokens/s | TFLOP/s/GPU | MFU |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    let n = if top == 0 {
        preds.len()
    } else {
        top.min(preds.len())
    };
    for (i, p) in preds.iter().take(n).enumerate() {
        let m = &p.memory;
        let t = &p.time;
        s.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {:.1}% | {:.0} | {:.2} | {:.1}% |\n",
            i + 1,
            p.layout,
            if p.fits { "yes" } else { "no" },
            gib(m.total()),
            gib(m.params),
            gib(m.grads),
            gib(m.optimizer),
            gib(m.activations),
            gib(m.buffers),
            secs(p.step_s),
            secs(t.compute),
            secs(t.tp_comm),
            secs(t.dp_exposed),
            100.0 * t.bubble_fraction,
            p.tokens_per_s,
            p.tflops_per_gpu,
            100.0 * p.mfu
        ));
    }
    s.push('\n');
    for (i, p) in preds.iter().take(n).enumerate() {
        let muon = if p.time.muon > 0.0 {
            format!(
                "; Muon adds {} a step (Newton–Schulz shared by the stage's ranks; each rank sends {} to gather matrices and scatter their updates)",
                secs(p.time.muon),
                bytes_text(p.time.muon_bytes)
            )
        } else {
            String::new()
        };
        s.push_str(&format!(
            "{}. {}: {}{muon}\n",
            i + 1,
            p.layout,
            reason(p, &preds[0])
        ));
    }
    if preds.len() > n {
        s.push_str(&format!(
            "({} more layouts; --top 0 shows all, --json gives every figure)\n",
            preds.len() - n
        ));
    }
    if let Some((p, cmp)) = pipeline_split(req, &preds[..n]) {
        s.push_str(&format!(
            "\nPipeline split of {} by per-layer FLOPs (stage busy: forward and backward FLOPs per token \
             of every micro-batch; weft train cuts the chosen split{}):\n{cmp}\n",
            p.layout,
            if req.recipe.accounting == Accounting::Mixed {
                ", Megatron-LM the equal one, which the prediction above assumes"
            } else {
                ", which the prediction above assumes"
            }
        ));
    }
    s
}

/// `, GQA 8 kv heads, SwiGLU 14336, window 4096 (5 local : 1 global)` —
/// what sets the block apart from GPT-2's.
fn architecture(m: &ModelSpec) -> String {
    let mut s = String::new();
    if m.kv_heads() != m.heads {
        s.push_str(&format!(", GQA {} kv heads", m.kv_heads()));
    }
    if m.head_dim != 0 {
        s.push_str(&format!(", head dim {}", m.head_dim));
    }
    if m.swiglu {
        s.push_str(&format!(", SwiGLU {}", m.ffn_hidden));
    } else if m.ffn_hidden != 4 * m.hidden {
        s.push_str(&format!(", MLP {}", m.ffn_hidden));
    }
    if m.window > 0 {
        s.push_str(&format!(", window {}", m.window));
        if m.global_every > 0 {
            s.push_str(&format!(" ({} local : 1 global)", m.global_every - 1));
        }
    }
    if m.qk_norm {
        s.push_str(", QK-norm");
    }
    s
}

/// The budget's paragraph: the Chinchilla-optimal size and tokens, and
/// what the budget buys at the best layout.
#[must_use]
pub fn budget_text(b: &BudgetReport, best: &Prediction) -> String {
    format!(
        "Budget {:.3e} FLOPs: Chinchilla-optimal {:.2}B parameters on {:.1}B tokens (Hoffmann et al. 2022: N = sqrt(C/120), D = 20·N; approach-3 loss {:.3}).\n\
         This model ({:.2}B parameters) at the best layout ({}, {:.0} tokens/s): the budget buys {:.1}B tokens in {:.1} days ({:.0} GPU-hours); \
         its compute-optimal {:.1}B tokens take {:.1} days.\n",
        b.optimum.flops,
        b.optimum.params / 1e9,
        b.optimum.tokens / 1e9,
        b.optimum.loss,
        b.params / 1e9,
        best.layout,
        b.tokens_per_s,
        b.tokens / 1e9,
        b.days,
        b.gpu_hours,
        b.optimal_tokens / 1e9,
        b.optimal_days
    )
}

/// One layout of the JSON output.
#[derive(Serialize)]
struct JsonLayout<'a> {
    /// The layout in one line (`dp=2 tp=4 pp=2 fsdp=full 1f1b mbs=1`).
    name: String,
    #[serde(flatten)]
    prediction: &'a Prediction,
    memory_total: u64,
    reason: String,
}

/// One split of the JSON output's pipeline comparison.
#[derive(Serialize)]
struct JsonSplit {
    /// Layers of each virtual stage.
    layers: Vec<usize>,
    /// Busy time (forward and backward FLOPs per token of every
    /// micro-batch) of each pipeline stage.
    stage_busy: Vec<f64>,
    /// The busiest stage's busy time over the idlest's.
    busy_spread: f64,
    /// Simulated makespan of one iteration, in the same units.
    makespan: f64,
    /// Simulated idle time over stages × makespan.
    bubble_fraction: f64,
}

impl From<&weft_pipeline::Partition> for JsonSplit {
    fn from(p: &weft_pipeline::Partition) -> Self {
        let (lo, hi) = p
            .stage_busy
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(lo, hi), &b| {
                (lo.min(b), hi.max(b))
            });
        JsonSplit {
            layers: p.layers_per_chunk(),
            stage_busy: p.stage_busy.clone(),
            busy_spread: if lo > 0.0 { hi / lo } else { f64::INFINITY },
            makespan: p.makespan,
            bubble_fraction: p.bubble_fraction,
        }
    }
}

/// The JSON output's pipeline comparison: the text's "Pipeline split"
/// paragraph ([`crate::predict::split_comparison`]).
#[derive(Serialize)]
struct JsonSplitComparison {
    /// The layout (the first shown with pipeline stages).
    layout: String,
    /// What the busy times count.
    units: &'static str,
    /// The equal-layer split.
    equal: JsonSplit,
    /// The split by per-layer cost (`weft train`'s).
    chosen: JsonSplit,
    /// `chosen.makespan / equal.makespan − 1` (negative: time saved).
    makespan_change: f64,
}

/// The JSON document.
#[derive(Serialize)]
struct JsonPlan<'a> {
    model: &'a ModelSpec,
    batch: usize,
    cluster: &'a Cluster,
    recipe: &'a Recipe,
    layouts: Vec<JsonLayout<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pipeline_split: Option<JsonSplitComparison>,
    #[serde(skip_serializing_if = "Option::is_none")]
    explain: Option<&'a Explanation>,
    #[serde(skip_serializing_if = "Option::is_none")]
    budget: Option<&'a BudgetReport>,
}

/// The first of `shown` with pipeline stages, and its split comparison
/// (as the table's paragraph shows it).
fn pipeline_split<'a>(
    req: &Request,
    shown: &'a [Prediction],
) -> Option<(&'a Prediction, weft_pipeline::SplitComparison)> {
    let p = shown.iter().find(|p| p.layout.parallel.pp > 1)?;
    let cmp = crate::predict::split_comparison(&req.model, &p.layout, req.batch).ok()??;
    Some((p, cmp))
}

/// `weft plan --json`: the request, the best `top` layouts (0: all) with
/// why each wins or loses, the pipeline split comparison of the first of
/// them with pipeline stages (`pipeline_split`: the equal-layer split
/// against the one by per-layer cost, as the table's paragraph), and the
/// explanation and budget when asked.
#[must_use]
pub fn json(
    req: &Request,
    preds: &[Prediction],
    top: usize,
    explain: Option<&Explanation>,
    budget: Option<&BudgetReport>,
) -> String {
    let top = if top == 0 {
        preds.len()
    } else {
        top.min(preds.len())
    };
    let out = JsonPlan {
        model: &req.model,
        batch: req.batch,
        cluster: &req.cluster,
        recipe: &req.recipe,
        layouts: preds[..top]
            .iter()
            .map(|p| JsonLayout {
                name: p.layout.to_string(),
                prediction: p,
                memory_total: p.memory.total(),
                reason: reason(p, &preds[0]),
            })
            .collect(),
        pipeline_split: pipeline_split(req, &preds[..top]).map(|(p, cmp)| JsonSplitComparison {
            layout: p.layout.to_string(),
            units: "forward and backward FLOPs per token, summed over micro-batches",
            equal: (&cmp.equal).into(),
            chosen: (&cmp.chosen).into(),
            makespan_change: cmp.makespan_change(),
        }),
        explain,
        budget,
    };
    serde_json::to_string_pretty(&out).unwrap_or_default()
}

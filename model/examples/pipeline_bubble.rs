//! Runs 1F1B and ZB-H1 for real — two pipeline stages on threads of the
//! local backend, p = 2, m = 8, a small GPT — and prints the measured
//! bubble beside the simulator's prediction from the measured mean action
//! costs of the same step.
//!
//! `cargo run --release -p weft-model --example pipeline_bubble [-- --trace DIR]`
//! (`--trace` writes each schedule's measured `trace.json` into `DIR`).
//! Run with `RAYON_NUM_THREADS=1` so each stage thread computes alone
//! instead of sharing one kernel thread pool with the other stage.

#![allow(clippy::print_stdout)] // an example prints its results

use anyhow::Context as _;
use weft_collectives::{Communicator, LocalCluster};
use weft_model::{Gpt, GptConfig, MicroBatch, pipeline_stages};
use weft_pipeline::{ExecError, Executor, Measured, ScheduleKind};

fn main() -> anyhow::Result<()> {
    let trace_dir = std::env::args()
        .skip_while(|a| a != "--trace")
        .nth(1)
        .map(std::path::PathBuf::from);
    let (p, m, b, t) = (2, 8, 4, 64);
    let cfg = GptConfig {
        n_layer: 4,
        n_head: 4,
        n_embd: 128,
        vocab_size: 512,
        block_size: t,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut model = Gpt::new(cfg)?;
    model.init_gpt2(1);
    let data: Vec<(Vec<u32>, Vec<u32>)> = (0..m as u32)
        .map(|k| {
            let x = (0..(b * t) as u32)
                .map(|i| (i * 31 + k * 7) % 512)
                .collect();
            let y = (0..(b * t) as u32)
                .map(|i| (i * 17 + k * 5 + 1) % 512)
                .collect();
            (x, y)
        })
        .collect();
    let mbs: Vec<MicroBatch<'_>> = data
        .iter()
        .map(|(x, y)| MicroBatch {
            tokens: x,
            targets: y,
        })
        .collect();
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!(
        "p = {p}, m = {m}, B = {b}, T = {t}, GPT 4 layers x 128 channels; RAYON_NUM_THREADS = {}; load average {}",
        std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into()),
        load.split_whitespace()
            .take(3)
            .collect::<Vec<_>>()
            .join(" ")
    );
    println!(
        "{:<8} {:>5} {:>10} {:>10} {:>7} {:>12} {:>12}   mean F / B / W per stage (ms)",
        "schedule", "step", "measured", "predicted", "ratio", "makespan ms", "predicted ms"
    );
    for kind in [ScheduleKind::OneFOneB, ScheduleKind::ZbH1] {
        let schedule = kind.generate(p, m, 1)?;
        let steps = 6;
        let results = LocalCluster::run(p, |comm| -> Result<Vec<Option<Measured>>, ExecError> {
            let stages = pipeline_stages(&model, &schedule, comm.rank(), &[2, 2], b, t)
                .map_err(|e| ExecError::Stage(Box::new(e)))?;
            let mut ex = Executor::new(schedule.clone(), comm.rank(), stages)?;
            let mut out = Vec::new();
            for _ in 0..steps {
                for s in ex.stages_mut() {
                    s.zero_grad();
                }
                let report = ex.step(&comm, &mbs, None)?;
                let all = ex.gather_timelines(&comm, &report.timeline)?;
                out.push(all.map(|r| Measured::new(&schedule, r)).transpose()?);
            }
            Ok(out)
        })?;
        let measured: Vec<Measured> = results
            .into_iter()
            .next()
            .context("rank 0")??
            .into_iter()
            .flatten()
            .collect();
        // Step 0 warms up (allocations, page faults); report the rest.
        for (i, ms) in measured.iter().enumerate().skip(1) {
            let pred = ms.predicted(&schedule)?;
            let (mb, pb) = (ms.timeline.bubble_fraction(), pred.bubble_fraction());
            let costs: Vec<String> = ms
                .costs
                .chunks
                .iter()
                .map(|c| {
                    format!(
                        "{:.2}/{:.2}/{:.2}",
                        c.forward * 1e3,
                        c.backward_input * 1e3,
                        c.backward_weight * 1e3
                    )
                })
                .collect();
            println!(
                "{:<8} {:>5} {:>10.3} {:>10.3} {:>7.2} {:>12.2} {:>12.2}   {}",
                kind.name(),
                i,
                mb,
                pb,
                mb / pb,
                ms.timeline.makespan() * 1e3,
                pred.makespan() * 1e3,
                costs.join("  ")
            );
        }
        let (mut sm, mut sp, mut n) = (0.0, 0.0, 0.0);
        for ms in measured.iter().skip(1) {
            sm += ms.timeline.bubble_fraction();
            sp += ms.predicted(&schedule)?.bubble_fraction();
            n += 1.0;
        }
        println!(
            "{:<8} {:>5} {:>10.3} {:>10.3} {:>7.2}",
            kind.name(),
            "mean",
            sm / n,
            sp / n,
            sm / sp
        );
        if let (Some(dir), Some(last)) = (&trace_dir, measured.last()) {
            std::fs::create_dir_all(dir)?;
            let path = dir.join(format!("{}.measured.trace.json", kind.name()));
            std::fs::write(&path, serde_json::to_string(&last.to_trace())?)
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(())
}

//! SVG plots of a plan: step time and its parts against the GPU count per
//! strategy, and memory per GPU by category for the best layouts. Drawn
//! with `weft-compare`'s charts, the ones every weft plot uses.

use weft_compare::chart::{Bar, Bars, LineChart, Series};

use crate::Request;
use crate::Strategy;
use crate::explain::Crossover;
use crate::memory::Memory;
use crate::predict::Prediction;
use crate::search::{Constraints, search};

/// Step time against GPU count, both axes logarithmic: for each strategy
/// its step, and for pure FSDP its compute and communication (the
/// crossover), dashed.
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn step_time_plot(
    strategies: &[(String, Vec<(usize, Prediction)>)],
    fsdp: &Crossover,
) -> String {
    let line = |name: String, points: Vec<(f64, f64)>, dashed: bool| Series {
        dashed,
        markers: true,
        ..Series::new(name, points)
    };
    let mut series: Vec<Series> = strategies
        .iter()
        .map(|(name, pts)| {
            let points = pts.iter().map(|(g, p)| (*g as f64, p.step_s)).collect();
            line(format!("{name}: step"), points, false)
        })
        .collect();
    let fsdp_part = |part: fn(&crate::explain::ScalingPoint) -> f64| {
        fsdp.points
            .iter()
            .map(|p| (p.gpus as f64, part(p)))
            .collect()
    };
    series.push(line("FSDP: compute".into(), fsdp_part(|p| p.compute), true));
    series.push(line(
        "FSDP: communication".into(),
        fsdp_part(|p| p.comm),
        true,
    ));
    let title = match fsdp.gpus {
        Some(g) => format!(
            "Step time vs GPUs (batch {}); FSDP crossover at {g} GPUs",
            fsdp.batch
        ),
        None => format!("Step time vs GPUs (batch {})", fsdp.batch),
    };
    LineChart::new(&title, "GPUs", "seconds per step")
        .log_log()
        .svg(&series)
}

/// Memory per GPU by category for each of `preds` (horizontal stacked
/// bars), with the GPU's capacity as a dashed mark and the total beside.
#[must_use]
#[allow(clippy::cast_precision_loss)]
pub fn memory_plot(preds: &[Prediction]) -> String {
    let categories = Memory::default()
        .categories()
        .map(|(n, _)| n.to_owned())
        .to_vec();
    let bars: Vec<Bar> = preds
        .iter()
        .map(|p| Bar {
            label: p.layout.to_string(),
            parts: p
                .memory
                .categories()
                .iter()
                .map(|(_, b)| *b as f64)
                .collect(),
            mark: Some(p.capacity as f64),
            note: crate::memory::bytes(p.memory.total()),
        })
        .collect();
    Bars {
        title: "Memory per GPU by layout".into(),
        categories,
    }
    .svg(&bars)
}

/// The step-time plot's strategies: replicas, FSDP and the best layout
/// of any kind, at each power-of-two GPU count up to the cluster's.
#[must_use]
pub fn strategies(req: &Request) -> Vec<(String, Vec<(usize, Prediction)>)> {
    let pure = |s: Option<Strategy>| Constraints {
        tp: Some(1),
        pp: Some(1),
        ep: Some(1),
        cp: Some(1),
        fsdp: Some(s),
        ..Constraints::default()
    };
    let kinds: [(&str, Constraints); 3] = [
        ("data parallel (replicas)", pure(None)),
        ("FSDP (ZeRO-3)", pure(Some(Strategy::Full))),
        ("best layout (tp, pp, FSDP...)", Constraints::default()),
    ];
    let mut out = Vec::new();
    for (name, c) in kinds {
        let mut pts = Vec::new();
        let mut g = 1usize;
        while g <= req.cluster.gpus.max(1) {
            let r = Request {
                cluster: req.cluster.clone().with_gpus(g),
                ..req.clone()
            };
            let c = if g == 1 && c.fsdp == Some(Some(Strategy::Full)) {
                pure(None)
            } else {
                c.clone()
            };
            if let Ok(v) = search(&r, &c)
                && let Some(p) = v.into_iter().find(|p| p.fits)
            {
                pts.push((g, p));
            }
            g *= 2;
        }
        out.push((name.to_owned(), pts));
    }
    out
}

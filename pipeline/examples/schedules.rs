//! Every schedule at p = 4, m = 8 with F = B = W: bubble, memory, and the
//! paper's prediction, side by side. Writes `zb-h1.trace.json` into the
//! current directory when given `--trace`.

#![allow(clippy::print_stdout)] // an example prints its results

use anyhow::Context as _;
use weft_pipeline::{PlanRequest, ScheduleKind, plan};

fn main() -> anyhow::Result<()> {
    let (p, m) = (4, 8);
    for kind in ScheduleKind::ALL {
        let plan =
            plan(&PlanRequest::new(kind, p, m)).with_context(|| format!("planning {kind}"))?;
        println!("{}", plan.table());
        if kind == ScheduleKind::ZbH1 && std::env::args().any(|a| a == "--trace") {
            let json = serde_json::to_string(&plan.trace)?;
            std::fs::write("zb-h1.trace.json", json).context("writing zb-h1.trace.json")?;
        }
    }
    Ok(())
}

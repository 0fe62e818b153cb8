//! Write synthetic run files for the end-to-end test and the large-input
//! measurements:
//! `cargo run -p weft-viz-web --example synth_run -- OUT_DIR STEPS EXPERTS LAYERS [TRACE_EVENTS]`
//! writes `metrics.jsonl` (with eval/skip/spike events and a torn last
//! line), `expert_load.jsonl`, `config.toml`, `summary.json`, and, when
//! `TRACE_EVENTS` is given, a `trace.json` of that many pipeline slices
//! over 16 stages.

use std::fmt::Write as _;
use std::path::PathBuf;

use weft_trace::{
    BatchPosition, ExpertLoadRecord, MetricsEvent, MetricsEventKind, MetricsRecord, Trace,
    TraceEvent,
};

/// A small deterministic generator (xorshift), so the files are the same
/// on every run.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> f64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().skip(1).collect();
    if a.len() < 4 {
        return Err("usage: synth_run OUT_DIR STEPS EXPERTS LAYERS [TRACE_EVENTS]".into());
    }
    let out = PathBuf::from(&a[0]);
    let (steps, experts, layers): (u64, usize, u32) = (a[1].parse()?, a[2].parse()?, a[3].parse()?);
    std::fs::create_dir_all(&out)?;
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let floor = 1.75;
    let mut m = String::new();
    for step in 1..=steps {
        let s = step as f64;
        let mut loss = floor + 4.0 * (-s / (steps as f64 / 5.0)).exp() + 0.05 * rng.next();
        if step == steps / 2 {
            loss += 1.5;
            let spike = MetricsEvent {
                step,
                kind: MetricsEventKind::Spike {
                    loss,
                    median: loss - 1.5,
                    batch: BatchPosition {
                        step: step - 1,
                        micro_batches: 4,
                    },
                },
            };
            writeln!(m, "{}", serde_json::to_string(&spike)?)?;
        }
        if step == steps / 3 {
            loss = f64::NAN;
        }
        let warm = (s / 10.0).min(1.0);
        let r = MetricsRecord {
            step,
            loss,
            lr: 3e-4
                * warm
                * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * s / steps as f64).cos())),
            grad_norm: 1.0 / (1.0 + s / 50.0) + 0.2 * rng.next(),
            tokens_per_s: 1000.0 + 50.0 * rng.next(),
            time_s: s * 0.8,
            loss_scale: None,
            mfu: Some(0.35 + 0.02 * rng.next()),
            max_vio: None,
            rss_bytes: None,
        };
        writeln!(m, "{}", serde_json::to_string(&r)?)?;
        if step == steps / 3 {
            let skip = MetricsEvent {
                step,
                kind: MetricsEventKind::Skip {
                    loss,
                    grad_norm: f64::NAN,
                },
            };
            writeln!(m, "{}", serde_json::to_string(&skip)?)?;
        }
        if step % (steps / 4).max(1) == 0 {
            let eval = MetricsEvent {
                step,
                kind: MetricsEventKind::Eval {
                    val_loss: loss.max(floor) + 0.05,
                    floor: Some(floor),
                },
            };
            writeln!(m, "{}", serde_json::to_string(&eval)?)?;
        }
    }
    m.push_str(r#"{"step":999999,"loss":2."#); // torn last line, as a killed run leaves
    std::fs::write(out.join("metrics.jsonl"), m)?;

    let mut e = String::new();
    for step in 1..=steps {
        for layer in 0..layers {
            let skew = 3.0 * (-(step as f64) / (steps as f64 / 4.0)).exp();
            let mut load: Vec<u64> = (0..experts)
                .map(|x| {
                    let hot = if x == (layer as usize * 3) % experts {
                        1.0 + skew
                    } else {
                        1.0
                    };
                    (256.0 * hot * (0.7 + 0.6 * rng.next())) as u64
                })
                .collect();
            if step % 97 == 0 {
                load[1 % experts] = 0;
            }
            let dropped = if step < steps / 5 {
                (skew * 40.0) as u64
            } else {
                0
            };
            let r = ExpertLoadRecord {
                step,
                layer,
                tokens_per_expert: load,
                dropped,
                router_entropy: None,
            };
            writeln!(e, "{}", serde_json::to_string(&r)?)?;
        }
    }
    std::fs::write(out.join("expert_load.jsonl"), e)?;
    std::fs::write(
        out.join("config.toml"),
        format!(
            "# synthetic run for weft viz tests\nname = \"synthetic\"\n\n[model]\nn_layer = {layers}\nn_embd = 256\nexperts = {experts}\ntop_k = 2\n\n[train]\nsteps = {steps}\nlr = 3e-4\n\n[parallel]\npp = 4\nep = 2\n"
        ),
    )?;
    std::fs::write(
        out.join("summary.json"),
        format!(
            r#"{{"steps":{steps},"final_loss":{:.4},"data":{{"corpus":"synthetic","entropy_floor":{floor}}},"wall_s":{:.1}}}"#,
            floor + 0.02,
            steps as f64 * 0.8
        ),
    )?;

    if let Some(n) = a.get(4) {
        let n: usize = n.parse()?;
        let stages = 16u64;
        let per = n / stages as usize;
        let mut t = Trace::new();
        for s in 0..stages {
            t.push(TraceEvent::process_name(s, format!("stage {s}")));
            let mut clock = s as f64 * 100.0;
            for i in 0..per {
                let (name, dur) = match i % 3 {
                    0 => ("F", 100.0),
                    1 => ("B", 100.0),
                    _ => ("W", 80.0),
                };
                t.push(
                    TraceEvent::complete(name, clock, dur, s, 0)
                        .with_arg("microbatch", (i / 3) as u64)
                        .with_arg("chunk", 0u32),
                );
                clock += dur + if rng.next() < 0.2 { 30.0 } else { 0.0 };
            }
        }
        std::fs::write(out.join("trace.json"), serde_json::to_string(&t)?)?;
    }
    Ok(())
}

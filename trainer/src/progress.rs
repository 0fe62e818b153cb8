//! How `weft train` shows progress: a progress bar on a terminal, plain log
//! lines otherwise (CI logs, pipes, files).

use std::io::{IsTerminal, Write};

use indicatif::{ProgressBar, ProgressStyle};
use weft_trainer::train::{EvalReport, HealthEvent, Observer, RunInfo, StepReport, Summary};

/// Writes a line to stdout; a closed pipe (`weft … | head`) is not an error
/// worth dying for, so write failures are ignored.
pub fn say(s: &str) {
    let _ = writeln!(std::io::stdout().lock(), "{s}");
}

/// Writes text to stdout as is, ignoring a closed pipe.
pub fn out(s: &str) {
    let _ = write!(std::io::stdout().lock(), "{s}");
}

/// Renders training progress for a person.
pub struct Terminal {
    bar: Option<ProgressBar>,
    steps: u64,
    log_every: u64,
    floor: Option<f64>,
    peak_source: String,
}

impl Terminal {
    /// A bar when stdout is a terminal, log lines otherwise.
    pub fn new() -> Self {
        Self {
            bar: None,
            steps: 0,
            log_every: 1,
            floor: None,
            peak_source: String::new(),
        }
    }

    fn line(&self, s: &str) {
        match &self.bar {
            Some(bar) => bar.println(s),
            None => say(s),
        }
    }
}

fn si(x: f64) -> String {
    if x >= 1e12 {
        format!("{:.2} T", x / 1e12)
    } else if x >= 1e9 {
        format!("{:.1} G", x / 1e9)
    } else if x >= 1e6 {
        format!("{:.1} M", x / 1e6)
    } else {
        format!("{x:.0} ")
    }
}

/// ` (N% of PEAK)`, or nothing when the peak is unknown.
fn of_peak(utilisation: f64, peak: &str) -> String {
    if utilisation.is_finite() {
        format!(" ({:.0}% of {peak})", 100.0 * utilisation)
    } else {
        String::new()
    }
}

fn with_floor(loss: f64, floor: Option<f64>) -> String {
    match floor {
        Some(f) => format!("{loss:.4} nats, floor {f:.4}"),
        None => format!("{loss:.4} nats"),
    }
}

/// What a precision stores and computes, per parameter: the dtypes of
/// the memory report's categories (which count the same buffers).
fn precision_line(p: weft_kernels::Precision) -> String {
    use weft_kernels::Precision;
    let n = match p {
        Precision::F32 => {
            return "fp32 products; 16 B per parameter: f32 weights 4, gradients 4, optimizer state 8 (two AdamW moments, or Muon's momentum and update); activations f32".into();
        }
        Precision::Bf16 => "bf16",
        Precision::F16 => "fp16",
    };
    let activations = if p == Precision::Bf16 {
        "activations f32, but the inputs only products read in bf16 (ln_1's output and the attention output; with the dense MLP ln_2's and the GELU output too)"
    } else {
        "activations f32"
    };
    format!(
        "{n} products (operands rounded to {n}, f32 accumulation); 16 B per parameter: f32 weights 4 (the masters: products read them as {n}, no {n} copy is kept), f32 gradients 4, f32 optimizer state 8 (two AdamW moments, or Muon's momentum and update); {activations}; the products' rounded and packed operand copies come on top (reported at the end)"
    )
}

impl Observer for Terminal {
    fn start(&mut self, info: &RunInfo) {
        self.steps = info.steps;
        self.floor = info.floor;
        self.log_every = (info.steps / 20).max(1);
        say(&format!("run folder      {}", info.run_dir.display()));
        let mut fp32 = info.fp32_activation_bytes.map_or_else(String::new, |b| {
            format!(" ({}B in fp32)", si(b as f64).trim())
        });
        if let Some((r, b)) = info.without_recompute {
            fp32 += &format!(" (recompute {r}; {}B without)", si(b as f64).trim());
        }
        if let Some((n, held, whole)) = info.loss_chunk {
            let [h, w] = [held, whole].map(|b| si(b as f64).trim().to_owned());
            fp32 += &format!(" (loss in chunks of {n} tokens: the head {h}B, {w}B whole)");
        }
        say(&format!(
            "model           {}, {} parameters, vocabulary {}, activations {}B per micro-batch{fp32}",
            info.arch,
            si(info.params as f64).trim(),
            info.vocab,
            si(info.activation_bytes as f64).trim()
        ));
        say(&format!(
            "work            {} tokens/step in {}, {}FLOP/token (6N + attention), {} steps",
            info.tokens_per_step,
            info.micro_batches,
            si(info.flops_per_token),
            info.steps
        ));
        if info.peak_flops.is_finite() {
            say(&format!(
                "matmul peak     {}FLOP/s ({}) {}",
                si(info.peak_flops),
                info.precision.name(),
                info.peak_source
            ));
        } else {
            say(&format!(
                "matmul peak     {} ({}): no utilisation figures",
                info.peak_source,
                info.precision.name()
            ));
        }
        self.peak_source.clone_from(&info.peak_source);
        say(&format!("backend         {}", info.backend));
        for (i, d) in info.data_shares.iter().enumerate() {
            let key = if i == 0 { "data" } else { "" };
            say(&format!(
                "{key:16}{}: {:.1}% of the run's {} sequences (weight {:.3}), {:.2} epochs",
                d.path,
                100.0 * d.fraction,
                info.data_shares.iter().map(|d| d.samples).sum::<u64>(),
                d.weight,
                d.epochs
            ));
        }
        if info.doc_mask {
            say(
                "documents       masked: each attends and is positioned as if alone (data.doc_mask)",
            );
        }
        let m = &info.memory;
        let predicted = info.predicted_memory == *m;
        say(&format!(
            "ranks           {}; per rank: params {}B, grads {}B, optimizer state {}B, activations {}B, comm buffers {}B (total {}B{})",
            info.layout,
            si(m.params as f64),
            si(m.grads as f64),
            si(m.optimizer as f64),
            si(m.activations as f64),
            si(m.comm as f64),
            si(m.total() as f64),
            if predicted {
                ", as predicted from the layout"
            } else {
                ""
            }
        ));
        if !predicted {
            say(&format!(
                "                predicted from the layout: {}",
                info.predicted_memory
            ));
        }
        if let Some(m) = &info.muon {
            let (f, s, r, t) = (si(m.flops), si(m.sent), si(m.received), si(m.total));
            say(&format!(
                "optimizer       Muon for {} hidden matrices (Q, K, V, gate and up, each expert's, one by one), AdamW for the rest; per step a rank does at most {f}FLOP of Newton–Schulz and, gathering matrices to the rank that orthogonalises each and scattering the updates back, sends up to {s}B and receives up to {r}B ({t}B over all {} ranks)",
                m.matrices, m.ranks
            ));
        }
        if info.checkpoint_every > 0 {
            say(&format!(
                "checkpoints     every {} steps, {}: {}B a rank of host memory to copy the parameters and optimizer state into",
                info.checkpoint_every,
                if info.checkpoint_background {
                    "written in the background while training goes on (one at a time)"
                } else {
                    "every rank stopping for the whole write"
                },
                si(info.checkpoint_bytes as f64),
            ));
        }
        say(&format!(
            "precision       {}",
            precision_line(info.precision)
        ));
        if info.coords.len() > 1 {
            say(&format!("mesh            {}", info.mesh));
            for c in &info.coords {
                say(&format!("                {c}"));
            }
        }
        if std::io::stdout().is_terminal() {
            let bar = ProgressBar::new(info.steps);
            let style = ProgressStyle::with_template(
                "{bar:30.cyan/blue} step {pos}/{len} {msg} [{elapsed_precise} < {eta_precise}]",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            self.bar = Some(bar);
        }
    }

    fn resumed(&mut self, step: u64, skipped: &[String]) {
        for s in skipped {
            say(&format!("skipped         checkpoint {s}"));
        }
        say(&format!(
            "resumed         from the checkpoint of step {step}{}",
            if skipped.is_empty() {
                ""
            } else {
                ", the newest that verifies"
            }
        ));
    }

    fn step(&mut self, r: &StepReport) {
        let rec = &r.record;
        let msg = format!(
            "loss {:.4} | lr {:.2e} | {:.0} tok/s | {}FLOP/s{}",
            rec.loss,
            rec.lr,
            rec.tokens_per_s,
            si(r.flops_per_s),
            of_peak(r.utilisation, "peak")
        );
        let msg = match r.max_vio {
            Some(v) => format!("{msg} | MaxVio {v:.2}"),
            None => msg,
        };
        match &self.bar {
            Some(bar) => {
                bar.set_position(rec.step);
                bar.set_message(msg);
            }
            None => {
                if rec.step.is_multiple_of(self.log_every)
                    || rec.step == 1
                    || rec.step == self.steps
                {
                    say(&format!(
                        "step {:>6}/{} {msg} | {:.1} s",
                        rec.step, self.steps, rec.time_s
                    ));
                }
            }
        }
    }

    fn eval(&mut self, r: &EvalReport) {
        self.line(&format!(
            "eval  step {:>6}: val loss {}",
            r.step,
            with_floor(r.loss, r.floor)
        ));
    }

    fn event(&mut self, e: &HealthEvent) {
        use weft_trace::{EventKind, MetricsEventKind};
        let s = match e {
            HealthEvent::Step(ev) => {
                let step = ev.step;
                match &ev.kind {
                    MetricsEventKind::Skip { loss, grad_norm } => format!(
                        "health step {step}: non-finite (loss {loss}, grad norm {grad_norm}): update skipped"
                    ),
                    MetricsEventKind::Overflow {
                        loss,
                        loss_scale,
                        next_loss_scale,
                    } => format!(
                        "health step {step}: fp16 gradients overflowed at loss scale {loss_scale} (loss {loss:.4}): update skipped, scale now {next_loss_scale}"
                    ),
                    MetricsEventKind::Spike {
                        loss,
                        median,
                        batch,
                    } => format!(
                        "health step {step}: loss spike {loss:.4} vs rolling median {median:.4} (the batch of step {} in a run without skips, {} micro-batches)",
                        batch.step + 1,
                        batch.micro_batches
                    ),
                    other => format!("health step {step}: {}", other.name()),
                }
            }
            HealthEvent::Run(EventKind::Straggler {
                step, rank, ratio, ..
            }) => format!(
                "health step {step}: rank {rank} is a straggler: {ratio:.2}× the median work time of its pipeline stage over the last two windows"
            ),
            HealthEvent::Run(EventKind::Rewind {
                step,
                reason,
                to_step,
                skipped_batches,
                ..
            }) => {
                let list: Vec<String> = skipped_batches.iter().map(u64::to_string).collect();
                format!(
                    "health step {step}: {reason}: rewinding to {}, leaving out the batch(es) of step(s) {}",
                    if *to_step == 0 {
                        "the start".to_owned()
                    } else {
                        format!("the checkpoint of step {to_step}")
                    },
                    list.join(", ")
                )
            }
            HealthEvent::Run(EventKind::Checkpoint {
                step,
                background,
                stall_s,
                waited_s,
                write_s,
                bytes,
            }) => format!(
                "checkpoint step {step}: {}B a rank written in {write_s:.2} s{}; training stood still {:.0} ms{}",
                si(*bytes as f64),
                if *background {
                    " in the background"
                } else {
                    ""
                },
                stall_s * 1e3,
                if *waited_s > 0.0 {
                    format!(" ({:.0} ms of it waiting for the write)", waited_s * 1e3)
                } else {
                    String::new()
                }
            ),
            HealthEvent::Run(other) => format!("health: {}", other.name()),
        };
        self.line(&s);
    }

    fn finish(&mut self, s: &Summary) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        say(&format!(
            "done            {} steps in {:.1} s; val loss {:.4} -> {}",
            s.steps,
            s.wall_s,
            s.initial_eval_loss,
            with_floor(s.final_eval_loss, s.floor)
        ));
        if let Some(f) = s.floor {
            say(&format!(
                "gap to floor    {:.4} nats",
                s.final_eval_loss - f
            ));
        }
        say(&format!(
            "throughput      {:.0} tokens/s, {}FLOP/s{}",
            s.tokens_per_s,
            si(s.flops_per_s),
            of_peak(
                s.utilisation,
                if self.peak_source.starts_with("measured") {
                    "the measured matmul peak"
                } else {
                    "the datasheet peak (MFU)"
                }
            )
        ));
        if s.operand_copy_bytes > 0 {
            say(&format!(
                "operand copies  {}B held by the mixed-precision products' threads (rounded or packed operands kept for the next product; on top of the per-rank memory above)",
                si(s.operand_copy_bytes as f64)
            ));
        }
        if let Some(b) = &s.pipeline_bubble {
            say(&format!(
                "pipeline        {} bubble {:.1}% per step measured, {:.1}% predicted by the simulator from the measured costs (trace.json)",
                b.schedule,
                100.0 * b.measured,
                100.0 * b.predicted
            ));
        }
        if let Some(t) = &s.traffic_per_step {
            let p = t.payload;
            let parts: Vec<String> = [
                ("tp", p.tp),
                ("dp", p.dp),
                ("pp", p.pp),
                ("cp", p.cp),
                ("ep", p.ep),
                ("other", p.other),
            ]
            .iter()
            .filter(|(_, b)| *b > 0.0)
            .map(|(n, b)| format!("{n} {}B", si(*b)))
            .collect();
            let sc = t.scalars;
            say(&format!(
                "traffic         per step, all ranks: {} (+ {}B of losses and norms)",
                if parts.is_empty() {
                    "none".to_owned()
                } else {
                    parts.join(", ")
                },
                si(sc.tp + sc.dp + sc.pp + sc.cp + sc.ep + sc.other)
            ));
        }
        if let Some(v) = s.final_max_vio {
            say(&format!(
                "expert load     MaxVio {v:.3} at the last step (expert_load.jsonl)"
            ));
        }
        if s.skipped_steps > 0 {
            say(&format!("skipped steps   {}", s.skipped_steps));
        }
        let files: Vec<&str> = [
            "config.toml",
            "metrics.jsonl",
            "summary.json",
            "trace.json",
            "expert_load.jsonl",
        ]
        .into_iter()
        .filter(|f| s.run_dir.join(f).is_file())
        .collect();
        say(&format!(
            "written         {}/{{{}}}  (weft viz {0})",
            s.run_dir.display(),
            files.join(", ")
        ));
    }
}

/// A byte-count progress display for `weft data prepare`: a bar with
/// documents/s, tokens/s and the ETA on a terminal, a line every few
/// seconds otherwise.
pub struct Bytes {
    bar: Option<ProgressBar>,
    last_line: Option<std::time::Instant>,
    what: &'static str,
}

impl Bytes {
    /// A display of `what` (e.g. `"preparing"`).
    pub fn new(what: &'static str) -> Self {
        Self {
            bar: None,
            last_line: None,
            what,
        }
    }

    /// Shows `p`.
    pub fn update(&mut self, p: &weft_data::Progress) {
        let secs = p.elapsed.as_secs_f64().max(1e-9);
        let rates = format!(
            "{} docs, {}docs/s, {}tokens/s, {} shards",
            p.documents,
            si(p.documents as f64 / secs),
            si(p.tokens as f64 / secs),
            p.shards
        );
        if std::io::stdout().is_terminal() {
            let bar = self.bar.get_or_insert_with(|| {
                let b = ProgressBar::new(p.bytes_total);
                b.set_style(
                    ProgressStyle::with_template(
                        "{prefix} [{bar:30}] {bytes}/{total_bytes} ({bytes_per_sec}, ETA {eta}) {msg}",
                    )
                    .expect("a valid template")
                    .progress_chars("=> "),
                );
                b.set_prefix(self.what);
                b
            });
            bar.set_position(p.bytes_read);
            bar.set_message(rates);
        } else if self
            .last_line
            .is_none_or(|t| t.elapsed() >= std::time::Duration::from_secs(5))
        {
            self.last_line = Some(std::time::Instant::now());
            let eta = if p.bytes_read > 0 && p.bytes_total > p.bytes_read {
                format!(
                    ", ETA {:.0} s",
                    secs * (p.bytes_total - p.bytes_read) as f64 / p.bytes_read as f64
                )
            } else {
                String::new()
            };
            say(&format!(
                "{} {:.1}% of {} input bytes: {rates}{eta}",
                self.what,
                100.0 * p.bytes_read as f64 / p.bytes_total.max(1) as f64,
                p.bytes_total
            ));
        }
    }

    /// Removes the bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish_and_clear();
        }
    }
}

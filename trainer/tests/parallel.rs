//! Multi-rank `weft train`: data parallelism over thread ranks gives
//! bitwise the single rank's run when reductions are reproducible.

use std::path::Path;

use weft_trainer::config::Config;
use weft_trainer::train::{Observer, RunInfo, Silent, TrainError, train};

/// Keeps the start-up report.
#[derive(Default)]
struct Info(Option<RunInfo>);
impl Observer for Info {
    fn start(&mut self, info: &RunInfo) {
        self.0 = Some(info.clone());
    }
}

fn config(dir: &Path, name: &str, extra: &[&str]) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "train.steps=6",
        "train.eval_every=3",
        "train.eval_sequences=6",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "checkpoint.every=0",
        "data.synthetic.regular=40",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={:?}", dir.display().to_string()),
        format!("run.name={name}"),
    ])
    .collect();
    Config::load(None, &sets).unwrap()
}

/// Every metrics line's loss and grad norm, and every eval line's loss, as
/// JSON text (which round-trips f64 bits).
fn trace(run: &Path) -> Vec<String> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            format!(
                "{} {} {} {}",
                v["step"], v["loss"], v["grad_norm"], v["val_loss"]
            )
        })
        .collect()
}

fn tmp(tag: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("weft-par-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

#[test]
fn data_parallel_is_bitwise_the_single_rank_run() {
    let dir = tmp("dp");
    let one = train(&config(&dir, "dp1", &[]), false, &mut Silent).unwrap();
    let reference = trace(&one.run_dir);
    assert_eq!(reference.len(), 6 + 3, "{reference:?}");
    for dp in [2, 4] {
        let name = format!("dp{dp}");
        let set = format!("parallel.dp={dp}");
        let s = train(&config(&dir, &name, &[&set]), false, &mut Silent).unwrap();
        assert_eq!(trace(&s.run_dir), reference, "dp={dp}");
        assert_eq!(s.final_eval_loss.to_bits(), one.final_eval_loss.to_bits());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// On defaults (`train.micro_batch_size = 0`) the micro-batches do not
/// depend on the layout, so changing only the layout changes no bit: one
/// rank, dp 2, and pp 3 × dp 2 with full sharding (the cases) are
/// bitwise equal; where the data-parallel ranks cannot share the default
/// micro-batches (dp 4 of 2), the start-up report names the setting to pin.
#[test]
fn layouts_on_default_micro_batches_are_bitwise_the_single_rank_run() {
    let dir = tmp("default-micro");
    // 16 sequences of 64 tokens: default micro-batches of 8 (512 tokens)
    let defaults = [
        "train.micro_batch_size=0",
        "model.n_layer=3",
        "model.block_size=64",
        "train.batch_size=16",
        "train.steps=3",
    ];
    let run = |name: &str, layout: &[&str]| {
        let sets: Vec<&str> = defaults.iter().chain(layout).copied().collect();
        let mut info = Info::default();
        let s = train(&config(&dir, name, &sets), false, &mut info).unwrap();
        (trace(&s.run_dir), info.0.unwrap().micro_batches)
    };
    let (one, split) = run("one", &[]);
    assert_eq!(
        split,
        "2 micro-batches of 8 sequences (2 per data-parallel rank)"
    );
    for (name, layout) in [
        ("dp2", &["parallel.dp=2"][..]),
        (
            "pp3dp2",
            &["parallel.pp=3", "parallel.dp=2", "parallel.fsdp=\"full\""],
        ),
    ] {
        let (got, split) = run(name, layout);
        assert_eq!(got, one, "{name} on defaults");
        assert!(
            split.starts_with("2 micro-batches of 8 sequences"),
            "{split}"
        );
    }
    let (_, split) = run("dp4", &["parallel.dp=4"]);
    assert!(
        split.contains("chosen from this layout") && split.contains("train.micro_batch_size = 4"),
        "{split}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn data_parallel_moe_balances_on_the_global_batch() {
    let dir = tmp("moe");
    let moe = ["model.moe.experts=4", "model.moe.top_k=2"];
    let one = train(&config(&dir, "m1", &moe), false, &mut Silent).unwrap();
    let two = [moe[0], moe[1], "parallel.dp=2"];
    let s = train(&config(&dir, "m2", &two), false, &mut Silent).unwrap();
    assert_eq!(trace(&s.run_dir), trace(&one.run_dir));
    // The expert-load log counts the whole global batch, as one rank does.
    let load = |run: &Path| -> Vec<String> {
        std::fs::read_to_string(run.join("expert_load.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["tokens_per_expert"].to_string()
            })
            .collect()
    };
    assert_eq!(load(&s.run_dir), load(&one.run_dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn plain_reductions_agree_to_rounding() {
    let dir = tmp("plain");
    let one = train(
        &config(&dir, "p1", &["parallel.reproducible=false"]),
        false,
        &mut Silent,
    )
    .unwrap();
    let two = train(
        &config(
            &dir,
            "p2",
            &["parallel.reproducible=false", "parallel.dp=2"],
        ),
        false,
        &mut Silent,
    )
    .unwrap();
    // every loss, gradient norm and validation loss within ROUNDING (the
    // split changes the sums' rounding, nothing more)
    close(&one.run_dir, &two.run_dir, ROUNDING);
    // Without exact sums the split shows in the last bits: what the
    // reproducible mode removes.
    assert_ne!(trace(&one.run_dir), trace(&two.run_dir));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_layouts_are_clear_errors() {
    let dir = tmp("bad");
    let e = Config::load(None, &["parallel.dp=3".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("dp = 3") && e.contains("train.batch_size"),
        "{e}"
    );
    let e = Config::load(None, &["parallel.ep=2".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("parallel.ep") && e.contains("experts"), "{e}");
    // A configuration built in code is validated by train itself.
    let mut c = config(&dir, "bad-split", &[]);
    c.parallel.dp = 3;
    let e = train(&c, false, &mut Silent).unwrap_err();
    assert!(matches!(e, TrainError::Config(_)), "{e}");
    assert!(e.to_string().contains("dp = 3"), "{e}");
    // A rank that fails takes the others down with its own error, not a hang.
    std::fs::create_dir_all(dir.join("taken")).unwrap();
    let e = train(
        &config(&dir, "taken", &["parallel.dp=2"]),
        false,
        &mut Silent,
    )
    .unwrap_err();
    assert!(matches!(e, TrainError::RunExists(_)), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        let target = to.join(e.file_name());
        if e.file_type().unwrap().is_dir() {
            copy_dir(&e.path(), &target);
        } else {
            std::fs::copy(e.path(), target).unwrap();
        }
    }
}

/// `train.precision = "bf16"`: the start-up report names it; data
/// parallelism with full sharding is bitwise the one-rank bf16 run; bf16
/// is not fp32 but within 1% of it; a resumed bf16 run continues bit for
/// bit (the master weights are what the checkpoint holds).
#[test]
fn bf16_runs_shard_resume_and_track_fp32() {
    let dir = tmp("bf16");
    let bf16 = ["train.precision=\"bf16\"", "checkpoint.every=3"];
    let mut info = Info::default();
    let one = train(&config(&dir, "bf1", &bf16), false, &mut info).unwrap();
    let info = info.0.unwrap();
    assert_eq!(info.precision.name(), "bf16");
    assert!(
        info.layout.contains("bf16 mixed precision"),
        "{}",
        info.layout
    );
    // the products' inputs kept in bf16: fewer activation bytes than the
    // same layout plans in fp32, which the report also gives
    let fp32_acts = info
        .fp32_activation_bytes
        .expect("a bf16 run reports fp32's");
    assert!(
        info.activation_bytes < fp32_acts,
        "{} vs {fp32_acts}",
        info.activation_bytes
    );
    let mut f32_info = Info::default();
    let f32_run = train(
        &config(&dir, "f1", &["checkpoint.every=3"]),
        false,
        &mut f32_info,
    )
    .unwrap();
    let f32_info = f32_info.0.unwrap();
    assert_eq!(
        f32_info.activation_bytes, fp32_acts,
        "fp32's plan is the fp32 run's"
    );
    assert_eq!(f32_info.fp32_activation_bytes, None);
    assert_ne!(
        trace(&one.run_dir),
        trace(&f32_run.run_dir),
        "bf16 is not fp32"
    );
    close(&one.run_dir, &f32_run.run_dir, 1e-2);
    let sharded: Vec<&str> = bf16
        .iter()
        .copied()
        .chain(["parallel.dp=2", "parallel.fsdp=\"full\""])
        .collect();
    let dp = train(&config(&dir, "bf2", &sharded), false, &mut Silent).unwrap();
    assert_eq!(trace(&dp.run_dir), trace(&one.run_dir));
    let again = dir.join("bf2-again");
    copy_dir(&dp.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "bf2-again", &sharded), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&dp.run_dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train.recompute`: the start-up report gives the activation bytes
/// with and without it; `full`, `every:2` and `selective` train the bits of `none` on
/// one rank and over pipeline stages with FSDP; a run saved with
/// recomputation resumes without it bit for bit (the policy is not part
/// of the model's state).
#[test]
fn recomputation_trains_the_same_bits_with_fewer_activations() {
    let dir = tmp("recompute");
    // four blocks: `every:2` recomputes two, and keeps one block's
    // activations for the recomputation
    let base = ["checkpoint.every=3", "model.n_layer=4"];
    let none = train(&config(&dir, "r0", &base), false, &mut Silent).unwrap();
    for (name, policy) in [
        ("r1", "\"full\""),
        ("r2", "\"every:2\""),
        ("r4", "\"selective\""),
    ] {
        let set = format!("train.recompute={policy}");
        let mut info = Info::default();
        let run = train(
            &config(&dir, name, &["checkpoint.every=3", "model.n_layer=4", &set]),
            false,
            &mut info,
        )
        .unwrap();
        let info = info.0.unwrap();
        let (r, without) = info.without_recompute.expect("reported");
        assert_eq!(format!("\"{r}\""), policy);
        assert!(info.activation_bytes < without, "{policy}: {info:?}");
        assert_eq!(trace(&run.run_dir), trace(&none.run_dir), "{policy}");
    }
    let piped = [
        "checkpoint.every=3",
        "model.n_layer=4",
        "train.recompute=\"full\"",
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.fsdp=\"full\"",
        "parallel.pp_schedule=\"zb-h1\"",
    ];
    let pp = train(&config(&dir, "r3", &piped), false, &mut Silent).unwrap();
    assert_eq!(trace(&pp.run_dir), trace(&none.run_dir), "pp x fsdp");
    // saved with recomputation at step 3, resumed without it
    let again = dir.join("r1-again");
    copy_dir(&dir.join("r1"), &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "r1-again", &base), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&none.run_dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train.loss_chunk`: the start-up report gives the head's activation
/// bytes with and without it; micro-batches of 1088 tokens in chunks of
/// 1024 train the bits of the whole micro-batch's loss, on one rank and
/// over tp × pp with a split backward; a run saved with chunks resumes
/// without them bit for bit; a chunk that is not whole blocks is refused.
#[test]
fn a_chunked_loss_trains_the_same_bits_with_a_smaller_head() {
    let dir = tmp("loss-chunk");
    let base = [
        "model.block_size=64",
        "train.batch_size=34",
        "train.micro_batch_size=17",
        "checkpoint.every=3",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    let whole = train(&config(&dir, "c0", &base), false, &mut Silent).unwrap();
    let mut info = Info::default();
    let chunked = with(&["train.loss_chunk=1024"]);
    let run = train(&config(&dir, "c1", &chunked), false, &mut info).unwrap();
    let info = info.0.unwrap();
    let (n, head, unchunked) = info.loss_chunk.expect("reported");
    assert_eq!(n, 1024);
    // at least the logits of the 64 tokens past the chunk fewer (vocabulary 40)
    assert!(
        head < unchunked && unchunked - head >= 64 * 4 * 40,
        "{info:?}"
    );
    assert_eq!(trace(&run.run_dir), trace(&whole.run_dir));
    let layout = [
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.pp=2",
        "parallel.pp_schedule=\"zb-h1\"",
    ];
    let laid = train(&config(&dir, "c2", &with(&layout)), false, &mut Silent).unwrap();
    let mut both = with(&layout);
    both.push("train.loss_chunk=1024");
    let laid_chunked = train(&config(&dir, "c3", &both), false, &mut Silent).unwrap();
    assert_eq!(
        trace(&laid_chunked.run_dir),
        trace(&laid.run_dir),
        "tp x pp"
    );
    // saved with chunks at step 3, resumed without them
    let again = dir.join("c1-again");
    copy_dir(&dir.join("c1"), &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "c1-again", &base), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&whole.run_dir));
    let sets = ["train.loss_chunk=1000".to_owned()];
    let err = Config::load(None, &sets).unwrap_err().to_string();
    assert!(
        err.contains("train.loss_chunk") && err.contains("multiple of 1024"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// fp16 with dynamic loss scaling. A first scale of 2^30 overflows fp16
/// (the logits' gradient times 2^30 is far beyond 65504), so the first
/// steps are skipped as `overflow` events with the scale backing off by
/// 2^-8, then the run trains; every step line carries its scale. dp=2
/// with FSDP gives the one-rank bits, and a run resumed from a checkpoint
/// taken after the overflows continues bit for bit (the scaler's state
/// is in the checkpoint: a resumed run starting again from 2^30 would
/// skip again). With a scale that fits from the start, fp16 is a
/// different run from fp32, within 1% of it.
#[test]
fn fp16_backs_its_loss_scale_off_on_overflow_and_resumes_it() {
    let dir = tmp("fp16");
    let fp16 = [
        "train.precision=\"fp16\"",
        "train.loss_scale.init=1073741824",
        "train.loss_scale.max=1073741824",
        "train.loss_scale.backoff=0.00390625",
        "checkpoint.every=3",
    ];
    let lines = |run: &Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(run.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let scales = |run: &Path| -> Vec<f64> {
        lines(run)
            .iter()
            .filter(|v| v.get("event").is_none())
            .map(|v| v["loss_scale"].as_f64().unwrap())
            .collect()
    };
    let mut info = Info::default();
    let one = train(&config(&dir, "h1", &fp16), false, &mut info).unwrap();
    let layout = info.0.unwrap().layout;
    assert!(layout.contains("fp16 mixed precision"), "{layout}");
    let overflows: Vec<serde_json::Value> = lines(&one.run_dir)
        .into_iter()
        .filter(|v| v["event"] == "overflow")
        .collect();
    assert!(!overflows.is_empty(), "2^30 overflows fp16");
    assert_eq!(overflows[0]["loss_scale"], 2f64.powi(30));
    assert_eq!(overflows[0]["next_loss_scale"], 2f64.powi(22));
    let s = scales(&one.run_dir);
    assert_eq!(s.len(), 6);
    assert_eq!(s[0], 2f64.powi(30));
    assert!(s.windows(2).all(|w| w[1] <= w[0]), "{s:?}");
    assert_eq!(one.skipped_steps, overflows.len() as u64);
    assert!(one.skipped_steps < 5, "the scale came down: {s:?}");
    assert!(one.final_train_loss.is_finite());
    // the fp16 copies of the operands are kept, counted and reported
    assert!(one.operand_copy_bytes > 0);
    let sharded: Vec<&str> = fp16
        .iter()
        .copied()
        .chain(["parallel.dp=2", "parallel.fsdp=\"full\""])
        .collect();
    let dp = train(&config(&dir, "h2", &sharded), false, &mut Silent).unwrap();
    assert_eq!(trace(&dp.run_dir), trace(&one.run_dir));
    assert_eq!(scales(&dp.run_dir), s);
    let again = dir.join("h2-again");
    copy_dir(&dp.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "h2-again", &sharded), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&dp.run_dir));
    assert_eq!(scales(&resumed.run_dir), s);
    let fits = ["train.precision=\"fp16\"", "train.loss_scale.init=1024"];
    let h = train(&config(&dir, "h3", &fits), false, &mut Silent).unwrap();
    let f = train(&config(&dir, "f3", &[]), false, &mut Silent).unwrap();
    assert_eq!(h.skipped_steps, 0);
    assert_ne!(trace(&h.run_dir), trace(&f.run_dir), "fp16 is not fp32");
    close(&h.run_dir, &f.run_dir, 1e-2);
    let e = Config::load(None, &["train.loss_scale.backoff=2".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.loss_scale.backoff") && e.contains("(0, 1)"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `parallel.grad_wire = "bf16"`: FSDP reduce-scatters bf16 gradients —
/// a different run from the f32 wire, within 1% of it, and (reproducible
/// sums: exact, rounded once) bitwise the same on 2 and 4 data-parallel
/// ranks; replicas all-reduce them the same way (the same bits as FSDP's
/// with reproducible sums; with plain sums in bf16 buckets, counted by
/// the memory report and within 1% of the f32 wire).
#[test]
fn bf16_gradients_on_the_wire_keep_layout_invariance() {
    let dir = tmp("wire");
    let f32_wire = ["parallel.fsdp=\"full\"", "parallel.dp=2"];
    let a = train(&config(&dir, "w32", &f32_wire), false, &mut Silent).unwrap();
    let mut info = Info::default();
    let bf16 = ["parallel.fsdp=\"full\"", "parallel.grad_wire=\"bf16\""];
    let two: Vec<&str> = bf16.iter().copied().chain(["parallel.dp=2"]).collect();
    let b = train(&config(&dir, "w16", &two), false, &mut info).unwrap();
    let layout = info.0.unwrap().layout;
    assert!(layout.contains("bf16 gradients on the wire"), "{layout}");
    assert_ne!(
        trace(&a.run_dir),
        trace(&b.run_dir),
        "the bf16 wire is taken"
    );
    close(&a.run_dir, &b.run_dir, 1e-2);
    let four: Vec<&str> = bf16.iter().copied().chain(["parallel.dp=4"]).collect();
    let c = train(&config(&dir, "w16x4", &four), false, &mut Silent).unwrap();
    assert_eq!(trace(&c.run_dir), trace(&b.run_dir));
    // replicas
    let wire = "parallel.grad_wire=\"bf16\"";
    let mut info = Info::default();
    let r = train(
        &config(&dir, "r16", &["parallel.dp=2", wire]),
        false,
        &mut info,
    )
    .unwrap();
    let info = info.0.unwrap();
    assert!(
        info.layout.contains("bf16 gradients on the wire"),
        "{}",
        info.layout
    );
    assert_eq!(trace(&r.run_dir), trace(&b.run_dir), "replicas = FSDP");
    let plain = ["parallel.dp=2", wire, "parallel.reproducible=false"];
    let mut info = Info::default();
    let p = train(&config(&dir, "p16", &plain), false, &mut info).unwrap();
    let info = info.0.unwrap();
    assert_eq!(info.memory, info.predicted_memory);
    let f32_plain = ["parallel.dp=2", "parallel.reproducible=false"];
    let mut info32 = Info::default();
    let p32 = train(&config(&dir, "p32", &f32_plain), false, &mut info32).unwrap();
    let info32 = info32.0.unwrap();
    // the bf16 buckets: 2 bytes per gradient beside the f32 ones
    assert_eq!(info.memory.comm, info32.memory.comm + info.memory.grads / 2);
    assert_ne!(trace(&p.run_dir), trace(&p32.run_dir));
    close(&p.run_dir, &p32.run_dir, 1e-2);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn expert_parallel_equals_replicated_experts_to_rounding_and_resumes_bit_for_bit() {
    let dir = tmp("ep");
    let moe = [
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "parallel.dp=2",
        "checkpoint.every=3",
    ];
    let replicated = train(&config(&dir, "ep1", &moe), false, &mut Silent).unwrap();
    let with_ep: Vec<&str> = moe.iter().copied().chain(["parallel.ep=2"]).collect();
    let sharded = train(&config(&dir, "ep2", &with_ep), false, &mut Silent).unwrap();
    // Experts on other ranks sum their tokens' gradients in another order:
    // equal to rounding, not bitwise.
    let num = |run: &Path| -> Vec<f64> {
        trace(run)
            .iter()
            .flat_map(|l| {
                l.split(' ')
                    .skip(1)
                    .map(|x| x.parse::<f64>().unwrap_or(0.0))
            })
            .collect()
    };
    let (a, b) = (num(&replicated.run_dir), num(&sharded.run_dir));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert!((x - y).abs() <= ROUNDING * x.abs().max(1.0), "{x} vs {y}");
    }
    // The checkpoint holds the whole model (every expert), as a single
    // rank's would.
    let ckpt =
        weft_checkpoint::Checkpoint::open(&sharded.run_dir.join("checkpoints/step-00000006"))
            .unwrap();
    ckpt.verify().unwrap();
    let experts = &ckpt.manifest().tensors["transformer.h.0.mlp.experts.c_fc.weight"];
    assert_eq!(experts.shape[0], 4, "all four experts saved");
    // Lose the last checkpoint and resume from step 3: bit for bit.
    let again = dir.join("ep2-again");
    copy_dir(&sharded.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let mut c = config(&dir, "ep2-again", &with_ep);
    c.run.name = "ep2-again".into();
    let resumed = train(&c, true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&sharded.run_dir));
    let _ = std::fs::remove_dir_all(&dir);
}

/// How far apart (relative) two layouts' losses, gradient norms and
/// validation losses may be when their reductions are split differently:
/// measured on these 6-step runs at most 2.8e-8 (tp), 1.2e-8 (ep), 2.4e-8
/// (tp × MoE) — a quarter of an f32 rounding step (1.2e-7) — and allowed
/// at 1e-6, a few f32 steps, for other CPUs' kernels.
const ROUNDING: f64 = 1e-6;

fn close(a: &Path, b: &Path, tol: f64) {
    let num = |run: &Path| -> Vec<f64> {
        trace(run)
            .iter()
            .flat_map(|l| {
                l.split(' ')
                    .skip(1)
                    .map(|x| x.parse::<f64>().unwrap_or(0.0))
            })
            .collect()
    };
    let (x, y) = (num(a), num(b));
    assert_eq!(x.len(), y.len());
    for (p, q) in x.iter().zip(&y) {
        assert!((p - q).abs() <= tol * p.abs().max(1.0), "{p} vs {q}");
    }
}

#[test]
fn tensor_parallel_equals_one_rank_to_rounding_and_resumes_bit_for_bit() {
    let dir = tmp("tp");
    let base = ["checkpoint.every=3"];
    let mut info1 = Info::default();
    let one = train(&config(&dir, "tp1", &base), false, &mut info1).unwrap();
    // Split reductions round differently: equal to rounding (the layers'
    // own tests bound the difference per tensor), not bitwise.
    let mut info2 = Info::default();
    let two = train(
        &config(&dir, "tp2", &["checkpoint.every=3", "parallel.tp=2"]),
        false,
        &mut info2,
    )
    .unwrap();
    close(&one.run_dir, &two.run_dir, ROUNDING);
    // Per-rank memory: the split layers halve, the replicated ones stay.
    let (m1, m2) = (info1.0.unwrap(), info2.0.unwrap());
    assert_eq!(m2.layout, "tp=2 reproducible sums");
    assert_eq!(m1.params, m2.params, "the same model");
    let (p1, p2) = (m1.memory.params, m2.memory.params);
    assert!(p2 < p1 * 6 / 10 && p2 > p1 / 2, "{p1} -> {p2}");
    assert_eq!(m2.memory.grads, p2);
    assert_eq!(m2.memory.optimizer, 2 * p2);
    // tp × dp: the data-parallel replicas of a tp=2 model.
    let mesh = ["checkpoint.every=3", "parallel.tp=2", "parallel.dp=2"];
    let four = train(&config(&dir, "tp2dp2", &mesh), false, &mut Silent).unwrap();
    close(&one.run_dir, &four.run_dir, ROUNDING);
    // With sequence parallelism: the same to rounding.
    let sp = [
        "checkpoint.every=3",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
    ];
    let seq = train(&config(&dir, "tp2sp", &sp), false, &mut Silent).unwrap();
    close(&one.run_dir, &seq.run_dir, ROUNDING);
    // The checkpoint is whole, and a resumed tp run continues bit for bit.
    let again = dir.join("tp2dp2-again");
    copy_dir(&four.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "tp2dp2-again", &mesh), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&four.run_dir));
    let e = Config::load(None, &["parallel.tp=3".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("parallel.tp") && e.contains("heads"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Key/value heads replicated over tensor parallelism (a Llama-family
/// model with 4 query heads and one key/value head at tp 4: every rank
/// holds a copy of it): the run follows one rank to rounding, resumes bit
/// for bit from its own checkpoint (each copy written once, read into
/// every replica), and its checkpoint resumes at tp 1 and tp 2, and one
/// rank's at tp 4, each following the one-rank run to rounding.
#[test]
fn replicated_key_value_heads_resume_on_other_layouts() {
    let dir = tmp("kvcopies");
    let llama = [
        "model.arch=llama",
        "model.n_head=4",
        "model.n_kv_head=1",
        "checkpoint.every=3",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        llama.iter().chain(extra).copied().collect()
    };
    let (tp1, tp2, tp4) = (
        with(&[]),
        with(&["parallel.tp=2"]),
        with(&["parallel.tp=4"]),
    );
    let one = train(&config(&dir, "one", &tp1), false, &mut Silent).unwrap();
    let four = train(&config(&dir, "four", &tp4), false, &mut Silent).unwrap();
    close(&one.run_dir, &four.run_dir, ROUNDING);
    for (from, to, name, exact) in [
        (&four.run_dir, &tp4, "4-to-4", true),
        (&four.run_dir, &tp1, "4-to-1", false),
        (&four.run_dir, &tp2, "4-to-2", false),
        (&one.run_dir, &tp4, "1-to-4", false),
    ] {
        let again = dir.join(name);
        copy_dir(from, &again);
        std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
        let resumed = train(&config(&dir, name, to), true, &mut Silent).unwrap();
        if exact {
            assert_eq!(trace(&resumed.run_dir), trace(&four.run_dir), "{name}");
        } else {
            close(&one.run_dir, &resumed.run_dir, ROUNDING);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tensor_parallel_moe_follows_the_single_rank_run() {
    let dir = tmp("tp-moe");
    let moe = ["model.moe.experts=4", "model.moe.top_k=2"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        moe.iter().chain(extra).copied().collect()
    };
    let one = train(&config(&dir, "one", &moe), false, &mut Silent).unwrap();
    // Attention and the dense parts split over tp; the experts replicated
    // over tp, and also shared out over an expert group.
    for (name, sets) in [
        ("tp2", with(&["parallel.tp=2"])),
        (
            "tp2-sp",
            with(&["parallel.tp=2", "parallel.sequence_parallel=true"]),
        ),
        (
            "tp2-ep2-dp2",
            with(&["parallel.tp=2", "parallel.dp=2", "parallel.ep=2"]),
        ),
    ] {
        let run = train(&config(&dir, name, &sets), false, &mut Silent).unwrap();
        close(&one.run_dir, &run.run_dir, ROUNDING);
        let load = |r: &Path| std::fs::read_to_string(r.join("expert_load.jsonl")).unwrap();
        assert_eq!(load(&run.run_dir).lines().count(), 6 * 2, "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Checkpoints are whole, so a run saved on one layout resumes on
/// another: bit for bit where the layouts are bitwise-equivalent (8 ranks
/// of pp × dp × FSDP and 1 rank), to rounding where tensor parallelism
/// changes the sums (1 rank to pp × dp × tp on 8 ranks).
/// Context parallelism through `weft train`: cp = 2 (and cp = 2 with
/// dp = 2) follows one rank to rounding (the weight gradients sum each
/// rank's tokens apart: not bitwise), holds about half the activations a
/// rank, resumes bit for bit from its own checkpoint, its checkpoint
/// resumes on one rank and one rank's on cp = 2 × dp = 2, and its trace
/// has the ring's lanes.
#[test]
fn context_parallel_follows_one_rank_and_resumes_across_layouts() {
    let dir = tmp("cp");
    let base = [
        "checkpoint.every=3",
        "model.block_size=256",
        "run.trace_steps=2",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    let cp2 = with(&["parallel.cp=2"]);
    let cp2dp2 = with(&["parallel.cp=2", "parallel.dp=2"]);
    let mut info1 = Info::default();
    let one = train(&config(&dir, "one", &with(&[])), false, &mut info1).unwrap();
    let mut info2 = Info::default();
    let two = train(&config(&dir, "cp2", &cp2), false, &mut info2).unwrap();
    close(&one.run_dir, &two.run_dir, ROUNDING);
    let (m1, m2) = (info1.0.unwrap(), info2.0.unwrap());
    assert_eq!(m2.layout, "cp=2 reproducible sums");
    assert_eq!(m1.memory.params, m2.memory.params, "parameters replicated");
    let (a1, a2) = (m1.memory.activations, m2.memory.activations);
    assert!(a2 < a1 * 6 / 10 && a2 > a1 / 3, "activations {a1} -> {a2}");
    let four = train(&config(&dir, "cp2dp2", &cp2dp2), false, &mut Silent).unwrap();
    close(&one.run_dir, &four.run_dir, ROUNDING);
    let t: weft_trace::Trace =
        serde_json::from_str(&std::fs::read_to_string(two.run_dir.join("trace.json")).unwrap())
            .unwrap();
    for lane in ["exchange kv", "wait kv"] {
        assert!(
            t.trace_events.iter().any(|e| e.name == lane),
            "no {lane} spans in the trace"
        );
    }
    for (from, to, name, exact) in [
        (&two.run_dir, &cp2, "cp2-again", true),
        (&two.run_dir, &with(&[]), "cp2-to-1", false),
        (&one.run_dir, &cp2dp2, "1-to-cp2dp2", false),
    ] {
        let again = dir.join(name);
        copy_dir(from, &again);
        std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
        let resumed = train(&config(&dir, name, to), true, &mut Silent).unwrap();
        if exact {
            assert_eq!(trace(&resumed.run_dir), trace(from), "{name}");
        } else {
            close(&one.run_dir, &resumed.run_dir, ROUNDING);
        }
    }
    // a mixture of experts routed per token and balanced by the selection
    // bias, whose load every cp rank sums before updating it
    let moe = with(&["model.moe.experts=4", "model.moe.top_k=2"]);
    let moe_cp = [
        &moe[..],
        &["parallel.cp=2", "parallel.dp=2", "parallel.ep=2"],
    ]
    .concat();
    let a = train(&config(&dir, "moe1", &moe), false, &mut Silent).unwrap();
    let b = train(&config(&dir, "moe-cp2", &moe_cp), false, &mut Silent).unwrap();
    // (rounding that this config's learning rate of 1e-2 amplifies: the
    // gradient norms 7e-9 apart at the first step, 8e-6 at the fifth)
    close(&a.run_dir, &b.run_dir, 1e-4);
    // the load the bias balances (and expert_load.jsonl logs) is every
    // token's: summed over the cp ranks as over the data-parallel ones
    let routed = |r: &Path| -> Vec<u64> {
        std::fs::read_to_string(r.join("expert_load.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                v["tokens_per_expert"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap())
                    .sum()
            })
            .collect()
    };
    assert_eq!(routed(&b.run_dir), routed(&a.run_dir));
    for (sets, what) in [
        (vec!["parallel.cp=3", "model.block_size=256"], "64"),
        (
            vec![
                "parallel.cp=2",
                "model.block_size=256",
                "model.moe.experts=4",
                "model.moe.balance=\"aux\"",
            ],
            "balance",
        ),
    ] {
        let sets: Vec<String> = sets.into_iter().map(String::from).collect();
        let e = Config::load(None, &sets).unwrap_err().to_string();
        assert!(e.contains("parallel.cp") && e.contains(what), "{e}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_run_resumes_on_another_layout() {
    let dir = tmp("relayout");
    let base = ["checkpoint.every=3", "train.micro_batch_size=1"];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    let eight = with(&["parallel.pp=2", "parallel.dp=4", "parallel.fsdp=full"]);
    let eight_tp = with(&["parallel.pp=2", "parallel.dp=2", "parallel.tp=2"]);
    let one = train(&config(&dir, "one", &with(&[])), false, &mut Silent).unwrap();
    let wide = train(&config(&dir, "eight", &eight), false, &mut Silent).unwrap();
    assert_eq!(trace(&wide.run_dir), trace(&one.run_dir), "8 ranks vs 1");
    for (from, to, name, exact) in [
        (&wide.run_dir, &with(&[]), "8-to-1", true),
        (&one.run_dir, &eight, "1-to-8", true),
        (&one.run_dir, &eight_tp, "1-to-8-tp", false),
    ] {
        let again = dir.join(name);
        copy_dir(from, &again);
        std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
        let resumed = train(&config(&dir, name, to), true, &mut Silent).unwrap();
        if exact {
            assert_eq!(trace(&resumed.run_dir), trace(&one.run_dir), "{name}");
        } else {
            close(&one.run_dir, &resumed.run_dir, ROUNDING);
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sharded_data_parallel_is_bitwise_the_single_rank_run() {
    let dir = tmp("fsdp");
    let one = train(&config(&dir, "single", &[]), false, &mut Silent).unwrap();
    let reference = trace(&one.run_dir);
    for (name, sets) in [
        ("full1", &["parallel.fsdp=\"full\""][..]),
        ("full2", &["parallel.fsdp=\"full\"", "parallel.dp=2"][..]),
        ("full4", &["parallel.fsdp=\"full\"", "parallel.dp=4"][..]),
        (
            "grad_op2",
            &["parallel.fsdp=\"grad_op\"", "parallel.dp=2"][..],
        ),
        (
            "optimizer4",
            &["parallel.fsdp=\"optimizer\"", "parallel.dp=4"][..],
        ),
        (
            "hybrid4",
            &[
                "parallel.fsdp=\"hybrid\"",
                "parallel.dp=4",
                "parallel.hybrid_shard=2",
            ][..],
        ),
    ] {
        let s = train(&config(&dir, name, sets), false, &mut Silent).unwrap();
        assert_eq!(trace(&s.run_dir), reference, "{name}");
    }
    // A sharded checkpoint is saved whole and resumes bit for bit.
    let sets = [
        "parallel.fsdp=\"full\"",
        "parallel.dp=2",
        "checkpoint.every=3",
    ];
    let run = train(&config(&dir, "ckpt", &sets), false, &mut Silent).unwrap();
    let again = dir.join("ckpt-again");
    copy_dir(&run.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "ckpt-again", &sets), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&run.run_dir));
    assert_eq!(trace(&run.run_dir), reference);
    // Its trace has the communication beside the computation.
    let text = std::fs::read_to_string(run.run_dir.join("trace.json")).unwrap();
    let t: weft_trace::Trace = serde_json::from_str(&text).unwrap();
    t.check().unwrap();
    let tracks: std::collections::BTreeSet<u64> = t.complete_events().map(|e| e.tid).collect();
    assert!(tracks.len() >= 2, "{tracks:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `trace.json` of a 6-step pipeline run (every step traced) holds the
/// summary's bubble, `measured`, in its `otherData`, with the steps it
/// averages (2 to 6: the first is warm-up) and each step's own figure; and
/// the viewer, recomputing each step's bubble from the slices' step
/// windows alone, gets the same figures.
fn check_trace_bubble(name: &str, t: &weft_trace::Trace, measured: f64) {
    use weft_trace::ArgValue;
    let other = &t.other_data;
    // serde_json reads floats back to within an ulp (its exact parser is
    // a feature this workspace leaves off).
    let written = other.get("bubble_fraction").and_then(ArgValue::as_f64);
    assert!(
        written.is_some_and(|w| (w - measured).abs() <= 1e-15),
        "{name}: otherData.bubble_fraction {written:?}, summary {measured}"
    );
    let steps = |key: &str| match other.get(key) {
        Some(ArgValue::List(v)) => v.clone(),
        v => panic!("{name}: otherData.{key} = {v:?}"),
    };
    let averaged: Vec<i64> = steps("bubble_steps")
        .iter()
        .filter_map(ArgValue::as_i64)
        .collect();
    assert_eq!(averaged, [2, 3, 4, 5, 6], "{name}");
    let per_step: Vec<(i64, f64, f64)> = steps("step_bubble_fractions")
        .iter()
        .map(|v| {
            let ArgValue::Map(m) = v else {
                panic!("{name}: {v:?}")
            };
            let num = |k: &str| m.get(k).and_then(ArgValue::as_f64).unwrap();
            (
                m["step"].as_i64().unwrap(),
                num("bubble_fraction"),
                num("makespan_us"),
            )
        })
        .collect();
    assert_eq!(per_step.len(), 6, "{name}");
    let mean = per_step[1..].iter().map(|s| s.1).sum::<f64>() / 5.0;
    assert!((mean - measured).abs() < 1e-12, "{name}: {mean} {measured}");
    let tl = weft_viz_web::timeline::Timeline::new("trace.json", t.clone());
    assert!(tl.bubble_from_file, "{name}");
    assert_eq!(tl.stages, stages_of(t), "{name}: p2p tracks are not stages");
    assert_eq!(tl.steps.len(), 6, "{name}");
    for (shown, (step, bubble, makespan)) in tl.steps.iter().zip(&per_step) {
        assert_eq!(shown.step, *step, "{name}");
        assert_eq!(shown.in_mean, *step > 1, "{name}");
        assert!(
            (shown.bubble_fraction - bubble).abs() < 1e-9,
            "{name} step {step}: viewer {} trainer {bubble}",
            shown.bubble_fraction
        );
        assert!((shown.makespan() - makespan).abs() < 1e-6, "{name}");
    }
    assert!(
        (tl.computed_bubble - measured).abs() < 1e-9,
        "{name}: viewer {} trainer {measured}",
        tl.computed_bubble
    );
    assert_eq!(tl.bubble_disagreement(), None, "{name}");
}

/// Pipeline stages in a trace: processes with an `F` slice.
fn stages_of(t: &weft_trace::Trace) -> usize {
    let pids: std::collections::BTreeSet<u64> = t
        .complete_events()
        .filter(|e| e.name == "F")
        .map(|e| e.pid)
        .collect();
    pids.len()
}

#[test]
fn pipeline_parallel_is_bitwise_the_single_rank_run() {
    let dir = tmp("pp");
    let four = "model.n_layer=4";
    let one = train(&config(&dir, "single", &[four]), false, &mut Silent).unwrap();
    let reference = trace(&one.run_dir);
    for (name, sets) in [
        (
            "gpipe2",
            &["parallel.pp=2", "parallel.pp_schedule=\"gpipe\""][..],
        ),
        (
            "1f1b4",
            &["parallel.pp=4", "parallel.pp_schedule=\"1f1b\""][..],
        ),
        (
            "zbh1-2",
            &["parallel.pp=2", "parallel.pp_schedule=\"zb-h1\""][..],
        ),
        (
            "zbv2",
            &["parallel.pp=2", "parallel.pp_schedule=\"zb-v\""][..],
        ),
        (
            "interleaved2",
            &[
                "parallel.pp=2",
                "parallel.pp_schedule=\"interleaved\"",
                "parallel.pp_chunks=2",
            ][..],
        ),
    ] {
        let sets: Vec<&str> = sets.iter().copied().chain([four]).collect();
        let s = train(&config(&dir, name, &sets), false, &mut Silent).unwrap();
        assert_eq!(trace(&s.run_dir), reference, "{name}");
        // The measured timeline, and its bubble beside the prediction.
        let b = s
            .pipeline_bubble
            .expect("a pipeline run reports its bubble");
        assert!(
            (0.0..1.0).contains(&b.measured) && (0.0..1.0).contains(&b.predicted),
            "{b:?}"
        );
        let text = std::fs::read_to_string(s.run_dir.join("trace.json")).unwrap();
        let t: weft_trace::Trace = serde_json::from_str(&text).unwrap();
        t.check().unwrap();
        let stages: std::collections::BTreeSet<u64> = t.complete_events().map(|e| e.pid).collect();
        assert!(stages.len() >= 2, "{name}: {stages:?}");
        check_trace_bubble(name, &t, b.measured);
    }
    // A pipelined checkpoint is saved whole and resumes bit for bit.
    let sets = ["parallel.pp=2", "checkpoint.every=3", four];
    let run = train(&config(&dir, "ckpt", &sets), false, &mut Silent).unwrap();
    let again = dir.join("ckpt-again");
    copy_dir(&run.run_dir, &again);
    std::fs::remove_dir_all(again.join("checkpoints/step-00000006")).unwrap();
    let resumed = train(&config(&dir, "ckpt-again", &sets), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), trace(&run.run_dir));
    // refused with the configuration, before any rank starts
    let sets = ["parallel.pp=4", "model.n_layer=2"].map(String::from);
    let e = Config::load(None, &sets).unwrap_err().to_string();
    assert!(
        e.contains("parallel.pp") && e.contains("need at least as many layers"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pipeline_parallel_moe_is_bitwise_the_single_rank_run() {
    let dir = tmp("pp-moe");
    let moe = [
        "model.n_layer=4",
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "model.moe.balance=\"bias\"",
        "model.moe.bias_rate=0.05",
    ];
    let one = train(&config(&dir, "single", &moe), false, &mut Silent).unwrap();
    // Every layer's record, every field (entropy sums included), per step.
    let load = |run: &Path| std::fs::read_to_string(run.join("expert_load.jsonl")).unwrap();
    let reference = load(&one.run_dir);
    assert_eq!(reference.lines().count(), 6 * 4);
    for (name, sets) in [
        ("1f1b2", &["parallel.pp=2"][..]),
        (
            "interleaved2",
            &[
                "parallel.pp=2",
                "parallel.pp_schedule=\"interleaved\"",
                "parallel.pp_chunks=2",
            ][..],
        ),
        (
            "zbh1-4",
            &["parallel.pp=4", "parallel.pp_schedule=\"zb-h1\""][..],
        ),
    ] {
        let sets: Vec<&str> = moe.iter().chain(sets).copied().collect();
        let s = train(&config(&dir, name, &sets), false, &mut Silent).unwrap();
        assert_eq!(trace(&s.run_dir), trace(&one.run_dir), "{name}");
        assert_eq!(load(&s.run_dir), reference, "{name}");
    }
    // Without the stages' bias updates the run would differ: the
    // balancer moves the routing.
    let sets: Vec<&str> = moe[..4]
        .iter()
        .copied()
        .chain(["model.moe.balance=\"none\""])
        .collect();
    let unbalanced = train(&config(&dir, "none", &sets), false, &mut Silent).unwrap();
    assert_ne!(load(&unbalanced.run_dir), reference);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_composed_layout_traces_every_rank_by_mesh_coordinate() {
    let dir = tmp("trace-mesh");
    let sets = [
        "model.n_layer=4",
        "parallel.pp=2",
        "parallel.dp=2",
        "parallel.fsdp=\"full\"",
        "train.steps=2",
        "run.trace_steps=2",
    ];
    let run = train(&config(&dir, "mesh", &sets), false, &mut Silent).unwrap();
    let text = std::fs::read_to_string(run.run_dir.join("trace.json")).unwrap();
    let t: weft_trace::Trace = serde_json::from_str(&text).unwrap();
    t.check().unwrap();
    let names = t.process_names();
    for rank in 0..4u64 {
        let (pp, dp) = (rank / 2, rank % 2);
        assert_eq!(
            names.get(&rank).map(String::as_str),
            Some(format!("rank {rank}: pp {pp}, dp {dp}, tp 0").as_str()),
            "{names:?}"
        );
        let of = |cat: &str, name: Option<&str>| {
            t.complete_events()
                .filter(|e| e.pid == rank && e.cat.contains(cat))
                .filter(|e| name.is_none_or(|n| e.name == n))
                .count()
        };
        // its pipeline actions (2 steps × 2 micro-batches, forward and
        // backward), FSDP's gathers and reduce-scatters
        assert_eq!(of("", Some("F")), 4, "rank {rank}");
        assert_eq!(of("", Some("BW")), 4, "rank {rank}");
        assert!(of("fsdp.comm", None) > 0, "rank {rank}");
        assert!(
            t.complete_events()
                .filter(|e| e.pid == rank)
                .all(|e| e.args.contains_key("step")),
            "rank {rank}: every slice carries its step"
        );
    }
    // the viewer orders the lanes by rank (pp, then dp) and groups them by
    // pipeline stage
    let tl = weft_viz_web::timeline::Timeline::new("trace.json", t);
    let pids: Vec<u64> = tl.lanes.iter().map(|l| l.pid).collect();
    assert!(pids.windows(2).all(|w| w[0] <= w[1]), "{pids:?}");
    for l in &tl.lanes {
        assert_eq!(
            l.group.as_deref(),
            Some(if l.pid < 2 { "pp 0" } else { "pp 1" })
        );
    }
    assert_eq!(tl.stages, 4, "every rank's compute lane is a stage lane");
    let _ = std::fs::remove_dir_all(&dir);
}

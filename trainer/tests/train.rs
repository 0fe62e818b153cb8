//! End-to-end: short runs of the training loop on the synthetic corpus.

use weft_moe::Balance as MoeBalance;
use weft_testkit::python;
use weft_trainer::config::Config;
use weft_trainer::train::{Silent, train};

fn tiny(dir: &std::path::Path, name: &str) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=32",
        "train.batch_size=8",
        "train.steps=60",
        "train.eval_every=30",
        "train.eval_sequences=16",
        "optim.warmup_steps=5",
        "optim.lr=1e-2",
        "data.synthetic.regular=40",
        "data.synthetic.successors=3",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={}", toml_str(dir)),
        format!("run.name={name}"),
    ])
    .collect();
    Config::load(None, &sets).unwrap()
}

fn toml_str(p: &std::path::Path) -> String {
    format!("{:?}", p.display().to_string())
}

fn losses(run: &std::path::Path) -> Vec<String> {
    std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter(|l| !l.contains("\"event\""))
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            // Compare the exact bits through the JSON text of the number.
            v["loss"].to_string()
        })
        .collect()
}

#[test]
fn loss_falls_toward_the_floor_and_runs_are_reproducible() {
    let dir = std::env::temp_dir().join(format!("weft-train-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let a = train(&tiny(&dir, "a"), false, &mut Silent).unwrap();
    let floor = a.floor.unwrap();
    // Far above the floor at initialisation (uniform over the vocabulary),
    // much closer after 60 steps.
    assert!(a.initial_eval_loss - floor > 2.0, "{a:?}");
    assert!(
        a.final_eval_loss - floor < 0.5 * (a.initial_eval_loss - floor),
        "gap {} of initial {}",
        a.final_eval_loss - floor,
        a.initial_eval_loss - floor
    );
    assert_eq!(a.skipped_steps, 0);
    // The run folder has what it promises.
    for f in ["config.toml", "metrics.jsonl", "summary.json"] {
        assert!(a.run_dir.join(f).is_file(), "{f}");
    }
    let resolved = Config::from_toml(
        &std::fs::read_to_string(a.run_dir.join("config.toml")).unwrap(),
        "x",
    )
    .unwrap();
    assert_eq!(resolved, tiny(&dir, "a"));
    // Same seed: bitwise the same losses.
    let b = train(&tiny(&dir, "b"), false, &mut Silent).unwrap();
    let (la, lb) = (losses(&a.run_dir), losses(&b.run_dir));
    assert_eq!(la.len(), 60);
    assert_eq!(la, lb);
    // Runs are never overwritten.
    let err = train(&tiny(&dir, "a"), false, &mut Silent)
        .unwrap_err()
        .to_string();
    assert!(err.contains("already exists"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The Llama-like families train through the same loop: a small Qwen3
/// (grouped-query attention, QK-norm, rotary positions, SwiGLU, windows
/// with every second layer global) falls toward the corpus floor as
/// GPT-2 does, its config round-trips through the run folder, and a run
/// that dies mid-step resumes to the uninterrupted run's bits.
#[test]
fn llama_family_models_train_and_resume_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("weft-llama-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |name: &str| {
        let mut c = tiny(&dir, name);
        c.model.arch = weft_trainer::config::Arch::Qwen3;
        c.model.n_layer = 2;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.sliding_window = 8;
        c.model.global_every = 2;
        c.checkpoint.every = 20;
        c
    };
    let whole = train(&cfg("whole"), false, &mut Silent).unwrap();
    let floor = whole.floor.unwrap();
    assert!(
        whole.final_eval_loss - floor < 0.5 * (whole.initial_eval_loss - floor),
        "gap {} of initial {}",
        whole.final_eval_loss - floor,
        whole.initial_eval_loss - floor
    );
    let resolved = Config::from_toml(
        &std::fs::read_to_string(whole.run_dir.join("config.toml")).unwrap(),
        "x",
    )
    .unwrap();
    assert_eq!(resolved, cfg("whole"));
    let crashed = std::panic::catch_unwind(|| {
        let _ = train(&cfg("crashy"), false, &mut CrashAfter(46));
    });
    assert!(crashed.is_err());
    let resumed = train(&cfg("crashy"), true, &mut Silent).unwrap();
    assert_eq!(losses(&whole.run_dir), losses(&resumed.run_dir));
    assert_eq!(
        whole.final_eval_loss.to_bits(),
        resumed.final_eval_loss.to_bits()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `model.init_from` (`weft train --init-from DIR`): a Hugging Face
/// folder (here sharded) sets the model's shape and its initial weights.
/// A folder holding exactly the seed's initialisation trains bit for bit
/// as the seeded run, on one rank and across pipeline stages, and within
/// rounding over tensor parallelism; other weights give another run; a
/// `[model]` key contradicting the folder is refused naming it.
#[test]
fn init_from_a_hugging_face_folder_on_any_layout() {
    let dir = std::env::temp_dir().join(format!("weft-init-from-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = |name: &str| {
        let mut c = tiny(&dir, name);
        c.model.arch = weft_trainer::config::Arch::Llama;
        c.model.n_layer = 2;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.train.steps = 6;
        c.train.eval_every = 3;
        c.train.micro_batch_size = 4;
        c.parallel.reproducible = true;
        c
    };
    // the folder: the seed's own initialisation, saved in 3+ shards
    let seeded = base("seeded");
    let data = weft_data::Dataset::open(&seeded.data, &seeded.dataset_options()).unwrap();
    let cfg = seeded.model.gpt_config(data.vocab_size());
    let ffn = seeded.model.swiglu().unwrap();
    let mut m = weft_model::Gpt::with_ffn(cfg, Box::new(ffn)).unwrap();
    m.init_gpt2(seeded.train.seed);
    let hf = dir.join("hf");
    weft_model::hf::save_sharded(&m, &hf, 20_000).unwrap();
    assert!(hf.join("model.safetensors.index.json").exists());
    let from = |name: &str, sets: &[&str]| {
        let mut s = vec![
            format!("run.dir={:?}", dir.display().to_string()),
            format!("run.name={name}"),
            format!("model.init_from={:?}", hf.display().to_string()),
            "model.block_size=32".into(),
            "train.batch_size=8".into(),
            "train.micro_batch_size=4".into(),
            "parallel.reproducible=true".into(),
            "train.steps=6".into(),
            "train.eval_every=3".into(),
            "checkpoint.every=6".into(),
            "train.eval_sequences=16".into(),
            "optim.warmup_steps=5".into(),
            "optim.lr=1e-2".into(),
            "data.synthetic.regular=40".into(),
            "data.synthetic.successors=3".into(),
        ];
        s.extend(sets.iter().map(|x| (*x).to_string()));
        Config::load(None, &s)
    };
    let one = from("one", &[]).unwrap();
    assert_eq!(one.model.arch, weft_trainer::config::Arch::Llama);
    assert_eq!((one.model.n_layer, one.model.n_kv_head), (2, 2));
    let a = train(&seeded, false, &mut Silent).unwrap();
    let b = train(&one, false, &mut Silent).unwrap();
    assert_eq!(
        losses(&a.run_dir),
        losses(&b.run_dir),
        "the folder's weights are the seed's"
    );
    let pp = train(
        &from(
            "pp",
            &[
                "parallel.pp=2",
                "parallel.dp=2",
                "parallel.reproducible=true",
            ],
        )
        .unwrap(),
        false,
        &mut Silent,
    )
    .unwrap();
    assert_eq!(losses(&a.run_dir), losses(&pp.run_dir));
    let tp = train(&from("tp", &["parallel.tp=2"]).unwrap(), false, &mut Silent).unwrap();
    let rel = (tp.final_eval_loss - a.final_eval_loss).abs() / a.final_eval_loss;
    assert!(
        rel < 1e-5,
        "tp=2 {} vs {}",
        tp.final_eval_loss,
        a.final_eval_loss
    );
    // `weft ckpt export --hf` writes the Llama-family run's checkpoint as a
    // Hugging Face folder: the run's model, its parameters
    let ckpt = one.run.dir.join("one/checkpoints/step-00000006");
    let out = dir.join("exported");
    let export = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["ckpt", "export"])
        .arg(&ckpt)
        .arg("--hf")
        .arg(&out)
        .output()
        .unwrap();
    assert!(export.status.success(), "{export:?}");
    let back = weft_model::hf::load(&out).unwrap();
    assert_eq!(back.config().n_kv_head(), 2);
    let saved = weft_checkpoint::Checkpoint::open(&ckpt).unwrap();
    for spec in back.layout().specs() {
        let bytes = saved.read_tensor(&spec.name).unwrap();
        let want: Vec<f32> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect();
        assert_eq!(
            back.param(&spec.name).unwrap(),
            want.as_slice(),
            "{}",
            spec.name
        );
    }
    // other weights: another run
    m.params.iter_mut().for_each(|x| *x *= 0.5);
    weft_model::hf::save(&m, &hf).unwrap();
    let halved = train(&from("halved", &[]).unwrap(), false, &mut Silent).unwrap();
    assert_ne!(halved.initial_eval_loss, a.initial_eval_loss);
    // a key that contradicts the folder
    let e = from("bad", &["model.n_layer=3"]).unwrap_err().to_string();
    assert!(
        e.contains("model.n_layer") && e.contains("config.json"),
        "{e}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `model.init_from` of a Qwen3-MoE folder: the folder sets the mixture
/// of experts (experts, top-k, widths, the dense first layer) and its
/// initial weights. A folder holding the seed's initialisation trains
/// bit for bit as the seeded run on one rank and over pipeline stages,
/// bit for bit as the seeded ep=2 run with expert parallelism, and within
/// rounding over tensor parallelism; transformers' own folder
/// (`Qwen3MoeForCausalLM.save_pretrained`, the model crate's fixture,
/// whose loss the model crate checks against transformers) starts the
/// same on one rank and on ep=2.
#[test]
fn init_from_a_qwen3_moe_folder_on_any_layout() {
    let dir = std::env::temp_dir().join(format!("weft-init-moe-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let base = |name: &str, sets: &[&str]| {
        let mut c = tiny(&dir, name);
        c.model.arch = weft_trainer::config::Arch::Qwen3Moe;
        (c.model.n_layer, c.model.n_head, c.model.n_kv_head) = (2, 4, 2);
        c.model.first_dense = 1;
        (c.model.moe.experts, c.model.moe.top_k) = (4, 2);
        c.model.moe.expert_hidden = 24;
        (c.train.steps, c.train.eval_every) = (6, 3);
        c.train.micro_batch_size = 4;
        c.parallel.reproducible = true;
        sets.iter().fold(c, |c, s| c.with_override(s).unwrap())
    };
    let seeded = base("seeded", &[]);
    let data = weft_data::Dataset::open(&seeded.data, &seeded.dataset_options()).unwrap();
    let cfg = seeded.model.gpt_config(data.vocab_size());
    let (ffn, _) = seeded.model.ffn(None).unwrap();
    let blocks = weft_model::GptBlocks::new(cfg, ffn).unwrap();
    let mut m = weft_model::Gpt::from_blocks(blocks);
    m.init_gpt2(seeded.train.seed);
    let hf = dir.join("hf");
    weft_model::hf::save(&m, &hf).unwrap();
    let from = |name: &str, folder: &std::path::Path, sets: &[&str]| {
        let mut s = vec![
            format!("run.dir={:?}", dir.display().to_string()),
            format!("run.name={name}"),
            format!("model.init_from={:?}", folder.display().to_string()),
            "model.block_size=32".into(),
            "train.batch_size=8".into(),
            "train.micro_batch_size=4".into(),
            "parallel.reproducible=true".into(),
            "train.steps=6".into(),
            "train.eval_every=3".into(),
            "train.eval_sequences=16".into(),
            "optim.warmup_steps=5".into(),
            "optim.lr=1e-2".into(),
            "data.synthetic.regular=40".into(),
            "data.synthetic.successors=3".into(),
        ];
        s.extend(sets.iter().map(|x| (*x).to_string()));
        Config::load(None, &s).unwrap()
    };
    let one = from("one", &hf, &[]);
    assert_eq!(one.model.arch, weft_trainer::config::Arch::Qwen3Moe);
    assert_eq!(one.model.moe, seeded.model.moe);
    assert_eq!(one.model.first_dense, 1);
    let run = |c: &Config| train(c, false, &mut Silent).unwrap();
    let a = run(&seeded);
    assert_eq!(losses(&a.run_dir), losses(&run(&one).run_dir), "1 rank");
    let pp = ["parallel.pp=2", "parallel.dp=2"];
    assert_eq!(
        losses(&a.run_dir),
        losses(&run(&from("pp", &hf, &pp)).run_dir),
        "pp=2"
    );
    let ep = ["parallel.dp=2", "parallel.ep=2"];
    let (seeded_ep, from_ep) = (run(&base("seeded-ep", &ep)), run(&from("ep", &hf, &ep)));
    assert_eq!(losses(&seeded_ep.run_dir), losses(&from_ep.run_dir), "ep=2");
    let near = |x: f64, y: f64| (x - y).abs() <= 1e-5 * y.abs();
    assert!(near(from_ep.final_eval_loss, a.final_eval_loss));
    let tp = run(&from("tp", &hf, &["parallel.tp=2"]));
    assert!(
        near(tp.final_eval_loss, a.final_eval_loss),
        "tp=2 {} vs {}",
        tp.final_eval_loss,
        a.final_eval_loss
    );
    // transformers' folder (8 experts, top-2, the first layer dense)
    let theirs = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures-qwen3moe/top2of8_norm_dense0");
    let small = [
        "model.block_size=16",
        "data.synthetic.regular=20",
        "train.steps=2",
        "train.eval_every=0",
    ];
    let t1 = run(&from("theirs", &theirs, &small));
    let t2 = run(&from("theirs-ep", &theirs, &[&small[..], &ep].concat()));
    assert!(t1.initial_eval_loss.is_finite());
    assert!(
        near(t2.initial_eval_loss, t1.initial_eval_loss),
        "{} vs {}",
        t2.initial_eval_loss,
        t1.initial_eval_loss
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A small Qwen3-MoE run (`model.arch = "qwen3-moe"`): fine-grained
/// SwiGLU experts, the first layer dense, bias balancing; it learns,
/// logs every layer's expert load, and resumes bit for bit.
#[test]
fn qwen3_moe_trains_and_resumes_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("weft-qwen3moe-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |name: &str| {
        let mut c = tiny(&dir, name);
        c.model.arch = weft_trainer::config::Arch::Qwen3Moe;
        c.model.n_layer = 2;
        c.model.n_head = 4;
        c.model.n_kv_head = 2;
        c.model.first_dense = 1;
        c.model.moe.experts = 4;
        c.model.moe.top_k = 2;
        c.model.moe.expert_hidden = 24;
        c.checkpoint.every = 20;
        c
    };
    let whole = train(&cfg("whole"), false, &mut Silent).unwrap();
    let floor = whole.floor.unwrap();
    assert!(
        whole.final_eval_loss - floor < 0.5 * (whole.initial_eval_loss - floor),
        "gap {} of initial {}",
        whole.final_eval_loss - floor,
        whole.initial_eval_loss - floor
    );
    let resolved = Config::from_toml(
        &std::fs::read_to_string(whole.run_dir.join("config.toml")).unwrap(),
        "x",
    )
    .unwrap();
    assert_eq!(resolved, cfg("whole"));
    // one record per step for the expert layer (1), none for the dense
    // layer 0; every token routed to its 2 experts; the viewer reads it
    let load = std::fs::read_to_string(whole.run_dir.join("expert_load.jsonl")).unwrap();
    let (records, warnings) = weft_compare::load::parse_expert_load("x", &load).unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(records.len(), 60, "{load}");
    for r in &records {
        assert_eq!((r.layer, r.kept() + r.dropped), (1, 2 * 8 * 32), "{r:?}");
    }
    let seen = weft_viz_web::expert::ExpertLoad::new("x", &records).unwrap();
    assert_eq!((seen.layers.as_slice(), seen.steps.len()), (&[1][..], 60));
    let curves = seen.curves(weft_viz_web::expert::LayerSel::All);
    assert!(curves.max_vio.iter().all(|v| v.is_finite()));
    let crashed = std::panic::catch_unwind(|| {
        let _ = train(&cfg("crashy"), false, &mut CrashAfter(46));
    });
    assert!(crashed.is_err());
    let resumed = train(&cfg("crashy"), true, &mut Silent).unwrap();
    assert_eq!(losses(&whole.run_dir), losses(&resumed.run_dir));
    assert_eq!(
        whole.final_eval_loss.to_bits(),
        resumed.final_eval_loss.to_bits()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_data_is_a_clear_error() {
    let dir = std::env::temp_dir().join(format!("weft-train-bad-{}", std::process::id()));
    let mut c = tiny(&dir, "x");
    c.data.source = weft_data::Source::Text(dir.join("no-such-file.txt"));
    let err = train(&c, false, &mut Silent).unwrap_err().to_string();
    assert!(err.contains("no-such-file.txt"), "{err}");
    assert!(
        !dir.join("x").exists(),
        "no run folder for a run that never started"
    );
}

#[test]
fn sizes_no_machine_has_are_refused_before_anything_is_allocated() {
    let dir = std::env::temp_dir().join(format!("weft-train-huge-{}", std::process::id()));
    let run = |f: &dyn Fn(&mut Config), what: &str| {
        let mut c = tiny(&dir, "x");
        f(&mut c);
        let err = train(&c, false, &mut Silent).unwrap_err().to_string();
        assert!(err.contains("needs") && err.contains("available"), "{err}");
        assert!(err.contains(what), "{what}: {err}");
        assert!(!dir.join("x").exists(), "no run folder: {err}");
    };
    // the parameters' floor, before any layout is built
    run(&|c| c.model.n_layer = 100_000_000, "model.n_layer");
    run(
        &|c| {
            c.model.n_embd = 1_000_000_000;
            c.model.n_head = 1;
        },
        "model.n_embd",
    );
    // the layout's prediction: activations
    run(
        &|c| {
            c.train.batch_size = 1 << 30;
            c.train.micro_batch_size = 1 << 30;
        },
        "train.micro_batch_size",
    );
    run(&|c| c.model.block_size = 100_000_000, "model.block_size");
}

/// Panics after a given step, like a process dying mid-run.
struct CrashAfter(u64);
impl weft_trainer::train::Observer for CrashAfter {
    fn step(&mut self, r: &weft_trainer::train::StepReport) {
        assert!(
            r.record.step < self.0,
            "simulated crash after step {}",
            self.0 - 1
        );
    }
}

#[test]
fn a_resumed_run_continues_bit_for_bit() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-resume-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let with_ckpt = |name: &str| {
        let mut c = tiny(&dir, name);
        c.checkpoint.every = 20;
        c
    };
    let whole = train(&with_ckpt("whole"), false, &mut Silent).unwrap();
    // A training process SIGKILLed at moments drawn from a fixed sequence
    // (checkpoints every 2 steps, so many land inside a save), then
    // resumed: always the uninterrupted run's bits.
    let mut often = with_ckpt("killed");
    often.checkpoint.every = 2;
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("killed.toml");
    std::fs::write(&config, often.to_toml()).unwrap();
    let run = dir.join("killed");
    let mut x = 0x2545_f491_4f6c_dd1du64;
    // kills that landed mid-run (a checkpoint there, no summary yet) and
    // were resumed and compared: the test proves nothing without them
    let mut mid_run = 0;
    for attempt in 0..12 {
        if attempt >= 5 && mid_run >= 1 {
            break;
        }
        let _ = std::fs::remove_dir_all(&run);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let mut child = std::process::Command::new(weft)
            .args(["train", "--config"])
            .arg(&config)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // once it trains (its heartbeat), a further 0–400 ms
        let t = std::time::Instant::now();
        while !run.join("heartbeats/rank-0").exists() && t.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert!(
            run.join("heartbeats/rank-0").exists(),
            "attempt {attempt}: no heartbeat in 60 s"
        );
        std::thread::sleep(std::time::Duration::from_millis(x % 400));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let unfinished = !run.join("summary.json").exists();
        let resumed = std::process::Command::new(weft)
            .args(["train", "--resume"])
            .arg(&run)
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&resumed.stderr);
        if !resumed.status.success() {
            // killed before its first checkpoint: nothing to resume, and
            // the error says so
            assert!(
                text.contains("no checkpoint") || text.contains("already finished"),
                "attempt {attempt}: {text}"
            );
            continue;
        }
        assert_eq!(losses(&run), losses(&whole.run_dir), "attempt {attempt}");
        mid_run += usize::from(unfinished);
    }
    assert!(
        mid_run >= 1,
        "no kill landed mid-run with a checkpoint to resume from"
    );
    // And the in-process path: a run that fails mid-step (its observer
    // panics in step 46) resumes from step 40.
    let crashed = std::panic::catch_unwind(|| {
        let _ = train(&with_ckpt("crashy"), false, &mut CrashAfter(46));
    });
    assert!(crashed.is_err());
    let run = dir.join("crashy");
    assert!(
        run.join("checkpoints/step-00000040/manifest.json")
            .is_file()
    );
    assert!(!run.join("checkpoints/step-00000060").exists());
    let resumed = train(&with_ckpt("crashy"), true, &mut Silent).unwrap();
    assert_eq!(losses(&whole.run_dir), losses(&resumed.run_dir));
    assert_eq!(losses(&resumed.run_dir).len(), 60);
    assert_eq!(
        whole.final_eval_loss.to_bits(),
        resumed.final_eval_loss.to_bits()
    );
    // Retention kept the newest two checkpoints.
    let mut kept: Vec<String> = std::fs::read_dir(run.join("checkpoints"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    kept.sort();
    assert_eq!(kept, ["step-00000040", "step-00000060"]);
    // Resuming a finished run says so and rewrites nothing.
    let files = |run: &std::path::Path| {
        ["summary.json", "metrics.jsonl"].map(|f| std::fs::read(run.join(f)).unwrap())
    };
    let before = files(&whole.run_dir);
    let err = train(&with_ckpt("whole"), true, &mut Silent)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("already finished") && err.contains("step 60"),
        "{err}"
    );
    assert!(
        files(&whole.run_dir) == before,
        "a finished run's files changed"
    );
    // Resuming under another configuration is refused.
    let mut other = with_ckpt("crashy");
    other.optim.lr = 5e-3;
    let err = train(&other, true, &mut Silent).unwrap_err().to_string();
    assert!(err.contains("another configuration"), "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Keeps what `resumed` reports.
#[derive(Default)]
struct Resumed(Option<(u64, Vec<String>)>);
impl weft_trainer::train::Observer for Resumed {
    fn resumed(&mut self, step: u64, skipped: &[String]) {
        self.0 = Some((step, skipped.to_vec()));
    }
}

#[test]
fn a_corrupt_newest_checkpoint_is_reported_skipped_and_kept() {
    let dir = std::env::temp_dir().join(format!("weft-corrupt-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "run");
    c.checkpoint.every = 20;
    c.train.steps = 40;
    train(&c, false, &mut Silent).unwrap();
    let ckpts = dir.join("run/checkpoints");
    // one flipped byte in the newest checkpoint's tensor data
    let shard = ckpts.join("step-00000040/rank-00000.safetensors");
    let mut bytes = std::fs::read(&shard).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x10;
    std::fs::write(&shard, &bytes).unwrap();
    c.train.steps = 60;
    let mut seen = Resumed::default();
    train(&c, true, &mut seen).unwrap();
    let (step, skipped) = seen.0.expect("the resume is reported");
    assert_eq!(step, 20, "resumed from the newest checkpoint that verifies");
    assert_eq!(skipped.len(), 1, "{skipped:?}");
    assert!(
        skipped[0].contains("step-00000040") && skipped[0].contains("moved to"),
        "says which was skipped, why and where it went: {skipped:?}"
    );
    // the evidence is kept, byte for byte, beside the new step-40 save
    let aside = ckpts.join("step-00000040.corrupt/rank-00000.safetensors");
    assert_eq!(std::fs::read(aside).unwrap(), bytes);
    assert!(ckpts.join("step-00000040/manifest.json").is_file());
    assert!(ckpts.join("step-00000060/manifest.json").is_file());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn moe_runs_log_expert_load_and_balance_with_the_bias() {
    let dir = std::env::temp_dir().join(format!("weft-moe-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "moe");
    c.train.steps = 12;
    c.model.moe.experts = 4;
    c.model.moe.top_k = 2;
    c.model.moe.balance = MoeBalance::Bias;
    c.model.moe.bias_rate = 0.05;
    c.checkpoint.every = 6;
    let s = train(&c, false, &mut Silent).unwrap();
    assert!(s.final_max_vio.is_some());
    let text = std::fs::read_to_string(s.run_dir.join("expert_load.jsonl")).unwrap();
    let recs: Vec<weft_trace::ExpertLoadRecord> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(recs.len(), 12, "one record per layer (1) per step");
    // Dropless top-2: every token lands on exactly two experts.
    let tokens = (c.train.batch_size * c.model.block_size) as u64;
    for r in &recs {
        assert_eq!(r.tokens_per_expert.iter().sum::<u64>(), 2 * tokens, "{r:?}");
        assert_eq!(r.dropped, 0);
    }
    // The balancer moved the selection bias, and the checkpoint carries it.
    let ckpt =
        weft_checkpoint::Checkpoint::open(&s.run_dir.join("checkpoints/step-00000012")).unwrap();
    let bias = ckpt
        .read_region(
            "transformer.h.0.mlp.router.selection_bias",
            &weft_checkpoint::Region::full(&[4]),
        )
        .unwrap();
    assert!(
        bias.chunks(4)
            .any(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]) != 0.0)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Real text: the opening of Shakespeare's plays (public domain), 30 kB,
/// tokenized with GPT-2's BPE. A short run's loss falls well below the
/// uniform guess over the 50,257-token vocabulary.
#[test]
fn loss_falls_on_real_text() {
    let dir = std::env::temp_dir().join(format!("weft-text-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "text");
    c.data.source = weft_data::Source::Text(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/shakespeare.txt").into(),
    );
    c.train.steps = 40;
    c.train.eval_every = 0;
    c.optim.lr = 3e-3;
    let s = train(&c, false, &mut Silent).unwrap();
    let uniform = (50_257f64).ln();
    assert!((s.initial_eval_loss - uniform).abs() < 0.5, "{s:?}");
    assert!(s.final_eval_loss < s.initial_eval_loss - 2.0, "{s:?}");
    assert!(s.floor.is_none(), "real text has no known floor");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn weft_eval_never_overwrites_what_it_reads() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-eval-out-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "run");
    c.train.steps = 2;
    c.checkpoint.every = 2;
    train(&c, false, &mut Silent).unwrap();
    // `--resume .` from inside the run folder
    let resumed = std::process::Command::new(weft)
        .current_dir(dir.join("run"))
        .args(["train", "--resume", ".", "--set", "train.steps=4"])
        .output()
        .unwrap();
    assert!(resumed.status.success(), "{resumed:?}");
    assert!(dir.join("run/checkpoints/step-00000004").is_dir());
    let hf = dir.join("hf");
    let ckpt = dir.join("run/checkpoints/step-00000002");
    let export = std::process::Command::new(weft)
        .args(["ckpt", "export"])
        .arg(&ckpt)
        .arg("--hf")
        .arg(&hf)
        .output()
        .unwrap();
    assert!(export.status.success(), "{export:?}");
    // a second export into the folder: refused without --overwrite
    let again = |extra: &[&str]| {
        std::process::Command::new(weft)
            .args(["ckpt", "export"])
            .arg(&ckpt)
            .arg("--hf")
            .arg(&hf)
            .args(extra)
            .output()
            .unwrap()
    };
    let refused = again(&[]);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && err.contains("--overwrite"),
        "{err}"
    );
    assert!(again(&["--overwrite"]).status.success());
    // a reshard into more ranks than any tensor has rows writes nothing
    let reshard = std::process::Command::new(weft)
        .args(["ckpt", "reshard"])
        .arg(&ckpt)
        .args(["--to", "1000000"])
        .arg(dir.join("resharded"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&reshard.stderr);
    assert!(
        !reshard.status.success() && err.contains("would hold nothing"),
        "{err}"
    );
    assert!(!dir.join("resharded").exists());
    let tokens = dir.join("tokens.json");
    std::fs::write(
        &tokens,
        r#"{"inputs": [[1, 2, 3]], "targets": [[2, 3, 4]]}"#,
    )
    .unwrap();
    let weights = hf.join("model.safetensors");
    let before = std::fs::read(&weights).unwrap();
    let eval = |out: &std::path::Path, extra: &[&str]| {
        let o = std::process::Command::new(weft)
            .args(["eval", "--hf-model"])
            .arg(&hf)
            .arg("--tokens")
            .arg(&tokens)
            .arg("--dump-grads")
            .arg(out)
            .args(extra)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // the model itself, even by another path and with --overwrite
    let same = hf.join("../hf/model.safetensors");
    for extra in [&[][..], &["--overwrite"][..]] {
        let (ok, err) = eval(&same, extra);
        assert!(!ok && err.contains("is an input"), "{err}");
    }
    assert_eq!(
        std::fs::read(&weights).unwrap(),
        before,
        "weights untouched"
    );
    let (ok, err) = eval(&tokens, &["--overwrite"]);
    assert!(!ok && err.contains("is an input"), "{err}");
    // a new file is written; an existing one only with --overwrite
    let grads = dir.join("grads.safetensors");
    assert!(eval(&grads, &[]).0);
    let written = std::fs::read(&grads).unwrap();
    let (ok, err) = eval(&grads, &[]);
    assert!(!ok && err.contains("--overwrite"), "{err}");
    assert!(eval(&grads, &["--overwrite"]).0);
    assert_eq!(
        std::fs::read(&grads).unwrap(),
        written,
        "the same gradients"
    );
    // errors name each cause once
    let missing = std::process::Command::new(weft)
        .args(["train", "--data", "/nonexistent-weft-data.txt"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&missing.stderr);
    assert!(!missing.status.success());
    assert_eq!(err.matches("(os error 2)").count(), 1, "{err}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_first_sigint_saves_and_stops_and_the_run_resumes_bit_for_bit() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-sigint-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let steps = 400;
    let mut whole = tiny(&dir, "whole");
    whole.train.steps = steps;
    whole.parallel.dp = 2;
    whole.checkpoint.every = 0;
    let reference = train(&whole, false, &mut Silent).unwrap();
    // the same job as a process of its own, stopped by Ctrl-C
    let mut c = whole.clone();
    c.run.name = "stopped".into();
    let config = dir.join("stopped.toml");
    std::fs::write(&config, c.to_toml()).unwrap();
    let mut child = std::process::Command::new(weft)
        .args(["train", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let metrics = dir.join("stopped/metrics.jsonl");
    let started = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 5 {
        if started.elapsed() > std::time::Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the run did not start");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // a second writer of the running run is refused, naming the process
    // that holds it, and leaves the run alone (it stops and resumes below
    // as if nothing had happened)
    let second = train(&c, true, &mut Silent).unwrap_err().to_string();
    assert!(
        second.contains("in use by process") && second.contains(&child.id().to_string()),
        "{second}"
    );
    let interrupt = std::process::Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(interrupt.success());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "a stopped run is not a finished one");
    assert!(
        err.contains("stopped after step") && err.contains("--resume"),
        "{err}"
    );
    // one checkpoint, of the last step logged
    let saved: Vec<String> = std::fs::read_dir(dir.join("stopped/checkpoints"))
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(saved.len(), 1, "{saved:?}");
    let step: u64 = saved[0]["step-".len()..].parse().unwrap();
    assert!(step < steps, "the signal landed before the end");
    assert_eq!(losses(&dir.join("stopped")).len(), step as usize);
    assert!(!dir.join("stopped/summary.json").exists());
    let resumed = train(&c, true, &mut Silent).unwrap();
    assert_eq!(losses(&resumed.run_dir), losses(&reference.run_dir));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The events a supervisor wrote, as JSON values.
/// A run's supervision and recovery events, without the drills' `fault`
/// lines, the `running` / `rewound` marks and the (timing-dependent)
/// straggler reports (see `all_events`).
fn events(run: &std::path::Path) -> Vec<serde_json::Value> {
    all_events(run)
        .into_iter()
        .filter(|e| {
            !["fault", "running", "rewound", "straggler", "checkpoint"]
                .contains(&e["event"].as_str().unwrap_or(""))
        })
        .collect()
}

fn all_events(run: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("events.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_supervised_run_restarts_after_a_kill_and_a_hang_and_ends_bit_for_bit() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-supervise-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut base = tiny(&dir, "whole");
    base.checkpoint.every = 10;
    let reference = train(&base, false, &mut Silent).unwrap();
    // (name, faults, checkpoint resumed from, steps lost)
    let cases: [(&str, &[&str], u64, u64); 4] = [
        ("killed", &["kill:step=37"], 30, 6),
        ("hung", &["hang:step=25"], 20, 4),
        // the newest checkpoint rots, then the process dies: the one
        // before it is used (and the rotten one kept aside)
        (
            "rotten",
            &["corrupt-checkpoint:step=30", "kill:step=33"],
            20,
            12,
        ),
        // killed while saving step 30 (in the background, training on):
        // that save never commits
        ("torn", &["crash-during-save:step=30"], 20, 10),
    ];
    for (name, faults, from, lost) in cases {
        let mut c = base.clone();
        c.run.name = name.into();
        // a kill or a hang a few steps after a save finds it committed
        // only if it was written before training went on: on a busy
        // machine a background save of step 30 can still be writing at
        // step 37 (and the restart rightly starts from step 20). The
        // torn save is the background case.
        c.checkpoint.background = name == "torn";
        let config = dir.join(format!("{name}.toml"));
        std::fs::write(&config, c.to_toml()).unwrap();
        let mut cmd = std::process::Command::new(weft);
        cmd.args(["train", "--supervise", "--restart-backoff", "0.1"])
            .args(["--heartbeat-timeout", "3", "--config"])
            .arg(&config);
        for f in faults {
            cmd.args(["--inject", f]);
        }
        let out = cmd.output().unwrap();
        let run = dir.join(name);
        assert!(
            out.status.success(),
            "{name}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(losses(&run), losses(&reference.run_dir), "{name}");
        let ev = events(&run);
        let kinds: Vec<&str> = ev.iter().map(|e| e["event"].as_str().unwrap()).collect();
        assert_eq!(
            kinds,
            ["start", "failure", "restart", "start", "finished"],
            "{name}: {ev:?}"
        );
        let failure = ev[1]["failure"].as_str().unwrap();
        match name {
            "hung" => assert!(
                failure == "no heartbeat (after step 24) for 3 s",
                "{failure}"
            ),
            _ => assert_eq!(failure, "signal 9", "{name}"),
        }
        assert_eq!(ev[2]["from_checkpoint_step"], from, "{name}");
        let lost_steps = ev[2]["lost_steps"].as_u64().unwrap();
        if name == "torn" {
            // the save is written in the background: training went on
            // while it was, so the kill found the job at step 30 or later
            assert!(
                (lost..lost + 5).contains(&lost_steps),
                "{name}: {lost_steps}"
            );
        } else {
            assert_eq!(lost_steps, lost, "{name}");
        }
        assert_eq!(ev[4]["restarts"], 1);
        let unverified = ev[2]["unverified_checkpoints"].as_array().unwrap();
        let ckpts = run.join("checkpoints");
        if name == "rotten" {
            assert_eq!(unverified.len(), 1, "{ev:?}");
            assert!(
                unverified[0]
                    .as_str()
                    .unwrap()
                    .contains("checksum mismatch")
            );
            assert!(ckpts.join("step-00000030.corrupt").is_dir());
        } else {
            assert!(unverified.is_empty(), "{name}: {ev:?}");
        }
        // the run's last checkpoint is whole
        assert!(ckpts.join("step-00000060").is_dir(), "{name}");
        // the drill's faults are recorded as they fire, and the restarted
        // job's start once it trains again
        let all = all_events(&run);
        let fired: Vec<&str> = all
            .iter()
            .filter(|e| e["event"] == "fault")
            .map(|e| e["fault"].as_str().unwrap())
            .collect();
        assert_eq!(fired, faults, "{name}");
        let running = all.iter().filter(|e| e["event"] == "running").count();
        assert_eq!(running, 2, "{name}: {all:?}");
    }
    // two data-parallel thread ranks; rank 1 killed with no spare: the
    // job shrinks to one replica (the global batch kept by accumulating
    // two micro-batches) and ends as the fault-free two-rank run
    let mut two = base.clone();
    two.parallel.dp = 2;
    two.run.name = "two".into();
    let reference = train(&two, false, &mut Silent).unwrap();
    two.run.name = "shrunk".into();
    let config = dir.join("shrunk.toml");
    std::fs::write(&config, two.to_toml()).unwrap();
    let out = std::process::Command::new(weft)
        .args([
            "train",
            "--supervise",
            "--restart-backoff",
            "0.1",
            "--shrink",
        ])
        .args(["--inject", "kill:rank=1,step=37", "--config"])
        .arg(&config)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let ev = events(&dir.join("shrunk"));
    assert_eq!(ev[2]["dp"], 1, "{ev:?}");
    assert_eq!(ev[4]["dp"], 1, "{ev:?}");
    assert_eq!(losses(&dir.join("shrunk")), losses(&reference.run_dir));
    // a bad fault is a clear error
    let out = std::process::Command::new(weft)
        .args(["train", "--inject", "explode:now"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown fault \"explode\""));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_spike_or_non_finite_steps_rewind_skip_the_batches_and_the_skip_list_reproduces_the_bits() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-rewind-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut base = tiny(&dir, "rewound");
    base.train.spike_window = 10;
    base.train.rewind = true;
    let run_with = |c: &Config, faults: &[&str]| {
        let config = dir.join(format!("{}.toml", c.run.name));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(&config, c.to_toml()).unwrap();
        let mut cmd = std::process::Command::new(weft);
        cmd.args(["train", "--config"]).arg(&config);
        for f in faults {
            cmd.args(["--inject", f]);
        }
        let out = cmd.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    // with checkpoints (rewinds go to the newest) and without (to the start)
    for every in [10, 0] {
        let mut c = base.clone();
        c.checkpoint.every = every;
        c.run.name = format!("rewound-{every}");
        // a garbage batch at 37 (a spike), then three batches that make
        // the gradients non-finite (44..46)
        let (ok, out) = run_with(&c, &["spike:step=37", "nan:step=44,count=3"]);
        assert!(ok, "{out}");
        assert!(out.contains("rewinding to"), "{out}");
        let run = dir.join(&c.run.name);
        let skip: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(run.join("skip.json")).unwrap()).unwrap();
        assert_eq!(
            skip["batches"],
            serde_json::json!([37, 44, 45, 46]),
            "{skip}"
        );
        assert_eq!(skip["rewinds"], 2);
        let ev = events(&run);
        assert_eq!(ev.len(), 2, "{ev:?}");
        assert_eq!(ev[0]["event"], "rewind");
        assert_eq!(ev[0]["skipped_batches"], serde_json::json!([37]));
        assert_eq!(ev[0]["to_step"], if every > 0 { 30 } else { 0 });
        assert!(ev[0]["reason"].as_str().unwrap().contains("rolling median"));
        assert_eq!(ev[1]["skipped_batches"], serde_json::json!([44, 45, 46]));
        assert_eq!(ev[1]["reason"], "3 non-finite steps in a row");
        assert_eq!(ev[1]["to_step"], if every > 0 { 40 } else { 0 });
        // the metrics are one run's: every step once, no skipped update
        let text = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
        assert!(!text.contains("\"skip\""), "{text}");
        assert_eq!(losses(&run).len(), 60);
        // a new run given the skip list, faults and all, has the same bits
        let mut again = c.clone();
        again.run.name = format!("again-{every}");
        again.train.skip_batches = vec![37, 44, 45, 46];
        let (ok, out) = run_with(&again, &["spike:step=37", "nan:step=44,count=3"]);
        assert!(ok, "{out}");
        assert!(!out.contains("rewinding"), "{out}");
        assert_eq!(
            losses(&run),
            losses(&dir.join(&again.run.name)),
            "every={every}"
        );
        // and it differs from the run that trained on the garbage
        let mut plain = c.clone();
        plain.train.rewind = false;
        plain.run.name = format!("plain-{every}");
        let (ok, out) = run_with(&plain, &["spike:step=37", "nan:step=44"]);
        assert!(ok && out.contains("loss spike"), "{out}");
        assert!(out.contains("health step 44: non-finite"), "{out}");
        // without rewinds: the spike and the skipped update are logged
        let text =
            std::fs::read_to_string(dir.join(&plain.run.name).join("metrics.jsonl")).unwrap();
        let logged: Vec<(u64, String)> = text
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter(|v| v["event"] == "skip" || v["event"] == "spike")
            .map(|v| {
                (
                    v["step"].as_u64().unwrap(),
                    v["event"].as_str().unwrap().to_owned(),
                )
            })
            .collect();
        assert_eq!(
            logged,
            [(37, "spike".to_owned()), (44, "skip".to_owned())],
            "{text}"
        );
        assert_ne!(losses(&run), losses(&dir.join(&plain.run.name)));
    }
    // rewinds are bounded
    let mut c = base.clone();
    c.run.name = "bounded".into();
    c.train.max_rewinds = 1;
    let (ok, out) = run_with(&c, &["spike:step=37", "spike:step=40"]);
    assert!(!ok);
    assert!(out.contains("train.max_rewinds = 1"), "{out}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_chaos_drill_detects_recovers_and_keeps_the_bits() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-chaos-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // a garbage batch, a crash while saving and a kill: a round of three
    // trials draws each of the kinds once
    let out = std::process::Command::new(weft)
        .args(["chaos", "--trials", "3", "--seed", "3"])
        .args(["--faults", "spike,crash-during-save,kill", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut spike_trial = None;
    for kind in ["spike:", "crash-during-save:", "kill:"] {
        let cols: Vec<&str> = text
            .lines()
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .find(|c| c.len() > 10 && c[1].starts_with(kind))
            .unwrap_or_else(|| panic!("no {kind} trial:\n{text}"));
        // detected, recovered, bitwise
        assert_eq!(
            (cols[2], cols[4], cols[10]),
            ("yes", "yes", "yes"),
            "{cols:?}"
        );
        if kind == "spike:" {
            spike_trial = Some(cols[0].to_owned());
        }
    }
    assert!(
        text.contains("detected 3/3, recovered 3/3, hung 0, bitwise 3/3"),
        "{text}"
    );
    // the trial after a rewind is compared with a fault-free run given
    // its skip list
    assert!(
        dir.join(format!("reference-{}", spike_trial.unwrap()))
            .is_dir()
    );
    // a second drill into the folder replaces none of its runs
    let again = std::process::Command::new(weft)
        .args(["chaos", "--trials", "1", "--dir"])
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&again.stderr);
    assert!(
        !again.status.success() && err.contains("already exists"),
        "{err}"
    );
    assert!(dir.join("trial-2").is_dir());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_slow_rank_is_reported_as_a_straggler_with_its_ratio() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-straggler-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "slow");
    c.parallel.dp = 2;
    c.train.straggler_window = 10;
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("slow.toml");
    std::fs::write(&config, c.to_toml()).unwrap();
    // rank 1 computes four times slower from step 5 on
    let out = std::process::Command::new(weft)
        .args([
            "train",
            "--inject",
            "slow:rank=1,step=5,factor=4",
            "--config",
        ])
        .arg(&config)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("rank 1 is a straggler"), "{text}");
    let reports: Vec<serde_json::Value> = all_events(&dir.join("slow"))
        .into_iter()
        .filter(|e| e["event"] == "straggler")
        .collect();
    assert!(!reports.is_empty());
    for r in &reports {
        assert_eq!(r["rank"], 1, "{r}");
        // its work over the window against its peer's: about 4×
        assert!(r["ratio"].as_f64().unwrap() > 2.0, "{r}");
    }
    // reported once, after two slow windows in a row (steps 1–10, slow
    // from 5, and 11–20)
    assert_eq!(reports.len(), 1, "{reports:?}");
    assert_eq!(reports[0]["step"], 20, "{reports:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Keeps the run's start-up figures.
#[derive(Default)]
struct Info(Option<weft_trainer::train::RunInfo>);
impl weft_trainer::train::Observer for Info {
    fn start(&mut self, info: &weft_trainer::train::RunInfo) {
        self.0 = Some(info.clone());
    }
}

#[test]
fn flops_and_utilisation_follow_the_6n_formula() {
    let dir = std::env::temp_dir().join(format!("weft-flops-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "flops");
    c.train.steps = 5;
    let mut obs = Info::default();
    let s = train(&c, false, &mut obs).unwrap();
    let info = obs.0.unwrap();
    // Kaplan et al. (2020) / PaLM's count: 6 FLOPs per parameter per
    // token (forward 2, backward 4) over the parameters a token multiplies
    // by — every one but the position table — plus 6·L·T·C for attention's
    // scores and weighted sums.
    let (v, cc, l, t) = (info.vocab as f64, 32.0, 1.0, 32.0);
    let blocks = l * (12.0 * cc * cc + 13.0 * cc);
    let matmul = v * cc + blocks + 2.0 * cc;
    assert_eq!(
        info.params as f64,
        matmul + t * cc,
        "GPT-2's parameter count"
    );
    assert_eq!(info.flops_per_token, 6.0 * matmul + 6.0 * l * t * cc);
    // the throughput figures are the same count over the measured time
    let rel = |a: f64, b: f64| ((a - b) / b).abs();
    assert!(rel(s.flops_per_s, s.tokens_per_s * info.flops_per_token) < 1e-12);
    assert!(rel(s.utilisation, s.flops_per_s / info.peak_flops) < 1e-12);
    assert!(
        info.peak_flops > 1e8 && s.utilisation > 0.0,
        "{} {}",
        info.peak_flops,
        s.utilisation
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A supervised job dies with its supervisor, however the supervisor dies:
/// SIGKILL to `weft train --supervise` leaves no training child writing
/// the run folder (Linux's parent-death signal).
#[test]
fn a_supervised_job_dies_with_its_killed_supervisor() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-orphan-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut c = tiny(&dir, "long");
    c.train.steps = 1_000_000;
    c.train.eval_every = 0;
    let config = dir.join("long.toml");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(&config, c.to_toml()).unwrap();
    let mut parent = std::process::Command::new(weft)
        .args(["train", "--supervise", "--config"])
        .arg(&config)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // the training child holds the run's lock, naming its pid
    let lock = dir.join("long/.lock");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let child: u32 = loop {
        let pid = std::fs::read_to_string(&lock)
            .ok()
            .and_then(|s| s.split_whitespace().next()?.parse().ok());
        if let Some(pid) = pid.filter(|&p| p != parent.id()) {
            break pid;
        }
        assert!(std::time::Instant::now() < deadline, "no training child");
        std::thread::sleep(std::time::Duration::from_millis(50));
    };
    let alive = |pid: u32| {
        std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
            s.rsplit(')')
                .next()
                .is_some_and(|r| !r.trim_start().starts_with('Z'))
        })
    };
    assert!(alive(child));
    parent.kill().unwrap();
    parent.wait().unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while alive(child) {
        if std::time::Instant::now() > deadline {
            // leave nothing running behind a failed test
            let _ = std::process::Command::new("kill")
                .args(["-9", &child.to_string()])
                .status();
            panic!("training child {child} outlived its killed supervisor");
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The start-up report's host-copy bytes and every checkpoint reported
/// (step, written in the background, bytes).
#[derive(Default)]
struct Saves {
    predicted: usize,
    saved: Vec<(u64, bool, u64)>,
}

impl weft_trainer::train::Observer for Saves {
    fn start(&mut self, info: &weft_trainer::train::RunInfo) {
        self.predicted = info.checkpoint_bytes;
    }
    fn event(&mut self, e: &weft_trainer::train::HealthEvent) {
        if let weft_trainer::train::HealthEvent::Run(weft_trace::EventKind::Checkpoint {
            step,
            background,
            bytes,
            ..
        }) = e
        {
            self.saved.push((*step, *background, *bytes));
        }
    }
}

#[test]
fn background_saves_write_what_synchronous_ones_do_from_the_predicted_copy() {
    use weft_checkpoint::Checkpoint;
    let dir = std::env::temp_dir().join(format!("weft-bg-save-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for layout in [&[][..], &["parallel.dp=2", "parallel.fsdp=\"full\""][..]] {
        let mut runs = Vec::new();
        for background in [true, false] {
            let name = format!("{}-{background}", layout.len());
            let mut sets = vec![
                format!("run.dir={}", toml_str(&dir)),
                format!("run.name={name}"),
                "checkpoint.every=20".to_owned(),
                "checkpoint.keep_last=5".to_owned(),
                format!("checkpoint.background={background}"),
            ];
            sets.extend(layout.iter().map(|s| (*s).to_owned()));
            let base = tiny(&dir, &name).to_toml();
            let config = dir.join(format!("{name}.toml"));
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(&config, base).unwrap();
            let c = Config::load(Some(&config), &sets).unwrap();
            let mut saves = Saves::default();
            let s = train(&c, false, &mut saves).unwrap();
            // every save reported once, in order, in its mode
            let steps: Vec<(u64, bool)> = saves.saved.iter().map(|s| (s.0, s.1)).collect();
            assert_eq!(steps, [20, 40, 60].map(|t| (t, background)), "{name}");
            let ck = s.run_dir.join("checkpoints");
            for &(step, _, bytes) in &saves.saved {
                // the copy is what the layout predicted, and what rank 0's
                // file holds
                assert_eq!(bytes as usize, saves.predicted, "{name}");
                let c = Checkpoint::open(&ck.join(format!("step-{step:08}"))).unwrap();
                let mine: u64 = c
                    .manifest()
                    .tensors
                    .values()
                    .flat_map(|t| &t.shards)
                    .filter(|sh| sh.file == "rank-00000.safetensors")
                    .map(|sh| sh.byte_len)
                    .sum();
                assert_eq!(mine, bytes, "{name} step {step}");
            }
            runs.push(s.run_dir);
        }
        // the same training and the same checkpoints, byte for byte
        assert_eq!(losses(&runs[0]), losses(&runs[1]));
        for step in [20, 40, 60] {
            let open = |r: &std::path::Path| {
                Checkpoint::open(&r.join(format!("checkpoints/step-{step:08}"))).unwrap()
            };
            let (a, b) = (open(&runs[0]), open(&runs[1]));
            assert_eq!(a.manifest().tensors.len(), b.manifest().tensors.len());
            for name in a.manifest().tensors.keys() {
                assert_eq!(a.read_tensor(name).unwrap(), b.read_tensor(name).unwrap());
            }
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// TensorBoard's own reader on the run folder: `{scalars: {tag: [[step,
/// value]]}, texts: {tag: [[step, text]]}}`.
const TB_READ: &str = r#"
import json, sys
from tensorboard.backend.event_processing import event_accumulator as ea
acc = ea.EventAccumulator(sys.argv[1], size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags[ea.SCALARS]},
       "texts": {t: [[e.step, e.tensor_proto.string_val[0].decode()] for e in acc.Tensors(t)]
                 for t in tags[ea.TENSORS]}}
print(json.dumps(out, allow_nan=True))
"#;

#[test]
fn tensorboard_shows_every_number_of_the_logs_once_across_a_resume() {
    let Some(py) = python("tensorboard") else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("weft-tb-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let base = dir.join("moe.toml");
    std::fs::write(&base, tiny(&dir, "moe").to_toml()).unwrap();
    let sets = [
        "model.n_layer=2",
        "model.moe.experts=4",
        "model.moe.top_k=2",
        "train.steps=20",
        "train.eval_every=10",
        "checkpoint.every=10",
    ];
    let c = Config::load(Some(&base), &sets.map(String::from)).unwrap();
    // 15 steps (saved at 10 and at the end), then resumed to 20: the
    // resumed run rewrites the file from the lines its logs keep
    let mut short = c.clone();
    short.train.steps = 15;
    let first = train(&short, false, &mut Silent);
    assert!(first.is_ok(), "{first:?}");
    let s = train(&c, true, &mut Silent).unwrap();
    let run = s.run_dir;
    let files: Vec<_> = std::fs::read_dir(&run)
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().contains("tfevents"))
        .collect();
    assert_eq!(files.len(), 1, "one event file");
    let out = std::process::Command::new(py)
        .args(["-c", TB_READ])
        .arg(&run)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tb: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    // (values compared as the f32 TensorBoard stores: JSON's text of
    // the widened f64 reads back to within an ulp of it)
    let series = |tag: &str| -> Vec<(u64, f32)> {
        tb["scalars"][tag]
            .as_array()
            .unwrap_or_else(|| panic!("no series {tag}: {tb}"))
            .iter()
            .map(|p| (p[0].as_u64().unwrap(), p[1].as_f64().unwrap() as f32))
            .collect()
    };
    // every number of metrics.jsonl, as f32, once per step
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(run.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let f32of = |v: &serde_json::Value| v.as_f64().unwrap() as f32;
    let records: Vec<&serde_json::Value> =
        lines.iter().filter(|l| l.get("loss").is_some()).collect();
    assert_eq!(records.len(), 20);
    for (tag, key) in [
        ("train/loss", "loss"),
        ("train/lr", "lr"),
        ("train/grad_norm", "grad_norm"),
        ("perf/tokens_per_s", "tokens_per_s"),
        ("perf/mfu", "mfu"),
        ("moe/max_vio", "max_vio"),
        ("memory/rss_bytes", "rss_bytes"),
    ] {
        let want: Vec<(u64, f32)> = records
            .iter()
            .map(|r| (r["step"].as_u64().unwrap(), f32of(&r[key])))
            .collect();
        assert_eq!(series(tag), want, "{tag}");
    }
    let evals: Vec<(u64, f32)> = lines
        .iter()
        .filter(|l| l["event"] == "eval")
        .map(|l| (l["step"].as_u64().unwrap(), f32of(&l["val_loss"])))
        .collect();
    // before training, at 10, at the first run's end (15) and at 20
    assert_eq!(
        evals.iter().map(|e| e.0).collect::<Vec<_>>(),
        [0, 10, 15, 20]
    );
    assert_eq!(series("eval/val_loss"), evals);
    // each expert layer's load of expert_load.jsonl
    let loads: Vec<serde_json::Value> = std::fs::read_to_string(run.join("expert_load.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for layer in 0..2 {
        let want: Vec<(u64, f32)> = loads
            .iter()
            .filter(|r| r["layer"] == layer)
            .map(|r| {
                let t: Vec<f64> = r["tokens_per_expert"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_f64().unwrap())
                    .collect();
                let mean = t.iter().sum::<f64>() / t.len() as f64;
                let max = t.iter().copied().fold(0.0, f64::max);
                (r["step"].as_u64().unwrap(), (max / mean - 1.0) as f32)
            })
            .collect();
        assert_eq!(want.len(), 20);
        assert_eq!(series(&format!("moe/layer{layer}/max_vio")), want);
    }
    // the configuration, and the checkpoints as texts
    let config = tb["texts"]["config"][0][1].as_str().unwrap();
    assert!(config.contains("experts = 4"), "{config}");
    let ckpts: Vec<u64> = tb["texts"]["checkpoints"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t[0].as_u64().unwrap())
        .collect();
    assert_eq!(ckpts, [20], "the resumed attempt's checkpoint");
    assert!(series("train/loss").iter().map(|p| p.0).eq(1..=20));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_wsd_run_branches_into_decays_from_its_stable_phase() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = std::env::temp_dir().join(format!("weft-wsd-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("stable.toml");
    std::fs::write(&config, tiny(&dir, "stable").to_toml()).unwrap();
    let run = |args: &[&str]| {
        let o = std::process::Command::new(weft)
            .arg("train")
            .args(args)
            .output()
            .unwrap();
        (
            o.status.success(),
            String::from_utf8_lossy(&o.stderr).into_owned(),
        )
    };
    // 40 steps, the last quarter decaying; a checkpoint every 10
    let (ok, err) = run(&[
        "--config",
        config.to_str().unwrap(),
        "--set",
        "train.steps=40",
        "--set",
        "optim.schedule=\"wsd\"",
        "--set",
        "optim.decay_fraction=0.25",
        "--set",
        "checkpoint.every=10",
        "--set",
        "checkpoint.keep_last=9",
    ]);
    assert!(ok, "{err}");
    // from step 20 of the stable phase into a 1-sqrt decay over 10 steps
    let from = |step: u64| {
        dir.join(format!("stable/checkpoints/step-{step:08}"))
            .to_str()
            .unwrap()
            .to_owned()
    };
    let (ok, err) = run(&[
        "--branch",
        &from(20),
        "--set",
        "run.name=\"sqrt\"",
        "--set",
        "train.steps=30",
        "--set",
        "optim.decay_steps=10",
        "--set",
        "optim.decay_shape=\"sqrt\"",
    ]);
    assert!(ok, "{err}");
    let records = |name: &str| -> Vec<serde_json::Value> {
        std::fs::read_to_string(dir.join(name).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .filter(|l| l.get("lr").is_some())
            .collect()
    };
    let (stable, branch) = (records("stable"), records("sqrt"));
    assert_eq!(branch.len(), 30);
    // the branch's first 20 steps are the stable run's, and so is step
    // 21's loss (the same parameters); its learning rate then follows
    // Hägele et al.'s 1 - sqrt(k/K) from the peak to the floor
    for s in 0..20 {
        assert_eq!(branch[s]["loss"], stable[s]["loss"]);
        assert_eq!(branch[s]["lr"], stable[s]["lr"]);
    }
    assert_eq!(branch[20]["loss"], stable[20]["loss"]);
    assert_ne!(branch[21]["loss"], stable[21]["loss"]);
    let (peak, floor) = (1e-2, 1e-3);
    for k in 1..=10u32 {
        let want = floor + (1.0 - (f64::from(k) / 10.0).sqrt()) * (peak - floor);
        let got = branch[19 + k as usize]["lr"].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "step {}: {got} vs {want}",
            20 + k
        );
    }
    // a checkpoint inside the run's own decay does not branch into
    // another, and no folder is made for it
    let (ok, err) = run(&[
        "--branch",
        &from(40),
        "--set",
        "run.name=\"late\"",
        "--set",
        "train.steps=50",
        "--set",
        "optim.decay_steps=5",
    ]);
    assert!(!ok);
    assert!(
        err.contains("checkpoint of the stable phase, at step 30 or before"),
        "{err}"
    );
    assert!(!dir.join("late").exists());
    // weft compare shows the branch beside its trunk, naming the decay
    let o = std::process::Command::new(weft)
        .arg("compare")
        .args([dir.join("stable"), dir.join("sqrt")])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&o.stdout);
    assert!(
        text.contains("config: optim.decay_shape = \"sqrt\""),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `optim.name = "muon"`: Muon for the hidden matrices, AdamW for the
/// rest. A run learns; killed and resumed it continues bit for bit; its
/// checkpoints hold each matrix's momentum under torch's name and no
/// second moment for it; a bf16 run sharded over two FSDP ranks (each
/// matrix gathered to its owner) trains and resumes bit for bit too.
#[test]
fn muon_runs_learn_save_their_momentum_and_resume_bit_for_bit() {
    let dir = std::env::temp_dir().join(format!("weft-muon-train-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = |name: &str, sharded: bool| {
        let mut c = tiny(&dir, name);
        c.model.n_layer = 2;
        c.optim.name = weft_kernels::Optimizer::Muon;
        c.optim.lr = 3e-3;
        c.optim.muon_lr = Some(1e-2);
        c.checkpoint.every = 20;
        if sharded {
            c.train.precision = weft_kernels::Precision::Bf16;
            c.parallel.dp = 2;
            c.parallel.fsdp = Some(weft_parallel::Strategy::Full);
        }
        c
    };
    for sharded in [false, true] {
        let whole = train(&cfg("whole", sharded), false, &mut Silent).unwrap();
        let floor = whole.floor.unwrap();
        assert!(
            whole.final_eval_loss - floor < 0.5 * (whole.initial_eval_loss - floor),
            "sharded {sharded}: gap {} of initial {}",
            whole.final_eval_loss - floor,
            whole.initial_eval_loss - floor
        );
        let crashed = std::panic::catch_unwind(|| {
            let _ = train(&cfg("crashy", sharded), false, &mut CrashAfter(46));
        });
        assert!(crashed.is_err());
        let resumed = train(&cfg("crashy", sharded), true, &mut Silent).unwrap();
        assert_eq!(
            losses(&whole.run_dir),
            losses(&resumed.run_dir),
            "sharded {sharded}"
        );
        let ckpt =
            weft_checkpoint::Checkpoint::open(&whole.run_dir.join("checkpoints/step-00000060"))
                .unwrap();
        let names = &ckpt.manifest().tensors;
        for (name, muon) in [
            ("transformer.h.1.attn.c_attn.weight", true),
            ("transformer.h.0.mlp.c_proj.weight", true),
            ("transformer.wte.weight", false),
            ("transformer.h.0.attn.c_attn.bias", false),
        ] {
            let has = |k: &str| names.contains_key(&format!("optimizer.{k}.{name}"));
            assert_eq!(
                (has("momentum_buffer"), has("exp_avg"), has("exp_avg_sq")),
                (muon, !muon, !muon),
                "{name}"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

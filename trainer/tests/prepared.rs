//! Training on prepared token data (`weft data prepare`): the same
//! sequences in the same order on every layout and after a resume, and
//! blends that report what they give.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};

use weft_data::{BlendEntry, Source};
use weft_trainer::config::Config;
use weft_trainer::train::{Observer, RunInfo, Silent, StepReport, train};

fn tmp(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("weft-prepared-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Shakespeare's openings cut into many small documents (paragraphs), as
/// .txt files and one .jsonl, prepared into `dir/name`.
fn prepared(dir: &Path, name: &str, skip: usize) -> PathBuf {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/shakespeare.txt"
    ))
    .unwrap();
    let docs: Vec<&str> = text
        .split("\n\n")
        .filter(|d| !d.trim().is_empty())
        .skip(skip)
        .collect();
    assert!(docs.len() > 40, "{}", docs.len());
    let src = dir.join(format!("{name}-text"));
    std::fs::create_dir_all(&src).unwrap();
    let mut jsonl = String::new();
    for (i, d) in docs.iter().enumerate() {
        if i % 2 == 0 {
            std::fs::write(src.join(format!("doc{i:04}.txt")), d).unwrap();
        } else {
            jsonl.push_str(&serde_json::json!({ "text": d }).to_string());
            jsonl.push('\n');
        }
    }
    std::fs::write(src.join("rest.jsonl"), jsonl).unwrap();
    let out = dir.join(name);
    let opts = weft_data::PrepareOptions {
        shard_tokens: 2000,
        ..Default::default()
    };
    weft_data::prepare(&[src], &out, &opts, &mut |_| ControlFlow::Continue(())).unwrap();
    out
}

fn config(dir: &Path, name: &str, data: &Path, extra: &[&str]) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=1",
        "model.n_head=2",
        "model.n_embd=32",
        "model.block_size=16",
        "train.batch_size=8",
        "train.micro_batch_size=2",
        "train.steps=8",
        "train.eval_every=4",
        "train.eval_sequences=8",
        "optim.warmup_steps=2",
        "optim.lr=1e-2",
        "checkpoint.every=0",
    ]
    .iter()
    .chain(extra)
    .map(|s| (*s).to_owned())
    .chain([
        format!("run.dir={:?}", dir.display().to_string()),
        format!("run.name={name}"),
        format!("data.source={:?}", data.display().to_string()),
    ])
    .collect();
    Config::load(None, &sets).unwrap()
}

/// Every metrics line's loss and grad norm and every eval's loss, as JSON
/// text (which round-trips f64 bits).
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

/// Keeps the start-up report.
#[derive(Default)]
struct Info(Option<RunInfo>);
impl Observer for Info {
    fn start(&mut self, info: &RunInfo) {
        self.0 = Some(info.clone());
    }
}

/// Panics in step `0` (a crash mid-run).
struct CrashAfter(u64);
impl Observer for CrashAfter {
    fn step(&mut self, r: &StepReport) {
        assert!(r.record.step < self.0, "simulated crash");
    }
}

#[test]
fn prepared_data_is_the_same_sequences_on_every_layout_and_after_a_resume() {
    let dir = tmp("layouts");
    let data = prepared(&dir, "p", 0);
    let mut info = Info::default();
    let one = train(&config(&dir, "dp1", &data, &[]), false, &mut info).unwrap();
    let reference = trace(&one.run_dir);
    assert_eq!(reference.len(), 8 + 3, "{reference:?}");
    // The start reports the one dataset: all of the run's 64 sequences.
    let shares = info.0.unwrap().data_shares;
    assert_eq!(shares.len(), 1);
    assert_eq!((shares[0].samples, shares[0].fraction), (64, 1.0));
    // Real text: the loss falls from the uniform guess.
    assert!(one.final_eval_loss < one.initial_eval_loss - 1.0, "{one:?}");
    // Data parallelism: the same sequences, bitwise the same run.
    let s = train(
        &config(&dir, "dp2", &data, &["parallel.dp=2"]),
        false,
        &mut Silent,
    )
    .unwrap();
    assert_eq!(trace(&s.run_dir), reference, "dp=2");
    // Other micro-batch cuts of the same global batch: the same sequences
    // (the first step's loss, before any update, is bitwise the same: a
    // mean of the same per-token losses), the rest equal to rounding (the
    // gradients accumulate in another order).
    let loss = |line: &str| line.split(' ').nth(1).unwrap().parse::<f64>().ok();
    for (name, sets) in [
        ("dp2-m4", &["parallel.dp=2", "train.micro_batch_size=4"][..]),
        ("m8", &["train.micro_batch_size=8"][..]),
    ] {
        let s = train(&config(&dir, name, &data, sets), false, &mut Silent).unwrap();
        let t = trace(&s.run_dir);
        assert_eq!(
            t[1].split(' ').nth(1),
            reference[1].split(' ').nth(1),
            "{name}"
        );
        assert_eq!(t.len(), reference.len(), "{name}: records");
        for (x, y) in t.iter().zip(&reference) {
            if let (Some(a), Some(b)) = (loss(x), loss(y)) {
                assert!((a - b).abs() < 1e-6 * b, "{name}: {x} vs {y}");
            }
        }
    }
    // A run that crashes after step 5 and resumes from its step-4
    // checkpoint continues bit for bit.
    let ckpt = ["checkpoint.every=4"];
    let crashed = std::panic::catch_unwind(|| {
        let _ = train(
            &config(&dir, "crashy", &data, &ckpt),
            false,
            &mut CrashAfter(6),
        );
    });
    assert!(crashed.is_err());
    let resumed = train(&config(&dir, "crashy", &data, &ckpt), true, &mut Silent).unwrap();
    assert_eq!(trace(&resumed.run_dir), reference);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `data.doc_mask`: bitwise the same run on one rank and on dp=2 with
/// FSDP, a different run from the unmasked one on the same data, reported
/// at the start, and kept by `weft sample`; refused without documents.
#[test]
fn document_masking_is_the_same_on_every_layout_and_changes_the_run() {
    let dir = tmp("docmask");
    let data = prepared(&dir, "p", 0);
    let mask = "data.doc_mask=true";
    let mut info = Info::default();
    let one = train(
        &config(&dir, "m1", &data, &[mask, "checkpoint.every=8"]),
        false,
        &mut info,
    )
    .unwrap();
    assert!(info.0.unwrap().doc_mask);
    let reference = trace(&one.run_dir);
    let fsdp = train(
        &config(
            &dir,
            "m2",
            &data,
            &[mask, "parallel.dp=2", "parallel.fsdp=\"full\""],
        ),
        false,
        &mut Silent,
    )
    .unwrap();
    assert_eq!(trace(&fsdp.run_dir), reference, "dp=2 fsdp");
    let plain = train(&config(&dir, "plain", &data, &[]), false, &mut Silent).unwrap();
    assert_ne!(trace(&plain.run_dir), reference, "the mask changes nothing");
    // Real text: the masked run learns too.
    assert!(one.final_eval_loss < one.initial_eval_loss - 1.0, "{one:?}");
    let sampler = weft_trainer::sample::Sampler::open(&one.run_dir).unwrap();
    assert_eq!(
        sampler.model().blocks().doc_boundary(),
        Some(weft_data::END_OF_TEXT)
    );
    let e = Config::load(None, &[mask.to_owned()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("data.doc_mask") && e.contains("synthetic"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn blends_report_their_shares_and_bad_blends_are_refused() {
    let dir = tmp("blend");
    let (a, b) = (prepared(&dir, "a", 0), prepared(&dir, "b", 20));
    let mut c = config(&dir, "blend", &a, &[]);
    let blend = |weights: [f64; 2], first: &Path| {
        Source::Blend(vec![
            BlendEntry {
                path: first.display().to_string(),
                weight: weights[0],
            },
            BlendEntry {
                path: b.display().to_string(),
                weight: weights[1],
            },
        ])
    };
    c.data.source = blend([3.0, 1.0], &a);
    // The config round-trips through its TOML (the run folder's copy).
    let again = Config::from_toml(&c.to_toml(), "test").unwrap();
    assert_eq!(again.data.source, c.data.source);
    let mut info = Info::default();
    train(&c, false, &mut info).unwrap();
    let shares = info.0.unwrap().data_shares;
    assert_eq!(shares.iter().map(|s| s.samples).sum::<u64>(), 64);
    assert!((shares[0].fraction - 0.75).abs() < 0.02, "{shares:?}");

    let text = format!(
        "[data]\nsource = {:?}\n[[data.blend]]\npath = {:?}\nweight = 1.0\n",
        a.display().to_string(),
        b.display().to_string()
    );
    let e = Config::from_toml(&text, "job.toml")
        .unwrap_err()
        .to_string();
    assert!(e.contains("data.blend: replaces data.source"), "{e}");
    let mut bad = c.clone();
    bad.data.source = blend([3.0, -1.0], &a);
    let e = bad.validate().unwrap_err().to_string();
    assert!(e.contains("data.blend[1].weight"), "{e}");
    let mut bad = c;
    bad.data.source = blend([3.0, 1.0], &dir.join("missing"));
    let e = train(&bad, false, &mut Silent).unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn weft_data_prepare_verify_and_train_from_the_command_line() {
    let weft = env!("CARGO_BIN_EXE_weft");
    let dir = tmp("cli");
    let src = dir.join("text");
    std::fs::create_dir_all(&src).unwrap();
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/shakespeare.txt"
    ))
    .unwrap();
    for (i, d) in text.split("\n\n").enumerate() {
        std::fs::write(src.join(format!("{i:04}.txt")), d).unwrap();
    }
    let out = dir.join("prepared");
    let run = |args: &[&str]| {
        let o = std::process::Command::new(weft)
            .args(args)
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        (o.status.success(), text)
    };
    let (src_s, out_s) = (src.display().to_string(), out.display().to_string());
    let (ok, said) = run(&["data", "prepare", &src_s, "--out", &out_s]);
    assert!(
        ok && said.contains("documents") && said.contains("tokens"),
        "{said}"
    );
    let (ok, said) = run(&["data", "prepare", &src_s, "--out", &out_s]);
    assert!(ok && said.contains("already prepared"), "{said}");
    let (ok, said) = run(&["data", "verify", &out_s]);
    assert!(
        ok && said.starts_with("ok:") && said.contains("weft format"),
        "{said}"
    );
    let run_dir = format!("run.dir={:?}", dir.display().to_string());
    let (ok, said) = run(&[
        "train",
        "--data",
        &out_s,
        "--set",
        &run_dir,
        "--set",
        "model.n_layer=1",
        "--set",
        "model.n_embd=32",
        "--set",
        "model.n_head=2",
        "--set",
        "model.block_size=16",
        "--set",
        "train.steps=2",
        "--set",
        "train.batch_size=4",
        "--set",
        "train.eval_every=0",
    ]);
    assert!(
        ok && said.contains("100.0% of the run's 8 sequences"),
        "{said}"
    );
    // A damaged shard: verify fails naming it, and so does training that
    // reads it.
    let shard = out.join("shard-00000.bin");
    let mut bytes = std::fs::read(&shard).unwrap();
    bytes[100] ^= 0xff;
    std::fs::write(&shard, bytes).unwrap();
    let (ok, said) = run(&["data", "verify", &out_s]);
    assert!(
        !ok && said.contains("shard-00000.bin") && said.contains("checksum"),
        "{said}"
    );
    let (ok, said) = run(&[
        "data",
        "prepare",
        &dir.join("nope").display().to_string(),
        "--out",
        &out_s,
    ]);
    assert!(!ok && said.contains("nope"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A word-level `tokenizer.json` of the words of `text` (ids 1..), `[UNK]`
/// 0, and `</s>` at id 70,000: ids past 16 bits.
fn wide_tokenizer(dir: &Path, text: &str) -> PathBuf {
    let mut vocab = serde_json::Map::new();
    vocab.insert("[UNK]".into(), 0.into());
    for w in text.split(|c: char| !c.is_alphanumeric()) {
        if !w.is_empty() && !vocab.contains_key(w) {
            let id = vocab.len();
            vocab.insert(w.into(), id.into());
        }
    }
    vocab.insert("</s>".into(), 70_000.into());
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
        "normalizer": null, "pre_tokenizer": {"type": "Whitespace"}, "post_processor": null,
        "decoder": null, "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "[UNK]"}
    });
    let path = dir.join("words.json");
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

/// `weft data prepare --tokenizer`: u32 shards that train a model of the
/// tokenizer's vocabulary, sampled through the folder's copy of it; the
/// job naming another tokenizer is refused.
#[test]
fn a_tokenizer_json_prepares_trains_and_samples() {
    let dir = tmp("hf");
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/shakespeare.txt"
    ))
    .unwrap();
    let src = dir.join("text");
    std::fs::create_dir_all(&src).unwrap();
    for (i, d) in text.split("\n\n").enumerate() {
        std::fs::write(src.join(format!("{i:04}.txt")), d).unwrap();
    }
    let json = wide_tokenizer(&dir, &text);
    let out = dir.join("prepared");
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["data", "prepare", "--tokenizer"])
        .args([&json, &src, Path::new("--out"), &out])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let index = weft_data::Index::read(&out.join("index.json")).unwrap();
    assert_eq!(
        (index.dtype, index.vocab_size),
        (weft_data::Dtype::U32, 70_001)
    );
    let mut info = Info::default();
    let sets = ["checkpoint.every=8", "data.doc_mask=true"];
    let r = train(&config(&dir, "hf", &out, &sets), false, &mut info).unwrap();
    assert_eq!(info.0.unwrap().vocab, 70_001);
    assert!(r.final_eval_loss < r.initial_eval_loss, "{r:?}");
    // The folder's copy of the tokenizer decodes, end-of-text included.
    std::fs::remove_file(&json).unwrap();
    let sampler = weft_trainer::sample::Sampler::open(&r.run_dir).unwrap();
    assert!(sampler.is_text());
    assert_eq!(sampler.model().blocks().doc_boundary(), Some(70_000));
    assert_eq!(sampler.encode_prompt(None).unwrap(), [70_000]);
    let prompt = sampler.encode_prompt(Some("To be or not")).unwrap();
    assert_eq!(prompt.len(), 4);
    assert_eq!(sampler.render(&prompt), "To be or not");
    // Another tokenizer named in the job: refused, naming both.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let json = wide_tokenizer(&other, "different words");
    let named = format!("data.tokenizer={}", json.display());
    let e = train(&config(&dir, "wrong", &out, &[&named]), false, &mut Silent)
        .unwrap_err()
        .to_string();
    assert!(e.contains("prepared") && e.contains("words.json"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

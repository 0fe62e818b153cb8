//! `weft sample` through the library: a short synthetic run with a
//! checkpoint, then generation from it — deterministic for a seed, and
//! greedy output equal to the argmax of the full training forward's logits.

use weft_trainer::config::Config;
use weft_trainer::sample::{SampleError, SampleOptions, Sampler};
use weft_trainer::train::{Silent, train};

fn config(dir: &std::path::Path, name: &str, extra: &[&str]) -> Config {
    let sets: Vec<String> = [
        "model.n_layer=2",
        "model.n_head=2",
        "model.n_embd=16",
        "model.block_size=16",
        "train.batch_size=4",
        "train.steps=6",
        "train.eval_every=0",
        "train.eval_sequences=4",
        "optim.warmup_steps=2",
        "checkpoint.every=3",
        "data.synthetic.regular=30",
        "data.synthetic.successors=3",
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

fn argmax(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in logits.iter().enumerate() {
        if x > logits[best] {
            best = i;
        }
    }
    u32::try_from(best).unwrap()
}

/// Greedy continuation by full forwards over the growing prefix (no cache).
fn greedy_by_full_forward(sampler: &Sampler, prompt: &[u32], n: usize) -> Vec<u32> {
    let model = sampler.model();
    let v = model.config().vocab_size;
    let mut seq = prompt.to_vec();
    for _ in 0..n {
        let mut acts = model.activations(1, seq.len()).unwrap();
        model.forward(&mut acts, &seq, None).unwrap();
        seq.push(argmax(&acts.logits()[(seq.len() - 1) * v..]));
    }
    seq[prompt.len()..].to_vec()
}

#[test]
fn sampling_a_trained_run_is_deterministic_and_greedy_follows_the_forward() {
    let dir = std::env::temp_dir().join(format!("weft-sample-test-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    for (name, extra) in [
        ("dense", &[][..]),
        ("moe", &["model.moe.experts=4", "model.moe.top_k=2"][..]),
        // trained with its sequences split over two ranks, decoded on one
        ("cp2", &["parallel.cp=2", "model.block_size=256"][..]),
    ] {
        let summary = train(&config(&dir, name, extra), false, &mut Silent).unwrap();
        let sampler = Sampler::open(&summary.run_dir).unwrap();
        assert_eq!(sampler.step(), 6, "{name}: the last checkpoint");
        assert!(!sampler.is_text());
        let prompt = sampler.encode_prompt(Some("3 <M1> 7")).unwrap();
        assert_eq!(prompt, [3, 31, 7]);

        // Greedy: the argmax of the training forward's logits at every step.
        let greedy = SampleOptions {
            tokens: 13,
            temperature: 0.0,
            ..SampleOptions::default()
        };
        let out = sampler.generate(&prompt, &greedy).unwrap();
        assert_eq!(out, greedy_by_full_forward(&sampler, &prompt, 13), "{name}");

        // Sampling: the same seed gives the same tokens, another seed others;
        // past block_size the context slides.
        let opts = |seed| SampleOptions {
            tokens: 40,
            temperature: 1.0,
            top_k: 10,
            seed,
        };
        let a = sampler.generate(&prompt, &opts(1)).unwrap();
        assert_eq!(a.len(), 40);
        assert_eq!(a, sampler.generate(&prompt, &opts(1)).unwrap(), "{name}");
        assert_ne!(a, sampler.generate(&prompt, &opts(2)).unwrap(), "{name}");
        assert!(a.iter().all(|&t| t < 36));
        let text = sampler.render(&a);
        assert_eq!(text.split_whitespace().count(), 40);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_runs_and_prompts_are_clear_errors() {
    let dir = std::env::temp_dir().join(format!("weft-sample-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let e = Sampler::open(&dir.join("nope")).unwrap_err();
    assert!(matches!(e, SampleError::NoRun(_)), "{e}");
    assert!(e.to_string().contains("not a run folder"), "{e}");

    // A run that never saved a checkpoint.
    let summary = train(
        &config(&dir, "nockpt", &["checkpoint.every=0", "train.steps=1"]),
        false,
        &mut Silent,
    )
    .unwrap();
    let _ = std::fs::remove_dir_all(summary.run_dir.join("checkpoints"));
    let e = Sampler::open(&summary.run_dir).unwrap_err();
    assert!(matches!(e, SampleError::NoCheckpoint(_)), "{e}");

    let summary = train(&config(&dir, "ok", &["train.steps=3"]), false, &mut Silent).unwrap();
    let sampler = Sampler::open(&summary.run_dir).unwrap();
    let long = vec!["1"; 17].join(" ");
    let e = sampler.encode_prompt(Some(&long)).unwrap_err();
    assert!(e.to_string().contains("block_size = 16"), "{e}");
    let e = sampler.encode_prompt(Some("1 two")).unwrap_err();
    assert!(e.to_string().contains("`two`"), "{e}");
    assert!(sampler.encode_prompt(Some(" ")).is_err());
    let e = sampler
        .generate(
            &[1],
            &SampleOptions {
                temperature: -1.0,
                ..SampleOptions::default()
            },
        )
        .unwrap_err();
    assert!(e.to_string().starts_with("--temperature"), "{e}");
    assert!(sampler.generate(&[99], &SampleOptions::default()).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `weft sample --hf-model DIR`: a Hugging Face folder (here a GPT-2 that
/// weft saved, so GPT-2's BPE is its tokenizer) continued greedily as the
/// training forward's argmax continues it; a folder without a tokenizer
/// weft can tell is an error naming `--tokenizer`.
#[test]
fn a_hugging_face_folder_samples_as_its_forward_continues() {
    let dir = std::env::temp_dir().join(format!("weft-sample-hf-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let cfg = weft_model::GptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 16,
        vocab_size: 50257,
        block_size: 16,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut m = weft_model::Gpt::new(cfg).unwrap();
    m.init_gpt2(3);
    weft_model::hf::save(&m, &dir).unwrap();
    let sampler = Sampler::open_hf(&dir, None).unwrap();
    let prompt = sampler.encode_prompt(Some("Hello world")).unwrap();
    assert_eq!(prompt, [15496, 995], "GPT-2's BPE");
    let opts = SampleOptions {
        tokens: 6,
        temperature: 0.0,
        ..SampleOptions::default()
    };
    let out = sampler.generate(&prompt, &opts).unwrap();
    assert_eq!(out, greedy_by_full_forward(&sampler, &prompt, 6));
    // the command line prints the same text
    let cli = std::process::Command::new(env!("CARGO_BIN_EXE_weft"))
        .args(["sample", "--hf-model"])
        .arg(&dir)
        .args([
            "--prompt",
            "Hello world",
            "--tokens",
            "6",
            "--temperature",
            "0",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&cli.stdout);
    let want = format!("{}{}", sampler.render(&prompt), sampler.render(&out));
    assert!(text.contains(&want), "{text} vs {want}");
    // a 101-token model: no tokenizer to guess
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../model/tests/fixtures/l2_h4_c32_v101_tied");
    match Sampler::open_hf(&fixture, None) {
        Err(SampleError::Tokenizer(e)) => assert!(e.contains("--tokenizer"), "{e}"),
        other => panic!("{other:?}"),
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

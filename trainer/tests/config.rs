//! The job file's keys: defaults, files, `--set` overrides and their
//! checks, each error naming the key (`weft_trainer::config`).

use std::path::Path;

use weft_kernels::Precision;
use weft_parallel::BatchSplit;
use weft_trainer::config::*;

#[test]
fn defaults_are_valid_and_round_trip() {
    let c = Config::default();
    c.validate().unwrap();
    let back = Config::from_toml(&c.to_toml(), "x").unwrap();
    assert_eq!(back, c);
}

#[test]
fn file_overrides_defaults() {
    let c = Config::from_toml("[optim]\nlr = 1e-4\n[model]\nn_layer = 6\n", "run.toml").unwrap();
    assert_eq!(c.optim.lr, 1e-4);
    assert_eq!(c.model.n_layer, 6);
    assert_eq!(c.model.n_embd, ModelConfig::default().n_embd);
}

#[test]
fn unknown_key_names_key_file_and_line() {
    let e = Config::from_toml("[optim]\nlr = 1e-4\nlearning_rate = 3\n", "run.toml").unwrap_err();
    let s = e.to_string();
    assert_eq!(e.position.map(|p| p.0), Some(3), "{s}");
    assert!(s.starts_with("run.toml:3:"), "{s}");
    assert!(s.contains("optim.learning_rate"), "{s}");
    assert!(s.contains("unknown field"), "{s}");
}

#[test]
fn ill_typed_value_names_expected_type() {
    let e = Config::from_toml("[train]\nsteps = \"many\"\n", "run.toml").unwrap_err();
    let s = e.to_string();
    assert!(s.starts_with("run.toml:2:"), "{s}");
    assert!(s.contains("train.steps"), "{s}");
    assert!(s.contains("u64"), "{s}");
}

#[test]
fn overrides_apply_and_are_checked() {
    let c = Config::default().with_override("optim.lr=0.01").unwrap();
    assert_eq!(c.optim.lr, 0.01);
    let c = c.with_override("run.name=trial").unwrap();
    assert_eq!(c.run.name, "trial");
    let c = c.with_override("data.synthetic.copy_length=12").unwrap();
    assert_eq!(c.data.synthetic.copy_length, 12);
    let e = c.with_override("optim.lrr=1").unwrap_err().to_string();
    assert!(
        e.contains("--set optim.lrr=1") && e.contains("unknown key") && e.contains("lr"),
        "{e}"
    );
    let e = c
        .with_override("model.n_layer=two")
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.n_layer") && e.contains("usize"), "{e}");
    let e = c.with_override("optim").unwrap_err().to_string();
    assert!(e.contains("KEY=VALUE"), "{e}");
    let e = c.with_override("nosuch.key=1").unwrap_err().to_string();
    assert!(e.contains("unknown section `nosuch`"), "{e}");
    // optional keys left unset are set, and unknown ones still refused
    let t = c
        .with_override("data.source=corpus.txt")
        .and_then(|c| c.with_override("data.tokenizer=t/tokenizer.json"))
        .and_then(|c| c.with_override("data.eot=</s>"))
        .unwrap();
    assert_eq!(
        t.data.tokenizer,
        Some(weft_data::TokenizerSpec::named(
            "t/tokenizer.json",
            Some("</s>")
        ))
    );
    let e = c.with_override("data.tokeniser=x").unwrap_err().to_string();
    assert!(e.contains("unknown key") && e.contains("doc_mask"), "{e}");
}

#[test]
fn settings_without_effect_and_names_that_are_paths_are_refused() {
    let err = |set: &str| {
        Config::load(None, &[set.into()])
            .and_then(|c| c.validate())
            .map(|()| String::new())
            .unwrap_or_else(|e| e.to_string())
    };
    let e = err("parallel.sequence_parallel=true");
    assert!(
        e.contains("parallel.sequence_parallel") && e.contains("tp > 1"),
        "{e}"
    );
    for name in ["\"../../x\"", "\"a/b\"", "\"..\"", "\".\""] {
        let e = err(&format!("run.name={name}"));
        assert!(
            e.contains("run.name") && e.contains("not a path"),
            "{name}: {e}"
        );
    }
    assert_eq!(err("run.name=\"my-run_2\""), "");
}

#[test]
fn choices_are_typed_and_unknown_values_list_the_valid_ones() {
    let c = Config::load(
        None,
        &[
            "parallel.fsdp=\"grad_op\"".into(),
            "parallel.pp_schedule=\"zb-h1\"".into(),
            "model.moe.gate=sigmoid".into(),
            "train.precision=bf16".into(),
        ],
    )
    .unwrap();
    assert_eq!(c.train.precision, Precision::Bf16);
    assert_eq!(c.parallel.fsdp, Some(weft_parallel::Strategy::GradOp));
    assert_eq!(c.parallel.pp_schedule, weft_pipeline::ScheduleKind::ZbH1);
    assert_eq!(c.model.moe.gate, weft_moe::Gate::Sigmoid);
    assert_eq!(Config::from_toml(&c.to_toml(), "x").unwrap(), c);
    for (set, valid) in [
        (
            "parallel.fsdp=zero3",
            "`none`, `optimizer`, `grad_op`, `full`, `hybrid`",
        ),
        (
            "parallel.pp_schedule=\"1F1B\"",
            "`gpipe`, `1f1b`, `interleaved`, `zb-h1`, `zb-h2`, `zb-v`",
        ),
        ("model.moe.gate=relu", "`softmax` or `sigmoid`"),
        ("model.moe.balance=loss", "`none`, `aux`, `bias`"),
        ("model.moe.drop=random", "`score` or `position`"),
        ("train.precision=fp8", "`fp32`, `bf16`, `fp16`"),
    ] {
        let e = Config::load(None, &[set.into()]).unwrap_err().to_string();
        let key = set.split('=').next().unwrap();
        assert!(
            e.contains(key) && e.contains("unknown variant") && e.contains(valid),
            "{e}"
        );
    }
    let e = Config::from_toml("[parallel]\nfsdp = \"zero2\"\n", "run.toml")
        .unwrap_err()
        .to_string();
    assert!(
        e.starts_with("run.toml:2:") && e.contains("`grad_op`"),
        "{e}"
    );
}

#[test]
fn the_global_batch_splits_over_any_layout_by_default() {
    let split = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| (*s).to_owned()).collect();
        Config::load(None, &sets).map(|c| c.batch_split().unwrap())
    };
    let s = |micro, global, per_rank, by_layout| BatchSplit {
        micro,
        global,
        per_rank,
        by_layout,
    };
    // 32 sequences of 64 tokens: micro-batches of 512 tokens on any
    // layout that can share them
    assert_eq!(split(&[]).unwrap(), s(8, 4, 4, false));
    assert_eq!(
        split(&["parallel.pp=2", "parallel.tp=2", "parallel.dp=2"]).unwrap(),
        s(8, 4, 2, false)
    );
    assert_eq!(split(&["parallel.dp=8"]).unwrap(), s(4, 8, 1, true));
    let e = split(&["parallel.dp=3"]).unwrap_err().to_string();
    assert!(
        e.contains("key `train.batch_size`") && e.contains("dp = 3"),
        "{e}"
    );
    let e = split(&["parallel.dp=4", "train.micro_batch_size=16"])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("key `train.micro_batch_size`")
            && e.contains("2 micro-batches")
            && e.contains("divides 8"),
        "{e}"
    );
}

#[test]
fn validation_names_the_key() {
    let e = Config::load(None, &["model.n_head=3".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.n_head") && e.contains("divide"), "{e}");
    let e = Config::load(None, &["train.micro_batch_size=5".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.micro_batch_size") && e.contains("32"),
        "{e}"
    );
    let e = Config::load(Some(Path::new("/nonexistent/run.toml")), &[])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("/nonexistent/run.toml") && e.contains("cannot read"),
        "{e}"
    );
}

#[test]
fn train_device_parses_and_says_what_is_missing() {
    for (set, want) in [
        ("train.device=cpu", Device::Cpu),
        ("train.device=cuda", Device::Cuda(0)),
        ("train.device=\"cuda:3\"", Device::Cuda(3)),
    ] {
        let c = Config::load(None, &[set.into()]).unwrap();
        assert_eq!(c.train.device, want, "{set}");
    }
    assert_eq!(Config::default().train.device, Device::Cpu);
    let e = Config::load(None, &["train.device=tpu".into()])
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("train.device") && e.contains("`cpu`, `cuda` or `cuda:N`"),
        "{e}"
    );
    let c = Config::from_toml("[train]\ndevice = \"cuda:1\"\n", "run.toml").unwrap();
    assert_eq!(c.train.device, Device::Cuda(1));
    assert!(toml::to_string(&c).unwrap().contains("device = \"cuda:1\""));
    assert_eq!(Device::Cpu.check(), Ok(()));
    // On this machine (CI has no GPU) a CUDA device is an error that
    // names it and what is missing; never a panic. With a GPU it is Ok.
    if let Err(e) = Device::Cuda(0).check() {
        assert!(e.starts_with("`cuda:0`: "), "{e}");
        assert!(
            e.contains("without CUDA") || e.contains("not available"),
            "{e}"
        );
    }
    #[cfg(not(feature = "cuda"))]
    assert!(
        Device::Cuda(0)
            .check()
            .is_err_and(|e| e.contains("--features cuda")),
        "a build without CUDA says how to build one"
    );
    // No ordinal is past every driver's count.
    let e = Device::Cuda(4096).check().unwrap_err();
    assert!(e.starts_with("`cuda:4096`: "), "{e}");
}

/// `train.device = "cuda"` takes the default job (one rank, dense,
/// fp32 or bf16, any micro-batch split) and refuses, naming the key,
/// what the GPU loop does not do; the CPU takes all of it.
#[test]
fn the_gpu_loop_refuses_what_it_does_not_do() {
    let cuda = |sets: &[&str]| {
        let mut all = vec!["train.device=cuda".to_owned()];
        all.extend(sets.iter().map(|s| (*s).to_owned()));
        Config::load(None, &all).map_err(|e| e.to_string())
    };
    for ok in [
        &[][..],
        &["train.precision=bf16"],
        &["train.micro_batch_size=8", "optim.grad_clip=0.5"],
        &["train.skip_batches=[3]", "parallel.backend=threads"],
    ] {
        assert!(cuda(ok).is_ok(), "{ok:?}: {:?}", cuda(ok));
    }
    for (sets, key, says) in [
        (&["parallel.dp=2"][..], "parallel.dp", "one GPU as one rank"),
        (&["parallel.tp=2"], "parallel.tp", "one GPU as one rank"),
        (
            &["parallel.pp=2", "model.n_layer=2"],
            "parallel.pp",
            "one GPU as one rank",
        ),
        (&["parallel.fsdp=full"], "parallel.fsdp", "no sharding"),
        (&["parallel.backend=mpi"], "parallel.backend", "one rank"),
        (&["model.moe.experts=4"], "model.moe.experts", "dense MLP"),
        (
            &[
                "data.doc_mask=true",
                "data.source=trainer/tests/data/shakespeare.txt",
            ],
            "data.doc_mask",
            "document masking",
        ),
        (&["train.precision=fp16"], "train.precision", "loss scaling"),
        (&["train.rewind=true"], "train.rewind", "does not rewind"),
        (
            &["train.recompute=\"full\""],
            "train.recompute",
            "no recomputation",
        ),
    ] {
        let e = cuda(sets).unwrap_err();
        assert!(
            e.contains(&format!("key `{key}`"))
                && e.contains(says)
                && e.contains("train.device = \"cpu\""),
            "{sets:?}: {e}"
        );
        let mut cpu: Vec<String> = sets.iter().map(|s| (*s).to_owned()).collect();
        cpu.push("train.device=cpu".into());
        if let Err(e) = Config::load(None, &cpu) {
            assert!(!e.to_string().contains("one GPU"), "{sets:?}: {e}");
        }
    }
}

#[test]
fn muon_settings_need_muon_and_are_range_checked_by_name() {
    let err = |sets: &[&str]| {
        let sets: Vec<String> = sets.iter().map(|s| (*s).to_owned()).collect();
        Config::load(None, &sets)
            .and_then(|c| c.validate())
            .map(|()| String::new())
            .unwrap_or_else(|e| e.to_string())
    };
    let e = err(&["optim.muon_lr=0.02"]);
    assert!(
        e.contains("optim.muon_lr") && e.contains("name = \"muon\""),
        "{e}"
    );
    let e = err(&["optim.name=muon", "optim.muon_momentum=1.5"]);
    assert!(
        e.contains("optim.muon_momentum") && e.contains("[0, 1)"),
        "{e}"
    );
    let e = err(&["optim.name=lion"]);
    assert!(e.contains("optim.name") && e.contains("muon"), "{e}");
    let e = err(&["optim.name=muon", "optim.muon_scale=huge"]);
    assert!(
        e.contains("match_rms_adamw") && e.contains("original"),
        "{e}"
    );
    assert_eq!(
        err(&[
            "optim.name=muon",
            "optim.muon_lr=0.02",
            "optim.muon_scale=original"
        ]),
        ""
    );
    let e = err(&["optim.name=muon", "train.device=cuda"]);
    assert!(e.contains("optim.name") && e.contains("AdamW only"), "{e}");
}

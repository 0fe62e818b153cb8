//! Sharded Hugging Face folders against transformers itself (run at test
//! time by `model/reference/hf_sharded_check.py`): weft loads what
//! `save_pretrained(max_shard_size=...)` writes and computes its loss;
//! transformers loads weft's sharded export and computes identical logits;
//! weft's greedy decoding equals transformers' `generate`.
//! Skipped, saying why, without Python.

use std::path::Path;
use std::process::Command;

use weft_model::{eval, hf};
use weft_testkit::python;

fn script(py: &Path, args: &[&str]) -> String {
    let s = Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/hf_sharded_check.py");
    let out = Command::new(py).arg(s).args(args).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout).to_string();
    assert!(
        out.status.success(),
        "python failed:\n{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    text
}

fn shards(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    v.sort();
    v
}

#[test]
#[allow(clippy::print_stdout)]
fn sharded_folders_load_both_ways_with_transformers() {
    let Some(py) = python("torch, transformers") else {
        return;
    };
    let root = std::env::temp_dir().join(format!("weft-hf-sharded-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    let (theirs, ours) = (root.join("theirs"), root.join("ours"));
    print!("{}", script(&py, &["make", theirs.to_str().unwrap()]));
    assert!(theirs.join("model.safetensors.index.json").exists());
    assert!(shards(&theirs).len() > 1, "{:?}", shards(&theirs));

    // weft reads transformers' shards and computes its loss
    let tokens = eval::read_tokens(&theirs.join("tokens.json")).unwrap();
    let want: f64 = {
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(theirs.join("tokens.json")).unwrap())
                .unwrap();
        v["loss"].as_f64().unwrap()
    };
    let loss = eval::eval_hf(&theirs, &tokens, None).unwrap();
    let rel = (loss - want).abs() / want;
    println!("weft on transformers' shards: loss {loss} vs {want} (float64), rel {rel:.1e}");
    assert!(rel < 1e-6, "loss {loss} vs {want}");

    // weft's greedy decoding (its KV cache) continues the prompt as
    // transformers' generate() does
    let model = hf::load(&theirs).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(theirs.join("tokens.json")).unwrap())
            .unwrap();
    let ids = |k: &str| -> Vec<u32> {
        v[k].as_array()
            .unwrap()
            .iter()
            .map(|x| u32::try_from(x.as_u64().unwrap()).unwrap())
            .collect()
    };
    let (prompt, greedy) = (ids("prompt"), ids("greedy"));
    let mut dec = weft_model::Decoder::new(&model);
    let decoded = dec
        .generate(
            &prompt,
            greedy.len(),
            weft_model::Sampling::GREEDY,
            &mut || 0.0,
            &mut || {},
        )
        .unwrap();
    println!("greedy: weft {decoded:?}, transformers {greedy:?}");
    assert_eq!(decoded, greedy, "greedy continuation of {prompt:?}");

    // weft's sharded export: transformers loads it with identical logits
    hf::save_sharded(&model, &ours, 50_000).unwrap();
    let files = shards(&ours);
    assert!(files.len() > 1 && !files.contains(&"model.safetensors".to_string()));
    assert_eq!(
        hf::load(&ours).unwrap().params,
        model.params,
        "weft reads its own shards"
    );
    let out = script(
        &py,
        &["check", theirs.to_str().unwrap(), ours.to_str().unwrap()],
    );
    println!("transformers on weft's shards: {out}");
    assert!(out.contains("\"identical_logits\": true"), "{out}");

    // saving again unsharded leaves one set of weights
    hf::save(&model, &ours).unwrap();
    assert_eq!(shards(&ours), ["model.safetensors"]);
    assert!(!ours.join("model.safetensors.index.json").exists());
    let _ = std::fs::remove_dir_all(&root);
}

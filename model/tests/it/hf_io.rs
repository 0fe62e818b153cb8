//! Import/export of Hugging Face GPT-2 folders and their error messages.

use std::path::{Path, PathBuf};

use anyhow::Result;
use weft_model::{Error, Gpt, GptConfig, hf};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn scratch(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("weft-model-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn copy_config(from: &Path, to: &Path) {
    std::fs::copy(from.join("config.json"), to.join("config.json")).unwrap();
}

#[test]
fn save_then_load_is_the_identity() -> Result<()> {
    for name in ["l2_h4_c32_v101_tied", "l2_h3_c24_v37_untied"] {
        let m = hf::load(&fixture(name))?;
        let dir = scratch(&format!("roundtrip-{name}"));
        hf::save(&m, &dir)?;
        let back = hf::load(&dir)?;
        assert_eq!(back.config(), m.config());
        assert_eq!(
            back.params, m.params,
            "{name}: parameters differ bitwise after save+load"
        );
        // The file holds exactly the names transformers wrote.
        let ours = std::fs::read(dir.join("model.safetensors"))?;
        let theirs = std::fs::read(fixture(name).join("model.safetensors"))?;
        let ours = safetensors::SafeTensors::deserialize(&ours)?;
        let theirs = safetensors::SafeTensors::deserialize(&theirs)?;
        let (mut a, mut b) = (ours.names(), theirs.names());
        a.sort();
        b.sort();
        assert_eq!(a, b, "{name}");
        std::fs::remove_dir_all(&dir)?;
    }
    Ok(())
}

#[test]
fn names_without_transformer_prefix_load() -> Result<()> {
    let m = hf::load(&fixture("l1_h2_c16_v53_tied"))?;
    let dir = scratch("noprefix");
    copy_config(&fixture("l1_h2_c16_v53_tied"), &dir);
    let tensors = m.layout().specs().iter().map(|s| {
        (
            s.name
                .strip_prefix("transformer.")
                .unwrap_or(&s.name)
                .to_string(),
            s.shape.clone(),
            &m.params[s.range()],
        )
    });
    hf::write_safetensors(&dir.join("model.safetensors"), tensors)?;
    assert_eq!(hf::load(&dir)?.params, m.params);
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

#[test]
fn malformed_folders_give_clear_errors() {
    let src = fixture("l1_h2_c16_v53_tied");
    let m = hf::load(&src).unwrap();

    // Missing weights file.
    let dir = scratch("noweights");
    copy_config(&src, &dir);
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("model.safetensors") && e.contains("not found"),
        "{e}"
    );

    // A tensor with the wrong shape: names the tensor and both shapes.
    let tensors: Vec<(String, Vec<usize>, Vec<f32>)> = m
        .layout()
        .specs()
        .iter()
        .map(|s| {
            let mut shape = s.shape.clone();
            let mut data = m.params[s.range()].to_vec();
            if s.name == "transformer.h.0.attn.c_attn.weight" {
                shape = vec![shape[1], shape[0]];
            }
            if s.name == "transformer.h.0.mlp.c_fc.bias" {
                shape = vec![shape[0] - 1];
                data.pop();
            }
            (s.name.clone(), shape, data)
        })
        .collect();
    hf::write_safetensors(
        &dir.join("model.safetensors"),
        tensors
            .iter()
            .map(|(n, s, d)| (n.clone(), s.clone(), d.as_slice())),
    )
    .unwrap();
    match hf::load(&dir).unwrap_err() {
        Error::TensorShape {
            tensor,
            expected,
            got,
            ..
        } => {
            assert_eq!(tensor, "transformer.h.0.attn.c_attn.weight");
            assert_eq!((expected, got), (vec![16, 48], vec![48, 16]));
        }
        e => panic!("unexpected {e}"),
    }

    // A missing tensor.
    let fewer = m
        .layout()
        .specs()
        .iter()
        .filter(|s| s.name != "transformer.ln_f.bias");
    hf::write_safetensors(
        &dir.join("model.safetensors"),
        fewer.map(|s| (s.name.clone(), s.shape.clone(), &m.params[s.range()])),
    )
    .unwrap();
    let e = hf::load(&dir).unwrap_err();
    assert!(
        matches!(&e, Error::MissingTensor { tensor, .. } if tensor == "transformer.ln_f.bias"),
        "{e}"
    );

    // Weights of a deeper model than config.json says.
    let mut cfg2 = m.config().clone();
    cfg2.n_layer = 2;
    let mut deep = Gpt::new(cfg2).unwrap();
    deep.init_gpt2(1);
    hf::save(&deep, &dir).unwrap();
    copy_config(&src, &dir);
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("transformer.h.1.") && e.contains("do not match"),
        "{e}"
    );

    // Broken config.json.
    std::fs::write(
        dir.join("config.json"),
        r#"{"n_layer": 1, "n_head": 3, "n_embd": 16, "vocab_size": 53, "n_positions": 8}"#,
    )
    .unwrap();
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("config.json") && e.contains("n_embd") && e.contains("n_head"),
        "{e}"
    );
    std::fs::write(
        dir.join("config.json"),
        r#"{"n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 53}"#,
    )
    .unwrap();
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(e.contains("missing field `n_positions`"), "{e}");
    std::fs::write(dir.join("config.json"), "{not json").unwrap();
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(e.contains("not valid JSON"), "{e}");

    // Dimensions no weight file here holds: refused before the model is
    // allocated from them (the process would abort), naming config.json.
    for (layers, embd) in [(1u64, 65536u64), (1 << 40, 16)] {
        std::fs::write(
            dir.join("config.json"),
            format!(
                r#"{{"n_layer": {layers}, "n_head": 2, "n_embd": {embd}, "vocab_size": 53, "n_positions": 8}}"#
            ),
        )
        .unwrap();
        let e = hf::load(&dir).unwrap_err().to_string();
        assert!(
            e.contains("config.json") && e.contains("the config does not describe these weights"),
            "{e}"
        );
    }

    // Garbage weights file.
    copy_config(&src, &dir);
    std::fs::write(dir.join("model.safetensors"), b"definitely not safetensors").unwrap();
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(e.contains("not a valid safetensors file"), "{e}");
    std::fs::remove_dir_all(&dir).unwrap();

    // Not a folder at all.
    let e = hf::load(Path::new("/nonexistent/weft"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a directory"), "{e}");
}

#[test]
fn bad_batches_are_errors_not_panics() -> Result<()> {
    let cfg = GptConfig {
        n_layer: 1,
        n_head: 2,
        n_embd: 8,
        vocab_size: 10,
        block_size: 4,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
        arch: weft_model::BlockArch::GPT2,
    };
    let mut m = Gpt::new(cfg)?;
    assert!(matches!(m.activations(1, 5), Err(Error::Batch { .. })));
    let mut acts = m.activations(1, 4)?;
    assert!(matches!(
        m.forward(&mut acts, &[1, 2, 3], None),
        Err(Error::Batch { .. })
    ));
    let e = m
        .forward(&mut acts, &[1, 2, 3, 10], None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("token id 10") && e.contains("vocabulary size 10"),
        "{e}"
    );
    assert!(matches!(m.backward(&mut acts), Err(Error::Batch { .. })));
    Ok(())
}

#[test]
fn sharded_folders_round_trip_and_bad_indexes_are_errors() -> Result<()> {
    let src = fixture("l2_h4_c32_v101_tied");
    let m = hf::load(&src)?;
    let dir = scratch("sharded");
    // shards of at most 8 KB: several files and an index
    hf::save_sharded(&m, &dir, 8_000)?;
    assert!(!dir.join("model.safetensors").exists());
    let index = dir.join("model.safetensors.index.json");
    let text = std::fs::read_to_string(&index)?;
    let v: serde_json::Value = serde_json::from_str(&text)?;
    let files: std::collections::BTreeSet<&str> = v["weight_map"]
        .as_object()
        .unwrap()
        .values()
        .map(|f| f.as_str().unwrap())
        .collect();
    assert!(files.len() > 2, "{files:?}");
    assert_eq!(
        v["metadata"]["total_size"].as_u64(),
        Some(4 * m.params.len() as u64)
    );
    assert_eq!(hf::load(&dir)?.params, m.params, "bitwise after sharding");

    // an index naming a file outside the folder
    let outside = text.replacen("\"model-00001-of-", "\"../model-00001-of-", 1);
    std::fs::write(&index, &outside)?;
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(e.contains("not a file name inside the folder"), "{e}");
    // an index naming a tensor its shard does not hold
    let first = files.iter().next().unwrap();
    let second = files.iter().nth(1).unwrap();
    let mut bad = v.clone();
    let (name, _) = v["weight_map"]
        .as_object()
        .unwrap()
        .iter()
        .find(|(_, f)| f.as_str() == Some(first))
        .unwrap();
    bad["weight_map"][name] = serde_json::json!(second);
    std::fs::write(&index, serde_json::to_string(&bad)?)?;
    let e = hf::load(&dir).unwrap_err();
    assert!(
        matches!(&e, Error::MissingTensor { tensor, path } if tensor == name && path.ends_with(second)),
        "{e}"
    );
    // a truncated shard
    std::fs::write(&index, &text)?;
    let shard = dir.join(first);
    let bytes = std::fs::read(&shard)?;
    std::fs::write(&shard, &bytes[..bytes.len() - 3])?;
    let e = hf::load(&dir).unwrap_err().to_string();
    assert!(
        e.contains("not a valid safetensors file") && e.contains(first),
        "{e}"
    );
    std::fs::remove_dir_all(&dir)?;
    Ok(())
}

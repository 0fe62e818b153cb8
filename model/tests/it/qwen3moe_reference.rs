//! Loss and every gradient of Qwen3-MoE models against transformers'
//! `Qwen3MoeForCausalLM` (float64, experts' eager implementation), on the
//! fixtures made by `model/reference/make_qwen3moe_fixtures.py`:
//! fine-grained SwiGLU experts (top-2 of 8, top-3 of 6), softmax gates
//! renormalised (`norm_topk_prob`) or not, grouped-query attention with
//! QK-norm, dense first layers (`mlp_only_layers`), tied and untied
//! embeddings, each loaded from the folder transformers saved.
//!
//! Tolerances as for the dense Llama family (`llama_reference.rs`): the
//! loss to a relative 1e-6, each gradient tensor to a max error of 1e-5
//! relative to that tensor's largest reference magnitude (f32 arithmetic
//! against the f64 answer). The fixtures record the smallest margin
//! between a token's k-th and (k+1)-th routing probability (≥ 6e-4), so
//! f32 rounding cannot change which experts weft picks.

use std::path::PathBuf;

use anyhow::{Context, Result};
use weft_model::hf;

use crate::reference::{fixture_dirs, fixture_loss, rel_err};

fn fixtures() -> Vec<PathBuf> {
    fixture_dirs("tests/fixtures-qwen3moe", 3)
}

#[test]
fn qwen3_moe_loss_and_every_gradient_match_transformers() -> Result<()> {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut model = hf::load(&dir).with_context(|| format!("loading {name}"))?;
        assert!(model.blocks().ffn().moe().is_some(), "{name}");
        let (loss, want_loss) = fixture_loss(&mut model, &dir)?;
        let loss_rel = (loss - want_loss).abs() / want_loss.abs();
        #[allow(clippy::print_stderr)]
        {
            eprintln!("{name}: loss {loss:.9} vs {want_loss:.9} (rel {loss_rel:.2e})");
        }
        assert!(loss_rel < 1e-6, "{name}: loss relative error {loss_rel:e}");
        let want = hf::read_params(model.layout(), &dir.join("grads.safetensors"))
            .with_context(|| format!("{name}: reading the reference gradients"))?;
        let mut worst = (0.0f64, String::new());
        for spec in model.layout().specs() {
            let got = model.grad(&spec.name).unwrap();
            if spec.name.ends_with("router.selection_bias") {
                // Not a transformers parameter; never trained by gradients.
                assert!(got.iter().all(|&g| g == 0.0), "{name}: {}", spec.name);
                continue;
            }
            let want = &want[spec.range()];
            let rel = rel_err(got, want);
            let scale = want.iter().fold(0.0f32, |m, &x| m.max(x.abs()));
            assert!(
                scale > 0.0,
                "{name}: {} has an all-zero reference gradient",
                spec.name
            );
            assert!(
                rel < 1e-5,
                "{name}: {} max relative error {rel:e}",
                spec.name
            );
            if rel > worst.0 {
                worst = (rel, spec.name.clone());
            }
        }
        #[allow(clippy::print_stderr)]
        {
            eprintln!("{name}: worst gradient {} at {:.2e}", worst.1, worst.0);
        }
        let path = std::env::temp_dir().join(format!("weft-grads-{}-{name}", std::process::id()));
        hf::save_grads(&model, &path)?;
        let back = hf::read_params(model.layout(), &path);
        std::fs::remove_file(&path)?;
        assert_eq!(back?, model.grads, "{name}: saved gradients");
    }
    Ok(())
}

/// weft's export is transformers' layout: saving a loaded folder and
/// loading it again gives the same parameters, the same config and the
/// same experts; a selection bias the balancer set is refused.
#[test]
fn qwen3_moe_folders_round_trip() -> Result<()> {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut model = hf::load(&dir)?;
        let out = std::env::temp_dir().join(format!("weft-hf-{}-{name}", std::process::id()));
        hf::save(&model, &out)?;
        let back = hf::load(&out).with_context(|| format!("reloading {name}"));
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(out.join("config.json"))?)?;
        std::fs::remove_dir_all(&out)?;
        let back = back?;
        assert_eq!(back.config(), model.config(), "{name}");
        assert_eq!(back.params, model.params, "{name}");
        let (a, b) = (
            back.blocks().ffn().moe().unwrap(),
            model.blocks().ffn().moe().unwrap(),
        );
        assert_eq!(a.config(), b.config(), "{name}");
        assert_eq!(a.first_dense(), b.first_dense(), "{name}");
        assert_eq!(json["model_type"], "qwen3_moe", "{name}");
        let bias = model
            .layout()
            .specs()
            .iter()
            .find(|s| s.name.ends_with("router.selection_bias"))
            .unwrap()
            .range();
        model.params[bias.start] = 1e-3;
        let err = hf::save(&model, &out).unwrap_err().to_string();
        let _ = std::fs::remove_dir_all(&out);
        assert!(err.contains("selection_bias"), "{name}: {err}");
    }
    Ok(())
}

/// Qwen3-MoE settings weft does not implement are errors naming the
/// field, never a panic or a silently different model.
#[test]
fn unsupported_qwen3_moe_configs_name_the_field() -> Result<()> {
    let src = &fixtures()[0];
    let text = std::fs::read_to_string(src.join("config.json"))?;
    let base: serde_json::Value = serde_json::from_str(&text)?;
    let dir = std::env::temp_dir().join(format!("weft-q3m-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    std::fs::copy(src.join("model.safetensors"), dir.join("model.safetensors"))?;
    for (field, value) in [
        ("mlp_only_layers", serde_json::json!([1])),
        ("decoder_sparse_step", serde_json::json!(2)),
        ("norm_topk_prob", serde_json::json!("yes")),
        ("num_experts_per_tok", serde_json::json!(-1)),
        ("num_experts_per_tok", serde_json::json!(9)),
    ] {
        let mut cfg = base.clone();
        cfg[field] = value;
        std::fs::write(dir.join("config.json"), cfg.to_string())?;
        let err = hf::load(&dir).unwrap_err().to_string();
        assert!(err.contains(field), "{field}: {err}");
    }
    let mut cfg = base;
    cfg.as_object_mut().unwrap().remove("moe_intermediate_size");
    std::fs::write(dir.join("config.json"), cfg.to_string())?;
    let err = hf::load(&dir).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir)?;
    assert!(err.contains("moe_intermediate_size"), "{err}");
    Ok(())
}

/// `model.init_from` (`weft train --init-from DIR`) of transformers'
/// folders: the `[model]` table resolved from `config.json` (family,
/// experts, top-k, widths, `norm_topk_prob`, the dense first layers)
/// builds, with the folder's weights as initial parameters, the model
/// transformers computes: the loss to the same 1e-6. A key that
/// contradicts the folder is refused naming it.
#[test]
fn init_from_transformers_folders_builds_their_model() -> Result<()> {
    use weft_model::{Arch, GptBlocks, ModelOptions};
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let json: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
        let tokens = weft_model::eval::read_tokens(&dir.join("tokens.json"))?;
        let table = ModelOptions {
            init_from: Some(dir.clone()),
            block_size: tokens.t,
            ..ModelOptions::default()
        };
        let m = table.resolve_init_from().with_context(|| name.clone())?;
        m.validate()?;
        assert_eq!(m.arch, Arch::Qwen3Moe, "{name}");
        let n = |k: &str| usize::try_from(json[k].as_u64().unwrap()).unwrap();
        let experts = json
            .get("num_experts")
            .or_else(|| json.get("num_local_experts"))
            .and_then(serde_json::Value::as_u64)
            .unwrap();
        assert_eq!(m.moe.experts as u64, experts, "{name}");
        assert_eq!(m.moe.top_k, n("num_experts_per_tok"), "{name}");
        assert_eq!(m.moe.expert_hidden, n("moe_intermediate_size"), "{name}");
        assert_eq!(m.ffn_hidden, n("intermediate_size"), "{name}");
        assert_eq!(m.moe.normalize, json["norm_topk_prob"] == true, "{name}");
        assert_eq!(
            m.first_dense,
            json["mlp_only_layers"].as_array().map_or(0, Vec::len),
            "{name}"
        );
        let vocab = n("vocab_size");
        let params = m.initial_params(vocab)?.unwrap();
        let (ffn, stats) = m.ffn(None)?;
        assert!(stats.is_some(), "{name}");
        let mut model = weft_model::Gpt::from_blocks(GptBlocks::new(m.gpt_config(vocab), ffn)?);
        model.params = params;
        let (loss, want) = fixture_loss(&mut model, &dir)?;
        let rel = (loss - want).abs() / want;
        #[allow(clippy::print_stderr)]
        {
            eprintln!(
                "{name} from [model]: loss {loss:.9} vs transformers {want:.9} (rel {rel:.1e})"
            );
        }
        assert!(rel < 1e-6, "{name}: loss {loss} against {want}");
        // a key that contradicts the folder names itself
        let bad = ModelOptions {
            moe: weft_moe::MoeOptions {
                top_k: m.moe.top_k + 1,
                ..m.moe.clone()
            },
            ..table.clone()
        };
        let err = bad.resolve_init_from().unwrap_err().to_string();
        assert!(
            err.contains("moe.top_k") && err.contains("config.json"),
            "{err}"
        );
    }
    // a dense folder refuses experts
    let llama = fixture_dirs("tests/fixtures-llama", 1).remove(0);
    let err = ModelOptions {
        init_from: Some(llama),
        moe: weft_moe::MoeOptions {
            experts: 4,
            ..weft_moe::MoeOptions::default()
        },
        ..ModelOptions::default()
    }
    .resolve_init_from()
    .unwrap_err()
    .to_string();
    assert!(err.contains("moe.experts"), "{err}");
    Ok(())
}

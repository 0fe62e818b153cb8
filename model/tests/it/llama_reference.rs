//! Loss and every gradient of Llama-family models against transformers
//! (float64), on the fixtures made by `model/reference/make_llama_fixtures.py`:
//! `LlamaForCausalLM` (grouped- and multi-query attention, Llama-3 rotary
//! scaling, tied and untied), `Qwen3ForCausalLM` (QK-norm, a head size set
//! apart from the width, local and global sliding-window layers),
//! `MistralForCausalLM` (a window on every layer) and `Qwen2ForCausalLM`
//! (query/key/value biases), each loaded from the folder transformers
//! saved.
//!
//! Tolerances as for GPT-2 (`reference.rs`): the loss to a relative 1e-6,
//! each gradient tensor to a max error of 1e-5 relative to that tensor's
//! largest reference magnitude (f32 arithmetic against the f64 answer).
//! In bf16 and fp16 products, as GPT-2's: the loss error within twice
//! PyTorch CPU autocast's plus 1e-3 relative, the worst gradient error
//! within twice autocast's (measured: bf16 loss errors 3e-6–1.3e-3 vs
//! autocast's 1.6e-4–8.2e-4, worst-gradient ratio weft/autocast at most
//! 1.23; fp16 at most 1.27).

use std::path::PathBuf;

use anyhow::{Context, Result};
use weft_model::hf;

use crate::reference::{fixture_dirs, fixture_loss, mixed_precision_against_autocast, rel_err};

fn fixtures() -> Vec<PathBuf> {
    fixture_dirs("tests/fixtures-llama", 6)
}

#[test]
fn llama_family_loss_and_every_gradient_match_transformers() -> Result<()> {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let mut model = hf::load(&dir).with_context(|| format!("loading {name}"))?;
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
            let want = &want[spec.range()];
            let rel = rel_err(model.grad(&spec.name).unwrap(), want);
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
        // `weft eval --dump-grads` writes them under transformers' names.
        let path = std::env::temp_dir().join(format!("weft-grads-{}-{name}", std::process::id()));
        hf::save_grads(&model, &path)?;
        let back = hf::read_params(model.layout(), &path);
        std::fs::remove_file(&path)?;
        assert_eq!(back?, model.grads, "{name}: saved gradients");
    }
    Ok(())
}

/// bf16 and fp16 products against transformers under PyTorch's CPU
/// autocast, held as GPT-2's are (`reference.rs`): loss and worst
/// gradient error against the float64 answer within twice autocast's.
#[test]
fn llama_family_mixed_precision_is_as_close_as_pytorch_autocast() -> Result<()> {
    mixed_precision_against_autocast(&fixtures(), &|model, path| {
        Ok(hf::read_params(model.layout(), path)?)
    })
}

/// weft's export is transformers' layout: saving a loaded folder and
/// loading it again gives the same parameters and the same config.
#[test]
fn llama_family_folders_round_trip() -> Result<()> {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = hf::load(&dir)?;
        let out = std::env::temp_dir().join(format!("weft-hf-{}-{name}", std::process::id()));
        hf::save(&model, &out)?;
        let back = hf::load(&out).with_context(|| format!("reloading {name}"));
        std::fs::remove_dir_all(&out)?;
        let back = back?;
        assert_eq!(back.config(), model.config(), "{name}");
        assert_eq!(back.params, model.params, "{name}");
    }
    Ok(())
}

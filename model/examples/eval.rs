//! The computation behind `weft eval`, runnable without the trainer:
//!
//! ```text
//! cargo run --release -p weft-model --example eval -- \
//!     --hf-model DIR --tokens FILE.json [--dump-grads OUT.safetensors] [--save-to DIR2]
//! ```
//!
//! Prints `{"loss": …}`. `--save-to` writes the loaded model back out with
//! weft's exporter (for checking that transformers loads what weft writes:
//! `model/reference/check_export.py`).

use std::path::PathBuf;

use anyhow::{Context, Result, bail};

fn main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let (mut model, mut tokens, mut grads, mut save) = (None, None, None, None);
    while let Some(a) = args.next() {
        let mut val = || {
            args.next()
                .map(PathBuf::from)
                .with_context(|| format!("{a} needs a value"))
        };
        match a.as_str() {
            "--hf-model" => model = Some(val()?),
            "--tokens" => tokens = Some(val()?),
            "--dump-grads" => grads = Some(val()?),
            "--save-to" => save = Some(val()?),
            other => bail!(
                "unknown argument {other}; expected --hf-model, --tokens, --dump-grads, --save-to"
            ),
        }
    }
    let model = model.context("--hf-model DIR is required")?;
    let tokens = tokens.context("--tokens FILE.json is required")?;
    let batch = weft_model::eval::read_tokens(&tokens)?;
    let loss = weft_model::eval::eval_hf(&model, &batch, grads.as_deref())
        .with_context(|| format!("evaluating {}", model.display()))?;
    if let Some(dir) = save {
        weft_model::hf::save(&weft_model::hf::load(&model)?, &dir)?;
    }
    #[allow(clippy::print_stdout)]
    {
        println!("{}", serde_json::json!({ "loss": loss }));
    }
    Ok(())
}

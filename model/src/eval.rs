//! `weft eval`: loss and gradients of a Hugging Face GPT-2 on a token file.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result, io};

/// A batch of token ids read from `{"inputs": [[…]], "targets": [[…]]}`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBatch {
    /// Batch size B (number of rows).
    pub b: usize,
    /// Sequence length T (row length).
    pub t: usize,
    /// Input ids, `(B,T)` row-major.
    pub inputs: Vec<u32>,
    /// Target ids, `(B,T)` row-major.
    pub targets: Vec<u32>,
}

#[derive(Deserialize)]
struct Raw {
    inputs: Vec<Vec<i64>>,
    targets: Vec<Vec<i64>>,
}

/// Reads a token file. Rows must all have the same length, and `inputs`
/// and `targets` the same shape; ids must be non-negative 32-bit integers.
///
/// # Errors
/// [`Error::Io`], or [`Error::Format`] naming the field and row.
pub fn read_tokens(path: &Path) -> Result<TokenBatch> {
    let text =
        weft_trace::input::read_to_string(path, weft_trace::input::LOG_BYTES).map_err(io(path))?;
    let bad = |reason: String| Error::Format {
        path: path.to_path_buf(),
        reason,
    };
    let raw: Raw = serde_json::from_str(&text).map_err(|e| {
        bad(format!(
            "{e}; expected {{\"inputs\": [[ids…], …], \"targets\": [[ids…], …]}}"
        ))
    })?;
    let b = raw.inputs.len();
    let t = raw.inputs.first().map_or(0, Vec::len);
    if b == 0 || t == 0 {
        return Err(bad(
            "`inputs` is empty; need at least one non-empty row".into()
        ));
    }
    let flat = |field: &str, rows: &[Vec<i64>]| -> Result<Vec<u32>> {
        if rows.len() != b {
            return Err(bad(format!(
                "`{field}` has {} rows, `inputs` has {b}",
                rows.len()
            )));
        }
        let mut out = Vec::with_capacity(b * t);
        for (r, row) in rows.iter().enumerate() {
            if row.len() != t {
                return Err(bad(format!(
                    "`{field}` row {r} has {} ids, expected {t} like row 0 of `inputs`",
                    row.len()
                )));
            }
            for (i, &id) in row.iter().enumerate() {
                out.push(u32::try_from(id).map_err(|_| {
                    bad(format!(
                        "`{field}`[{r}][{i}] = {id} is not a valid token id"
                    ))
                })?);
            }
        }
        Ok(out)
    };
    Ok(TokenBatch {
        b,
        t,
        inputs: flat("inputs", &raw.inputs)?,
        targets: flat("targets", &raw.targets)?,
    })
}

/// Loads the model in `model_dir`, computes the mean cross-entropy of
/// `tokens`, and, when `dump_grads` is given, runs the backward and writes
/// every parameter gradient there (Hugging Face names). Returns the loss.
///
/// # Errors
/// Any load error; [`Error::Tensor`] naming the first tensor holding a
/// non-finite value; [`Error::Batch`] if the sequences are longer than the
/// model's `n_positions`, or for a non-finite loss; a kernel error for an
/// id outside the vocabulary.
pub fn eval_hf(model_dir: &Path, tokens: &TokenBatch, dump_grads: Option<&Path>) -> Result<f64> {
    let mut model = crate::hf::load(model_dir)?;
    // weights that are not numbers give no loss: name the tensor
    for spec in model.layout().specs() {
        if let Some(i) = model.params[spec.range()]
            .iter()
            .position(|x| !x.is_finite())
        {
            return Err(Error::Tensor {
                path: model_dir.to_path_buf(),
                tensor: spec.name.clone(),
                reason: format!(
                    "element {i} is {} — the weights hold non-finite values, so the loss would be too",
                    model.params[spec.offset + i]
                ),
            });
        }
    }
    let mut acts = model.activations(tokens.b, tokens.t)?;
    let loss = model
        .forward(&mut acts, &tokens.inputs, Some(&tokens.targets))?
        .unwrap_or(f64::NAN);
    if !loss.is_finite() {
        return Err(Error::Batch {
            reason: format!(
                "the loss of these tokens is {loss} with finite weights (an overflow in the forward)"
            ),
        });
    }
    if let Some(out) = dump_grads {
        model.zero_grad();
        model.backward(&mut acts)?;
        crate::hf::save_grads(&model, out)?;
    }
    Ok(loss)
}

//! weft-model's mixture-of-experts block ([`MoeFfn`]) against PyTorch.
//!
//! The fixtures under `model/reference/moe/` were written by
//! `model/reference/make_moe_fixtures.py`, which builds the same block in
//! PyTorch (top-k softmax or sigmoid router, renormalised or not, E GPT-2
//! MLP experts with tanh-GELU, optional shared expert, optional auxiliary
//! loss, optional selection bias) and stores float32 inputs and parameters
//! with float64 outputs and gradients of `sum(out · dout) + aux` for a
//! random `dout`. weft computes in f32; the output must agree within 1e-5
//! and every gradient within 1e-4, both relative to the reference tensor's
//! largest magnitude.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use safetensors::{Dtype, SafeTensors};
use weft_kernels::Mode;
use weft_model::{Dims, FeedForward, MoeFfn};
use weft_moe::{AuxLoss, AuxScope, Gate, MoeConfig, Router};

type TestResult = Result<(), Box<dyn std::error::Error>>;

fn fixture_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("reference/moe")
}

fn read(st: &SafeTensors<'_>, name: &str) -> Result<Vec<f64>, String> {
    let t = st.tensor(name).map_err(|e| format!("{name}: {e}"))?;
    let d = t.data();
    Ok(match t.dtype() {
        Dtype::F32 => d
            .chunks_exact(4)
            .map(|b| f64::from(f32::from_le_bytes([b[0], b[1], b[2], b[3]])))
            .collect(),
        Dtype::F64 => d
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect(),
        other => return Err(format!("{name}: unexpected dtype {other:?}")),
    })
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    #[allow(clippy::cast_possible_truncation)]
    v.iter().map(|&x| x as f32).collect()
}

/// Largest |got − want| over the largest |want| (or over 1 if `want` is 0).
fn rel_err(got: &[f32], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    let scale = want.iter().fold(0.0f64, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(want)
        .map(|(&g, &w)| (f64::from(g) - w).abs())
        .fold(0.0f64, f64::max);
    if scale > 0.0 { worst / scale } else { worst }
}

fn meta<'a>(m: &'a HashMap<String, String>, key: &str) -> Result<&'a str, String> {
    m.get(key)
        .map(String::as_str)
        .ok_or_else(|| format!("metadata key `{key}` missing"))
}

fn num(m: &HashMap<String, String>, key: &str) -> Result<usize, Box<dyn std::error::Error>> {
    Ok(meta(m, key)?.parse()?)
}

fn check_case(path: &Path) -> TestResult {
    let name = path.file_stem().unwrap_or_default().to_string_lossy();
    let bytes = std::fs::read(path)?;
    let (_, header) = SafeTensors::read_metadata(&bytes)?;
    let m = header
        .metadata()
        .clone()
        .ok_or_else(|| format!("{name}: no metadata"))?;
    let st = SafeTensors::deserialize(&bytes)?;
    let (c, h, e, k) = (
        num(&m, "channels")?,
        num(&m, "hidden")?,
        num(&m, "experts")?,
        num(&m, "top_k")?,
    );
    let (b, t) = (num(&m, "batch")?, num(&m, "seq_len")?);
    let gate = match meta(&m, "gate")? {
        "softmax" => Gate::Softmax,
        "sigmoid" => Gate::Sigmoid,
        g => return Err(format!("{name}: unknown gate {g}").into()),
    };
    let aux_coef: f64 = meta(&m, "aux_coef")?.parse()?;
    let scope = match meta(&m, "aux_scope")? {
        "sequence" => AuxScope::Sequence,
        _ => AuxScope::Batch,
    };
    let cfg = MoeConfig {
        channels: c,
        hidden: h,
        router: Router::top_k(e, k)
            .with_gate(gate)
            .with_normalize(meta(&m, "normalize")? == "true"),
        expert: weft_moe::Expert::Gelu,
        shared_experts: usize::from(meta(&m, "shared_expert")? == "true"),
        aux: (aux_coef > 0.0).then_some(AuxLoss {
            coef: aux_coef,
            scope,
        }),
    };
    let (ffn, stats) = MoeFfn::new(cfg)?;
    let specs = ffn.params(c);
    // Parameters in the block's buffer order, from their weft names.
    let mut params = Vec::new();
    for s in &specs {
        let tensor = s
            .suffix
            .strip_prefix("mlp.")
            .ok_or("param without mlp. prefix")?;
        let v = read(&st, tensor)?;
        assert_eq!(
            v.len(),
            s.shape.iter().product::<usize>(),
            "{name}: {tensor}"
        );
        params.extend(to_f32(&v));
    }
    let n = b * t;
    let inp = to_f32(&read(&st, "inp")?);
    let dout = to_f32(&read(&st, "dout")?);
    let d = Dims {
        b,
        t,
        c,
        mode: Mode::default(),
        precision: weft_kernels::Precision::F32,
        loss_scale: 1.0,
        layer: 0,
        tp: None,
        replay: false,
        selective: false,
    };
    let mut out = vec![0.0f32; n * c];
    let mut saved = vec![0.0f32; ffn.saved_len(&d)];
    let mut scratch = vec![0.0f32; ffn.scratch_len(&d)];
    ffn.forward(
        &mut out,
        &mut saved,
        &mut scratch,
        weft_kernels::LinearInput::Wide(&inp),
        &params,
        d,
    )?;
    let err = rel_err(&out, &read(&st, "out")?);
    assert!(err < 1e-5, "{name}: output relative error {err:.2e}");
    let (_, fwd) = stats.take().pop().ok_or("no statistics logged")?;
    let aux_ref = read(&st, "aux_loss")?[0];
    assert!(
        (fwd.aux_loss - aux_ref).abs() <= 1e-5 * aux_ref.abs().max(1e-3),
        "{name}: aux loss {} vs {aux_ref}",
        fwd.aux_loss
    );
    let ent_ref = read(&st, "router_entropy")?[0];
    assert!(
        (fwd.stats.entropy() - ent_ref).abs() < 1e-5 * ent_ref,
        "{name}: router entropy {} vs {ent_ref}",
        fwd.stats.entropy()
    );
    assert_eq!(
        fwd.stats.tokens_per_expert.iter().sum::<u64>(),
        (n * k) as u64
    );

    let mut dinp = vec![0.0f32; n * c];
    let mut dparams = vec![0.0f32; params.len()];
    ffn.backward(
        &mut dinp,
        &mut dparams,
        &mut scratch,
        &dout,
        weft_kernels::LinearInput::Wide(&inp),
        &saved,
        &params,
        d,
    )?;
    let err = rel_err(&dinp, &read(&st, "grad.inp")?);
    assert!(err < 1e-4, "{name}: grad.inp relative error {err:.2e}");
    let mut off = 0;
    for s in &specs {
        let tensor = &s.suffix["mlp.".len()..];
        let len = s.shape.iter().product::<usize>();
        let want = read(&st, &format!("grad.{tensor}"))?;
        let got = &dparams[off..off + len];
        off += len;
        if tensor == "router.selection_bias" {
            assert!(got.iter().all(|&g| g == 0.0), "{name}: bias gradient");
            assert!(want.iter().all(|&g| g == 0.0));
            continue;
        }
        let err = rel_err(got, &want);
        assert!(err < 1e-4, "{name}: grad.{tensor} relative error {err:.2e}");
    }
    Ok(())
}

#[test]
fn moe_block_matches_pytorch_forward_and_backward() -> TestResult {
    let mut cases: Vec<PathBuf> = std::fs::read_dir(fixture_dir())?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    cases.sort();
    // The generator writes these five; a missing file is an error, not a skip.
    assert_eq!(cases.len(), 5, "fixtures: {cases:?}");
    for p in &cases {
        check_case(p)?;
    }
    Ok(())
}

//! One whole-model optimizer step with Muon against PyTorch: a GPT-2 and
//! a Llama-family model (grouped-query attention, QK-norm, q/k/v biases,
//! SwiGLU, untied head) on one rank, one [`ParallelGpt::train_step`] with
//! Muon for the hidden matrices and AdamW for the rest, and the same step
//! in torch — `torch.optim.Muon` (Newton–Schulz patched to f32, as
//! `weft-kernels/tests/muon_torch.rs` does) on every matrix of
//! [`muon_matrices`], each a separate tensor in torch's `[out, in]`
//! layout (`c_attn`'s Q, K and V apart, SwiGLU's gate and up apart), and
//! `torch.optim.AdamW` on everything else, in two groups by the layout's
//! decay mask ([`ParamSpec::decay`](weft_model::ParamSpec)).
//!
//! The gradients: a first model built from the same parameters takes an
//! AdamW-only step on the same micro-batches with β₁ = 0 and lr = 0, so
//! its first moment is `0·0 + 1·g`: the gradient, bit for bit, as
//! [`ParallelGpt::gather_whole`] returns it. torch steps from those. That
//! the Muon model stepped from the very same gradients is then checked,
//! not assumed: its first moments (AdamW's `exp_avg`, Muon's momentum
//! buffer, both `lerp(0, g, 1 − β)` on step one) must equal torch's bit
//! for bit.
//!
//! What is compared, per tensor (each Muon matrix apart): the relative L2
//! error of the parameter's change, `‖p_weft − p_torch‖ / ‖p_torch − p₀‖`,
//! and the largest element error. Tolerances: 2e-5 for Muon's matrices
//! (the kernel test's f32 bound; measured at most 4.1e-6, the largest
//! element error 6e-8 for updates of about 1e-3), 1e-6 for AdamW's tensors
//! (measured: the same bits where nothing decays, at most 5.9e-8 — an
//! element error of 2e-9 — where the decay factor rounds differently);
//! AdamW's second moments within 1e-6 relative (measured: the same bits).
//! Run with `--nocapture` for the figures per tensor.
//!
//! Skipped, saying why on stderr, without a Python that has torch and
//! numpy (`WEFT_PYTHON`, else `~/.cache/weft-venv/bin/python`, else
//! `python3`); a failure under `WEFT_REQUIRE_ALL`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use weft_collectives::LocalCluster;
use weft_kernels::{AdamW, Muon, MuonScale, OptimStep, Precision};
use weft_model::tp::TpOptions;
use weft_model::{
    BlockArch, FeedForward, Gpt, GptConfig, Init, MicroBatch, Mlp, ParallelGpt, ParallelPlan,
    ParamLayout, Recompute, SwiGlu, muon_matrices,
};
use weft_parallel::ParallelDims;
use weft_testkit::python;

/// Sequences per micro-batch, tokens per sequence, micro-batches.
const B: usize = 2;
const T: usize = 16;
const MICRO: usize = 2;

const ADAMW: AdamW = AdamW {
    lr: 1e-3,
    beta1: 0.9,
    beta2: 0.95,
    eps: 1e-8,
    weight_decay: 0.1,
};

fn muon_hp() -> Muon {
    Muon {
        lr: 0.02,
        weight_decay: 0.1,
        ..Muon::default()
    }
}

/// The reference step: `tests/python/muon_step_ref.py` (its header says
/// what it reads and writes).
const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/muon_step_ref.py");

/// A scratch directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> Self {
        let d = std::env::temp_dir().join(format!(
            "weft-model-muon-torch-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn write(path: &Path, v: &[f32]) {
    let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(path, bytes).unwrap();
}

fn read(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

/// The models of the test.
#[derive(Clone, Copy, Debug)]
enum Model {
    /// GPT-2: LayerNorm, learned positions, biases, GELU MLP, tied head.
    Gpt2,
    /// Llama-family: RMSNorm, rotary positions, 4 query heads over 2
    /// key/value heads, QK-norm, q/k/v biases, SwiGLU, untied head.
    Llama,
}

impl Model {
    fn config(self) -> GptConfig {
        let base = GptConfig {
            n_layer: 2,
            n_head: 4,
            n_embd: 32,
            vocab_size: 41,
            block_size: T,
            tied_embeddings: true,
            layer_norm_epsilon: 1e-5,
            arch: BlockArch::GPT2,
        };
        match self {
            Model::Gpt2 => base,
            Model::Llama => {
                let mut arch = BlockArch::llama(2, 10_000.0);
                arch.qk_norm = true;
                arch.qkv_bias = true;
                GptConfig {
                    tied_embeddings: false,
                    layer_norm_epsilon: 1e-6,
                    arch,
                    ..base
                }
            }
        }
    }

    fn ffn(self) -> Arc<dyn FeedForward> {
        match self {
            Model::Gpt2 => Arc::new(Mlp),
            Model::Llama => Arc::new(SwiGlu { hidden: 48 }),
        }
    }

    /// GPT-2's initialisation, norms and biases perturbed (they start at
    /// 1 and 0, where AdamW's decay and update would be too special).
    fn init(self) -> (Vec<f32>, ParamLayout) {
        let ffn: Box<dyn FeedForward> = match self {
            Model::Gpt2 => Box::new(Mlp),
            Model::Llama => Box::new(SwiGlu { hidden: 48 }),
        };
        let mut m = Gpt::with_ffn(self.config(), ffn).unwrap();
        m.init_gpt2(7);
        let layout = m.layout().clone();
        let noise = rand(m.params.len(), 99, 0.05);
        for spec in layout.specs() {
            if spec.global_shape.len() == 1 {
                for i in spec.range() {
                    m.params[i] += noise[i];
                }
            }
        }
        (m.params, layout)
    }
}

/// `n` values in [-scale, scale) from a fixed-seed xorshift generator.
fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let u = (s >> 40) as f32 / (1u64 << 24) as f32;
            scale * (2.0 * u - 1.0)
        })
        .collect()
}

/// The micro-batches' tokens and targets.
fn data(vocab: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
    (0..MICRO)
        .map(|k| {
            let seq: Vec<u32> = (0..B * T + 1)
                .map(|i| {
                    let x = (k as u64 * 7919 + i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                    ((x >> 33) % vocab as u64) as u32
                })
                .collect();
            (seq[..B * T].to_vec(), seq[1..].to_vec())
        })
        .collect()
}

/// One step of `model` from `p0` on `data` with `hp` (planning Muon when
/// it has Muon's settings): the whole model's `[params, m, v]` after it.
fn step(model: Model, p0: &[f32], data: &[(Vec<u32>, Vec<u32>)], hp: OptimStep) -> [Vec<f32>; 3] {
    let plan = ParallelPlan {
        fsdp: None,
        pipeline: None,
        batch: B,
        seq: T,
        micro_batches: MICRO,
        reproducible: true,
        tp: TpOptions::default(),
        precision: Precision::F32,
        grad_wire: weft_collectives::Dtype::F32,
        doc_boundary: None,
        recompute: Recompute::None,
        loss_chunk: 0,
    };
    let comm = LocalCluster::single();
    let mesh = ParallelDims::SINGLE.build(&comm).unwrap();
    let mut g =
        ParallelGpt::new(model.config(), model.ffn(), Init::Whole(p0), &plan, mesh).unwrap();
    if let Some(m) = &hp.muon {
        g.use_muon(m.ns_steps).unwrap();
    }
    let mbs: Vec<_> = data
        .iter()
        .map(|(a, b)| MicroBatch {
            tokens: a,
            targets: b,
        })
        .collect();
    let r = g.train_step(&mbs, &hp, 0.0).unwrap();
    assert!(r.applied && r.loss.is_finite());
    let n = g.whole_layout().len();
    let mut out = [vec![0.0f32; n], vec![0.0; n], vec![0.0; n]];
    {
        let [a, b, c] = &mut out;
        assert_eq!(g.gather_whole(Some([a, b, c])).unwrap(), 1);
    }
    out
}

/// `(‖got − want‖ / ‖want − p0‖, max |got − want|)` over `idx`, in f64.
fn errors(idx: &[usize], got: &[f32], want: &[f32], p0: &[f32]) -> (f64, f64) {
    let (mut num, mut den, mut max) = (0.0f64, 0.0f64, 0.0f64);
    for &i in idx {
        let (g, w, p) = (f64::from(got[i]), f64::from(want[i]), f64::from(p0[i]));
        num += (g - w) * (g - w);
        den += (w - p) * (w - p);
        max = max.max((g - w).abs());
    }
    ((num / den).sqrt(), max)
}

#[allow(clippy::print_stderr, clippy::too_many_lines)]
fn check(model: Model) {
    let Some(py) = python("torch, numpy") else {
        return;
    };
    let t0 = std::time::Instant::now();
    let cfg = model.config();
    let (p0, layout) = model.init();
    let data = data(cfg.vocab_size);

    // The gradients: β₁ = 0 keeps them as the first moment, lr = 0 moves
    // nothing.
    let probe = AdamW {
        lr: 0.0,
        beta1: 0.0,
        weight_decay: 0.0,
        ..ADAMW
    };
    let [_, grads, _] = step(model, &p0, &data, OptimStep::from(probe));
    assert!(grads.iter().all(|g| g.is_finite()));
    assert!(grads.iter().any(|&g| g != 0.0));

    let muon = muon_hp();
    let hp = OptimStep {
        adamw: ADAMW,
        muon: Some(muon),
    };
    let [p1, m1, v1] = step(model, &p0, &data, hp);

    // The reference.
    let matrices = muon_matrices(&cfg, &layout).unwrap();
    let per_layer = match model {
        Model::Gpt2 => 6,  // Q, K, V, attn.c_proj, c_fc, mlp.c_proj
        Model::Llama => 7, // Q, K, V, attn.c_proj, gate, up, down
    };
    assert_eq!(matrices.len(), per_layer * cfg.n_layer);
    let adjust = match muon.scale {
        MuonScale::Original => "original",
        MuonScale::MatchRmsAdamW => "match_rms_adamw",
    };
    let [a, b, c] = muon.ns_coefficients;
    let mut spec = format!(
        "hp {} {} {} {} {} {a} {b} {c} {} {adjust} {} {} {} {} {}\n",
        muon.lr,
        muon.weight_decay,
        muon.momentum,
        u8::from(muon.nesterov),
        muon.ns_steps,
        muon.eps,
        // weft's AdamW settings are f32: torch gets those values exactly
        f64::from(ADAMW.lr),
        f64::from(ADAMW.beta1),
        f64::from(ADAMW.beta2),
        f64::from(ADAMW.eps),
        f64::from(ADAMW.weight_decay),
    );
    // (name, element indices, Muon's?) of every tensor and Muon matrix
    let mut pieces: Vec<(String, Vec<usize>, bool)> = Vec::new();
    let mut muon_elems = vec![false; layout.len()];
    for m in &matrices {
        let off = layout.get(&m.tensor).unwrap().offset + m.slab * m.rows * m.width;
        spec += &format!(
            "muon {off} {} {} {} {}\n",
            m.rows, m.width, m.cols.start, m.cols.end
        );
        let idx: Vec<usize> = (0..m.rows)
            .flat_map(|r| m.cols.clone().map(move |j| off + r * m.width + j))
            .collect();
        for &i in &idx {
            assert!(!muon_elems[i], "{}: overlapping Muon matrices", m.tensor);
            muon_elems[i] = true;
        }
        pieces.push((
            format!("{}[:, {}..{}]", m.tensor, m.cols.start, m.cols.end),
            idx,
            true,
        ));
    }
    for s in layout.specs() {
        let r = s.range();
        if muon_elems[r.start] {
            assert!(
                r.clone().all(|i| muon_elems[i]),
                "{}: partly Muon's",
                s.name
            );
            continue;
        }
        spec += &format!("adamw {} {} {}\n", r.start, r.len(), u8::from(s.decay));
        pieces.push((s.name.clone(), r.collect(), false));
    }
    let dir = TempDir::new(&format!("{model:?}"));
    std::fs::write(dir.0.join("spec.txt"), spec).unwrap();
    write(&dir.0.join("p0.f32"), &p0);
    write(&dir.0.join("g.f32"), &grads);
    let out = Command::new(&py).arg(SCRIPT).arg(&dir.0).output().unwrap();
    assert!(
        out.status.success(),
        "the torch step failed:\n{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let want = [
        read(&dir.0.join("p1.f32")),
        read(&dir.0.join("m1.f32")),
        read(&dir.0.join("v1.f32")),
    ];

    // Muon's momentum buffers and AdamW's first moments: the same bits,
    // so the Muon step ran on the probe's gradients.
    let differing = (0..layout.len())
        .filter(|&i| m1[i].to_bits() != want[1][i].to_bits())
        .count();
    assert_eq!(
        differing,
        0,
        "{model:?}: {differing} first-moment elements differ from torch's (max {:e})",
        m1.iter()
            .zip(&want[1])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max)
    );

    let (mut worst_muon, mut worst_adamw, mut worst_v, mut worst_abs) =
        (0.0f64, 0.0f64, 0.0f64, [0.0f64; 2]);
    for (name, idx, is_muon) in &pieces {
        let (change, max) = errors(idx, &p1, &want[0], &p0);
        eprintln!(
            "{model:?} {:<5} {name:<42} change error {change:.2e}, max element error {max:.2e}",
            if *is_muon { "muon" } else { "adamw" }
        );
        let tol = if *is_muon { 2e-5 } else { 1e-6 };
        assert!(
            change < tol,
            "{model:?} {name}: relative error of the change {change:e} > {tol:e}"
        );
        if *is_muon {
            worst_muon = worst_muon.max(change);
        } else {
            worst_adamw = worst_adamw.max(change);
            let (v, _) = errors(idx, &v1, &want[2], &vec![0.0; p0.len()]);
            assert!(v < 1e-6, "{model:?} {name}: second moment off by {v:e}");
            worst_v = worst_v.max(v);
        }
        let slot = usize::from(!*is_muon);
        worst_abs[slot] = worst_abs[slot].max(max);
    }
    eprintln!(
        "{model:?}: worst relative error of the change: Muon {worst_muon:.2e}, AdamW \
         {worst_adamw:.2e} (max element error {:.2e}, {:.2e}); AdamW's v {worst_v:.2e}; \
         {:.2} s",
        worst_abs[0],
        worst_abs[1],
        t0.elapsed().as_secs_f64()
    );
}

#[test]
fn gpt2_step_with_muon_matches_torch() {
    check(Model::Gpt2);
}

#[test]
fn llama_step_with_muon_matches_torch() {
    check(Model::Llama);
}

use weft_moe::{AuxLoss, AuxScope, DropPolicy, Expert, Gate, MoeBlock, MoeConfig, Router};

use crate::Rng;

fn configs() -> Vec<MoeConfig> {
    let base = MoeConfig {
        channels: 4,
        hidden: 6,
        router: Router::top_k(4, 2),
        expert: Expert::Gelu,
        shared_experts: 0,
        aux: None,
    };
    vec![
        base,
        MoeConfig {
            router: Router::top_k(4, 2).with_normalize(true),
            shared_experts: 1,
            aux: Some(AuxLoss::new(0.1)),
            ..base
        },
        MoeConfig {
            router: Router::top_k(5, 3)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true),
            aux: Some(AuxLoss {
                coef: 0.2,
                scope: AuxScope::Sequence,
            }),
            ..base
        },
        MoeConfig {
            router: Router::top_k(4, 1).with_capacity(1.0, DropPolicy::ByPosition),
            shared_experts: 1,
            ..base
        },
        // Fine-grained SwiGLU experts: Qwen3-MoE's softmax router ...
        MoeConfig {
            hidden: 3,
            router: Router::top_k(6, 2).with_normalize(true),
            expert: Expert::SwiGlu,
            ..base
        },
        // ... and DeepSeek-V3's: sigmoid scores, normalised and scaled,
        // two shared experts.
        MoeConfig {
            hidden: 3,
            router: Router::top_k(6, 3)
                .with_gate(Gate::Sigmoid)
                .with_normalize(true)
                .with_scale(2.5),
            expert: Expert::SwiGlu,
            shared_experts: 2,
            ..base
        },
        MoeConfig {
            router: Router::top_k(5, 2).with_scale(0.7),
            expert: Expert::SwiGlu,
            shared_experts: 1,
            aux: Some(AuxLoss::new(0.1)),
            ..base
        },
    ]
}

/// `Σ out·w + aux` for the finite differences.
fn loss(block: &MoeBlock, inp: &[f64], params: &[f64], lens: &[usize], w: &[f64]) -> f64 {
    let n: usize = lens.iter().sum();
    let cfg = block.config();
    let mut out = vec![0.0; n * cfg.channels];
    let mut saved = vec![0.0; n * cfg.saved_per_token()];
    let f = block
        .forward(&mut out, &mut saved, inp, params, lens)
        .unwrap();
    out.iter().zip(w).map(|(a, b)| a * b).sum::<f64>() + f.aux_loss
}

#[test]
fn gradients_match_finite_differences_in_f64() {
    let mut rng = Rng::new(21);
    let lens = [3, 4];
    let n = 7;
    for cfg in configs() {
        let block = MoeBlock::new(cfg).unwrap();
        let c = cfg.channels;
        let mut params = vec![0.0f64; block.num_params()];
        block.init(&mut params, 3, 1.0).unwrap();
        // Larger weights than GPT-2's so every path matters.
        for p in &mut params {
            *p *= 20.0;
        }
        // A selection bias as the balancer would leave it.
        let br = cfg.selection_bias_range();
        for p in &mut params[br.clone()] {
            *p = rng.sym(0.05);
        }
        let inp = rng.vec(n * c, 1.0);
        let w = rng.vec(n * c, 1.0);
        let mut out = vec![0.0; n * c];
        let mut saved = vec![0.0; n * cfg.saved_per_token()];
        let fwd = block
            .forward(&mut out, &mut saved, &inp, &params, &lens)
            .unwrap();
        assert_eq!(fwd.stats.tokens, n as u64);
        let mut dinp = vec![0.0; n * c];
        let mut dparams = vec![0.0; params.len()];
        block
            .backward(&mut dinp, &mut dparams, &w, &inp, &saved, &params, &lens)
            .unwrap();
        assert!(dparams[br.clone()].iter().all(|&g| g == 0.0));
        let h = 1e-6;
        let mut worst: f64 = 0.0;
        let fd = |x: &mut Vec<f64>, i: usize, f: &dyn Fn(&[f64]) -> f64| {
            let x0 = x[i];
            x[i] = x0 + h;
            let lp = f(x);
            x[i] = x0 - h;
            let lm = f(x);
            x[i] = x0;
            (lp - lm) / (2.0 * h)
        };
        let mut x = inp.clone();
        for i in 0..x.len() {
            let g = fd(&mut x, i, &|x| loss(&block, x, &params, &lens, &w));
            worst = worst.max((g - dinp[i]).abs() / (1.0 + g.abs()));
        }
        let mut p = params.clone();
        for i in (0..p.len()).filter(|i| !br.contains(i)) {
            let g = fd(&mut p, i, &|p| loss(&block, &inp, p, &lens, &w));
            worst = worst.max((g - dparams[i]).abs() / (1.0 + g.abs()));
        }
        assert!(
            worst < 1e-6,
            "{}: worst relative error {worst}",
            cfg.router.name()
        );
    }
}

/// The grouped forward equals a per-token loop written from the formula.
#[test]
fn grouped_forward_equals_per_token_reference() {
    let mut rng = Rng::new(22);
    let (c, h, e, k) = (8, 12, 6, 2);
    let cfg = MoeConfig {
        channels: c,
        hidden: h,
        router: Router::top_k(e, k).with_normalize(true),
        expert: Expert::Gelu,
        shared_experts: 1,
        aux: None,
    };
    let block = MoeBlock::new(cfg).unwrap();
    let mut params = vec![0.0f64; block.num_params()];
    block.init(&mut params, 5, 1.0).unwrap();
    for p in &mut params {
        *p *= 10.0;
    }
    let lens = [9, 4];
    let n = 13;
    let inp = rng.vec(n * c, 1.0);
    let mut out = vec![0.0; n * c];
    let mut saved = vec![0.0; n * cfg.saved_per_token()];
    let fwd = block
        .forward(&mut out, &mut saved, &inp, &params, &lens)
        .unwrap();
    assert_eq!(
        fwd.stats.tokens_per_expert.iter().sum::<u64>(),
        (n * k) as u64
    );
    // Unpack the parameters by hand.
    let mut off = 0;
    let mut next = |len: usize| {
        let s = &params[off..off + len];
        off += len;
        s
    };
    let wr = next(c * e);
    let _bias = next(e);
    let (w1, b1, w2, b2) = (next(e * c * h), next(e * h), next(e * h * c), next(e * c));
    let (sw1, sb1, sw2, sb2) = (next(c * h), next(h), next(h * c), next(c));
    let gelu = |x: f64| {
        0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
    };
    let mlp = |x: &[f64], w1: &[f64], b1: &[f64], w2: &[f64], b2: &[f64]| -> Vec<f64> {
        let a: Vec<f64> = (0..h)
            .map(|j| gelu(b1[j] + (0..c).map(|i| x[i] * w1[i * h + j]).sum::<f64>()))
            .collect();
        (0..c)
            .map(|j| b2[j] + (0..h).map(|i| a[i] * w2[i * c + j]).sum::<f64>())
            .collect()
    };
    let mut worst: f64 = 0.0;
    for t in 0..n {
        let x = &inp[t * c..(t + 1) * c];
        let logits: Vec<f64> = (0..e)
            .map(|j| (0..c).map(|i| x[i] * wr[i * e + j]).sum())
            .collect();
        let m = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let p: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
        let mut idx: Vec<usize> = (0..e).collect();
        idx.sort_by(|&a, &b| p[b].partial_cmp(&p[a]).unwrap());
        let top = &idx[..k];
        let tot: f64 = top.iter().map(|&j| p[j]).sum();
        let mut want = mlp(x, sw1, sb1, sw2, sb2);
        for &j in top {
            let y = mlp(
                x,
                &w1[j * c * h..(j + 1) * c * h],
                &b1[j * h..(j + 1) * h],
                &w2[j * h * c..(j + 1) * h * c],
                &b2[j * c..(j + 1) * c],
            );
            for (wv, yv) in want.iter_mut().zip(&y) {
                *wv += p[j] / tot * yv;
            }
        }
        for (a, b) in want.iter().zip(&out[t * c..(t + 1) * c]) {
            worst = worst.max((a - b).abs());
        }
    }
    assert!(worst < 1e-12, "{worst}");
}

#[test]
fn expert_choice_is_rejected_by_the_block() {
    let cfg = MoeConfig {
        router: Router::expert_choice(4, 2, 1.0),
        ..MoeConfig::new(4, 4, 2)
    };
    let err = MoeBlock::new(cfg).unwrap_err();
    assert!(err.to_string().contains("token choice"), "{err}");
}

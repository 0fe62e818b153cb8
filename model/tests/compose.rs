//! Axes composed through [`ParallelGpt`]: a mixture-of-experts GPT split
//! over tensor-parallel ranks (attention and the dense parts sharded, the
//! experts replicated over tp), with and without sequence parallelism, and
//! over tp × ep × dp (experts also shared out over an expert group), against
//! the same model on one rank with the same global batch.
//!
//! Tolerance: each step's loss and gradient norm within 1e-5 relative of
//! the one-rank run's over four AdamW steps (measured: 1e-9 to 2e-7). The
//! parameters are not compared elementwise: AdamW normalises each update,
//! so an element whose gradient is rounding noise (the key bias's is 0 in
//! exact arithmetic) moves by ±lr either way. Not bitwise:
//! the row-parallel layers and the vocabulary-parallel cross-entropy sum
//! partial products in another order (`tp.rs` bounds each tensor's
//! gradient), and expert GEMMs under ep run over other rows (`moe_ep.rs`).
//! The router is scaled up so that no top-k choice is near a tie that such
//! a difference could flip.

use std::sync::Arc;

use weft_collectives::{Communicator, LocalCluster};
use weft_kernels::AdamW;
use weft_model::tp::TpOptions;
use weft_model::{
    FeedForward, Gpt, GptConfig, MicroBatch, MoeFfn, ParallelGpt, ParallelPlan, expert_group,
};
use weft_moe::{AuxLoss, MoeConfig, Router};
use weft_parallel::ParallelDims;

const B: usize = 2;
const T: usize = 8;
const STEPS: usize = 4;

fn gpt_config() -> GptConfig {
    GptConfig {
        n_layer: 2,
        n_head: 4,
        n_embd: 32,
        vocab_size: 37,
        block_size: T,
        tied_embeddings: true,
        layer_norm_epsilon: 1e-5,
    }
}

fn moe_config() -> MoeConfig {
    MoeConfig {
        router: Router::top_k(4, 2).with_normalize(true),
        shared_expert: true,
        aux: Some(AuxLoss::new(0.01)),
        ..MoeConfig::new(32, 4, 2)
    }
}

/// The whole model's initial parameters: GPT-2 init, the router scaled up.
fn init() -> Vec<f32> {
    let (ffn, _) = MoeFfn::new(moe_config()).unwrap();
    let mut m = Gpt::with_ffn(gpt_config(), Box::new(ffn)).unwrap();
    m.init_gpt2(5);
    for spec in m.layout().specs().to_vec() {
        if spec.name.ends_with("mlp.router.weight") {
            m.params[spec.range()].iter_mut().for_each(|x| *x *= 30.0);
        }
    }
    m.params
}

/// Global micro-batch `g` of step `s`.
fn batch(s: usize, g: usize) -> (Vec<u32>, Vec<u32>) {
    let v = gpt_config().vocab_size as u64;
    let seq: Vec<u32> = (0..B * T + 1)
        .map(|i| {
            let x = (s as u64 * 1_000_003 + g as u64 * 7919 + i as u64)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            ((x >> 33) % v) as u32
        })
        .collect();
    (seq[..B * T].to_vec(), seq[1..].to_vec())
}

struct Run {
    losses: Vec<f64>,
    norms: Vec<f64>,
    /// The whole model gathered on rank 0 after the last step.
    params: Vec<f32>,
}

/// `STEPS` steps of a global batch of `global` micro-batches on the mesh
/// `dims`; rank 0's figures and the gathered parameters.
fn run(dims: ParallelDims, sequence_parallel: bool, global: usize) -> Run {
    let p0 = init();
    let out = LocalCluster::run(dims.world_size(), |comm| {
        let mesh = dims.build(&comm).unwrap();
        let ffn: Arc<dyn FeedForward> = if dims.ep > 1 {
            Arc::new(
                MoeFfn::with_expert_parallel(moe_config(), expert_group(&mesh))
                    .unwrap()
                    .0,
            )
        } else {
            Arc::new(MoeFfn::new(moe_config()).unwrap().0)
        };
        let per = global / dims.dp;
        let plan = ParallelPlan {
            fsdp: None,
            pipeline: None,
            batch: B,
            seq: T,
            micro_batches: per,
            reproducible: true,
            tp: TpOptions {
                sequence_parallel,
                reproducible: true,
                ..TpOptions::default()
            },
        };
        let mut g = ParallelGpt::new(gpt_config(), ffn, &p0, &plan, mesh).unwrap();
        let first = g.mesh().coords().dp() * per;
        let hp = AdamW {
            lr: 1e-2,
            weight_decay: 0.1,
            ..AdamW::default()
        };
        let (mut losses, mut norms) = (Vec::new(), Vec::new());
        for s in 0..STEPS {
            let data: Vec<_> = (first..first + per).map(|m| batch(s, m)).collect();
            let mbs: Vec<_> = data
                .iter()
                .map(|(a, b)| MicroBatch {
                    tokens: a,
                    targets: b,
                })
                .collect();
            let r = g.train_step(&mbs, &hp, 1.0).unwrap();
            assert!(r.applied);
            losses.push(r.loss);
            norms.push(r.grad_norm);
        }
        let len = g.whole_layout().len();
        let mut bufs = [vec![0.0f32; len], vec![0.0; len], vec![0.0; len]];
        {
            let [a, b, c] = &mut bufs;
            let root = comm.rank() == 0;
            g.gather_whole(root.then_some([&mut a[..], &mut b[..], &mut c[..]]))
                .unwrap();
        }
        let [params, _, _] = bufs;
        Run {
            losses,
            norms,
            params,
        }
    })
    .unwrap();
    out.into_iter().next().unwrap()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-12)
}

#[allow(clippy::print_stdout)]
fn check(what: &str, got: &Run, want: &Run) {
    for s in 0..STEPS {
        let (l, n) = (
            rel(got.losses[s], want.losses[s]),
            rel(got.norms[s], want.norms[s]),
        );
        println!("{what} step {s}: loss {l:.1e}, norm {n:.1e} relative");
        assert!(
            l < 1e-5,
            "{what} step {s}: loss {} vs {}",
            got.losses[s],
            want.losses[s]
        );
        assert!(
            n < 1e-5,
            "{what} step {s}: norm {} vs {}",
            got.norms[s],
            want.norms[s]
        );
    }
    // The gathered model is the whole model, every expert included.
    assert_eq!(got.params.len(), want.params.len(), "{what}");
    assert!(got.params.iter().all(|x| x.is_finite()), "{what}");
}

#[test]
fn moe_under_tp_and_tp_ep_dp_follows_one_rank() {
    let one = run(ParallelDims::SINGLE, false, 2);
    for sp in [false, true] {
        let tp = ParallelDims {
            tp: 2,
            ..ParallelDims::SINGLE
        };
        check(&format!("tp=2 sp={sp}"), &run(tp, sp, 2), &one);
    }
    let mesh = ParallelDims {
        pp: 1,
        dp: 2,
        tp: 2,
        ep: 2,
    };
    check("tp=2 × ep=2 (dp=2)", &run(mesh, false, 2), &one);
}

//! Property tests: save then load is the identity; reshard round-trips.

use proptest::prelude::*;
use weft_checkpoint::{
    Checkpoint, Dtype, Layout, OwnedShard, Region, SaveOptions, TargetLayout, TrainerState,
    load_shards, reshard, save,
};

use crate::util::{Tensor, borrow, slice, tensor};

/// How one tensor is laid out over `world` ranks.
#[derive(Clone, Debug)]
enum Placement {
    /// Whole tensor on one rank.
    Replicated(usize),
    /// Split along a dimension (taken modulo the rank).
    Split(usize),
    /// 2-D grid: dim 0 into `a` parts, dim 1 into world/a parts.
    Grid(usize),
}

fn place(t: &Tensor, p: &Placement, world: usize, rank: usize) -> Option<Region> {
    let n = t.shape.len();
    if t.shape.contains(&0) {
        return (rank == 0).then(|| Region::full(&t.shape));
    }
    let r = match p {
        Placement::Replicated(owner) => (rank == owner % world).then(|| Region::full(&t.shape))?,
        Placement::Split(_) | Placement::Grid(_) if n == 0 => {
            (rank == 0).then(|| Region::full(&t.shape))?
        }
        Placement::Split(d) => Region::split(&t.shape, d % n, world, rank),
        Placement::Grid(a) => {
            let a = (1..=world)
                .filter(|k| (world / k) * k == world)
                .nth(a % world)
                .unwrap_or(1);
            let b = world / a;
            let rows = Region::split(&t.shape, 0, a, rank / b);
            if n == 1 {
                if rank - rank / b * b != 0 {
                    return None;
                }
                rows
            } else {
                let cols = Region::split(&t.shape, 1, b, rank % b);
                let mut r = rows;
                r.offsets[1] = cols.offsets[1];
                r.shape[1] = cols.shape[1];
                r
            }
        }
    };
    (r.volume() != Some(0)).then_some(r)
}

fn dtype() -> impl Strategy<Value = Dtype> {
    prop::sample::select(vec![
        Dtype::F32,
        Dtype::BF16,
        Dtype::F16,
        Dtype::I64,
        Dtype::U8,
        Dtype::F64,
    ])
}

fn placement() -> impl Strategy<Value = Placement> {
    prop_oneof![
        (0usize..8).prop_map(Placement::Replicated),
        (0usize..3).prop_map(Placement::Split),
        (0usize..4).prop_map(Placement::Grid),
    ]
}

fn tensors() -> impl Strategy<Value = Vec<(Tensor, Placement, Placement)>> {
    prop::collection::vec(
        (
            prop::collection::vec(0u64..9, 0..=3),
            dtype(),
            any::<u64>(),
            placement(),
            placement(),
        ),
        1..5,
    )
    .prop_map(|v| {
        v.into_iter()
            .enumerate()
            .map(|(i, (shape, dt, seed, a, b))| (tensor(&format!("t{i}"), dt, &shape, seed), a, b))
            .collect()
    })
}

fn shards(ts: &[(Tensor, Placement, Placement)], world: usize, src: bool) -> Vec<Vec<OwnedShard>> {
    (0..world)
        .map(|rank| {
            ts.iter()
                .filter_map(|(t, a, b)| {
                    let region = place(t, if src { a } else { b }, world, rank)?;
                    Some(OwnedShard {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        global_shape: t.shape.clone(),
                        data: slice(t, &region),
                        region,
                    })
                })
                .collect()
        })
        .collect()
}

fn opts() -> SaveOptions {
    SaveOptions {
        chunk_bytes: 64,
        fsync: false,
        ..Default::default()
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    /// Save on n ranks, read any region: equals the slice of the original.
    #[test]
    fn save_then_load_is_identity(ts in tensors(), n in 1usize..6, pick in any::<u64>()) {
        let dir = tempfile::tempdir().unwrap();
        let ranks = shards(&ts, n, true);
        let c = save(dir.path(), 3, &Layout::flat("dp", n as u32), &borrow(&ranks), &TrainerState::default(), &opts()).unwrap();
        let ck = Checkpoint::open(&c.path).unwrap();
        ck.verify().unwrap();
        for (t, _, _) in &ts {
            prop_assert_eq!(&ck.read_tensor(&t.name).unwrap(), &t.data);
            // A pseudo-random box.
            let mut r = Region::full(&t.shape);
            for (d, &g) in t.shape.iter().enumerate() {
                let h = pick.rotate_left(d as u32 * 7);
                let o = if g == 0 { 0 } else { h % g };
                r.offsets[d] = o;
                r.shape[d] = if g == 0 { 0 } else { (h >> 16) % (g - o) + 1 };
            }
            prop_assert_eq!(ck.read_region(&t.name, &r).unwrap(), slice(t, &r));
        }
    }

    /// n ranks → m ranks with random per-tensor placements on both sides:
    /// every target rank gets exactly its slice, and the resharded
    /// checkpoint holds the same global tensors.
    #[test]
    fn reshard_round_trips(ts in tensors(), n in 1usize..6, m in 1usize..6) {
        let dir = tempfile::tempdir().unwrap();
        let ranks = shards(&ts, n, true);
        let c = save(&dir.path().join("src"), 5, &Layout::flat("dp", n as u32), &borrow(&ranks), &TrainerState::default(), &opts()).unwrap();
        let src = Checkpoint::open(&c.path).unwrap();
        let ts2 = ts.clone();
        let target = TargetLayout::custom(Layout::flat("tp", m as u32), move |name, _, rank| {
            let (t, _, b) = ts2.iter().find(|(t, _, _)| t.name == name)?;
            place(t, b, m, rank as usize)
        });
        let want = shards(&ts, m, false);
        for (rank, want) in want.iter().enumerate() {
            let got = load_shards(&src, &target, rank as u32).unwrap();
            prop_assert_eq!(&got, want);
        }
        let out = reshard(&src, &target, &dir.path().join("dst"), &opts()).unwrap();
        let dst = Checkpoint::open(&out.path).unwrap();
        dst.verify().unwrap();
        prop_assert_eq!(dst.manifest().layout.world_size, m as u32);
        for (t, _, _) in &ts {
            prop_assert_eq!(&dst.read_tensor(&t.name).unwrap(), &t.data);
        }
        // And back to n ranks.
        let back = reshard(&dst, &TargetLayout::split_rows(n as u32), &dir.path().join("back"), &opts()).unwrap();
        let back = Checkpoint::open(&back.path).unwrap();
        for (t, _, _) in &ts {
            prop_assert_eq!(&back.read_tensor(&t.name).unwrap(), &t.data);
        }
    }
}

#[test]
fn fsdp_4_to_2_and_tp_2_to_1() {
    let dir = tempfile::tempdir().unwrap();
    let ts = crate::util::model(9);
    let ranks = crate::util::shard_rows(&ts, 4);
    let c = save(
        &dir.path().join("a"),
        1,
        &Layout::flat("fsdp", 4),
        &borrow(&ranks),
        &TrainerState::default(),
        &opts(),
    )
    .unwrap();
    let src = Checkpoint::open(&c.path).unwrap();
    let two = reshard(
        &src,
        &TargetLayout::parse("2").unwrap(),
        &dir.path().join("b"),
        &opts(),
    )
    .unwrap();
    assert_eq!(two.manifest.files.len(), 2);
    let tp2 = reshard(
        &Checkpoint::open(&two.path).unwrap(),
        &TargetLayout::parse("2:dim1").unwrap(),
        &dir.path().join("c"),
        &opts(),
    )
    .unwrap();
    let shard = &tp2.manifest.tensors["wte.weight"].shards;
    assert_eq!(shard.len(), 2);
    assert_eq!(shard[1].offsets, vec![0, 4]);
    let one = reshard(
        &Checkpoint::open(&tp2.path).unwrap(),
        &TargetLayout::parse("1").unwrap(),
        &dir.path().join("d"),
        &opts(),
    )
    .unwrap();
    let one = Checkpoint::open(&one.path).unwrap();
    for t in &ts {
        assert_eq!(one.read_tensor(&t.name).unwrap(), t.data);
    }
    assert!(TargetLayout::parse("0").is_err());
    assert!(TargetLayout::parse("2:rows").is_err());
}

//! Rank threads saving into one staging folder (`SharedSave`): FSDP flat
//! parameters, tensor-parallel column and row splits, a replicated tensor;
//! then loading on other layouts.

use std::sync::Barrier;

use weft_checkpoint::{
    Checkpoint, Dtype, Error, Layout, MeshDim, RankReport, Region, SaveOptions, ShardData,
    SharedSave, TargetLayout, TrainerState, list_checkpoints, load_shards, read_latest_pointer,
    write_rank_file,
};

use crate::util::{Tensor, slice, tensor};

/// dp 2 x tp 2 = 4 ranks, rank = 2·dp + tp.
fn mesh() -> Layout {
    Layout {
        world_size: 4,
        mesh: vec![
            MeshDim {
                name: "dp".into(),
                size: 2,
            },
            MeshDim {
                name: "tp".into(),
                size: 2,
            },
        ],
    }
}

struct Model {
    /// An FSDP unit's flat buffer (1001 f32, not a multiple of 4 ranks).
    flat: Tensor,
    /// Column-parallel over tp, replicated over dp.
    col: Tensor,
    /// Row-parallel over tp, replicated over dp.
    row: Tensor,
    /// Replicated everywhere.
    ln: Tensor,
}

fn model() -> Model {
    Model {
        flat: tensor("fsdp.h.0", Dtype::F32, &[1001], 1),
        col: tensor("h.0.attn.c_attn.weight", Dtype::BF16, &[8, 24], 2),
        row: tensor("h.0.attn.c_proj.weight", Dtype::F32, &[24, 8], 3),
        ln: tensor("ln_f.weight", Dtype::F32, &[8], 4),
    }
}

/// What rank `r` saves: its FSDP slice of the flat buffer (shard length
/// ceil(1001/4) = 251, padding dropped), and, on dp = 0 only, its tp slices
/// (replicas are written once); rank 0 also the replicated tensor.
fn rank_regions(m: &Model, r: u64) -> Vec<(&Tensor, Region)> {
    let s = 1001u64.div_ceil(4);
    let (a, b) = ((r * s).min(1001), ((r + 1) * s).min(1001));
    let mut out = vec![(&m.flat, Region::new(vec![a], vec![b - a]))];
    let (dp, tp) = (r / 2, r % 2);
    if dp == 0 {
        out.push((&m.col, Region::split(&m.col.shape, 1, 2, tp as usize)));
        out.push((&m.row, Region::split(&m.row.shape, 0, 2, tp as usize)));
    }
    if r == 0 {
        out.push((&m.ln, Region::full(&m.ln.shape)));
    }
    out
}

fn opts() -> SaveOptions {
    SaveOptions {
        chunk_bytes: 100,
        ..Default::default()
    }
}

#[test]
fn rank_threads_save_one_checkpoint_that_loads_on_other_layouts() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let save = SharedSave::begin(dir.path(), 30, &mesh(), &opts()).unwrap();
    let start = Barrier::new(4);
    std::thread::scope(|sc| {
        for r in 0..4u64 {
            let (save, m, start) = (&save, &m, &start);
            sc.spawn(move || {
                let parts = rank_regions(m, r);
                let data: Vec<Vec<u8>> = parts.iter().map(|(t, reg)| slice(t, reg)).collect();
                let shards: Vec<ShardData<'_>> = parts
                    .iter()
                    .zip(&data)
                    .map(|((t, reg), d)| ShardData {
                        name: &t.name,
                        dtype: t.dtype,
                        global_shape: &t.shape,
                        region: reg.clone(),
                        data: d,
                    })
                    .collect();
                start.wait();
                save.write_rank(r as u32, &shards).unwrap();
            });
        }
    });
    assert!(save.missing().is_empty());
    let state = TrainerState {
        optimizer_step: 30,
        ..Default::default()
    };
    let c = save.commit(&state).unwrap();
    assert_eq!(
        read_latest_pointer(dir.path()).unwrap().as_deref(),
        Some("step-00000030")
    );
    let ck = Checkpoint::open(&c.path).unwrap();
    ck.verify().unwrap();
    assert_eq!(ck.manifest().layout, mesh());
    assert_eq!(ck.manifest().files.len(), 4);
    let all = [&m.flat, &m.col, &m.row, &m.ln];
    for t in all {
        assert_eq!(ck.read_tensor(&t.name).unwrap(), t.data, "{}", t.name);
    }
    // A model tensor inside the flat unit (elements 300..540, crossing the
    // shards of ranks 1 and 2) reads as a 1-d range.
    let view = Region::new(vec![300], vec![240]);
    assert_eq!(
        ck.read_region("fsdp.h.0", &view).unwrap(),
        slice(&m.flat, &view)
    );
    // Reshard 4 -> 3 (rows) and 4 -> 1, and tp 2 -> 3 (columns).
    for target in [
        TargetLayout::split_rows(3),
        TargetLayout::split_rows(1),
        TargetLayout::split_dim("tp", 3, 1),
    ] {
        let mut covered = 0usize;
        for rank in 0..target.layout.world_size {
            for s in load_shards(&ck, &target, rank).unwrap() {
                let t = all.iter().find(|t| t.name == s.name).unwrap();
                assert_eq!(s.data, slice(t, &s.region), "{} rank {rank}", s.name);
                covered += s.data.len();
            }
        }
        assert_eq!(covered, all.iter().map(|t| t.data.len()).sum::<usize>());
    }
}

#[test]
fn a_missing_rank_commits_nothing_and_a_rank_saves_once() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let save = SharedSave::begin(dir.path(), 5, &mesh(), &opts()).unwrap();
    let write = |r: u64| {
        let parts = rank_regions(&m, r);
        let data: Vec<Vec<u8>> = parts.iter().map(|(t, reg)| slice(t, reg)).collect();
        let shards: Vec<ShardData<'_>> = parts
            .iter()
            .zip(&data)
            .map(|((t, reg), d)| ShardData {
                name: &t.name,
                dtype: t.dtype,
                global_shape: &t.shape,
                region: reg.clone(),
                data: d,
            })
            .collect();
        save.write_rank(r as u32, &shards)
    };
    for r in [0, 1, 3] {
        write(r).unwrap();
    }
    let again = write(1).unwrap_err();
    assert!(again.to_string().contains("rank 1 saved twice"), "{again}");
    let outside = save.write_rank(4, &[]).unwrap_err();
    assert!(matches!(outside, Error::InvalidShard { .. }), "{outside}");
    assert_eq!(save.missing(), vec![2]);
    let err = save.commit(&TrainerState::default()).unwrap_err();
    assert!(err.to_string().contains("ranks [2] of 4"), "{err}");
    assert!(list_checkpoints(dir.path()).unwrap().is_empty());
    assert_eq!(read_latest_pointer(dir.path()).unwrap(), None);
    assert!(dir.path().join("step-00000005.tmp").is_dir());
}

#[test]
fn reports_from_other_processes_are_merged() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let save = SharedSave::begin(dir.path(), 8, &mesh(), &opts()).unwrap();
    for r in 0..4u64 {
        let parts = rank_regions(&m, r);
        let data: Vec<Vec<u8>> = parts.iter().map(|(t, reg)| slice(t, reg)).collect();
        let shards: Vec<ShardData<'_>> = parts
            .iter()
            .zip(&data)
            .map(|((t, reg), d)| ShardData {
                name: &t.name,
                dtype: t.dtype,
                global_shape: &t.shape,
                region: reg.clone(),
                data: d,
            })
            .collect();
        // As another process would: write into the staging folder, send
        // the report as JSON.
        let report = write_rank_file(save.staging(), r as u32, &shards, &opts()).unwrap();
        let json = serde_json::to_string(&report).unwrap();
        let back: RankReport = serde_json::from_str(&json).unwrap();
        if r == 2 {
            let mut wrong = back.clone();
            wrong.rank = 3;
            assert!(save.add_report(wrong).is_err());
        }
        save.add_report(back).unwrap();
    }
    let c = save.commit(&TrainerState::default()).unwrap();
    let ck = Checkpoint::open(&c.path).unwrap();
    for t in [&m.flat, &m.col, &m.row, &m.ln] {
        assert_eq!(ck.read_tensor(&t.name).unwrap(), t.data, "{}", t.name);
    }
}

#[test]
fn overlapping_rank_shards_are_refused_at_commit() {
    let dir = tempfile::tempdir().unwrap();
    let m = model();
    let save = SharedSave::begin(dir.path(), 9, &Layout::flat("dp", 2), &opts()).unwrap();
    // Both ranks save the replicated tensor: it would be tiled twice.
    for r in 0..2 {
        let d = m.ln.data.clone();
        save.write_rank(
            r,
            &[ShardData::full(&m.ln.name, m.ln.dtype, &m.ln.shape, &d)],
        )
        .unwrap();
    }
    let err = save.commit(&TrainerState::default()).unwrap_err();
    assert!(
        matches!(&err, Error::InvalidShard { tensor, .. } if tensor == "ln_f.weight"),
        "{err}"
    );
    assert!(list_checkpoints(dir.path()).unwrap().is_empty());
}

/// A rank may hold several pieces of one tensor (the Q, K and V column
/// blocks of a tensor-parallel shard of a fused projection): the second
/// and later are `name#k` in its file, the manifest lists each, and every
/// reader sees the whole tensor.
#[test]
fn a_rank_holds_several_pieces_of_one_tensor() {
    let root = std::env::temp_dir().join(format!("weft-ckpt-pieces-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    // a 4 x 6 "qkv" tensor: each of 2 ranks holds one column of Q, K and V
    let shape = [4u64, 6];
    let w: Vec<f32> = (0..24).map(|i| i as f32).collect();
    let col = |c: u64| -> Vec<u8> {
        (0..4)
            .flat_map(|r| w[(r * 6 + c) as usize].to_le_bytes())
            .collect()
    };
    let cols: Vec<Vec<u8>> = (0..6).map(col).collect();
    let rank = |r: u64| -> Vec<ShardData<'_>> {
        [0u64, 2, 4]
            .into_iter()
            .map(|q| ShardData {
                name: "qkv",
                dtype: Dtype::F32,
                global_shape: &shape,
                region: Region::new(vec![0, q + r], vec![4, 1]),
                data: &cols[(q + r) as usize],
            })
            .collect()
    };
    let save =
        SharedSave::begin(&root, 1, &Layout::flat("tp", 2), &SaveOptions::default()).unwrap();
    save.write_rank(0, &rank(0)).unwrap();
    save.write_rank(1, &rank(1)).unwrap();
    let committed = save.commit(&TrainerState::default()).unwrap();
    let ck = Checkpoint::open(&committed.path).unwrap();
    ck.verify().unwrap();
    let want: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(ck.read_tensor("qkv").unwrap(), want);
    assert_eq!(ck.manifest().tensors["qkv"].shards.len(), 6);
    // a name with '#' is refused
    let bad = [ShardData {
        name: "a#1",
        dtype: Dtype::F32,
        global_shape: &[1],
        region: Region::full(&[1]),
        data: &[0; 4],
    }];
    let save =
        SharedSave::begin(&root, 2, &Layout::flat("tp", 1), &SaveOptions::default()).unwrap();
    assert!(matches!(
        save.write_rank(0, &bad),
        Err(Error::InvalidShard { .. })
    ));
    let _ = std::fs::remove_dir_all(&root);
}

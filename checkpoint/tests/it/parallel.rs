//! The threaded reader (`read_many`, `verify`) against the serial slicer,
//! at every thread count, with chunk boundaries that cut rows.

use std::fs;

use weft_checkpoint::{
    Checkpoint, Dtype, Error, Layout, ReadRequest, Region, SaveOptions, TrainerState, save,
};

use crate::util::{Tensor, borrow, shard_rows, slice, tensor};

fn tensors() -> Vec<Tensor> {
    vec![
        tensor("big", Dtype::F32, &[600, 512], 11),
        tensor("bf", Dtype::BF16, &[1000, 300], 12),
        tensor("cols", Dtype::F32, &[257, 1000], 13),
        tensor("cube", Dtype::F16, &[30, 40, 50], 14),
        tensor("small", Dtype::F32, &[7], 15),
    ]
}

/// Regions of every kind: whole, row ranges cutting the saved shards,
/// column slices (strided), a grid box.
fn regions(t: &Tensor) -> Vec<Region> {
    let s = &t.shape;
    let mut out = vec![Region::full(s)];
    for i in 0..5 {
        out.push(Region::split(s, 0, 5, i));
    }
    if s.len() > 1 {
        for i in 0..3 {
            out.push(Region::split(s, 1, 3, i));
        }
        let mut r = Region::split(&Region::split(s, 0, 2, 1).shape, 1, 2, 0);
        r.offsets[0] = s[0] / 2;
        out.push(r);
    }
    out
}

fn saved(dir: &std::path::Path) -> std::path::PathBuf {
    // 3000-byte chunks: chunk boundaries fall inside rows and elements.
    let opts = SaveOptions {
        chunk_bytes: 3000,
        ..Default::default()
    };
    let ts = tensors();
    save(
        dir,
        5,
        &Layout::flat("dp", 3),
        &borrow(&shard_rows(&ts, 3)),
        &TrainerState::default(),
        &opts,
    )
    .unwrap()
    .path
}

#[test]
fn read_many_matches_the_serial_slicer_at_every_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path());
    let ts = tensors();
    let wanted: Vec<(&Tensor, Region)> = ts
        .iter()
        .flat_map(|t| regions(t).into_iter().map(move |r| (t, r)))
        .collect();
    for threads in [1, 2, 3, 8] {
        let ck = Checkpoint::open(&path).unwrap().with_threads(threads);
        assert_eq!(ck.threads(), threads);
        let mut bufs: Vec<Vec<u8>> = wanted
            .iter()
            .map(|(t, r)| vec![0xAA; ck.region_bytes(&t.name, r).unwrap()])
            .collect();
        let mut reqs: Vec<ReadRequest<'_>> = wanted
            .iter()
            .zip(bufs.iter_mut())
            .map(|((t, r), b)| ReadRequest {
                name: &t.name,
                region: r.clone(),
                out: b,
            })
            .collect();
        ck.read_many(&mut reqs).unwrap();
        for ((t, r), got) in wanted.iter().zip(&bufs) {
            assert!(*got == slice(t, r), "{threads} threads: {} {:?}", t.name, r);
        }
        let rep = ck.verify().unwrap();
        assert_eq!(
            rep.bytes,
            ts.iter().map(|t| t.data.len() as u64).sum::<u64>()
        );
    }
}

#[test]
fn first_error_in_request_order_at_every_thread_count() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    // Corrupt the last shard of `cube`, then the first shard of `big`.
    for (name, shard) in [("cube", 2), ("big", 0)] {
        let s = &ck.manifest().tensors[name].shards[shard];
        let file = path.join(&s.file);
        let mut bytes = fs::read(&file).unwrap();
        bytes[(s.byte_offset + s.byte_len / 2) as usize] ^= 0x40;
        fs::write(&file, bytes).unwrap();
    }
    let ts = tensors();
    let mut first = Vec::new();
    for threads in [1, 2, 4, 8] {
        let ck = Checkpoint::open(&path).unwrap().with_threads(threads);
        // `cube` is requested before `big`: its error is the one reported.
        let order: Vec<&Tensor> = [&ts[3], &ts[0], &ts[1]].into();
        let mut bufs: Vec<Vec<u8>> = order.iter().map(|t| vec![0; t.data.len()]).collect();
        let mut reqs: Vec<ReadRequest<'_>> = order
            .iter()
            .zip(bufs.iter_mut())
            .map(|(t, b)| ReadRequest {
                name: &t.name,
                region: Region::full(&t.shape),
                out: b,
            })
            .collect();
        let err = ck.read_many(&mut reqs).unwrap_err();
        assert!(
            matches!(&err, Error::Checksum { tensor, .. } if tensor == "cube"),
            "{threads} threads: {err}"
        );
        // verify() walks tensors in name order: `big` comes first.
        let verr = ck.verify().unwrap_err();
        assert!(
            matches!(&verr, Error::Checksum { tensor, .. } if tensor == "big"),
            "{threads} threads: {verr}"
        );
        first.push((err.to_string(), verr.to_string()));
    }
    assert!(first.windows(2).all(|w| w[0] == w[1]), "{first:#?}");
    // An untouched tensor still reads.
    assert_eq!(ck.read_tensor("bf").unwrap(), ts[1].data);
}

#[test]
fn wrong_buffer_size_and_unknown_tensor_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = saved(dir.path());
    let ck = Checkpoint::open(&path).unwrap();
    let mut small = vec![0u8; 3];
    let err = ck
        .read_many(&mut [ReadRequest {
            name: "big",
            region: Region::full(&[600, 512]),
            out: &mut small,
        }])
        .unwrap_err();
    assert!(matches!(err, Error::RegionOutOfBounds { .. }), "{err}");
    let err = ck
        .read_many(&mut [ReadRequest {
            name: "nope",
            region: Region::full(&[1]),
            out: &mut small,
        }])
        .unwrap_err();
    assert!(matches!(err, Error::UnknownTensor { .. }), "{err}");
}

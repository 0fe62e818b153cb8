//! Whole models from shards and shards from whole models, by placement:
//! the one implementation behind checkpoints, exports and resharding.

use weft_collectives::Communicator;

use crate::error::{Error, Result, layout_err};
use crate::layout::{ParamLayout, ParamSpec};
use crate::mesh::MeshCoords;

/// The runs of `spec` (a tensor of `local`) in the whole buffer laid out
/// by `whole`: `(start in the whole buffer, start in the local buffer,
/// len)`.
fn buffer_runs(
    spec: &ParamSpec,
    local: &ParamLayout,
    whole: &ParamLayout,
) -> Result<Vec<(usize, usize, usize)>> {
    buffer_runs_of(spec, local, whole, false)
}

/// [`buffer_runs`], only the runs this rank holds first (`first`:
/// leaving copies to the lowest tensor-parallel rank holding them).
fn buffer_runs_of(
    spec: &ParamSpec,
    local: &ParamLayout,
    whole: &ParamLayout,
    first: bool,
) -> Result<Vec<(usize, usize, usize)>> {
    let w = whole
        .get(&spec.name)
        .ok_or_else(|| layout_err(&spec.name, "not in the whole model's layout"))?;
    if w.shape != spec.global_shape {
        return Err(layout_err(
            &spec.name,
            format!(
                "whole shape {:?}, but the whole model has {:?}",
                spec.global_shape, w.shape
            ),
        ));
    }
    let runs = if first {
        spec.first_runs(&local.coords())?
    } else {
        spec.runs(&local.coords())?
    };
    Ok(runs
        .into_iter()
        .map(|r| (w.offset + r.whole, spec.offset + r.local, r.len))
        .collect())
}

/// Copies a rank's share of a whole-model buffer: every tensor of
/// `local` (a rank's layout: its pipeline stage's tensors, sharded over
/// `tp` and `ep` at the layout's coordinates) from the tensor of the same
/// name in `from` (laid out by `whole`, a single rank's layout) into `to`.
/// Parameters, gradients and AdamW moments alike.
///
/// # Errors
/// [`Error::Layout`] if a buffer has the wrong length or a tensor is
/// missing from `whole` or has another shape there.
pub fn extract(
    local: &ParamLayout,
    whole: &ParamLayout,
    from: &[f32],
    to: &mut [f32],
) -> Result<()> {
    check_len("whole buffer", from.len(), whole.len())?;
    check_len("local buffer", to.len(), local.len())?;
    for spec in local.specs() {
        for (w, l, n) in buffer_runs(spec, local, whole)? {
            to[l..l + n].copy_from_slice(&from[w..w + n]);
        }
    }
    Ok(())
}

fn check_len(what: &str, got: usize, want: usize) -> Result<()> {
    if got == want {
        Ok(())
    } else {
        Err(layout_err(
            what,
            format!("holds {got} floats, expected {want}"),
        ))
    }
}

const TAG: u64 = 0x5746_4757; // "WFGW"

/// Assembles whole-model buffers on rank 0 of `world` from every rank's
/// shards: for each of `locals` (parameters, moments, … all laid out by
/// `local`) the matching buffer of `wholes` (laid out by `whole`), which
/// only rank 0 passes (`None` elsewhere). Each tensor part is sent once,
/// by the rank that [`owns`](MeshCoords::owns) it (`coords`); rank 0
/// places what it receives by the sender's runs. Collective over `world`.
///
/// # Errors
/// [`Error::Layout`] for buffers that do not fit their layouts;
/// collective errors; [`Error::Corrupt`] for a header that does not fit
/// the whole buffer.
pub fn gather_whole(
    world: &dyn Communicator,
    coords: &MeshCoords,
    local: &ParamLayout,
    whole: &ParamLayout,
    locals: &[&[f32]],
    wholes: Option<&mut [&mut [f32]]>,
) -> Result<()> {
    for b in locals {
        check_len("local buffer", b.len(), local.len())?;
    }
    if let Some(ws) = &wholes {
        if ws.len() != locals.len() {
            return Err(layout_err(
                "whole buffers",
                format!("{} given for {} local buffers", ws.len(), locals.len()),
            ));
        }
        for w in ws.iter() {
            check_len("whole buffer", w.len(), whole.len())?;
        }
    }
    // (whole start, local start, len) of every run this rank owns
    let mut mine = Vec::new();
    for spec in local.specs() {
        if coords.owns(spec) {
            mine.extend(buffer_runs_of(spec, local, whole, true)?);
        }
    }
    if world.rank() != 0 {
        let header: Vec<u8> = mine
            .iter()
            .flat_map(|&(w, _, n)| [w as u64, n as u64])
            .flat_map(u64::to_le_bytes)
            .collect();
        world.send_bytes(0, TAG, &(header.len() as u64).to_le_bytes())?;
        world.send_bytes(0, TAG + 1, &header)?;
        for buf in locals {
            let data: Vec<f32> = mine
                .iter()
                .flat_map(|&(_, l, n)| buf[l..l + n].iter().copied())
                .collect();
            world.send_bytes(0, TAG + 2, &f32_bytes(&data))?;
        }
        return Ok(());
    }
    let ws = wholes.ok_or_else(|| {
        layout_err(
            "whole buffers",
            "rank 0 assembles the whole model and must pass them",
        )
    })?;
    for (buf, out) in locals.iter().zip(ws.iter_mut()) {
        for &(w, l, n) in &mine {
            out[w..w + n].copy_from_slice(&buf[l..l + n]);
        }
    }
    for peer in 1..world.size() {
        let mut n = [0u8; 8];
        world.recv_bytes(peer, TAG, &mut n)?;
        let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(usize::MAX);
        if !len.is_multiple_of(16) || len / 16 > whole.len() {
            return Err(Error::Corrupt {
                rank: peer,
                reason: format!("a gather header of {len} bytes"),
            });
        }
        let mut header = vec![0u8; len];
        world.recv_bytes(peer, TAG + 1, &mut header)?;
        let runs: Vec<(usize, usize)> = header
            .chunks_exact(16)
            .map(|c| {
                let w = u64::from_le_bytes(c[..8].try_into().unwrap_or_default());
                let n = u64::from_le_bytes(c[8..].try_into().unwrap_or_default());
                (
                    usize::try_from(w).unwrap_or(usize::MAX),
                    usize::try_from(n).unwrap_or(usize::MAX),
                )
            })
            .collect();
        let total: usize = runs.iter().map(|r| r.1).sum();
        if runs
            .iter()
            .any(|&(w, n)| w.checked_add(n).is_none_or(|e| e > whole.len()))
        {
            return Err(Error::Corrupt {
                rank: peer,
                reason: "a run outside the whole model".into(),
            });
        }
        for out in ws.iter_mut() {
            let mut bytes = vec![0u8; 4 * total];
            world.recv_bytes(peer, TAG + 2, &mut bytes)?;
            let mut at = 0;
            for &(w, n) in &runs {
                for (o, c) in out[w..w + n]
                    .iter_mut()
                    .zip(bytes[4 * at..].chunks_exact(4))
                {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
                at += n;
            }
        }
    }
    Ok(())
}

fn f32_bytes(xs: &[f32]) -> Vec<u8> {
    xs.iter().flat_map(|x| x.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Coords, LayoutBuilder, ParallelDims, Placement, Placements};
    use weft_collectives::LocalCluster;

    fn layout(c: Coords) -> ParamLayout {
        let mut b = LayoutBuilder::new(c);
        b.push("wte", &[5, 4], true, Placements::tp(Placement::shard(0)))
            .unwrap();
        b.push(
            "qkv",
            &[4, 6],
            true,
            Placements::tp(Placement::strided(1, 3)),
        )
        .unwrap();
        b.push("ln", &[4], false, Placements::REPLICATED).unwrap();
        b.finish().unwrap()
    }

    #[test]
    fn shards_gather_back_into_the_whole_model() {
        let whole = layout(Coords::SINGLE);
        let params: Vec<f32> = (0..whole.len()).map(|i| i as f32).collect();
        let moments: Vec<f32> = params.iter().map(|x| -x).collect();
        let dims = ParallelDims {
            tp: 2,
            dp: 2,
            ..ParallelDims::SINGLE
        };
        let out = LocalCluster::run(4, |comm| {
            let mesh = dims.build(&comm)?;
            let local = layout(mesh.coords().sharding());
            let mut p = vec![0.0; local.len()];
            let mut m = vec![0.0; local.len()];
            extract(&local, &whole, &params, &mut p)?;
            extract(&local, &whole, &moments, &mut m)?;
            let mut wp = vec![f32::NAN; whole.len()];
            let mut wm = vec![f32::NAN; whole.len()];
            let root = mesh.world().rank() == 0;
            let mut outs = [&mut wp[..], &mut wm[..]];
            gather_whole(
                mesh.world(),
                &mesh.coords(),
                &local,
                &whole,
                &[&p, &m],
                root.then_some(&mut outs[..]),
            )?;
            Ok::<_, Error>((wp, wm))
        })
        .unwrap();
        let (wp, wm) = out.into_iter().next().unwrap().unwrap();
        assert_eq!(wp, params);
        assert_eq!(wm, moments);
    }
}

//! Byte messages between the ranks of a job, and agreement on an outcome.
//!
//! The collectives move numbers; a job also has to move a little text
//! (host names, a cache file's path, trace events as JSON, error
//! messages) and, before any rank goes on to a collective, make sure that
//! every rank is able to: a rank that failed to open its data must not
//! leave the others waiting in the next all-reduce. [`gather_bytes`] and
//! [`all_gather_bytes`] carry variable-length byte strings point to
//! point; [`agree`] turns each rank's `Result` of a set-up step into one
//! outcome every rank shares, with one report of what failed where.

use std::fmt::Display;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::OpKind;

/// Largest message one rank sends in [`gather_bytes`].
pub const MAX_GATHERED: usize = 1 << 30;

/// The point-to-point tag [`agree`] exchanges under (and the three above
/// it); callers of [`gather_bytes`] pick tags elsewhere.
pub const AGREE_TAG: u64 = 0x5741_4700; // "WAG"

fn length(reason: String) -> Error {
    Error::InvalidArgument {
        op: OpKind::SendRecv,
        arg: "length",
        reason,
    }
}

/// Every rank's `mine` on rank 0, in rank order (`None` elsewhere): a
/// length, then the bytes, point to point under tags `tag` and `tag + 1`.
/// Collective over `comm`.
///
/// # Errors
/// A failed send or receive, or a rank announcing more than
/// [`MAX_GATHERED`] bytes.
pub fn gather_bytes(
    comm: &dyn Communicator,
    tag: u64,
    mine: &[u8],
) -> Result<Option<Vec<Vec<u8>>>> {
    if comm.rank() != 0 {
        comm.send_bytes(0, tag, &(mine.len() as u64).to_le_bytes())?;
        comm.send_bytes(0, tag + 1, mine)?;
        return Ok(None);
    }
    let mut all = vec![mine.to_vec()];
    for peer in 1..comm.size() {
        let mut n = [0u8; 8];
        comm.recv_bytes(peer, tag, &mut n)?;
        let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(usize::MAX);
        if len > MAX_GATHERED {
            return Err(length(format!(
                "rank {peer} announced {len} bytes (at most {MAX_GATHERED})"
            )));
        }
        let mut buf = vec![0u8; len];
        comm.recv_bytes(peer, tag + 1, &mut buf)?;
        all.push(buf);
    }
    Ok(Some(all))
}

/// Every rank's `mine` on every rank, in rank order: [`gather_bytes`] to
/// rank 0, which sends the whole list back to each (tags `tag` to
/// `tag + 3`). Collective over `comm`.
///
/// # Errors
/// As [`gather_bytes`]; a list from rank 0 that does not decode.
pub fn all_gather_bytes(comm: &dyn Communicator, tag: u64, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
    if comm.size() == 1 {
        return Ok(vec![mine.to_vec()]);
    }
    if let Some(all) = gather_bytes(comm, tag, mine)? {
        let mut packed = Vec::new();
        for b in &all {
            packed.extend_from_slice(&(b.len() as u64).to_le_bytes());
            packed.extend_from_slice(b);
        }
        for peer in 1..comm.size() {
            comm.send_bytes(peer, tag + 2, &(packed.len() as u64).to_le_bytes())?;
            comm.send_bytes(peer, tag + 3, &packed)?;
        }
        return Ok(all);
    }
    let mut n = [0u8; 8];
    comm.recv_bytes(0, tag + 2, &mut n)?;
    let len = usize::try_from(u64::from_le_bytes(n)).unwrap_or(usize::MAX);
    if len > MAX_GATHERED.saturating_mul(comm.size()) {
        return Err(length(format!("rank 0 announced {len} bytes")));
    }
    let mut packed = vec![0u8; len];
    comm.recv_bytes(0, tag + 3, &mut packed)?;
    let mut all = Vec::with_capacity(comm.size());
    let mut rest = &packed[..];
    while let Some((head, tail)) = rest.split_first_chunk::<8>() {
        let n = usize::try_from(u64::from_le_bytes(*head)).unwrap_or(usize::MAX);
        if n > tail.len() {
            return Err(length("rank 0's list is cut short".into()));
        }
        all.push(tail[..n].to_vec());
        rest = &tail[n..];
    }
    if all.len() != comm.size() {
        return Err(length(format!(
            "rank 0 sent {} entries for {} ranks",
            all.len(),
            comm.size()
        )));
    }
    Ok(all)
}

/// Why [`agree`] says a rank cannot go on.
#[derive(Debug)]
pub enum Disagreement<E> {
    /// This rank's own error, reported by this rank: rank 0's when it
    /// failed alone or every rank failed alike (a bad configuration is
    /// reported once, not once per rank), or whatever this rank had when
    /// the exchange itself failed.
    Own(E),
    /// On rank 0: ranks failed with different errors (or not rank 0);
    /// each distinct message with the ranks it happened on, rank 0's
    /// first.
    OnRanks(Vec<(Vec<usize>, String)>),
    /// On every rank but 0: some rank failed, and rank 0 reports it.
    Elsewhere,
    /// The exchange failed on a rank that had no error of its own.
    Comm(Error),
}

/// Agrees on a step's outcome across the ranks of `comm`, so that no rank
/// goes on to a collective that another will never join. Every rank gets
/// its `result` back when it holds on every rank; otherwise see
/// [`Disagreement`]. Collective over `comm` (point to point under
/// [`AGREE_TAG`]); one rank returns at once.
///
/// ```
/// use weft_collectives::{Communicator, Disagreement, LocalCluster, agree};
///
/// let out = LocalCluster::run(3, |comm| {
///     let mine: Result<(), String> = if comm.rank() == 2 { Err("no data".into()) } else { Ok(()) };
///     match agree(&comm, mine) {
///         Ok(()) => "ok".to_owned(),
///         Err(Disagreement::OnRanks(f)) => format!("{f:?}"),
///         Err(Disagreement::Elsewhere) => "elsewhere".to_owned(),
///         Err(other) => format!("{other:?}"),
///     }
/// })
/// .unwrap();
/// assert_eq!(out, [r#"[([2], "no data")]"#, "elsewhere", "elsewhere"]);
/// ```
///
/// # Errors
/// A [`Disagreement`] when any rank failed or the exchange did.
pub fn agree<T, E: Display>(
    comm: &dyn Communicator,
    result: std::result::Result<T, E>,
) -> std::result::Result<T, Disagreement<E>> {
    if comm.size() == 1 {
        return result.map_err(Disagreement::Own);
    }
    let mine = match &result {
        Ok(_) => Vec::new(),
        Err(e) => {
            let mut v = vec![1u8];
            v.extend_from_slice(e.to_string().as_bytes());
            v
        }
    };
    let all = match all_gather_bytes(comm, AGREE_TAG, &mine) {
        Ok(all) => all,
        Err(e) => {
            return Err(match result {
                Err(own) => Disagreement::Own(own),
                Ok(_) => Disagreement::Comm(e),
            });
        }
    };
    let mut failures: Vec<(Vec<usize>, String)> = Vec::new();
    for (rank, b) in all.iter().enumerate() {
        if b.is_empty() {
            continue;
        }
        let msg = String::from_utf8_lossy(&b[1..]).into_owned();
        match failures.iter_mut().find(|(_, m)| *m == msg) {
            Some((ranks, _)) => ranks.push(rank),
            None => failures.push((vec![rank], msg)),
        }
    }
    if failures.is_empty() {
        return result.map_err(Disagreement::Own);
    }
    if comm.rank() != 0 {
        return Err(Disagreement::Elsewhere);
    }
    let alone_or_everywhere =
        failures.len() == 1 && (failures[0].0 == [0] || failures[0].0.len() == comm.size());
    match result {
        Err(e) if alone_or_everywhere => Err(Disagreement::Own(e)),
        _ => Err(Disagreement::OnRanks(failures)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::LocalCluster;

    #[test]
    fn bytes_gather_on_every_rank() {
        let out = LocalCluster::run(3, |comm| {
            let mine = vec![b'a' + u8::try_from(comm.rank()).unwrap(); comm.rank()];
            let all = all_gather_bytes(&comm, 0x100, &mine).unwrap();
            let at_zero = gather_bytes(&comm, 0x200, &mine).unwrap();
            (all, at_zero.is_some())
        })
        .unwrap();
        for (rank, (all, at_zero)) in out.iter().enumerate() {
            assert_eq!(all, &[b"".to_vec(), b"b".to_vec(), b"cc".to_vec()]);
            assert_eq!(*at_zero, rank == 0);
        }
    }

    #[test]
    fn agreement_reports_each_failure_once_on_rank_zero() {
        let run = |fail: fn(usize) -> Option<String>| {
            LocalCluster::run(3, move |comm| {
                let mine = fail(comm.rank()).map_or(Ok(comm.rank()), Err);
                match agree(&comm, mine) {
                    Ok(r) => format!("ok {r}"),
                    Err(Disagreement::Own(e)) => format!("own {e}"),
                    Err(Disagreement::OnRanks(f)) => format!("ranks {f:?}"),
                    Err(Disagreement::Elsewhere) => "elsewhere".into(),
                    Err(Disagreement::Comm(e)) => format!("comm {e}"),
                }
            })
            .unwrap()
        };
        assert_eq!(run(|_| None), ["ok 0", "ok 1", "ok 2"]);
        // the same error everywhere: reported once, as rank 0's own
        assert_eq!(
            run(|_| Some("bad config".into())),
            ["own bad config", "elsewhere", "elsewhere"]
        );
        // rank 0 alone
        assert_eq!(
            run(|r| (r == 0).then(|| "x".into())),
            ["own x", "elsewhere", "elsewhere"]
        );
        // different errors: each with its ranks, on rank 0
        assert_eq!(
            run(|r| (r > 0).then(|| format!("e{}", r % 2))),
            [
                r#"ranks [([1], "e1"), ([2], "e0")]"#,
                "elsewhere",
                "elsewhere"
            ]
        );
    }
}

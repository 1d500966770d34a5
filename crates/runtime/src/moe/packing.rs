//! Row positions inside the all-to-all buffers (shared by the four exchanges of a step), and
//! packing rows into and out of wire buffers.

use lazarus_comm::{bytes_to_f32, f32_wire};
use lazarus_plan::RankLayout;

use super::DispatchMode;
use crate::error::RuntimeError;

pub(super) struct Packing {
    /// Row, in the buffer to `dst`, of each entry of `layout.send[dst]`.
    pub(super) send_rows: Vec<Vec<usize>>,
    /// Rows in the buffer to each rank (padding included).
    pub(super) send_len: Vec<usize>,
    /// (first row, rows) of each expert's block in the buffer from each rank.
    pub(super) recv_blocks: Vec<Vec<(usize, usize)>>,
    pub(super) recv_len: Vec<usize>,
}

impl Packing {
    pub(super) fn new(
        layout: &RankLayout,
        mode: DispatchMode,
        replicas: &[Vec<u32>],
        tokens: &[Vec<u64>],
        me: usize,
    ) -> Result<Self, RuntimeError> {
        let ranks = layout.send.len();
        let experts = replicas.len();
        match mode {
            DispatchMode::Flexible | DispatchMode::Balanced | DispatchMode::Deterministic => {
                let send_rows = layout.send.iter().map(|v| (0..v.len()).collect()).collect();
                let send_len = layout.send.iter().map(Vec::len).collect();
                let mut recv_blocks = vec![vec![(0, 0); experts]; ranks];
                let mut recv_len = vec![0; ranks];
                for src in 0..ranks {
                    for e in 0..experts {
                        let c = layout.recv[src][e] as usize;
                        recv_blocks[src][e] = (recv_len[src], c);
                        recv_len[src] += c;
                    }
                }
                Ok(Packing { send_rows, send_len, recv_blocks, recv_len })
            }
            DispatchMode::StaticPadded | DispatchMode::StaticSkipPadding => {
                if let Some(e) = replicas.iter().position(|r| r.iter().sum::<u32>() != 1) {
                    return Err(RuntimeError::Invalid {
                        field: "placement",
                        reason: format!("static expert parallelism needs exactly one replica per expert (expert {e})"),
                    });
                }
                let cap = tokens.iter().flatten().copied().max().unwrap_or(0) as usize;
                let held = |rank: usize| -> Vec<usize> { (0..experts).filter(|&e| replicas[e][rank] > 0).collect() };
                let mut send_rows = Vec::with_capacity(ranks);
                let mut send_len = Vec::with_capacity(ranks);
                for dst in 0..ranks {
                    let theirs = held(dst);
                    let mut seen = vec![0usize; experts];
                    let rows = layout.send_experts[dst]
                        .iter()
                        .map(|&e| {
                            let e = e as usize;
                            let block = theirs.iter().position(|&x| x == e).unwrap_or(0);
                            seen[e] += 1;
                            block * cap + seen[e] - 1
                        })
                        .collect();
                    send_rows.push(rows);
                    send_len.push(theirs.len() * cap);
                }
                let mine = held(me);
                let recv_blocks = (0..ranks)
                    .map(|src| {
                        (0..experts)
                            .map(|e| match mine.iter().position(|&x| x == e) {
                                Some(b) if mode == DispatchMode::StaticPadded => (b * cap, cap),
                                Some(b) => (b * cap, layout.recv[src][e] as usize),
                                None => (0, 0),
                            })
                            .collect()
                    })
                    .collect();
                Ok(Packing { send_rows, send_len, recv_blocks, recv_len: vec![mine.len() * cap; ranks] })
            }
        }
    }
}

/// Buffers for each destination: `rows(dst, i)` is the row of entry i, placed at
/// `at[dst][i]`; `len[dst]` rows in all (the rest is padding).
pub(super) fn pack<'a>(at: &[Vec<usize>], len: &[usize], d: usize, rows: impl Fn(usize, usize) -> &'a [f32]) -> Vec<Vec<u8>> {
    let row_bytes = d * 4;
    at.iter()
        .enumerate()
        .map(|(dst, positions)| {
            let mut buf = vec![0u8; len[dst] * row_bytes];
            for (i, &r) in positions.iter().enumerate() {
                buf[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&f32_wire(rows(dst, i)));
            }
            buf
        })
        .collect()
}

/// Decode buffers and check each holds the expected number of rows.
pub(super) fn unpack(bytes: &[Vec<u8>], len: &[usize], d: usize, what: &'static str) -> Result<Vec<Vec<f32>>, RuntimeError> {
    bytes
        .iter()
        .enumerate()
        .map(|(r, b)| {
            let v = bytes_to_f32(b)?;
            if v.len() != len[r] * d {
                return Err(RuntimeError::Invalid {
                    field: what,
                    reason: format!("rank {r} sent {} values, expected {}", v.len(), len[r] * d),
                });
            }
            Ok(v)
        })
        .collect()
}

pub(super) fn wire(bufs: &[Vec<u8>], me: usize) -> u64 {
    bufs.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, b)| b.len() as u64).sum()
}

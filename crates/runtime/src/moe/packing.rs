//! Row positions inside the all-to-all buffers (shared by the four exchanges of a step), packing
//! rows into and out of wire buffers, and the rows a rank keeps for itself: a rank's slots for its
//! own experts go through no buffer — their rows are read from h on the device and their outputs
//! stay there ([`Local`], [`Rows`]), so only what other ranks send or wait for crosses the host.

use candle_core::{DType, Tensor};
use lazarus_comm::f32_wire;
use lazarus_plan::RankLayout;

use super::distinct::Distinct;
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

impl Packing {
    /// The buffers that cross to other ranks: these positions with this rank's own buffer empty.
    pub(super) fn without(&self, me: usize) -> Remote {
        let mut remote = Remote {
            send_rows: self.send_rows.clone(),
            send_len: self.send_len.clone(),
            recv_len: self.recv_len.clone(),
            distinct: vec![None; self.send_len.len()],
        };
        if let Some(rows) = remote.send_rows.get_mut(me) {
            rows.clear();
        }
        for len in [remote.send_len.get_mut(me), remote.recv_len.get_mut(me)].into_iter().flatten() {
            *len = 0;
        }
        remote
    }
}

/// The all-to-all buffers' positions without a rank's buffer to itself (see [`Packing`]).
pub(super) struct Remote {
    pub(super) send_rows: Vec<Vec<usize>>,
    pub(super) send_len: Vec<usize>,
    pub(super) recv_len: Vec<usize>,
    /// Per destination: its token rows sent once per distinct token ([`Distinct`]), or None:
    /// a row per slot.
    pub(super) distinct: Vec<Option<Distinct>>,
}

impl Remote {
    /// Plans each buffer to another rank as distinct token rows where that is smaller. Only
    /// for buffers without padding (not the static baselines, whose wire form is theirs): row i
    /// of the buffer to `dst` is entry i of `layout.send[dst]`.
    pub(super) fn send_distinct(&mut self, layout: &RankLayout, k: usize, d: usize) {
        for (dst, slots) in layout.send.iter().enumerate() {
            if self.send_len[dst] == slots.len() && self.send_rows[dst].iter().enumerate().all(|(i, &r)| i == r) {
                let tokens: Vec<u32> = slots.iter().map(|&s| s / k as u32).collect();
                self.distinct[dst] = Distinct::plan(&tokens, d);
            }
        }
    }
}

/// The buffer a rank would send itself, never built: the token and the slot of each of its rows
/// (None: a padding row, zeros).
pub(super) struct Local {
    pub(super) token_at: Vec<Option<u32>>,
    pub(super) slot_at: Vec<Option<u32>>,
}

impl Local {
    pub(super) fn new(layout: &RankLayout, packing: &Packing, me: usize, k: usize) -> Result<Self, RuntimeError> {
        let (sent, received) = (packing.send_len[me], packing.recv_len[me]);
        if sent != received {
            return Err(RuntimeError::Invalid {
                field: "dispatch layout",
                reason: format!("rank {me} would send itself {sent} rows and receive {received}"),
            });
        }
        let (mut token_at, mut slot_at) = (vec![None; sent], vec![None; sent]);
        for (i, &s) in layout.send[me].iter().enumerate() {
            token_at[packing.send_rows[me][i]] = Some(s / k as u32);
            slot_at[packing.send_rows[me][i]] = Some(s);
        }
        Ok(Local { token_at, slot_at })
    }
}

/// Where a row of [`Rows`] comes from.
#[derive(Clone, Copy)]
pub(super) enum Source<'a> {
    /// A row received on the host.
    Host(&'a [f32]),
    /// A row of the device tensor.
    Device(u32),
}

/// A tensor of rows assembled on the device in order: rows of a device tensor (read there),
/// rows from the host (one copy to the device for all of them), and zero rows. One gather.
pub(super) struct Rows {
    device: Tensor,
    host: Vec<f32>,
    /// Per row: Ok(device row) or Err(host row, None for a zero row).
    places: Vec<Result<u32, Option<u32>>>,
    d: usize,
}

impl Rows {
    pub(super) fn new(device: Tensor, d: usize) -> Self {
        Rows { device, host: Vec::new(), places: Vec::new(), d }
    }

    /// The next row from the host.
    pub(super) fn push_host(&mut self, row: &[f32]) {
        self.places.push(Err(Some((self.host.len() / self.d.max(1)) as u32)));
        self.host.extend_from_slice(row);
    }

    /// The next row: row `r` of the device tensor, or zeros.
    pub(super) fn push_device(&mut self, r: Option<u32>) {
        self.places.push(r.ok_or(None));
    }

    /// The rows [rows, d] (f32) on the device tensor's device.
    pub(super) fn gather(self) -> Result<Tensor, RuntimeError> {
        let Rows { device, host, places, d } = self;
        let dev = device.device().clone();
        if places.is_empty() {
            return Ok(Tensor::zeros((0, d), DType::F32, &dev)?);
        }
        let on_device = device.dim(0)?;
        let host_rows = host.len() / d.max(1);
        let mut parts = Vec::with_capacity(3);
        if on_device > 0 {
            parts.push(device.to_dtype(DType::F32)?);
        }
        if host_rows > 0 {
            let _p = lazarus_model::profile::kernel("to device");
            parts.push(Tensor::from_vec(host, (host_rows, d), &dev)?);
        }
        let zero = (on_device + host_rows) as u32;
        if places.contains(&Err(None)) {
            parts.push(Tensor::zeros((1, d), DType::F32, &dev)?);
        }
        let source = if parts.len() == 1 { parts.remove(0) } else { Tensor::cat(&parts, 0)? };
        let index: Vec<u32> = places
            .iter()
            .map(|p| match *p {
                Ok(r) => r,
                Err(Some(j)) => on_device as u32 + j,
                Err(None) => zero,
            })
            .collect();
        Ok(lazarus_model::ops::gather_rows(&source, &index)?)
    }
}

/// One buffer of `len` rows: `row(i)` is entry i's, placed at `at[i]` (the rest is padding).
pub(super) fn pack_one<'a>(at: &[usize], len: usize, d: usize, row: impl Fn(usize) -> &'a [f32]) -> Vec<u8> {
    let row_bytes = d * 4;
    let mut buf = vec![0u8; len * row_bytes];
    for (i, &r) in at.iter().enumerate() {
        buf[r * row_bytes..(r + 1) * row_bytes].copy_from_slice(&f32_wire(row(i)));
    }
    buf
}

pub(super) fn wire(bufs: &[Vec<u8>], me: usize) -> u64 {
    bufs.iter().enumerate().filter(|(r, _)| *r != me).map(|(_, b)| b.len() as u64).sum()
}

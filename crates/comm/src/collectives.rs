//! Collectives over a [`Group`] of ranks, built on [`Transport`] send/recv. Every member must
//! call the same collectives on the same group in the same order; each call takes a fresh tag
//! from the group's sequence so messages of different calls can never be confused.

use std::time::Duration;

use crate::error::CommError;
use crate::Transport;

/// An ordered set of ranks (the whole world, or e.g. the ranks holding one expert).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Group {
    members: Vec<usize>,
    id: u32,
    seq: u32,
}

impl Group {
    /// Members in ascending order, without duplicates.
    pub fn new(mut members: Vec<usize>) -> Result<Self, CommError> {
        members.sort_unstable();
        members.dedup();
        if members.is_empty() {
            return Err(CommError::invalid("group", "no members"));
        }
        // FNV-1a of the member list: the same group gets the same id on every rank.
        let mut h: u32 = 0x811c_9dc5;
        for &m in &members {
            for b in (m as u64).to_le_bytes() {
                h = (h ^ b as u32).wrapping_mul(0x0100_0193);
            }
        }
        Ok(Group { members, id: h, seq: 0 })
    }

    pub fn world(n: usize) -> Self {
        Group::new((0..n.max(1)).collect()).expect("non-empty")
    }

    pub fn members(&self) -> &[usize] {
        &self.members
    }

    pub fn len(&self) -> usize {
        self.members.len()
    }

    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    pub(crate) fn position(&self, rank: usize) -> Result<usize, CommError> {
        self.members
            .iter()
            .position(|&m| m == rank)
            .ok_or_else(|| CommError::invalid("group", format!("rank {rank} is not a member of {:?}", self.members)))
    }

    fn next_tag(&mut self) -> u64 {
        self.seq = self.seq.wrapping_add(1);
        crate::tags::collective(self.id, self.seq)
    }
}

/// Every member's `data`, in member order.
pub fn all_gather(t: &mut dyn Transport, g: &mut Group, data: &[u8], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
    let deadline = crate::deadline_after(timeout);
    let tag = g.next_tag();
    let me = t.rank();
    g.position(me)?;
    for &p in &g.members {
        if p != me {
            t.send(p, tag, data, deadline)?;
        }
    }
    g.members.iter().map(|&p| if p == me { Ok(data.to_vec()) } else { t.recv(p, tag, deadline) }).collect()
}

/// All-to-all with arbitrary per-peer sizes (no padding): `sends[i]` goes to member i; returns
/// what each member sent to this rank.
pub fn all_to_all_v(t: &mut dyn Transport, g: &mut Group, sends: &[Vec<u8>], timeout: Duration) -> Result<Vec<Vec<u8>>, CommError> {
    if sends.len() != g.len() {
        return Err(CommError::invalid("sends", format!("{} buffers for a group of {}", sends.len(), g.len())));
    }
    let deadline = crate::deadline_after(timeout);
    let tag = g.next_tag();
    let me = t.rank();
    let my = g.position(me)?;
    for (i, &p) in g.members.iter().enumerate() {
        if p != me {
            t.send(p, tag, &sends[i], deadline)?;
        }
    }
    g.members.iter().map(|&p| if p == me { Ok(sends[my].clone()) } else { t.recv(p, tag, deadline) }).collect()
}

/// `data` from member `root` (an index into the group) to every member.
pub fn broadcast(t: &mut dyn Transport, g: &mut Group, root: usize, data: &[u8], timeout: Duration) -> Result<Vec<u8>, CommError> {
    let deadline = crate::deadline_after(timeout);
    let tag = g.next_tag();
    let me = t.rank();
    g.position(me)?;
    let Some(&root_rank) = g.members.get(root) else {
        return Err(CommError::invalid("root", format!("{root} (group of {})", g.len())));
    };
    if me == root_rank {
        for &p in &g.members {
            if p != me {
                t.send(p, tag, data, deadline)?;
            }
        }
        Ok(data.to_vec())
    } else {
        t.recv(root_rank, tag, deadline)
    }
}

/// Returns once every member has reached it.
pub fn barrier(t: &mut dyn Transport, g: &mut Group, timeout: Duration) -> Result<(), CommError> {
    all_gather(t, g, &[], timeout).map(|_| ())
}

/// Buffers up to this size are all-reduced by gathering everything (lowest latency); larger
/// ones by a ring (reduce-scatter + all-gather, bandwidth-optimal).
pub const RING_THRESHOLD_BYTES: usize = 256 << 10;

/// Element-wise sum over the group, in place. Every member ends with bit-identical values
/// (each element is reduced in one fixed order, then copied).
pub fn all_reduce_sum_f32(t: &mut dyn Transport, g: &mut Group, buf: &mut [f32], timeout: Duration) -> Result<(), CommError> {
    let m = g.len();
    if m == 1 {
        g.position(t.rank())?;
        return Ok(());
    }
    if buf.len() * 4 <= RING_THRESHOLD_BYTES || buf.len() < m {
        let all = all_gather(t, g, &f32_wire(buf), timeout)?;
        let parts: Vec<Vec<f32>> = all.iter().map(|b| bytes_to_f32(b)).collect::<Result<_, _>>()?;
        for p in &parts {
            if p.len() != buf.len() {
                return Err(CommError::Protocol { peer: usize::MAX, reason: format!("all-reduce length {} vs {}", p.len(), buf.len()) });
            }
        }
        for (i, x) in buf.iter_mut().enumerate() {
            *x = parts.iter().fold(0.0f32, |acc, p| acc + p[i]);
        }
        return Ok(());
    }
    ring_all_reduce(
        t,
        g,
        buf.len(),
        timeout,
        buf,
        |buf, r| f32_wire(&buf[r]),
        |buf, r, got, add| {
            if whole_f32s(got).map_err(|e| e.to_string())? != r.len() {
                return Err(format!("ring chunk of {} bytes, expected {} values", got.len(), r.len()));
            }
            apply_f32(&mut buf[r], got, add);
            Ok(())
        },
    )
}

/// A ring all-reduce of `len` values held in `state` (reduce-scatter, then all-gather, each
/// member's chunk passed to the next one): `wire(state, range)` is a chunk's bytes, and
/// `apply(state, range, bytes, add)` adds a received chunk (`add`) or takes it as the sum
/// (`!add`), or says why the bytes are not such a chunk. Each chunk is reduced in one fixed
/// order and then copied, so every member ends with the same bits.
pub(crate) fn ring_all_reduce<S: ?Sized>(
    t: &mut dyn Transport,
    g: &mut Group,
    len: usize,
    timeout: Duration,
    state: &mut S,
    wire: impl for<'a> Fn(&'a S, std::ops::Range<usize>) -> std::borrow::Cow<'a, [u8]>,
    mut apply: impl FnMut(&mut S, std::ops::Range<usize>, &[u8], bool) -> Result<(), String>,
) -> Result<(), CommError> {
    let m = g.len();
    let deadline = crate::deadline_after(timeout);
    let me = t.rank();
    let pos = g.position(me)?;
    let next = g.members[(pos + 1) % m];
    let prev = g.members[(pos + m - 1) % m];
    let bounds: Vec<std::ops::Range<usize>> = (0..m).map(|c| c * len / m..(c + 1) * len / m).collect();
    // Reduce-scatter: after m−1 steps member `pos` holds the full sum of chunk (pos+1) mod m.
    // Pass chunk `send_c` to the next member and receive chunk `recv_c` from the previous one.
    let mut exchange = |t: &mut dyn Transport, g: &mut Group, state: &mut S, send_c: usize, recv_c: usize, add: bool| {
        let tag = g.next_tag();
        t.send(next, tag, &wire(state, bounds[send_c].clone()), deadline)?;
        let got = t.recv(prev, tag, deadline)?;
        apply(state, bounds[recv_c].clone(), &got, add).map_err(|reason| CommError::Protocol { peer: prev, reason })
    };
    for step in 0..m - 1 {
        exchange(t, g, state, (pos + m - step) % m, (pos + m - step - 1) % m, true)?;
    }
    // All-gather the reduced chunks around the ring.
    for step in 0..m - 1 {
        exchange(t, g, state, (pos + 1 + m - step) % m, (pos + m - step) % m, false)?;
    }
    Ok(())
}

/// Send a named buffer (e.g. one expert tensor) to `peer`.
pub fn send_named(t: &mut dyn Transport, peer: usize, tag: u64, name: &str, data: &[u8], timeout: Duration) -> Result<(), CommError> {
    let mut payload = Vec::with_capacity(4 + name.len() + data.len());
    payload.extend_from_slice(&(name.len() as u32).to_le_bytes());
    payload.extend_from_slice(name.as_bytes());
    payload.extend_from_slice(data);
    t.send(peer, tag, &payload, crate::deadline_after(timeout))
}

/// Receive a named buffer from `peer`: (name, data).
pub fn recv_named(t: &mut dyn Transport, peer: usize, tag: u64, timeout: Duration) -> Result<(String, Vec<u8>), CommError> {
    let payload = t.recv(peer, tag, crate::deadline_after(timeout))?;
    let bad = |reason: &str| CommError::Protocol { peer, reason: reason.to_string() };
    let len =
        u32::from_le_bytes(payload.get(..4).ok_or_else(|| bad("named buffer shorter than its header"))?.try_into().expect("4")) as usize;
    let name = payload.get(4..4 + len).ok_or_else(|| bad("name runs past the buffer"))?;
    let name = String::from_utf8(name.to_vec()).map_err(|_| bad("name is not UTF-8"))?;
    Ok((name, payload[4 + len..].to_vec()))
}

/// The wire form of f32 values (little-endian).
pub fn f32_to_bytes(v: &[f32]) -> Vec<u8> {
    f32_wire(v).into_owned()
}

/// `v` as wire bytes: a view without copying on little-endian machines.
pub fn f32_wire(v: &[f32]) -> std::borrow::Cow<'_, [u8]> {
    if cfg!(target_endian = "little") {
        std::borrow::Cow::Borrowed(bytemuck::cast_slice(v))
    } else {
        std::borrow::Cow::Owned(v.iter().flat_map(|x| x.to_le_bytes()).collect())
    }
}

fn whole_f32s(b: &[u8]) -> Result<usize, CommError> {
    if !b.len().is_multiple_of(4) {
        return Err(CommError::Protocol { peer: usize::MAX, reason: format!("{} bytes is not a whole number of f32 values", b.len()) });
    }
    Ok(b.len() / 4)
}

pub fn bytes_to_f32(b: &[u8]) -> Result<Vec<f32>, CommError> {
    let mut out = vec![0f32; whole_f32s(b)?];
    out.iter_mut().zip(b.chunks_exact(4)).for_each(|(o, c)| *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    Ok(out)
}

/// `out[i] += value i of b` (or `=` when `add` is false), straight from the wire bytes.
fn apply_f32(out: &mut [f32], b: &[u8], add: bool) {
    let vals = b.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]));
    if add {
        out.iter_mut().zip(vals).for_each(|(o, v)| *o += v);
    } else {
        out.iter_mut().zip(vals).for_each(|(o, v)| *o = v);
    }
}

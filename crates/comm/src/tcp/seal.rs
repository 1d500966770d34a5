//! Optional encryption of the data plane (`--encrypt-data`): every frame on a connection is
//! sealed with AES-256-GCM (ring; AES-NI where the CPU has it) — its header and its payload as
//! two records, each with its 16-byte tag. Each direction of a connection has its own key,
//! derived from the job's secret and the two nonces of the connection's handshake
//! ([`crate::auth`]), so keys are fresh for every connection of every epoch and never cross the
//! network. A record's nonce is its number on that direction (both sides count, TCP keeps the
//! order): a record replayed, reordered, dropped or altered fails to open, and the connection is
//! closed as any broken one is.
//!
//! Without it, frames are authenticated only at the rendezvous (the peer proved the secret) and
//! travel in clear: enough on a private network, not on a shared one.

use ring::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_256_GCM};

/// Bytes a sealed record adds: its tag.
pub const TAG: usize = 16;

/// The key of one direction of a connection (rank `from` to rank `to` at `epoch`), derived from
/// the job's secret and the handshake's nonces (the connecting rank's first).
fn key(secret: u128, from: usize, to: usize, epoch: u64, connect_nonce: &[u8], accept_nonce: &[u8]) -> LessSafeKey {
    let context = format!("lazarus data key: rank {from} to rank {to} at epoch {epoch}");
    let bytes = crate::auth::prove(secret, context.as_bytes(), connect_nonce, accept_nonce);
    LessSafeKey::new(UnboundKey::new(&AES_256_GCM, &bytes).expect("32 bytes are an AES-256 key"))
}

/// The record counter as a 96-bit nonce.
fn nonce(counter: u64) -> Nonce {
    let mut n = [0u8; 12];
    n[..8].copy_from_slice(&counter.to_le_bytes());
    Nonce::assume_unique_for_key(n)
}

/// The sending half of a connection's encryption.
pub struct Sealer {
    key: LessSafeKey,
    sent: u64,
    /// The last frame sealed (its buffer reused by the next: no allocation per frame).
    frame: Vec<u8>,
}

/// The receiving half.
pub struct Opener {
    key: LessSafeKey,
    received: u64,
}

/// The two halves of `rank`'s connection to `peer` at `epoch`; `connecting` says which side of
/// the handshake `rank` was (its nonce came first).
pub fn halves(secret: u128, rank: usize, peer: usize, epoch: u64, connecting: bool, ours: &[u8], theirs: &[u8]) -> (Sealer, Opener) {
    let (connect_nonce, accept_nonce) = if connecting { (ours, theirs) } else { (theirs, ours) };
    (
        Sealer { key: key(secret, rank, peer, epoch, connect_nonce, accept_nonce), sent: 0, frame: Vec::new() },
        Opener { key: key(secret, peer, rank, epoch, connect_nonce, accept_nonce), received: 0 },
    )
}

impl Sealer {
    /// A frame's bytes on the wire: its header sealed, then its payload sealed (two records,
    /// each with its tag).
    pub fn seal_frame(&mut self, header: &[u8], payload: &[u8]) -> &[u8] {
        self.frame.clear();
        self.frame.reserve(header.len() + payload.len() + 2 * TAG);
        for part in [header, payload] {
            let start = self.frame.len();
            self.frame.extend_from_slice(part);
            let n = nonce(self.sent);
            self.sent += 1;
            let tag =
                self.key.seal_in_place_separate_tag(n, Aad::empty(), &mut self.frame[start..]).expect("a record within AES-GCM's limits");
            self.frame.extend_from_slice(tag.as_ref());
        }
        &self.frame
    }
}

impl Opener {
    /// The plaintext of the next record `sealed` (its tag last), opened in place; None if it
    /// is not that record, whole and unaltered.
    pub fn open<'a>(&mut self, sealed: &'a mut [u8]) -> Option<&'a mut [u8]> {
        let n = nonce(self.received);
        self.received += 1;
        self.key.open_in_place(n, Aad::empty(), sealed).ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_open_once_in_order_and_only_unaltered_with_the_right_key() {
        let (a, b) = ([1u8; 16], [2u8; 16]);
        let (mut seal, _) = halves(7, 0, 1, 3, true, &a, &b);
        let (_, mut open) = halves(7, 1, 0, 3, false, &b, &a);
        // Two frames, four records in order: 100 zeros, 100 ones (the first frame's header and
        // payload), 100 twos and nothing (the second's).
        let mut records: Vec<Vec<u8>> = Vec::new();
        for (header, payload) in [([0u8; 100], &[1u8; 100][..]), ([2u8; 100], &[][..])] {
            let frame = seal.seal_frame(&header, payload);
            assert_eq!(frame.len(), 100 + payload.len() + 2 * TAG);
            records.push(frame[..100 + TAG].to_vec());
            records.push(frame[100 + TAG..].to_vec());
        }
        assert!(!records[0].windows(100).any(|w| w == [0u8; 100]), "not in clear");
        assert_eq!(open.open(&mut records[0].clone()).map(|p| p.to_vec()), Some(vec![0u8; 100]));
        // Replayed, skipped ahead, altered: refused.
        let (_, mut replay) = halves(7, 1, 0, 3, false, &b, &a);
        replay.open(&mut records[0].clone()).unwrap();
        assert!(replay.open(&mut records[0].clone()).is_none());
        assert!(open.open(&mut records[2].clone()).is_none(), "out of order");
        records[1][5] ^= 1;
        let (_, mut fresh) = halves(7, 1, 0, 3, false, &b, &a);
        fresh.open(&mut records[0].clone()).unwrap();
        assert!(fresh.open(&mut records[1]).is_none(), "altered");
        // Another secret, epoch or direction: another key.
        for (secret, epoch, from, to) in [(8, 3, 1, 0), (7, 4, 1, 0), (7, 3, 0, 1)] {
            let (_, mut other) = halves(secret, from, to, epoch, false, &b, &a);
            assert!(other.open(&mut records[0].clone()).is_none());
        }
    }
}
